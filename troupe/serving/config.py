"""apps/serve.py's configuration: where the served model comes from (``ModelSource``), what a
replica accepts (``Limits``) and the recipe itself (``ServeConfig``)."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, field_validator, model_validator

from troupe.compression.quantize import known_modes
from troupe.config import AppConfig, Config
from troupe.devices import Device, Precision, check_decode_graphs


class ModelSource(Config):
    """Where the served model comes from: a Hugging Face model directory (``pretrained``:
    config.json, safetensors, tokenizer and chat template; it takes precedence over the other
    two, so that ``model.pretrained=DIR`` overrides any recipe), a pretraining checkpoint
    (sharded, as apps/pretrain.py writes it: a step directory, or a run or checkpoints
    directory whose newest complete checkpoint is used; a local path or an fsspec URL such as
    s3://...) or a single model file written by ``troupe.serving.save_model``."""

    pretrained: str | None = None
    checkpoint: str | None = None
    file: str | None = None
    name: str = "troupe-gpt"
    template: str | None = None  # a chat template in place of the tokenizer's own: a name
    # troupe ships (hermes_tools: tool calls for templates without them) or a .jinja file

    @model_validator(mode="before")
    @classmethod
    def _pretrained_first(cls, data: Any) -> Any:
        if isinstance(data, dict) and data.get("pretrained") is not None:
            return {k: v for k, v in data.items() if k not in ("checkpoint", "file")}
        return data

    @model_validator(mode="after")
    def _one_source(self) -> "ModelSource":
        if self.pretrained is None and (self.checkpoint is None) == (self.file is None):
            raise ValueError("give exactly one of pretrained, checkpoint and file")
        return self


class Limits(Config):
    """What one replica accepts (troupe.serving.admission says how each limit is enforced):
    prompt and completion lengths in tokens; requests in flight (``max_concurrent``), and
    beyond them up to ``max_queued`` waiting for a place for at most ``queue_timeout_s``
    (then 429); the request body in bytes (413), the seconds it may take to arrive and the
    rate it must keep from 3 seconds after its first part (408); requests whose bodies are
    still arriving past their headers (beyond them: 429, so that slow senders cannot hold
    every place); the decode batch; and ``request_timeout_s``, the longest a request may take
    end to end at the HTTP proxy, waiting for a replica included (then 408): when a replica's
    host is lost and none is left, requests and /health get 408 within it, not an endless
    wait, until Serve has started a replica elsewhere."""

    max_prompt_tokens: int = Field(default=1024, ge=1)
    max_tokens: int = Field(default=256, ge=1)
    max_concurrent: int = Field(default=64, ge=1)
    max_queued: int = Field(default=64, ge=0)
    queue_timeout_s: float = Field(default=5.0, gt=0)
    max_body_bytes: int = Field(default=1 << 20, ge=1024)
    body_timeout_s: float = Field(default=10.0, gt=0)
    min_body_rate: int = Field(default=1024, ge=1)  # bytes per second
    max_receiving: int = Field(default=256, ge=1)
    max_batch: int = Field(default=16, ge=1)
    request_timeout_s: float = Field(default=600.0, gt=0)


class ServeConfig(AppConfig):
    """apps/serve.py's configuration. quantize: module-name patterns to modes (w8a8, w8a16,
    w4a16, ternary, binary; see troupe.compression), {} to serve fp32; not used for a
    quantized model directory (model.pretrained written by apps/compress.py or
    troupe.compression.artifact), which says how each layer is held. embedding: hold the token
    embedding as int8 or int4 rows (a tied output projection gets the same integers). outlier_channels: the W8A8 layers keep
    this many input channels in fp32, those with the largest activations on a few calibration
    windows of text (the standard library's docstrings, in the model's tokenizer); 0: none. api_key_env: the environment variable
    holding the bearer token clients must send (unset or empty: no authentication).
    expert_parallel: for MoE models, spread each replica's experts over this many expert
    actors, which exchange tokens with all_to_all (1: the replica holds every expert).
    tensor_parallel: split each replica's model over this many actors (troupe.parallel.tensor:
    attention heads, MLPs and the vocabulary; each rank quantizes its own shards), which run
    every sequence together (a model larger than one worker; T must divide the query heads,
    and the key/value heads or be a multiple of them). Under it structured outputs and the
    prefix cache work (each rank masks the same tokens and caches its own shards' keys and
    values); the embedding stays fp32 and adapters, speculation and captured steps are not
    available.
    precision: "bf16" holds the weights that stay unquantized (embeddings, norms, fp32 layers)
    and the KV cache in bf16 and computes in it; "fp16" likewise in fp16 (for GPUs: the CPU
    has few fp16 kernels); "fp32" (default) in fp32.
    device: where each replica (or expert rank) computes (auto: cuda when the cluster has
    GPUs, else cpu); num_gpus: GPUs each of them asks Ray for on cuda.
    metrics_open: /metrics answers without the API key (for a scraper that cannot send one;
    it shows counts and timings, no content); by default it is behind the key like the API,
    and /health alone is open (GET). prefix_cache_mb: the keys and values of prompt prefixes
    kept between requests (troupe.generation.prefix_cache; 0: none), so that a prompt that
    begins as an earlier one (a shared system prompt, a conversation's earlier turns) runs
    only what follows. adapters: LoRA adapters served over the model, name -> a Hugging Face
    PEFT directory (troupe.models.adapters: applied per row, so requests for different
    adapters share a batch); a request picks one by ``model``, /v1/models lists them, and
    POST /v1/load_lora_adapter adds one to a running replica. decode_graphs: on cuda, each
    replica's decode steps run in fixed shapes captured as CUDA graphs, one per batch bucket
    (troupe.generation.static_step; the cache preallocated to limits.max_prompt_tokens +
    limits.max_tokens a row); steps with grammars, logit adjustments, adapters or top
    log-probabilities run eagerly. speculate: batches of at most 4 requests decode by prompt
    lookup, up to this many tokens proposed a step from each request's own context and
    verified in one pass (troupe.generation.speculative: the same tokens as without; 0: off);
    /metrics counts the passes, the tokens proposed and those accepted. speculate_draft: the
    proposals come from a draft model instead (troupe.generation.draft): "w8a8", a W8A8 copy
    of the served model, or a Hugging Face model directory of the same tokenizer."""

    model: ModelSource
    quantize: dict[str, str] = Field(default_factory=lambda: {"*": "w8a8"})
    embedding: Literal["fp32", "int8", "int4"] = "fp32"
    group_size: int = Field(default=64, ge=2)
    outlier_channels: int = Field(default=16, ge=0)
    limits: Limits = Limits()
    num_replicas: int = Field(default=1, ge=1)
    num_cpus: float = Field(default=1.0, gt=0)
    threads: int = Field(default=1, ge=1)
    host: str = "127.0.0.1"
    port: int = Field(default=8000, ge=0, le=65535)
    api_key_env: str = "TROUPE_API_KEY"
    metrics_open: bool = False
    prefix_cache_mb: float = Field(default=512.0, ge=0)
    adapters: dict[str, str] = Field(default_factory=dict)
    expert_parallel: int = Field(default=1, ge=1)
    tensor_parallel: int = Field(default=1, ge=1, le=1024)
    precision: Precision = "fp32"
    device: Device = "auto"
    num_gpus: float = Field(default=1.0, gt=0)
    decode_graphs: bool = False
    speculate: int = Field(default=0, ge=0)
    speculate_draft: str | None = None

    @model_validator(mode="after")
    def _graphs_on_gpus(self) -> "ServeConfig":
        check_decode_graphs(self.decode_graphs, self.device)
        if self.speculate_draft is not None and not self.speculate:
            raise ValueError(f"speculate_draft={self.speculate_draft} proposes for speculative "
                             "decoding, which speculate=0 turns off: set speculate (e.g. 4)")
        if self.expert_parallel > 1 and (self.speculate or self.decode_graphs):
            key = f"speculate={self.speculate}" if self.speculate else "decode_graphs=true"
            raise ValueError(f"{key} with expert_parallel={self.expert_parallel}: the expert "
                             "ranks decode in lockstep, two passes a step, which neither "
                             "speculation nor a captured step keeps: use one or the other")
        T = self.tensor_parallel
        if T > 1:
            other = [k for k, on in (("expert_parallel", self.expert_parallel > 1),
                                     ("speculate", self.speculate),
                                     ("decode_graphs", self.decode_graphs),
                                     ("adapters", self.adapters),
                                     ("embedding", self.embedding != "fp32")) if on]
            if other:
                raise ValueError(f"tensor_parallel={T} with {other[0]}: not available over "
                                 "tensor-parallel ranks (their shards and all-reduces); use "
                                 "one or the other")
        return self

    @field_validator("quantize")
    @classmethod
    def _known_modes(cls, rules: dict[str, str]) -> dict[str, str]:
        return known_modes(rules)
