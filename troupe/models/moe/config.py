"""The MoE settings a GPT recipe carries."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, field_validator

from troupe.config import Config


class MoEConfig(Config):
    """Where the MoE layers are and how their gates route.

    num_experts: experts per MoE layer; a list gives one count per MoE layer (the pyramid
        layout of PR-MoE, more experts in the last layers).
    expert_interval: every ``expert_interval``-th block is an MoE block (blocks k-1, 2k-1, ...).
    top_k: experts per token. capacity_factor / eval_capacity_factor: capacity per expert is
        max(ceil(top_k * factor * tokens / experts), min_capacity), in training / evaluation.
    drop_policy: over capacity, keep the first tokens ("position") or the most probable
        ("probs"); dropless: never drop (capacity is whatever the batch needs).
    random_token_selection: keep a random subset instead of the first tokens (training only).
    noisy_gate: "jitter" multiplies the gate input by U(1-eps, 1+eps); "rsample" adds Gumbel
        noise to the logits used for choosing experts (training only).
    residual: Residual MoE, out = mlp(x) * a1 + moe(x) * a0 with a = softmax(Linear(M, 2)(x)).
    aux_loss_coef: weight of the load-balancing loss in the training loss.
    ep_size: expert-parallel group size; each rank of a group holds num_experts / ep_size.
    dense_layers: blocks that stay dense where expert_interval would make them MoE (Qwen2-MoE's
        mlp_only_layers). expert_d_ff: each expert's hidden width (default: the model's d_ff).
    normalize_top_k: a token's kept top-k weights are renormalised to sum to 1 (Mixtral);
        false keeps the softmax probabilities (Qwen1.5-MoE's norm_topk_prob=false).
    shared_expert_d_ff: Qwen2-MoE's shared expert, an MLP of this width that every token goes
        through, scaled by sigmoid(Linear(M, 1)(x)) and added to the experts' output.
    dispatch: how the all_to_all carries tokens between expert-parallel ranks: "model" in the
        model's dtype; "int8" or "int9" each token's activations (and, going back, the
        experts' outputs; in backward, the gradients) as 8- or 9-bit integers with a scale per
        token (troupe.collectives.autograd): int8 0.26x fp32's bytes at d_model 128, int9 0.29x
        with steps half as wide. Off by default: each value sent to another rank is rounded to
        the nearest of its row's steps (absmax / 127 or / 255); a rank's rows to itself stay
        exact. On moe-tiny over seven seeds int8 cost 6.3% of the validation loss on
        average, int9 1.4%; with a top-2 dropless gate int8 was within 1% on two seeds of
        seven and moved the others by up to 13% either way, as the timing of the tiny
        model's learning moved (benchmarks/RESULTS.md).
    """

    num_experts: int | list[int] = 4
    expert_interval: int = Field(default=2, ge=1)
    top_k: int = Field(default=1, ge=1)
    capacity_factor: float = Field(default=1.0, gt=0)
    eval_capacity_factor: float = Field(default=1.0, gt=0)
    min_capacity: int = Field(default=4, ge=0)
    drop_policy: Literal["position", "probs"] = "position"
    dropless: bool = False
    random_token_selection: bool = False
    noisy_gate: Literal["none", "jitter", "rsample"] = "none"
    jitter_eps: float = Field(default=1e-2, ge=0)
    residual: bool = False
    aux_loss_coef: float = Field(default=0.01, ge=0)
    ep_size: int = Field(default=1, ge=1)
    dense_layers: list[int] = Field(default_factory=list)
    expert_d_ff: int | None = Field(default=None, ge=1)
    normalize_top_k: bool = True
    shared_expert_d_ff: int | None = Field(default=None, ge=1)
    dispatch: Literal["model", "int8", "int9"] = "model"

    @field_validator("num_experts")
    @classmethod
    def _positive(cls, v: int | list[int]) -> int | list[int]:
        counts = v if isinstance(v, list) else [v]
        if not counts or any(c < 1 for c in counts):
            raise ValueError(f"every expert count must be >= 1, got {v}")
        return v

    def experts_per_layer(self, num_moe_layers: int) -> list[int]:
        """The expert count of each MoE layer, checked against the number of MoE layers."""
        if isinstance(self.num_experts, int):
            return [self.num_experts] * num_moe_layers
        if len(self.num_experts) != num_moe_layers:
            raise ValueError(f"moe.num_experts lists {len(self.num_experts)} counts but the model "
                             f"has {num_moe_layers} MoE layers")
        return list(self.num_experts)
