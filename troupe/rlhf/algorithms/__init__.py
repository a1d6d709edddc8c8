"""RLHF step 3's algorithms: one object per algorithm (``get(name)``; base.Algorithm says what
one states), built from the pure tensor functions re-exported here (functions.py)."""

from troupe.rlhf.algorithms import online, offline  # noqa: F401, I001  (they register themselves)
from troupe.rlhf.algorithms.base import (
    Advantages,
    Algorithm,
    Scores,
    get,
    names,
    register,
)
from troupe.rlhf.algorithms.functions import (
    clip_fraction,
    discounted_returns,
    dpo_loss,
    ema_update,
    gae,
    group_ids,
    grpo_advantages,
    kl_estimate,
    kl_rewards,
    last_index,
    masked_mean,
    overlong_penalty,
    pairwise_loss,
    policy_loss,
    rloo_advantages,
    sequence_advantages,
    sequence_policy_loss,
    spread_groups,
    value_loss,
    whiten,
)

__all__ = ["Advantages", "Algorithm", "Scores", "clip_fraction", "discounted_returns",
           "dpo_loss", "ema_update", "gae", "get", "group_ids", "grpo_advantages",
           "kl_estimate", "kl_rewards", "last_index", "masked_mean", "names", "overlong_penalty",
           "pairwise_loss", "policy_loss", "register", "rloo_advantages", "sequence_advantages",
           "sequence_policy_loss", "spread_groups", "value_loss", "whiten"]
