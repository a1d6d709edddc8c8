"""The model a server holds: loaded from a Hugging Face model directory, a pretraining
checkpoint or a model file, then quantized per ServeConfig.quantize (ZeroQuant post-training
quantization); or a quantized model directory (troupe.compression.artifact: apps/compress.py's
output, or any model saved after quantize_model), held as it was written."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from troupe import checkpoint as ckpt
from troupe.checkpoint import storage
from troupe.checkpoint.storage import StorePath
from troupe.compression import quantize_model
from troupe.compression.artifact import MANIFEST, is_quantized_dir, load_quantized
from troupe.compression.quantize import check_patterns, outlier_channels
from troupe.config import ConfigError, validate
from troupe.data import DataConfig, HFTokens, Tokenizer, TokenDataset, load_tokenizer
from troupe.devices import precision_dtype, worker_device
from troupe.generation.tools import template_text
from troupe.models import GPT, GPTConfig, from_pretrained
from troupe.models.hf_config import read_config
from troupe.models.io import load_state, read_module_file, save_module
from troupe.parallel.tensor import check_split
from troupe.pretrain.export import checkpoint_model, load_full_model
from troupe.serving.config import ModelSource, ServeConfig

FORMAT = "troupe-model/1"


def save_model(model: GPT, path: str | Path) -> Path:
    """Write a GPT (fp32 weights and its config) as one wire-format file."""
    return save_module(path, model, format=FORMAT, config=model.cfg.model_dump_json())


def load_model(path: str | Path) -> GPT:
    """Read a file written by ``save_model``; errors name the file and what is wrong."""
    meta, state = read_module_file(path)
    if meta.get("format") != FORMAT:
        raise ValueError(f"model file {path}: not a {FORMAT} file")
    model = GPT(validate(GPTConfig, json.loads(meta["config"]), f"{path}: config"))
    load_state(model, state, path)
    return model.eval()


def resolve_checkpoint(path: StorePath) -> StorePath:
    """A checkpoint directory, or a directory of checkpoints (``train.checkpoint_dir``) or a run
    directory (its ``checkpoints``) whose newest complete checkpoint is used; local paths or
    fsspec URLs."""
    if storage.is_file(storage.join(path, ckpt.MANIFEST)):
        return path
    newest = ckpt.latest(path) or ckpt.latest(storage.join(path, "checkpoints"))
    if newest is None:
        raise FileNotFoundError(f"model.checkpoint={str(path)!r}: neither a checkpoint "
                                "directory (with manifest.json) nor a run directory with "
                                "complete checkpoints; train one with apps/pretrain.py")
    return newest


def locate(src: ModelSource) -> StorePath:
    """The model file or checkpoint directory ``src`` names; FileNotFoundError or ConfigError
    naming the config key when there is none or it cannot be read (checked on the driver
    before any replica starts)."""
    if src.pretrained is not None:
        path = Path(src.pretrained).expanduser()
        if not (path / "config.json").is_file():
            raise FileNotFoundError(f"model.pretrained={src.pretrained!r}: no config.json there "
                                    "(a Hugging Face model directory, local)")
        return path
    if src.file is not None:
        if not Path(src.file).is_file():
            raise FileNotFoundError(f"model.file={src.file!r} does not exist; write one with "
                                    "troupe.serving.model.save_model")
        return Path(src.file)
    try:
        return resolve_checkpoint(src.checkpoint)
    except (storage.StorageError, ckpt.CheckpointError) as e:  # e.g. s3:// without s3fs
        raise ConfigError(f"model.checkpoint={str(src.checkpoint)!r}: {e}") from None


def check_source(cfg: ServeConfig) -> None:
    """What the driver checks before any replica starts: the model exists (``locate``), every
    quantize pattern matches some layer of it, and the limits fit its context; ConfigError
    naming the key otherwise."""
    path = locate(cfg.model)
    quantized_dir = cfg.model.pretrained is not None and is_quantized_dir(path)
    if quantized_dir:
        if cfg.quantize and "quantize" in cfg.model_fields_set:
            raise ConfigError(f"quantize: model.pretrained={cfg.model.pretrained!r} is a "
                              f"quantized model directory (its {MANIFEST} says how each layer "
                              "is held); set quantize={} or serve the fp32 model")
        if cfg.expert_parallel > 1:
            raise ConfigError("expert_parallel: a quantized model directory holds no MoE "
                              "experts to spread; set expert_parallel=1")
        if cfg.tensor_parallel > 1:
            raise ConfigError("tensor_parallel: a quantized model directory's integer weights "
                              "are not split again; serve the fp32 model (each rank quantizes "
                              "its shards) or set tensor_parallel=1")
    if cfg.model.pretrained is not None:
        try:
            model_cfg = read_config(path).model_dump()
        except (ValueError, KeyError) as e:
            raise ConfigError(f"model.pretrained: {e}") from None
        where = f"{path}/config.json"
    elif cfg.model.file is not None:
        meta, _ = read_module_file(path)
        model_cfg = meta.get("config")
        model_cfg = json.loads(model_cfg) if isinstance(model_cfg, str) else None
        where = f"model.file {path}"
    else:
        try:
            model_cfg = checkpoint_model(ckpt.read_manifest(path), path).architecture.model_dump()
        except ckpt.CheckpointError as e:
            raise ConfigError(f"model.checkpoint: {e}") from None
        where = f"model.checkpoint {path}"
    if model_cfg is None:
        return  # an older file or manifest without a config: the replica checks the weights
    arch = validate(GPTConfig, model_cfg, f"{path}: config")
    if cfg.tensor_parallel > 1:
        try:
            check_split(arch, cfg.tensor_parallel, training=False)
        except ValueError as e:
            raise ConfigError(f"{e} ({where})") from None
    if cfg.quantize and not quantized_dir:
        with torch.device("meta"):
            check_patterns(GPT(arch), cfg.quantize)
    check_limits(cfg, arch.seq_len, where)


def check_limits(cfg: ServeConfig, context: int, where: str) -> None:
    """ConfigError when ``limits.max_tokens`` cannot be honoured by a model of ``context``
    tokens (set in ``where``): a completion that long leaves no room for a prompt. (A prompt
    over the context is the request's fault, refused with 400 naming its field.)"""
    n = cfg.limits.max_tokens
    if n >= context:
        raise ConfigError(f"limits.max_tokens={n} leaves no room for a prompt in the model's "
                          f"context of {context} tokens ({where}): set it below {context}")


def source_tokenizer(src: ModelSource) -> Tokenizer:
    """The tokenizer of the model ``src`` names: a Hugging Face directory's own; for a
    pretraining checkpoint the one its model record names (the directory the run started
    from, or troupe's byte tokenizer); troupe's byte tokenizer for a model file. With
    ``src.template``, that chat template in place of the tokenizer's own."""
    template = template_text(src.template) if src.template else None
    if src.pretrained is not None:
        return load_tokenizer(src.pretrained, template=template)
    if src.checkpoint is not None:
        path = locate(src)
        return load_tokenizer(checkpoint_model(ckpt.read_manifest(path), path).tokenizer,
                              template=template)
    return load_tokenizer(None)


def load_source(src: ModelSource) -> GPT:
    """The fp32 model ``src`` names. MoE layers are rebuilt dropless: a served token's
    output must not depend on which other requests share its batch."""
    path = locate(src)
    if src.pretrained is not None:
        model = from_pretrained(path)
    else:
        model = load_model(path) if src.file is not None else load_full_model(path)
    if model.cfg.moe is not None and not model.cfg.moe.dropless:
        cfg = model.cfg.model_copy(update={"moe": model.cfg.moe.model_copy(
            update={"dropless": True})})
        dropless = GPT(cfg)
        dropless.load_state_dict(model.state_dict())
        model = dropless
    return model.eval().requires_grad_(False)


def load_served_model(cfg: ServeConfig, tok: Tokenizer | None = None
                      ) -> tuple[GPT, dict[str, str]]:
    """The model per ``cfg.model``, quantized per ``cfg.quantize``; returns it and the mode
    each quantized Linear (or MoE experts module, quantized expert by expert) got. ``tok``:
    the model's tokenizer (default: loaded from the source)."""
    path = locate(cfg.model)
    if cfg.model.pretrained is not None and is_quantized_dir(path):
        model, modes = load_quantized(path)  # held as written: no rules apply
        return placed(model, cfg), modes
    model = placed(load_source(cfg.model), cfg)
    tok = tok or source_tokenizer(cfg.model)
    return model, quantize_served(model, cfg, calibrate(model, cfg, tok))


def load_draft(cfg: ServeConfig, model: GPT) -> GPT | None:
    """The draft model ``cfg.speculate_draft`` names for ``model`` (speculative decoding,
    troupe.generation.draft): "w8a8" a W8A8 copy of the served model (before its own
    quantization, from the source), a directory a Hugging Face model of the same vocabulary;
    None without one. ConfigError naming the key for a draft of another vocabulary."""
    name = cfg.speculate_draft
    if name is None:
        return None
    if name == "w8a8":
        draft = placed(load_source(cfg.model), cfg)
        quantize_model(draft, {"*": "w8a8"})
        return draft.eval()
    draft = placed(from_pretrained(Path(name).expanduser()), cfg).eval()
    if draft.cfg.vocab_size != model.cfg.vocab_size:
        raise ConfigError(f"speculate_draft={name}: its vocabulary of {draft.cfg.vocab_size} "
                          f"tokens is not the served model's {model.cfg.vocab_size}: a draft "
                          "shares the tokenizer")
    return draft


def placed(model: GPT, cfg: ServeConfig) -> GPT:
    """``model`` on this replica's device (``cfg.device``: its Ray GPU or the CPU) in
    ``cfg.precision``, before quantization (which reads the weights in fp32 and keeps its
    scales in fp32 whatever the rest is; on cuda the INT8 layers run torch._int_mm)."""
    return model.to(worker_device(cfg.device), precision_dtype(cfg.precision))


def calibrate(model: GPT, cfg: ServeConfig, tok: Tokenizer) -> dict[str, torch.Tensor] | None:
    """The outlier input channels the W8A8 layers keep in fp32 (``cfg.outlier_channels`` per
    layer, from 2 x 4 windows of the standard library's docstrings); None when there are
    none to find. Run on the whole model before an expert-parallel split, so that every rank
    finds the same channels; on a tensor-parallel one after its split (all ranks at once),
    so that each finds its own shards' (a row-parallel layer's input is its columns)."""
    if not cfg.outlier_channels or "w8a8" not in cfg.quantize.values():
        return None
    data = TokenDataset(DataConfig(), tok if isinstance(tok, HFTokens) else None)
    T = min(256, model.cfg.seq_len)
    batches = [data.train_batch(10_000 + i, 4, T)[0] for i in range(2)]
    return outlier_channels(model, batches, cfg.outlier_channels)


def quantize_served(model: GPT, cfg: ServeConfig,
                    outliers: dict[str, torch.Tensor] | None = None) -> dict[str, str]:
    """Quantize ``model`` in place per ``cfg.quantize`` ({}: fp32); returns the modes."""
    if not cfg.quantize and cfg.embedding == "fp32":
        return {}
    return quantize_model(model, cfg.quantize, cfg.group_size, outliers=outliers,
                          embedding=cfg.embedding)


def weight_bytes(model: torch.nn.Module) -> int:
    """Bytes of the weights as held (integer weights and scales for quantized layers)."""
    total = 0
    for m in model.modules():
        total += getattr(m, "weight_nbytes", 0)
        total += sum(p.numel() * p.element_size() for p in m.parameters(recurse=False))
    return total
