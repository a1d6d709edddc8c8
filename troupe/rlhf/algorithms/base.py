"""What an RL algorithm is, as one object, and the registry that names them.

An ``Algorithm`` states everything step 3 decides by algorithm: which roles it needs (a critic?
rollouts at all, or preference pairs?), which scores the driver collects for a batch of
rollouts (the sampling policy's log-probabilities, the reference's, the critic's values), where
the KL to the reference goes and how it is estimated, how many samples it draws per prompt,
which groups of samples it keeps (dynamic sampling), how scores become advantages and returns,
and the policy's loss. The driver, the recipe's validation, the experience making and the
policy's update read these; none of them branches on the algorithm's name.

The built-in algorithms are registered by name (troupe.rlhf.algorithms.online, .offline). A
recipe may also name one of its own as ``algorithm: "module:attribute"`` (a subclass of
``Algorithm``, or an instance): every process, the role workers included, imports it the same
way, as the reward function's "module:function" is found.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, ClassVar, Literal

import torch

from troupe.rlhf.algorithms import functions as F

if TYPE_CHECKING:
    from troupe.rlhf.config import RLHFConfig

Where = Literal["reward", "loss"]


@dataclass
class Scores:
    """A batch of rollouts as the roles and the reward function scored it, on the driver: one
    entry per data-parallel rank for the per-token fields, (B_r, S-1). ``reward`` is each
    sequence's reward (the learned model's and the function's, weighted), ``group`` its group
    id (the samples of one prompt draw share one). Fields the algorithm did not ask for are
    None."""

    reward: list[torch.Tensor]   # (B_r,)
    group: list[torch.Tensor]    # (B_r,) int64
    action: list[torch.Tensor]   # (B_r, S-1) 1.0 on response tokens
    logp: list[torch.Tensor] | None = None
    ref: list[torch.Tensor] | None = None
    values: list[torch.Tensor] | None = None

    def rows(self) -> list[int]:
        return [len(r) for r in self.reward]


@dataclass
class Advantages:
    """What ``Algorithm.advantages`` returns: per-rank (B_r, S-1) advantages, value targets
    when there is a critic (else None), and statistics for the iteration's metrics."""

    advantages: list[torch.Tensor]
    returns: list[torch.Tensor] | None = None
    stats: dict = field(default_factory=dict)


