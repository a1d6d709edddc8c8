"""MoE: gate invariants, sparse dispatch against a per-token reference, and expert parallelism
over 2 and 4 ranks against one process holding every expert."""

import pytest
import torch

from tests.kernels.test_grouped_mlp import loop_mlp
from troupe import collectives
from troupe.models.moe import MoE, MoEConfig, TopKGate
from troupe.models.moe.gate import keep_within_capacity
from troupe.parallel import apply_expert_parallel, expert_layout
from troupe.runtime import ActorGraph

M, H, E = 16, 32, 8


def test_uniform_routing_gives_aux_loss_one():
    gate = TopKGate(M, E, MoEConfig(top_k=1))
    torch.nn.init.zeros_(gate.wg.weight)  # every expert equally likely
    routing = gate(torch.randn(64, M))
    assert routing.aux_loss.item() == pytest.approx(1.0, abs=1e-6)


@pytest.mark.parametrize("k,policy,rts", [(1, "position", False), (2, "position", False),
                                          (2, "probs", False), (1, "position", True),
                                          (3, "probs", True)])
def test_no_expert_above_capacity(k, policy, rts):
    torch.manual_seed(k)
    cfg = MoEConfig(top_k=k, capacity_factor=0.5, min_capacity=0, drop_policy=policy,
                    random_token_selection=rts)
    routing = TopKGate(M, E, cfg)(torch.randn(200, M) * 3)
    per_expert = torch.bincount(routing.experts_SK[routing.kept_SK], minlength=E)
    assert per_expert.max().item() <= routing.capacity
    assert (~routing.kept_SK).any(), "capacity 0.5 must drop some tokens"


