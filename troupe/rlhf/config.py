"""The RLHF recipe: its top-level keys, the checks that span sections and the values an
algorithm resolves (the sections themselves: troupe.rlhf.sections)."""

from __future__ import annotations

from typing import ClassVar, Literal

from pydantic import Field, field_validator, model_validator

from troupe.config import AppConfig, check_zero_stage
from troupe.data import ByteTokenizer
from troupe.devices import Device, Precision, check_decode_graphs
from troupe.rlhf import algorithms
from troupe.rlhf.sections import (
    DPOConfig,
    DataConfig,
    EnvConfig,
    ModelConfig,
    RewardConfig,
    Step3Config,
    StepConfig,
    TaskConfig,
)
from troupe.runtime.metrics import LoggingConfig

SPLIT_ROLES = ("policy", "reference", "reward", "critic")  # the roles tensor_parallel sizes
STEP3 = "step3"  # step 3's name (it was "ppo", whatever the algorithm: still read as step3)


class RLHFConfig(AppConfig):
    """An RLHF recipe (apps/configs/rlhf-*.yaml). algorithm: step 3's (ppo, grpo, rloo,
    reinforce_pp, dapo, gspo: online, configured under ``step3``; dpo: offline, under ``dpo``;
    or "module:attribute" naming your own troupe.rlhf.algorithms.Algorithm). steps: which
    of the three steps run (the command line's --step wins; step 3 is "step3" whatever the
    algorithm, and step 2 is skipped when no learned reward model is used). workers: data-parallel workers per role;
    tensor_parallel: T, how many actors of each role (policy, reference, reward, critic) hold
    one data-parallel rank's model between them, each its share of every layer
    (troupe.parallel.tensor): a role is workers x T actors; a policy's rollouts are generated
    by its T ranks together, and rollout replicas (which hold the whole model) get its weights
    put together by name (troupe.parallel.weight_sync); a mapping gives each role its own
    ({policy: 2, critic: 1}; a role not named: 1; roles placed apart, colocate=false, since
    colocated ones share bundles rank for rank; a role living in another's processes,
    reference_in_policy or reward_in_critic, has that role's);
    threads: torch threads of a worker in steps 1 and 2 (one role computes at a time; step 3
    has its own, step3.threads); colocate: the four roles share the policy's bundles (else each role is placed on its own);
    reference_in_policy: the frozen reference lives in the policy's worker processes instead of
    its own (a process fewer per rank; its log-probabilities then wait for the policy's work);
    reward_in_critic (ppo only): the reward model lives, and trains in step 2, in the critic's
    worker processes (a process fewer per rank);
    max_restarts: how often step 3 may recover from a failed worker of any role (Ray restarts
    it, every role goes back to the last step-3 checkpoint) before the run fails.
    collective_timeout_s: how long a collective waits for the other ranks (see
    troupe.config.AppConfig).
    precision: "bf16" runs every role's forward and backward except generation under bf16
    autocast (troupe.rlhf.models.lm.GPTLM), the fp32 weights, gradients and optimizer state kept;
    "fp16" the same in fp16, the trained roles' losses scaled dynamically (an update whose
    gradients overflow on any rank is skipped by all: troupe.optim.LossScaler).
    device: where the roles compute (auto: cuda when the cluster has GPUs, else cpu);
    num_gpus: GPUs each worker of each role asks Ray for on cuda (None: colocated roles
    share one GPU per rank in equal fractions, a role placed on its own takes a whole one).
    zero_stage, zero_prefetch, memory_per_worker: see troupe.config.ZERO (the budget is
    checked per trained role when its optimizer starts); stages 2 and 3 partition the trained
    roles (policy, critic, reward model) over their data-parallel groups and the reference
    over its own; the policy gathers its whole model once per rollout to generate.
    logging: where the metric records go besides metrics.jsonl (troupe.runtime.metrics:
    tensorboard, wandb, mlflow; the same in every app).
    decode_graphs: on cuda, the rollouts' decode steps run in fixed shapes captured as CUDA
    graphs (troupe.generation.static_step, as the server's ``decode_graphs``), kept between
    rollouts: the weights are updated in place, which the graphs read."""

    MOVED: ClassVar[dict[str, str]] = {"model.precision": "precision", "ppo": "step3"}

    algorithm: str = "ppo"
    steps: list[Literal["sft", "reward", "step3"]] = ["sft", "reward", "step3"]
    model: ModelConfig = ModelConfig()
    task: TaskConfig = TaskConfig()
    data: DataConfig = DataConfig()
    sft: StepConfig = StepConfig()
    reward: RewardConfig = RewardConfig(steps=400)
    step3: Step3Config = Step3Config()
    dpo: DPOConfig = DPOConfig()
    env: EnvConfig = EnvConfig()
    workers: int = Field(default=2, ge=1)
    tensor_parallel: int | dict[Literal["policy", "reference", "reward", "critic"], int] = 1
    threads: int = Field(default=1, ge=1)
    colocate: bool = True
    reference_in_policy: bool = False
    reward_in_critic: bool = False
    num_cpus: float = Field(default=0.25, gt=0)
    precision: Precision = "fp32"
    device: Device = "auto"
    num_gpus: float | None = Field(default=None, gt=0)
    decode_graphs: bool = False
    max_restarts: int = Field(default=2, ge=0)
    collective_timeout_s: float = Field(default=300.0, gt=0)
    seed: int = 0
    out_dir: str = "runs/rlhf"
    logging: LoggingConfig = LoggingConfig()
    zero_stage: Literal[1, 2, 3] = 1
    zero_prefetch: int = Field(default=1, ge=0, le=8)
    memory_per_worker: float | None = Field(default=None, gt=0)

    @field_validator("steps", mode="before")
    @classmethod
    def _step3_was_ppo(cls, v):
        return [STEP3 if s == "ppo" else s for s in v] if isinstance(v, list) else v

    @field_validator("tensor_parallel")
    @classmethod
    def _sizes(cls, v):
        sizes = {"tensor_parallel": v} if isinstance(v, int) else {
            f"tensor_parallel.{r}": t for r, t in v.items()}
        bad = {k: t for k, t in sizes.items() if not 1 <= t <= 1024}
        if bad:
            raise ValueError(f"sizes must be 1..1024, got {bad}")
        return v

    @field_validator("algorithm")
    @classmethod
    def _known(cls, v: str) -> str:
        algorithms.get(v)  # ValueError naming what it looked for
        return v

    @model_validator(mode="after")
    def _consistent(self) -> RLHFConfig:
        byte_vocab = ByteTokenizer.vocab_size
        if self.model.pretrained is None and self.model.gpt.vocab_size != byte_vocab:
            raise ValueError(f"model.gpt.vocab_size={self.model.gpt.vocab_size}: troupe's GPT "
                             f"reads byte tokens, {byte_vocab} ids")
        self.algo().check(self)
        check_decode_graphs(self.decode_graphs, self.device)
        check_zero_stage(self.zero_stage, {"sft.optimizer": self.sft.optimizer,
                                           "reward.optimizer": self.reward.optimizer,
                                           "step3.actor": self.step3.actor,
                                           "step3.critic": self.step3.critic,
                                           "dpo.optimizer": self.dpo.optimizer})
        Z = f"zero_stage={self.zero_stage}"
        if self.zero_stage != 1 and self.step3.lora.enabled:
            raise ValueError(f"{Z} partitions the whole policy; step3.lora trains adapters "
                             "beside frozen weights it keeps whole: use zero_stage=1")
        if self.zero_stage != 1 and self.step3.quantize_frozen != "none":
            raise ValueError(f"{Z} keeps the frozen roles partitioned in fp32; "
                             "step3.quantize_frozen needs them whole: use one or the other")
        if self.zero_stage != 1 and self.step3.ema:
            raise ValueError(f"{Z} with step3.ema: the EMA copy would be a whole model on "
                             "every rank; use zero_stage=1")
        if any(t > 1 for t in self.tp_sizes().values()) or self.step3.rollout.tensor_parallel > 1:
            _check_tensor_parallel(self)
        W = self.workers
        for key, batch in (("sft.batch_size", self.sft.batch_size),
                           ("reward.batch_size", self.reward.batch_size),
                           ("dpo.batch_size", self.dpo.batch_size)):
            if batch < W:
                raise ValueError(f"{key}={batch} leaves some of workers={W} data-parallel "
                                 f"ranks without an example: at least {W}")
        if self.algo().online and self.step3.prompts_per_iter * self.samples_per_prompt() < W:
            raise ValueError(f"step3.prompts_per_iter={self.step3.prompts_per_iter} x "
                             f"{self.samples_per_prompt()} samples leave some of workers={W} "
                             f"data-parallel ranks without a sequence: at least {W}")
        if self.model.packing_tokens and not self.model.packing:
            raise ValueError("model.packing_tokens is the budget of packed micro-batches: "
                             "set model.packing=true with it")
        if self.zero_stage != 1 and self.model.packing_tokens:
            raise ValueError(f"{Z} with model.packing_tokens: the ranks of a partitioned "
                             "model must run the same number of micro-batches, "
                             "and a token budget gives each rank its own; use "
                             "micro_batch_size (packed rows) or zero_stage=1")
        if self.model.template and self.model.pretrained is None:
            raise ValueError("model.template replaces a Hugging Face tokenizer's chat "
                             "template: troupe's byte-level GPT (no model.pretrained) has none")
        if self.env.tools and self.model.pretrained is None:
            raise ValueError("env.tools are rendered by a chat template: troupe's byte-level "
                             "GPT (no model.pretrained) has none")
        r = self.step3.rollout
        if r.max_staleness > 0 and r.replicas == 0:
            raise ValueError(f"step3.rollout.max_staleness={r.max_staleness} overlaps "
                             "generation with training, which needs rollout actors of their "
                             "own: set step3.rollout.replicas >= 1")
        if r.max_staleness > 0 and self.dynamic_sampling():
            raise ValueError(f"step3.rollout.max_staleness={r.max_staleness} with dynamic "
                             "sampling: its extra rounds wait for rewards before the batch "
                             "is known; set step3.dynamic_sampling=false or max_staleness=0")
        return self

    def tis_cap(self) -> float | None:
        """step3.tis_cap, or 2 when batches come off-policy (max_staleness > 0) or from bf16
        replicas of an fp32 trainer."""
        cap, r = self.step3.tis_cap, self.step3.rollout
        off = r.replicas and (r.max_staleness > 0 or r.precision != self.precision)
        return 2.0 if cap is None and off else cap

    def tp_of(self, role: str) -> int:
        """The tensor-parallel size of ``role`` (a role living in another's processes has
        that role's; "rollout": a replica's, step3.rollout.tensor_parallel)."""
        if role == "rollout":
            return self.step3.rollout.tensor_parallel
        if role == "reference" and self.reference_in_policy:
            role = "policy"
        if role == "reward" and self.reward_in_critic:
            role = "critic"
        T = self.tensor_parallel
        return T if isinstance(T, int) else T.get(role, 1)

    def tp_sizes(self) -> dict[str, int]:
        """Each model role's tensor-parallel size (``tp_of``)."""
        return {r: self.tp_of(r) for r in SPLIT_ROLES}

    def ranks(self, role: str) -> int:
        """How many actors ``role`` has: ``workers`` data-parallel ranks (the rollout role:
        its replicas) of ``tp_of(role)`` each."""
        n = self.step3.rollout.replicas if role == "rollout" else self.workers
        return n * self.tp_of(role)

    # what the recipe resolves to (None means "the algorithm's value") -------------------------
    def algo(self) -> algorithms.Algorithm:
        """Step 3's algorithm object (troupe.rlhf.algorithms)."""
        return algorithms.get(self.algorithm)

    def samples_per_prompt(self) -> int:
        return _or(self.step3.samples_per_prompt, self.algo().samples_per_prompt)

    def kl_coef(self) -> float:
        return _or(self.step3.kl_coef, self.algo().kl_coef)

    def kl_in_loss(self) -> bool:
        return _or(self.step3.kl_in_loss, self.algo().kl_in == "loss")

    def kl_estimator(self) -> str:
        return _or(self.step3.kl_estimator, "k3" if self.kl_in_loss() else "k1")

    def clip(self) -> tuple[float, float]:
        """The ratio's clip range below and above 1."""
        low = _or(self.step3.policy_clip, self.algo().clip)
        high = self.step3.clip_high
        if high is None:
            high = self.algo().clip_high if self.step3.policy_clip is None else None
        return low, _or(high, low)

    def dynamic_sampling(self) -> bool:
        return _or(self.step3.dynamic_sampling, self.algo().dynamic_sampling)

    def overlong_buffer(self) -> int:
        return _or(self.step3.overlong_buffer,
                   int(self.algo().overlong_share * self.step3.max_new_tokens))

    def reward_model_weight(self) -> float:
        """reward.model_coef, or 1 when nothing else gives rewards (no reward function, no
        environment), else 0."""
        if self.reward.model_coef is not None:
            return self.reward.model_coef
        return 0.0 if self.reward.function or self.env.function else 1.0

    def uses_critic(self) -> bool:
        return self.algo().critic

    def uses_reward_model(self) -> bool:
        """A learned reward model is trained in step 2 and scores in step 3."""
        return self.algo().uses_reward_model(self)

    def uses_reference(self) -> bool:
        return self.algo().uses_reference(self)


