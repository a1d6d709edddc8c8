"""The space of recipes the config fuzzer draws from: each app's bundled recipe with overrides
over the keys that change what a run does and the combinations that matter (algorithm x
zero_stage x packing x replicas x staleness x environment x LoRA x quantize_frozen x precision
x workers, and the lengths and budgets held against the model). Used by
tests/apps/test_config_fuzz.py (hypothesis) and benchmarks/config_fuzz.py (drawn recipes run
to the end at tiny sizes)."""

from __future__ import annotations

import random

from hypothesis import strategies as st

NONE = None

# key -> the values drawn for it; a recipe is the bundled one with a subset of these set
RLHF = {
    "algorithm": ["ppo", "grpo", "rloo", "reinforce_pp", "dapo", "gspo", "dpo"],
    "zero_stage": [1, 2, 3],
    "model.packing": [False, True],
    "model.packing_tokens": [NONE, NONE, NONE, 8, 64],
    "model.gpt.seq_len": [8, 16, 24, 32, 48],
    "step3.max_new_tokens": [1, 4, 8, 16, 31, 40, 100],
    "step3.rollout.replicas": [0, 1, 2],
    "step3.rollout.max_staleness": [0, 1, 2],
    "step3.lora.enabled": [False, True],
    "step3.quantize_frozen": ["none", "w8a8"],
    "step3.ema": [False, True],
    "step3.samples_per_prompt": [NONE, 1, 2, 4],
    "step3.prompts_per_iter": [1, 2, 4, 20001],
    "step3.dynamic_sampling": [NONE, False, True],
    "env.function": [NONE, "apps.environments:Calculator"],
    "env.max_tokens": [1, 8, 16, 31, 256],
    "env.max_turns": [1, 2, 4, 40],
    "precision": ["fp32", "bf16", "fp16"],
    "workers": [1, 2, 3, 4],
    "sft.batch_size": [1, 4, 32, 1000000],
    "reward.batch_size": [1, 4, 32],
    "memory_per_worker": [NONE, 0.0001, 0.002, 1.0],
    "reference_in_policy": [False, True],
    "colocate": [True, False],
}

PRETRAIN = {
    "workers": [1, 2, 3, 4],
    "zero_stage": [1, 2, 3],
    "optimizer.name": ["adam", "adamw", "lamb", "onebit_adam", "zero_one_adam", "onebit_lamb"],
    "model.seq_len": [4, 16, 64, 128, 4096],
    "curriculum.enabled": [False, True],
    "curriculum.min_len": [1, 8, 64, 512],
    "train.batch_size": [1, 2, 4, 8, 12],
    "train.offload": [False, True],
    "precision": ["fp32", "bf16", "fp16"],
    "memory_per_worker": [NONE, 0.001, 0.002, 1.0],
}

SERVE = {  # over a model file of context 128 (tests/apps/test_config_fuzz.py)
    "quantize": ["{}", '{"*": w8a8}', '{"*.attn.*": w8a16, "*.ffn.*": w4a16}',
                 '{"*.attnn.*": w8a8}', '{"*": ternary}'],
    "embedding": ["fp32", "int8", "int4"],
    "group_size": [2, 16, 64, 1000],
    "limits.max_tokens": [1, 64, 127, 128, 256],
    "limits.max_prompt_tokens": [1, 96, 4096],
    "limits.max_batch": [1, 16, 64],
    "num_replicas": [1, 2],
    "precision": ["fp32", "bf16", "fp16"],
    "expert_parallel": [1, 2],
}

COMPRESS = {  # over a teacher of 4 blocks and context 64 (tests/apps/test_config_fuzz.py)
    "model.keep_layers": [NONE, "[0,2]", "[0,3]", "[5]", "[]"],
    "model.seq_len": [8, 32, 64, 128],
    "quantize": ['{"blocks.*": ternary}', '{"blocks.*": binary}', '{"blockz.*": ternary}',
                 '{"*": w8a8}'],
    "embedding": ["fp32", "int8", "int4"],
    "distill.temperature": [0.5, 1.0, 2.0],
    "distill.hidden_mse": [0.0, 1.0],
    "workers": [1, 2, 3],
    "zero_stage": [1, 2, 3],
    "train.batch_size": [1, 2, 4, 6],
    "memory_per_worker": [NONE, 0.00001, 1.0],
}

RECIPES = {"rlhf": ("rlhf-sort", RLHF), "pretrain": ("dense-tiny", PRETRAIN)}


def overrides(values: dict) -> list[str]:
    """``key=value`` overrides (YAML scalars) of drawn values."""
    return [f"{k}={'null' if v is None else str(v).lower() if isinstance(v, bool) else v}"
            for k, v in values.items()]


def strategy(space: dict) -> st.SearchStrategy[list[str]]:
    """Overrides of any subset of ``space``'s keys (hypothesis)."""
    return st.fixed_dictionaries({}, optional={k: st.sampled_from(v) for k, v in space.items()}
                                 ).map(overrides)


def draw(space: dict, rng: random.Random, share: float = 0.4) -> list[str]:
    """Overrides of a random subset of ``space``'s keys (each set with probability
    ``share``), for a seeded benchmark."""
    return overrides({k: rng.choice(v) for k, v in space.items() if rng.random() < share})