def test_capacity_formula():
    for k in (1, 2, 3):
        routing = TopKGate(M, E, MoEConfig(top_k=k, capacity_factor=0.5, min_capacity=0))(
            torch.randn(200, M))
        assert routing.capacity == -(-k * 100 // E)
    routing = TopKGate(M, E, MoEConfig(min_capacity=40))(torch.randn(200, M))
    assert routing.capacity == 40


def test_drop_by_position_keeps_first_tokens():
    experts = torch.zeros(10, 1, dtype=torch.long)  # all to expert 0
    prio = torch.arange(10, dtype=torch.float64)[:, None]
    assert keep_within_capacity(experts, prio, 2, 3)[:, 0].tolist() == [True] * 3 + [False] * 7


def test_top2_weights_sum_to_one_for_kept_tokens():
    gate = TopKGate(M, E, MoEConfig(top_k=2, dropless=True))
    routing = gate(torch.randn(100, M))
    assert torch.allclose(routing.weights_SK.sum(-1), torch.ones(100), atol=1e-6)
    assert (routing.experts_SK[:, 0] != routing.experts_SK[:, 1]).all()


def test_dispatch_matches_per_token_reference():
    torch.manual_seed(0)
    moe = MoE(M, H, E, MoEConfig(top_k=2, capacity_factor=0.75, min_capacity=0))
    moe.experts.init_weights(0, "e", 0.3, 0.3)
    x = torch.randn(50, M)
    y, _ = moe(x)
    r, ex = moe.last_routing, moe.experts
    want = torch.zeros_like(x)
    for s in range(50):
        for j in range(2):
            e = r.experts_SK[s, j]
            h = torch.nn.functional.gelu(x[s] @ ex.w1[e] + ex.b1[e])
            want[s] += r.weights_SK[s, j] * (h @ ex.w2[e] + ex.b2[e])
    assert (~r.kept_SK).any()
    torch.testing.assert_close(y, want, atol=1e-5, rtol=1e-5)


# --- expert parallelism -----------------------------------------------------------------------

def _batch(rank: int):
    g = torch.Generator().manual_seed(100 + rank)
    return torch.randn(2, 24, M, generator=g), torch.randn(2, 24, M, generator=g)


def _cfg(dropless: bool, k: int) -> MoEConfig:
    return MoEConfig(top_k=k, dropless=dropless, capacity_factor=0.6, min_capacity=0)


def _build(cfg: MoEConfig, group=None) -> MoE:
    torch.manual_seed(7)  # the gate is dense: the same everywhere
    moe = apply_expert_parallel(MoE(M, H, E, cfg), group)
    moe.experts.init_weights(3, "layer", 0.2, 0.2)
    return moe


class ExpertRank:
    """One data-parallel rank holding a slice of the experts."""

    def step(self, dropless: bool, k: int, world: int, loop: bool = False):
        """One forward + backward; ``loop`` runs the experts through the per-expert autograd
        loop that grouped_mlp replaced."""
        ep, edp = collectives.get_group("ep"), collectives.get_group("edp")
        moe = _build(_cfg(dropless, k), ep)
        if loop:
            ex = moe.experts
            ex.forward = lambda x, counts: loop_mlp(x, counts, ex.w1, ex.b1, ex.w2, ex.b2)
        x, target = _batch(self._rank())
        x.requires_grad_(True)
        y, aux = moe(x)
        ((y * target).sum() + aux).div(world).backward()
        grads = {n: p.grad.clone() for n, p in moe.experts.named_parameters()}
        for g in grads.values():  # sum over ranks holding the same experts; /world already
            edp.all_reduce(g)
        dropped = int((~moe.last_routing.kept_SK).sum())
        return y.detach(), x.grad, grads, moe.experts.first, dropped

    def _rank(self) -> int:
        from troupe.runtime import get_context
        return get_context().rank


def _reference(dropless: bool, k: int, world: int):
    moe = _build(_cfg(dropless, k))
    outs, xgrads = [], []
    for r in range(world):
        x, target = _batch(r)
        x.requires_grad_(True)
        y, aux = moe(x)
        ((y * target).sum() + aux).div(world).backward()
        outs.append(y.detach())
        xgrads.append(x.grad)
    return outs, xgrads, {n: p.grad for n, p in moe.experts.named_parameters()}


@pytest.fixture(scope="module", params=[(2, 2), (4, 4), (4, 2)], ids=lambda p: f"dp{p[0]}-ep{p[1]}")
def expert_ranks(request, cluster):
    world, ep_size = request.param
    layout = expert_layout(world, ep_size)
    graph = (ActorGraph(f"moe{world}-{ep_size}").role("w", ExpertRank, world, num_cpus=1)
             .collective("ep", ["w"], "gloo", parts=layout.ep_groups)
             .collective("edp", ["w"], "gloo", parts=layout.edp_groups)
             .build(timeout_s=120, call_timeout_s=300))
    yield world, layout, graph["w"]
    graph.shutdown()


@pytest.mark.parametrize("dropless,k", [(True, 1), (False, 1), (False, 2), (True, 2)])
def test_expert_parallel_matches_single_process(expert_ranks, dropless, k):
    world, layout, ranks = expert_ranks
    results = ranks.invoke(ExpertRank.step, dropless, k, world)
    outs, xgrads, grads = _reference(dropless, k, world)
    if not dropless:
        assert sum(r[4] for r in results) > 0, "capacity limits must drop something"
    for r, (y, xg, g, first, _) in enumerate(results):
        torch.testing.assert_close(y, outs[r], atol=1e-5, rtol=0)
        torch.testing.assert_close(xg, xgrads[r], atol=1e-5, rtol=0)
        n = E // layout.ep_size
        for name, grad in g.items():
            torch.testing.assert_close(grad, grads[name][first:first + n], atol=1e-5, rtol=0)


@pytest.mark.parametrize("dropless,k", [(False, 1), (True, 2)])
def test_expert_gradients_equal_the_former_loop(expert_ranks, dropless, k):
    """On every expert-parallel layout, the expert weights' gradients (reduced over the
    expert-data-parallel group) equal those of the per-expert autograd loop to 1e-6."""
    world, _, ranks = expert_ranks
    new, old = ranks.invoke(ExpertRank.step, dropless, k, world), ranks.invoke(ExpertRank.step, dropless, k, world, True)
    for (y, xg, grads, _, _), (y_old, xg_old, grads_old, _, _) in zip(new, old):
        torch.testing.assert_close(y, y_old, atol=1e-6, rtol=0)
        torch.testing.assert_close(xg, xg_old, atol=1e-6, rtol=0)
        for name, grad in grads.items():
            torch.testing.assert_close(grad, grads_old[name], atol=1e-6, rtol=0)
