"""How a plain role class becomes a Ray actor: the worker that hosts it (context, collective
groups, stack dumps for timeouts) and the dispatch declarations on its methods. The role
classes themselves live with their application (troupe.pretrain, troupe.rlhf, troupe.serving)."""

from troupe.actors.dispatch import Dispatch, PerRank, dispatch, split

__all__ = ["Dispatch", "PerRank", "dispatch", "split"]
