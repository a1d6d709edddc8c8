"""The MoE layer: route tokens with the gate, sort them by expert, send each expert's tokens to
the rank holding it (all_to_all with variable splits), run the experts, and send the results
back to be summed with the combine weights. No tokens x experts x capacity tensor is formed."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from troupe.collectives import Communicator, all_to_all, gather_rows, split_rows
from troupe.collectives.autograd import Meter
from troupe.kernels.moe import permute, unpermute
from troupe.models.layers import MLP
from troupe.models.moe.config import MoEConfig
from troupe.models.moe.experts import Experts
from troupe.models.moe.gate import Routing, TopKGate


class MoE(nn.Module):
    """``num_experts`` experts behind a top-k gate. Built whole; after
    ``troupe.parallel.apply_expert_parallel`` this rank holds experts [rank * E/P,
    (rank + 1) * E/P) and exchanges tokens with the other ranks of ``group``. The experts are
    GELU MLPs with biases (troupe's PR-MoE) or, with ``mlp="swiglu", bias=False``, Mixtral's;
    ``cfg.shared_expert_d_ff`` adds Qwen2-MoE's gated shared expert (a dense MLP, replicated).

    forward(x) returns (y, aux_loss) with y of x's shape. ``meter.bytes``: what its token
    exchanges sent to the other ranks so far (``cfg.dispatch``: in the model's dtype, or as 8-
    or 9-bit integers with a scale per token).

    ``tp`` (set by troupe.parallel.apply_tensor_parallel): the tensor-parallel group, whose
    ranks hold the same tokens. The gate routes all of them on every rank (the same
    decisions and load-balancing loss as without the split); then each rank dispatches only
    its 1/T of the tokens and the outputs are gathered back (TED's duplicate-token dropping).
    ``drop_duplicates=False`` dispatches every token from every rank instead, as if the
    ranks were unaware of each other: the same outputs for T times the exchange (for
    measuring what the dropping saves; the experts' gradients are then T times too large).
    """

    def __init__(self, d_model: int, d_ff: int, num_experts: int, cfg: MoEConfig,
                 mlp: str = "gelu", bias: bool = True):
        super().__init__()
        self.num_experts, self.num_local = num_experts, num_experts
        self.group: Communicator | None = None  # set by apply_expert_parallel
        self.dispatch_bits = {"model": None, "int8": 8, "int9": 9}[cfg.dispatch]
        self.meter = Meter()  # bytes the token exchanges sent to other ranks
        self.gate = TopKGate(d_model, num_experts, cfg)
        self.experts = Experts(num_experts, 0, d_model, d_ff, mlp, bias)
        self.last_routing: Routing | None = None
        self.tp: Communicator | None = None
        self.drop_duplicates = True
        self.shared: MLP | None = None
        self.shared_gate: nn.Linear | None = None
        if cfg.shared_expert_d_ff:  # Qwen2-MoE: one more MLP for every token, gated
            self.shared = MLP(d_model, cfg.shared_expert_d_ff, mlp, bias)
            self.shared_gate = nn.Linear(d_model, 1, bias=False)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        x_SM = x.reshape(-1, x.shape[-1])
        routing = self.gate(x_SM)
        self.last_routing = routing
        tokens, weights_SK = x_SM, routing.weights_SK
        experts_SK, kept_SK = routing.experts_SK, routing.kept_SK
        split = self.tp is not None and self.drop_duplicates
        if split:  # this rank's share of the tokens (and of their routing)
            tokens, weights_SK = split_rows(x_SM, self.tp), split_rows(weights_SK, self.tp)
            lo = -(-x_SM.shape[0] // self.tp.world_size) * self.tp.rank
            experts_SK = experts_SK[lo:lo + tokens.shape[0]]
            kept_SK = kept_SK[lo:lo + tokens.shape[0]]
        x_AM, plan = permute(tokens, experts_SK, weights_SK, kept_SK, self.num_experts)
        y_AM = self._run_experts(x_AM, plan.counts_E)
        y = unpermute(y_AM, plan)
        if split:
            y = gather_rows(y, self.tp, x_SM.shape[0])
        y = y.view_as(x)
        if self.shared is not None:
            y = y + torch.sigmoid(self.shared_gate(x)) * self.shared(x)[0]
        return y, routing.aux_loss

    def _run_experts(self, x_AM: torch.Tensor, counts_E: torch.Tensor) -> torch.Tensor:
        if self.group is None:
            return self.experts(x_AM, counts_E.tolist())
        P, L = self.group.world_size, self.num_local
        send_PL = counts_E.view(P, L)
        recv_PL = self.group.all_to_all(send_PL.contiguous())  # row p: rows per local expert from p
        send_rows, recv_rows = send_PL.sum(1).tolist(), recv_PL.sum(1).tolist()
        x_recv = all_to_all(x_AM, self.group, recv_rows, send_rows,  # by source, then expert
                            self.dispatch_bits, self.meter)
        expert_of_row = torch.repeat_interleave(torch.arange(L, device=x_AM.device).repeat(P),
                                                recv_PL.reshape(-1))
        by_expert = torch.argsort(expert_of_row, stable=True)
        y = self.experts(x_recv[by_expert], recv_PL.sum(0).tolist())
        y_recv = torch.empty_like(y).index_copy(0, by_expert, y)  # back to source order
        return all_to_all(y_recv, self.group, send_rows, recv_rows, self.dispatch_bits,
                          self.meter)


class ResidualMoE(nn.Module):
    """Residual MoE: a dense MLP beside the experts, mixed per token by a learned 2-way softmax."""

    def __init__(self, d_model: int, d_ff: int, num_experts: int, cfg: MoEConfig):
        super().__init__()
        self.moe = MoE(d_model, d_ff, num_experts, cfg)
        self.mlp = nn.Sequential(nn.Linear(d_model, d_ff), nn.GELU(), nn.Linear(d_ff, d_model))
        self.coefficient = nn.Linear(d_model, 2)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        y_moe, aux = self.moe(x)
        a = F.softmax(self.coefficient(x), dim=-1)
        return self.mlp(x) * a[..., 1:] + y_moe * a[..., :1], aux
