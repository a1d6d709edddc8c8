"""Parameter counts of the recipes: dense-tiny, moe-tiny (standard MoE) and pr-moe-tiny
(Residual MoE + pyramid), built on the same base model.

    python benchmarks/moe_params.py

Per recipe: total parameters, expert parameters, and parameters used per token (top-k experts
plus, for Residual MoE, the dense MLP beside them). One JSON line each, with ratios to moe-tiny.
"""

from __future__ import annotations

import json
from pathlib import Path

from troupe.config import load_config
from troupe.models import GPT, expert_parameters
from troupe.models.moe import MoE
from troupe.pretrain.config import PretrainConfig

CONFIGS = Path(__file__).resolve().parent.parent / "apps" / "configs"


def counts(name: str) -> dict:
    cfg = load_config(PretrainConfig, CONFIGS / f"{name}.yaml")
    model = GPT(cfg.model.model_copy(update={"moe": cfg.model.moe and cfg.model.moe.model_copy(
        update={"ep_size": 1})}))
    total = sum(p.numel() for p in model.parameters())
    experts = sum(p.numel() for p in expert_parameters(model)[1])
    active = total - experts
    for m in model.modules():
        if isinstance(m, MoE):
            per_expert = sum(p.numel() for p in m.experts.parameters()) // m.num_experts
            active += cfg.model.moe.top_k * per_expert
    layers = [m.num_experts for m in model.modules() if isinstance(m, MoE)]
    return {"recipe": name, "experts_per_moe_layer": layers, "params": total,
            "expert_params": experts, "active_params_per_token": active}


def main() -> None:
    rows = [counts(n) for n in ("dense-tiny", "moe-tiny", "pr-moe-tiny")]
    base = rows[1]
    for r in rows:
        r["params_vs_moe_tiny"] = round(r["params"] / base["params"], 3)
        r["active_vs_moe_tiny"] = round(r["active_params_per_token"]
                                        / base["active_params_per_token"], 3)
        print(json.dumps({"bench": "moe_params", **r}))


if __name__ == "__main__":
    main()
