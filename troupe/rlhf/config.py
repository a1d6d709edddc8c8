"""The RLHF recipe: model source, the bundled task or your data, and the three steps."""

from __future__ import annotations

from pydantic import Field, field_validator

from troupe.config import Config
from troupe.models import GPTConfig
from troupe.optim import OptimizerConfig


class ModelConfig(Config):
    """The model every role starts from: ``pretrained``, a local Hugging Face directory
    (Llama, Qwen2, Mistral, Mixtral, GPT-2; loaded into troupe's decoder, its tokenizer with
    it; reward and critic are the same body with a value head), or else troupe's byte-level
    GPT of shape ``gpt``, initialised from the seed. chat_template: give the task's prompts
    as a user turn through the model's chat template (when its tokenizer has one).
    activation_checkpointing: the trained roles recompute each block's activations in the
    backward instead of keeping them (less memory, about a third more compute in training)."""

    pretrained: str | None = None
    gpt: GPTConfig = GPTConfig(seq_len=32, n_layer=3, n_head=4, d_model=96)
    chat_template: bool = True
    activation_checkpointing: bool = False


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
    """Your own data: a JSON-lines file with prompt, chosen and rejected (DeepSpeed-Chat's
    format); SFT trains on prompt + chosen, the reward model on the pairs, PPO on the prompts.
    The last ``eval_fraction`` is held out."""

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


class LoRAConfig(Config):
    """Low-rank adapters on the policy's linear layers during PPO (fused into the weights
    for generation and at the end)."""

    enabled: bool = False
    rank: int = Field(default=8, ge=1)
    alpha: float = Field(default=16.0, gt=0)


class PPOConfig(Config):
    """Step 3. micro_batch_size: sequences per forward (scoring) and forward/backward (policy
    and critic updates) on each worker, gradients accumulated (None: all at once). threads:
    torch threads of each worker in this step, where all four roles compute at once (more
    threads than cores in all makes every role spin-wait for the others)."""

    iterations: int = Field(default=120, ge=0)
    threads: int = Field(default=1, ge=1)
    prompts_per_iter: int = Field(default=32, ge=1)
    micro_batch_size: int | None = Field(default=None, ge=1)
    max_new_tokens: int = Field(default=8, ge=1)
    temperature: float = Field(default=1.0, ge=0)
    top_p: float = Field(default=1.0, gt=0, le=1)
    ppo_epochs: int = Field(default=1, ge=1)
    kl_coef: float = Field(default=0.05, ge=0)
    clip_reward: float = Field(default=5.0, gt=0)
    gamma: float = Field(default=1.0, ge=0, le=1)
    lam: float = Field(default=0.95, ge=0, le=1)
    policy_clip: float = Field(default=0.2, gt=0)
    value_clip: float = Field(default=0.2, gt=0)
    actor: OptimizerConfig = OptimizerConfig(name="adamw", lr=2e-4, min_lr=2e-4)
    critic: OptimizerConfig = OptimizerConfig(name="adamw", lr=5e-4, min_lr=5e-4)
    ema: bool = False
    ema_beta: float = Field(default=0.992, gt=0, lt=1)
    ptx_coef: float = Field(default=0.0, ge=0)
    lora: LoRAConfig = LoRAConfig()
    int8_generation: bool = False  # roll out with W8A8 weights (troupe.compression)
    checkpoint_every: int = Field(default=40, ge=0)
    eval_every: int = Field(default=20, ge=1)


class RLHFConfig(Config):
    """An RLHF recipe (apps/configs/rlhf-*.yaml). workers: data-parallel workers per role;
    threads: torch threads of a worker in steps 1 and 2 (one role computes at a time; step 3
    has its own, ppo.threads); colocate: the four roles share the policy's bundles (else each role is placed on its own);
    max_restarts: how often PPO may recover from a failed worker of any role (Ray restarts it,
    every role goes back to the last PPO checkpoint) before the run fails."""

    model: ModelConfig = ModelConfig()
    task: TaskConfig = TaskConfig()
    data: DataConfig = DataConfig()
    sft: StepConfig = StepConfig()
    reward: StepConfig = StepConfig(steps=400)
    ppo: PPOConfig = PPOConfig()
    workers: int = Field(default=2, ge=1)
    threads: int = Field(default=1, ge=1)
    colocate: bool = True
    num_cpus: float = Field(default=0.25, gt=0)
    max_restarts: int = Field(default=2, ge=0)
    seed: int = 0
    out_dir: str = "runs/rlhf"
