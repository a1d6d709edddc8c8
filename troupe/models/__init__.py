"""Models in plain torch: GPT blocks and mixture-of-experts layers."""

from troupe.models.gpt import GPT, GPTConfig, KVCache, attention_mask, expert_parameters
from troupe.models.moe import MoE, MoEConfig, ResidualMoE, TopKGate

__all__ = ["GPT", "GPTConfig", "KVCache", "attention_mask", "MoE", "MoEConfig", "ResidualMoE", "TopKGate",
           "expert_parameters"]
