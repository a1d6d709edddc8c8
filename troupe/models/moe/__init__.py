"""Mixture of experts: the gate, the experts and the layer that dispatches tokens between them,
locally or over an expert-parallel group."""

from troupe.models.moe.config import MoEConfig
from troupe.models.moe.experts import Experts
from troupe.models.moe.gate import Routing, TopKGate, capacity
from troupe.models.moe.layer import MoE, ResidualMoE
from troupe.models.moe.layout import ExpertLayout, expert_layout

__all__ = ["ExpertLayout", "Experts", "MoE", "MoEConfig", "ResidualMoE", "Routing", "TopKGate",
           "capacity", "expert_layout"]
