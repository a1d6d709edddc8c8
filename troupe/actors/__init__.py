"""Role classes hosted by the graph's workers: thin shells over the plain classes below."""

from troupe.actors.pretrain import PretrainRank

__all__ = ["PretrainRank"]