class Algorithm:
    """Step 3's algorithm. Subclasses set the class attributes and override ``advantages``
    (online algorithms) and, when the loss is not the token-level clipped surrogate,
    ``policy_loss`` and ``loss_units``. The defaults resolve settings the recipe leaves None
    (``step3.samples_per_prompt``, ``kl_coef``, ``kl_in_loss``, ``kl_estimator``,
    ``policy_clip``, ``clip_high``)."""

    name: ClassVar[str] = ""
    online: ClassVar[bool] = True       # samples rollouts (False: learns preference pairs)
    critic: ClassVar[bool] = False      # trains a value function beside the policy
    samples_per_prompt: ClassVar[int] = 1
    min_samples_per_prompt: ClassVar[int] = 1
    kl_coef: ClassVar[float] = 0.05
    kl_in: ClassVar[Where] = "reward"
    clip: ClassVar[float] = 0.2
    clip_high: ClassVar[float | None] = None  # None: the same as clip
    dynamic_sampling: ClassVar[bool] = False  # keep only groups whose rewards differ
    overlong_share: ClassVar[float] = 0.0     # overlong buffer, as a share of max_new_tokens

    def __repr__(self) -> str:
        return f"<algorithm {self.name}>"

    # the recipe, resolved -------------------------------------------------------------------
    def check(self, cfg: RLHFConfig) -> None:
        """Refuse a recipe this algorithm cannot run (ValueError, one line naming the key)."""
        n = cfg.samples_per_prompt()
        if n < self.min_samples_per_prompt:
            raise ValueError(f"step3.samples_per_prompt={n}: {self.name} compares samples of one "
                             f"prompt and needs at least {self.min_samples_per_prompt}")
        if cfg.reward_in_critic and not self.critic:
            raise ValueError(f"reward_in_critic: algorithm={self.name} has no critic")
        if self.online and cfg.reward_model_weight() == 0 and not cfg.reward.function \
                and not cfg.env.function:
            raise ValueError("reward: model_coef is 0 and neither reward.function nor "
                             "env.function is set: step 3 would have no reward")

    def scores(self, cfg: RLHFConfig) -> set[str]:
        """Which of "logp", "ref", "values" the driver collects for a batch of rollouts."""
        want = set()
        kl_reward = cfg.kl_coef() > 0 and not cfg.kl_in_loss()
        if self.critic or kl_reward or cfg.step3.ppo_epochs > 1:  # else the ratio is 1
            want.add("logp")
        if cfg.kl_coef() > 0:
            want.add("ref")
        if self.critic:
            want.add("values")
        return want

    def uses_reward_model(self, cfg: RLHFConfig) -> bool:
        return self.online and cfg.reward_model_weight() > 0

    def uses_reference(self, cfg: RLHFConfig) -> bool:
        return cfg.kl_coef() > 0

    # a batch ----------------------------------------------------------------------------------
    def keep(self, reward_B: torch.Tensor, group_B: torch.Tensor) -> torch.Tensor:
        """(B,) bool: the rows of a freshly sampled batch this algorithm trains on (all, unless
        it samples dynamically: then the groups whose rewards are not all equal)."""
        if self.dynamic_sampling:
            return F.spread_groups(reward_B, group_B)
        return torch.ones(len(reward_B), dtype=torch.bool, device=reward_B.device)

    def advantages(self, s: Scores, cfg: RLHFConfig) -> Advantages:
        raise NotImplementedError(f"algorithm {self.name} does not make advantages")

    # the policy's loss ---------------------------------------------------------------------
    def loss_units(self, mask_BR: torch.Tensor) -> torch.Tensor:
        """What the loss averages over: response tokens (token-level aggregation)."""
        return mask_BR.sum()

    def policy_loss(self, logp_BR: torch.Tensor, old_logp_BR: torch.Tensor,
                    adv_BR: torch.Tensor, mask_BR: torch.Tensor, clip: float,
                    clip_high: float | None) -> tuple[torch.Tensor, torch.Tensor]:
        """(loss averaged over this micro-batch's units, share of its response tokens that
        were clipped): the clipped surrogate with a per-token ratio."""
        loss = F.policy_loss(logp_BR, old_logp_BR, adv_BR, mask_BR, clip, clip_high)
        clipped = F.clip_fraction(logp_BR.detach(), old_logp_BR, adv_BR, mask_BR, clip,
                                  clip_high)
        return loss, clipped


_REGISTRY: dict[str, Algorithm] = {}


def register(cls: type[Algorithm]) -> type[Algorithm]:
    """Class decorator: make ``cls`` (its ``name`` set) available to recipes by name."""
    if not cls.name or cls.name in _REGISTRY:
        raise ValueError(f"algorithm {cls.__name__}: name {cls.name!r} is empty or taken")
    _REGISTRY[cls.name] = cls()
    return cls


def names() -> list[str]:
    return list(_REGISTRY)


def get(name: str) -> Algorithm:
    """The algorithm a recipe names: a registered name, or "module:attribute" (an Algorithm
    subclass or instance). ValueError naming what was looked for."""
    if name in _REGISTRY:
        return _REGISTRY[name]
    if name.count(":") != 1 or not all(name.split(":")):
        raise ValueError(f"{name!r}: expected one of {', '.join(_REGISTRY)}, or "
                         "'module:attribute' naming an Algorithm")
    module, attr = name.split(":")
    try:
        found = getattr(importlib.import_module(module), attr)
    except (ImportError, AttributeError) as e:
        raise ValueError(f"{name!r}: cannot import it ({e})") from None
    if isinstance(found, type) and issubclass(found, Algorithm):
        found = found()
    if not isinstance(found, Algorithm):
        raise ValueError(f"{name!r} is a {type(found).__name__}, not an Algorithm")
    _REGISTRY[name] = found
    return found
