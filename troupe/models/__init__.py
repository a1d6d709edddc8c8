"""Models in plain torch: one decoder (troupe's GPT, GPT-2 and the Llama family) with
mixture-of-experts layers, and Hugging Face checkpoints in and out (troupe.models.hf)."""

from troupe.models.attention import KVCache, PrefixTree, RowCache, attention_mask
from troupe.models.gpt import GPT, GPTConfig, expert_parameters
from troupe.models.hf import from_pretrained, save_pretrained
from troupe.models.moe import MoE, MoEConfig, ResidualMoE, TopKGate

__all__ = ["GPT", "GPTConfig", "KVCache", "PrefixTree", "RowCache", "MoE", "MoEConfig",
           "ResidualMoE", "TopKGate", "attention_mask", "expert_parameters", "from_pretrained",
           "save_pretrained"]
