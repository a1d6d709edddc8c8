"""The offline algorithm: DPO learns the preference pairs directly, against the frozen SFT
policy (the reference); no rollouts, reward model or critic. Its loss is
troupe.rlhf.algorithms.functions.dpo_loss, its step 3 troupe.rlhf.pipeline.dpo."""

from __future__ import annotations

from typing import TYPE_CHECKING

from troupe.rlhf.algorithms.base import Algorithm, register

if TYPE_CHECKING:
    from troupe.rlhf.config import RLHFConfig


@register
class DPO(Algorithm):
    name = "dpo"
    online = False

    def check(self, cfg: RLHFConfig) -> None:
        super().check(cfg)
        if cfg.reward.function or cfg.reward.model_coef:
            raise ValueError("reward: algorithm=dpo learns from the preference pairs and uses no "
                             "reward (unset reward.function and reward.model_coef)")

    def scores(self, cfg: RLHFConfig) -> set[str]:
        return set()

    def uses_reference(self, cfg: RLHFConfig) -> bool:
        return True  # its log-probabilities of each pair are DPO's baseline
