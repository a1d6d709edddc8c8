"""The sections of an RLHF recipe (troupe.rlhf.config.RLHFConfig): the model, the bundled task
or your data, and one section per step (sft, reward, dpo, step3 with its rollout role, the
agent environment). Each validates its own fields; what spans sections is RLHFConfig's."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, field_validator, model_validator

from troupe.config import Config
from troupe.models import GPTConfig
from troupe.optim import OptimizerConfig


class ModelConfig(Config):
    """The model every role starts from: ``pretrained``, a local Hugging Face directory
    (Llama, Qwen2, Mistral, Mixtral, GPT-2; loaded into troupe's decoder, its tokenizer with
    it; reward and critic are the same body with a value head), or else troupe's byte-level
    GPT of shape ``gpt``, initialised from the seed. chat_template: give the task's prompts
    as a user turn through the model's chat template (when its tokenizer has one). template:
    a chat template in place of the tokenizer's own, as the server's ``model.template`` (a
    name troupe ships, hermes_tools: tool calls for templates without them, or a .jinja file).
    activation_checkpointing: the trained roles recompute each block's activations in the
    backward instead of keeping them (less memory, about a third more compute in training).
    packing: every role's forwards (SFT, reward training, scoring and step 3's update) lay
    the real tokens of a micro-batch's rows end to end in as few rows as hold them, each
    sample attending to itself only (troupe.models.packing): no compute on padding, the
    same values up to the order of float sums. Rows of a group that share their prompt run it
    once instead (troupe.rlhf.models.lm.GPTLM.shared_hidden), packed or not. packing_tokens: with
    packing, a micro-batch is consecutive samples of at most this many real tokens (a longer
    sample alone) instead of ``micro_batch_size`` samples (SFT, step 3; the reward model's
    pairs keep micro_batch_size)."""

    pretrained: str | None = None
    gpt: GPTConfig = GPTConfig(seq_len=32, n_layer=3, n_head=4, d_model=96)
    chat_template: bool = True
    template: str | None = None
    activation_checkpointing: bool = False
    packing: bool = False
    packing_tokens: int | None = Field(default=None, ge=1)


class TaskConfig(Config):
    """The bundled sorting task (used when ``data.path`` is unset): digits per prompt,
    the share of flawed SFT demonstrations, how many examples each step gets, and how a
    prompt is phrased (``template`` holds {digits}, and no other digit)."""

    min_digits: int = Field(default=3, ge=1)
    max_digits: int = Field(default=5, ge=1)
    noise: float = Field(default=0.5, ge=0, le=1)
    sft_examples: int = Field(default=20000, ge=1)
    preference_examples: int = Field(default=20000, ge=1)
    eval_examples: int = Field(default=256, ge=8)
    template: str = "sort {digits}:"

    @field_validator("template")
    @classmethod
    def _has_digits(cls, v: str) -> str:
        if v.count("{digits}") != 1 or any(c.isdigit() for c in v.replace("{digits}", "")):
            raise ValueError("holds {digits} once and no other digit")
        return v


class DataConfig(Config):
    """Your own data: a JSON-lines (or parquet) file of rows with a prompt (text, or chat
    messages) and optionally chosen and rejected (DeepSpeed-Chat's format) and other fields for
    a reward function (troupe.rlhf.data.datasets); SFT trains on prompt + chosen, the reward
    model and DPO on the pairs, step 3 on every prompt. The last ``eval_fraction`` is held out."""

    path: str | None = None
    eval_fraction: float = Field(default=0.05, gt=0, lt=1)


class StepConfig(Config):
    """A supervised step (SFT or reward model). init_from_sft (reward model only): start the
    reward model's body from the SFT policy's weights instead of from scratch.
    micro_batch_size: examples per forward/backward, gradients accumulated over the batch
    (the same step in less activation memory; None: the whole batch at once)."""

    steps: int = Field(default=600, ge=0)
    init_from_sft: bool = True
    batch_size: int = Field(default=32, ge=1)
    micro_batch_size: int | None = Field(default=None, ge=1)
    optimizer: OptimizerConfig = OptimizerConfig(name="adamw", lr=2e-3, min_lr=2e-4,
                                                 warmup_steps=20)


class RewardConfig(StepConfig):
    """Step 2 (the learned reward model) and where step 3's rewards come from: the learned
    model (weight ``model_coef``), a Python function ``function`` = "module:function"
    (weight ``function_coef``), or the weighted sum of both (and an environment's, ``env``).
    model_coef None: 1 without a function or an environment, 0 with one (no reward model is
    trained or held then).

    The function is called as ``fn(prompt, response, **fields)`` (prompt: the task's text or
    the row's chat messages; fields: the data row's other fields, e.g. ground_truth) in
    ``function_workers`` separate processes, each limited to ``function_memory_mb`` of address
    space (0: no limit) and killed with whatever it started when a call runs past
    ``timeout_s``; a call that raises, runs past the limit, breaks the reply protocol or
    returns something other than a finite number counts as a failure, scores
    ``failure_score``, and is logged; the run goes on (troupe.rlhf.pipeline.rewards)."""

    function: str | None = None
    function_coef: float = 1.0
    model_coef: float | None = Field(default=None, ge=0)
    timeout_s: float = Field(default=10.0, gt=0)
    function_workers: int = Field(default=2, ge=1)
    function_memory_mb: int = Field(default=4096, ge=0)
    failure_score: float = 0.0

    @field_validator("function")
    @classmethod
    def _module_function(cls, v: str | None) -> str | None:
        return module_attribute(v, "function", "my_rewards:exact_match")


class EnvConfig(Config):
    """Multi-turn (agentic) rollouts in step 3 (troupe.rlhf.agents.loop): each trajectory talks
    with an instance of ``function`` = "module:Class" (reset(row) -> messages; step(messages,
    assistant) -> (messages, reward or None, done); troupe.rlhf.agents.environments),
    constructed with ``kwargs``, in ``workers`` sandboxed processes per rollout engine: each
    request limited to ``timeout_s``, each process to ``memory_mb`` of address space (0: no
    limit); a failure ends its trajectory, scored ``failure_score``, counted by cause. A
    trajectory ends when the environment says done, after ``max_turns`` assistant turns (each at
    most step3.max_new_tokens), or when its tokens after the opening (the model's and the
    environment's) would pass ``max_tokens``. Its reward, the sum of the environment's, times
    ``reward_coef``, is added to the reward function's and the reward model's when those are
    set. ``tools``: OpenAI tool specs the chat template renders in every turn (SmolLM2's
    template ignores them: model.template=hermes_tools). Only the model's tokens are trained on:
    the environment's and the template's are masked out of the loss."""

    function: str | None = None
    kwargs: dict = {}
    workers: int = Field(default=2, ge=1)
    timeout_s: float = Field(default=30.0, gt=0)
    memory_mb: int = Field(default=2048, ge=0)
    max_turns: int = Field(default=4, ge=1)
    max_tokens: int = Field(default=256, ge=1)
    reward_coef: float = 1.0
    failure_score: float = 0.0
    tools: list[dict] = []

    @field_validator("function")
    @classmethod
    def _module_class(cls, v: str | None) -> str | None:
        return module_attribute(v, "Class", "my_envs:Calculator")

    @field_validator("tools")
    @classmethod
    def _tools(cls, v: list[dict]) -> list[dict]:
        from troupe.generation.tools import Tool
        for i, spec in enumerate(v):
            try:
                Tool.model_validate(spec)
            except ValueError as e:
                raise ValueError(f"tools[{i}]: not an OpenAI tool spec "
                                 f"({{'type': 'function', 'function': {{'name': ...}}}}): "
                                 f"{str(e).splitlines()[0]}") from None
        return v


class DPOConfig(Config):
    """Step 3 when ``algorithm`` is dpo: the policy learns the preference pairs directly,
    against the frozen SFT policy (the reference, whose log-probabilities of each pair are
    computed once). loss: sigmoid (DPO) or ipo; label_smoothing: conservative DPO; sft_coef:
    weight of the chosen responses' per-token NLL added to the loss (RPO, Pang et al. 2024;
    TRL's rpo_alpha): without it DPO lowers the chosen responses' likelihood along with the
    rejected ones', and the freed probability can go to tokens neither response has."""

    steps: int = Field(default=300, ge=0)
    batch_size: int = Field(default=32, ge=1)
    micro_batch_size: int | None = Field(default=None, ge=1)
    beta: float = Field(default=0.1, gt=0)
    loss: Literal["sigmoid", "ipo"] = "sigmoid"
    label_smoothing: float = Field(default=0.0, ge=0, lt=0.5)
    sft_coef: float = Field(default=0.0, ge=0)
    optimizer: OptimizerConfig = OptimizerConfig(name="adamw", lr=5e-4, min_lr=5e-5,
                                                 warmup_steps=10)
    eval_every: int = Field(default=100, ge=1)


class LoRAConfig(Config):
    """Low-rank adapters on the policy's linear layers during PPO (fused into the weights
    for generation and at the end)."""

    enabled: bool = False
    rank: int = Field(default=8, ge=1)
    alpha: float = Field(default=16.0, gt=0)


class RolloutConfig(Config):
    """Where step 3's rollouts are generated. replicas: 0 (the default) has the policy's own
    workers generate, between its updates; N >= 1 starts a ``rollout`` role of N engine
    replicas (the server's continuous batcher, int8_generation and generation_batch as the
    policy's) on their own actors and resources (num_cpus, num_gpus each; threads: torch
    threads of each, None: step3.threads), fed prompts by the driver and weights by the
    policy after each update (troupe.parallel.weight_sync: buckets of ``bucket_mb``, a
    version, a checksum per bucket; a sync not finished within ``sync_timeout_s`` fails naming
    the replica). max_staleness: how many updates older than the policy the weights that
    generated a batch may be: 0 generates each batch after the update before it (the
    synchronous order); 1 generates the next batch while the policy trains on this one
    (one-step-off); k keeps up to k batches in flight. Off-policy tokens are corrected by
    step3.tis_cap (2 when left None with max_staleness > 0). overlap_sync (with max_staleness
    >= 1, host weights): the policy stages its weights (a copy of the model's bytes) and sends
    them from a thread while it scores and trains the next batch, so a sync costs the trainer
    the copy, not the transfer; off (or on cuda, or with zero_stage 2 or 3, whose staged copy
    would be the whole model on rank 0: it streams its weights unit by unit instead, each bucket
    packed while the one before it travels), it sends them before it goes on.
    max_restarts: how often a dead replica is restarted, re-synced and its prompts re-issued
    before the run fails. precision: what the replicas hold their weights and compute in:
    "fp32", or "bf16", the policy's weights cast to it before they travel (half the bytes of
    a sync; the same bits as an fp32 sync cast on arrival), the engine's log-probabilities
    then a bf16 model's (the trainer's and the engine's differ more: step3.tis_cap corrects
    it, 2 by default then). tensor_parallel: how many actors each replica's model is split
    over (troupe.parallel.tensor; inference: the key/value heads may be replicated when T
    exceeds them), its ranks generating together; each receives the policy's whole tensors,
    whatever the policy's own layout, and keeps its shards. A split replica that dies is not
    restarted alone (its peers wait in its collectives): the run's failure policy takes it."""

    replicas: int = Field(default=0, ge=0)
    tensor_parallel: int = Field(default=1, ge=1, le=1024)
    max_staleness: int = Field(default=0, ge=0)
    num_cpus: float = Field(default=0.25, gt=0)
    num_gpus: float | None = Field(default=None, gt=0)
    threads: int | None = Field(default=None, ge=1)
    bucket_mb: float = Field(default=64.0, gt=0)
    sync_timeout_s: float = Field(default=120.0, gt=0)
    overlap_sync: bool = True
    max_restarts: int = Field(default=4, ge=0)
    precision: Literal["fp32", "bf16"] = "fp32"


class Step3Config(Config):
    """Step 3 of the online algorithms (ppo, grpo, rloo, reinforce_pp, dapo, gspo; the section
    was called ``ppo``, which is still read as ``step3``). micro_batch_size: sequences per forward (scoring) and forward/backward (policy
    and critic updates) on each worker, gradients accumulated (None: all at once). threads:
    torch threads of each worker in this step, where the roles compute at once (more threads
    than cores in all makes every role spin-wait for the others).

    A setting left None takes the algorithm's value (troupe.rlhf.algorithms):
    samples_per_prompt: responses sampled per prompt (4 for the group algorithms, else 1).
    kl_coef: weight of the KL to the reference (0.05; 0 for dapo and gspo), in the reward
    (kl_in_loss false: per token, PPO/RLOO/REINFORCE++) or as a loss term (true: GRPO's),
    estimated by kl_estimator (k1 in the reward, k3 in the loss). policy_clip, clip_high: the
    ratio is clipped to [1 - policy_clip, 1 + clip_high] (0.2 and 0.2; DAPO's clip-higher 0.28;
    GSPO's sequence ratio 3e-4 and 4e-4). group_std: the group algorithms divide by the group's
    standard deviation (false: Dr. GRPO). dynamic_sampling: keep only groups whose rewards are
    not all equal, sampling more prompts (up to ``sample_rounds`` rounds an iteration) until
    ``prompts_per_iter`` groups are kept (true for dapo). overlong_buffer: responses longer than
    max_new_tokens - overlong_buffer tokens lose up to ``overlong_penalty`` of reward, linearly
    (DAPO's soft overlong punishment; dapo: a quarter of max_new_tokens, else 0). generation_batch: sequences the rollout engine
    decodes at once (the others wait for a free slot: continuous batching; None: all at
    once); 16 is what the CPU decode kernel serves, and bounds the KV cache.
    keep_decode_weights: the policy keeps its weights packed for the CPU decode kernel between
    rollouts, refreshed in place (faster rollouts; a second copy of the linear weights held
    throughout, 0.54 GB for SmolLM2). quantize_frozen: "w8a8" holds the frozen reference and
    reward models' linear layers as W8A8 (troupe.compression, quantized once when step 3 loads
    them; the reward's value head and the tied output embedding stay fp32): their scoring
    passes run on the INT8 kernel at a quarter of the weight bytes. int8_generation: rollouts
    with W8A8 weights, an INT8 copy of the policy kept and re-quantized in place after each
    update. release_memory: the policy gives its gradient buffer back while it generates (made
    again, zeroed, at its next backward) and returns the CUDA allocator's cached blocks to the
    device, as DeepSpeed-Chat's hybrid engine frees training memory for the KV cache: a
    model's worth of fp32 bytes less during rollouts, for one allocation per update.
    prefix_cache_mb: a rollout keeps its prompts' keys and values (troupe.generation.
    prefix_cache; 0: off), so that the samples of a prompt admitted at different steps of the
    engine run it once (samples admitted together share it anyway); each record says how many
    prompt tokens the engine ran (prefill_tokens, of prompt_tokens). speculate: rollouts of at
    most 4 sequences at a time decode by prompt lookup, up to this many tokens proposed a step
    from each response's own context and verified in one pass (troupe.generation.speculative:
    the same tokens as without; 0: off); each record says how it went (spec_passes,
    spec_proposed, spec_accepted, spec_accept_rate). speculate_draft: "w8a8" proposes with a
    W8A8 copy of the policy instead (troupe.generation.draft; re-quantized in place after each
    update, as int8_generation's copy is; not with int8_generation, whose rollouts decode that
    copy already).
    temperature, top_p, top_k: how rollouts and the held-out evaluation sample (top_k 0: from
    every token); the engine's log-probabilities, like the trainer's, are of the model's whole
    distribution, whatever narrower one sampled (as OpenRLHF and verl take them).
    tis_cap: truncated importance sampling between the trainer and the rollout engine (which
    may differ in precision, kernels or weights: int8_generation, bf16): each response token's
    advantage is weighted by min(p_trainer / p_engine, tis_cap), the trainer's probability
    taken at the sampling weights (None: off). Whether on or not, every step-3 record carries
    the mismatch: the mean and max |log p_trainer - log p_engine| over the response tokens
    (logprob_mismatch_mean, _max) and the share of tokens whose ratio was truncated
    (tis_truncated)."""

    iterations: int = Field(default=120, ge=0)
    threads: int = Field(default=1, ge=1)
    prompts_per_iter: int = Field(default=32, ge=1)
    samples_per_prompt: int | None = Field(default=None, ge=1)
    kl_in_loss: bool | None = None
    kl_estimator: Literal["k1", "k2", "k3"] | None = None
    policy_clip: float | None = Field(default=None, gt=0)
    clip_high: float | None = Field(default=None, gt=0)
    group_std: bool = True
    dynamic_sampling: bool | None = None
    sample_rounds: int = Field(default=4, ge=1)
    overlong_buffer: int | None = Field(default=None, ge=0)
    overlong_penalty: float = Field(default=1.0, ge=0)
    generation_batch: int | None = Field(default=16, ge=1)
    keep_decode_weights: bool = False
    speculate: int = Field(default=0, ge=0)
    speculate_draft: Literal["w8a8"] | None = None
    release_memory: bool = False
    quantize_frozen: Literal["none", "w8a8"] = "none"
    micro_batch_size: int | None = Field(default=None, ge=1)
    max_new_tokens: int = Field(default=8, ge=1)
    temperature: float = Field(default=1.0, ge=0)
    top_p: float = Field(default=1.0, gt=0, le=1)
    top_k: int = Field(default=0, ge=0)
    tis_cap: float | None = Field(default=None, ge=1)
    ppo_epochs: int = Field(default=1, ge=1)
    kl_coef: float | None = Field(default=None, ge=0)
    clip_reward: float = Field(default=5.0, gt=0)
    gamma: float = Field(default=1.0, ge=0, le=1)
    lam: float = Field(default=0.95, ge=0, le=1)
    value_clip: float = Field(default=0.2, gt=0)
    actor: OptimizerConfig = OptimizerConfig(name="adamw", lr=2e-4, min_lr=2e-4)
    critic: OptimizerConfig = OptimizerConfig(name="adamw", lr=5e-4, min_lr=5e-4)
    ema: bool = False
    ema_beta: float = Field(default=0.992, gt=0, lt=1)
    ptx_coef: float = Field(default=0.0, ge=0)
    lora: LoRAConfig = LoRAConfig()
    int8_generation: bool = False
    prefix_cache_mb: float = Field(default=256.0, ge=0)
    rollout: RolloutConfig = RolloutConfig()
    checkpoint_every: int = Field(default=40, ge=0)
    eval_every: int = Field(default=20, ge=1)

    @model_validator(mode="after")
    def _draft_needs_speculation(self) -> "Step3Config":
        if self.speculate_draft and (not self.speculate or self.int8_generation):
            raise ValueError(f"step3.speculate_draft={self.speculate_draft} proposes for "
                             + ("speculative decoding, which step3.speculate=0 turns off: set "
                                "step3.speculate (e.g. 4)" if not self.speculate else
                                "the W8A8 rollouts of step3.int8_generation, which decode "
                                "that copy already: use one or the other"))
        return self


def module_attribute(v: str | None, what: str, example: str) -> str | None:
    """``v`` as "module:name" (None stays None); ValueError showing the form otherwise."""
    if v is not None and (v.count(":") != 1 or not all(v.split(":"))):
        raise ValueError(f"{v!r}: expected 'module:{what}', e.g. {example}")
    return v
