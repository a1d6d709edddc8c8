"""Role classes hosted by the graph's workers: thin shells over the plain classes below."""

from troupe.actors.pretrain import PretrainRank
from troupe.actors.rlhf import CriticActor, PolicyActor, ReferenceActor, RewardActor
from troupe.actors.serve import ServeRank, ServeReplica
from troupe.actors.shard import ParameterShardRank

__all__ = ["CriticActor", "ParameterShardRank", "PolicyActor", "PretrainRank", "ReferenceActor",
           "RewardActor", "ServeRank", "ServeReplica"]
