"""Mixture of experts: the gate, the experts and the layer that dispatches tokens between them,
locally or, once troupe.parallel.apply_expert_parallel has split the experts, over an
expert-parallel group."""

from troupe.models.moe.config import MoEConfig
from troupe.models.moe.experts import Experts
from troupe.models.moe.gate import Routing, TopKGate, capacity
from troupe.models.moe.layer import MoE, ResidualMoE

__all__ = ["Experts", "MoE", "MoEConfig", "ResidualMoE", "Routing", "TopKGate", "capacity"]
