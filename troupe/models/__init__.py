"""Models in plain torch: GPT blocks and mixture-of-experts layers."""

from troupe.models.gpt import GPT, GPTConfig, expert_parameters
from troupe.models.moe import MoE, MoEConfig, ResidualMoE, TopKGate

__all__ = ["GPT", "GPTConfig", "MoE", "MoEConfig", "ResidualMoE", "TopKGate",
           "expert_parameters"]