def _check_tensor_parallel(cfg: RLHFConfig) -> None:
    """What tensor parallelism does not combine with in RLHF (ValueError naming the key), and
    troupe's own GPT's heads and widths that T does not split (a Hugging Face model's
    config.json is read by the plan: troupe.rlhf.plan)."""
    from troupe.parallel.tensor import check_optimizer, check_split
    sizes, p = cfg.tp_sizes(), cfg.step3
    if not isinstance(cfg.tensor_parallel, int):
        for role, host, on in (("reference", "policy", cfg.reference_in_policy),
                               ("reward", "critic", cfg.reward_in_critic)):
            given = cfg.tensor_parallel.get(role)
            if on and given is not None and given != sizes[host]:
                raise ValueError(f"tensor_parallel.{role}={given}: with {role}_in_{host} the "
                                 f"{role} lives in the {host}'s processes, of tensor_parallel."
                                 f"{host}={sizes[host]}")
        if cfg.colocate and len(set(sizes.values())) > 1:
            raise ValueError(f"tensor_parallel={dict(cfg.tensor_parallel)} with colocate=true: "
                             "colocated roles share the policy's bundles rank for rank, so "
                             "they split their models alike; set colocate=false to give each "
                             "role its own size")
    roles_split = any(t > 1 for t in sizes.values())
    refused = {  # the trained and frozen roles' (a split replica holds none of them)
        f"zero_stage={cfg.zero_stage}": roles_split and cfg.zero_stage != 1,
        "step3.lora": roles_split and p.lora.enabled,
        "step3.ema": roles_split and p.ema,
        "step3.quantize_frozen": roles_split and p.quantize_frozen != "none",
        # and the engine's, wherever it runs
        "step3.int8_generation": p.int8_generation,
        "step3.speculate_draft": p.speculate_draft is not None,
        "decode_graphs": cfg.decode_graphs,
        "env.function": bool(cfg.env.function),
    }
    split = (("tensor_parallel", cfg.tensor_parallel) if roles_split
             else ("step3.rollout.tensor_parallel", p.rollout.tensor_parallel))
    for key, on in refused.items():
        if on:
            raise ValueError(f"{split[0]}={split[1]} with {key}: not built for models split "
                             "by tensor parallelism (their shards would each need their own "
                             f"copy, adapters or environment); set {split[0]}=1 or turn "
                             f"{key} off")
    for key, opt, role in (("sft.optimizer", cfg.sft.optimizer, "policy"),
                           ("reward.optimizer", cfg.reward.optimizer, "reward"),
                           ("step3.actor", p.actor, "policy"),
                           ("step3.critic", p.critic, "critic"),
                           ("dpo.optimizer", cfg.dpo.optimizer, "policy")):
        if sizes[role] > 1:
            check_optimizer(opt, sizes[role], key)
    if cfg.model.pretrained is None:
        for t in sorted(set(sizes.values()) - {1}):
            check_split(cfg.model.gpt, t)
        if p.rollout.tensor_parallel > 1:  # inference: key/value heads may be replicated
            check_split(cfg.model.gpt, p.rollout.tensor_parallel, training=False)


def _or(value, default):
    return default if value is None else value
