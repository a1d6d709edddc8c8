"""compressed_allreduce against an independent single-process simulation of the algorithm."""

import math

import pytest
import torch

from troupe import collectives, wire

from tests.collectives.helpers import GroupRank, gloo_ranks


def simulate(inputs: list[torch.Tensor], steps: int) -> list[torch.Tensor]:
    """The 1-bit allreduce of troupe/collectives/compressed.py's docstring, written out
    element-wise in one process (fp32)."""
    w, n = len(inputs), inputs[0].numel()
    unit = w * (w * 8 // math.gcd(w, 8))
    padded = (n + unit - 1) // unit * unit
    chunk = padded // w
    worker_err = [torch.zeros(padded) for _ in range(w)]
    server_err = [torch.zeros(chunk) for _ in range(w)]
    sign = lambda v: torch.where(v >= 0, torch.ones_like(v), -torch.ones_like(v))  # noqa: E731
    outputs = []
    for _ in range(steps):
        scales, signs = [], []
        for i, x in enumerate(inputs):
            m = torch.cat([x.reshape(-1), torch.zeros(padded - n)]) + worker_err[i]
            s = torch.linalg.vector_norm(m) / math.sqrt(padded)
            worker_err[i] = m - s * sign(m)
            scales.append(s)
            signs.append(sign(m))
        out = torch.empty(padded)
        for j in range(w):
            part = slice(j * chunk, (j + 1) * chunk)
            c = sum(scales[i] * signs[i][part] for i in range(w)) / w + server_err[j]
            s = torch.linalg.vector_norm(c) / math.sqrt(chunk)
            server_err[j] = c - s * sign(c)
            out[part] = s * sign(c)
        outputs.append(out[:n].reshape(inputs[0].shape))
    return outputs


def rank_input(rank: int, numel: int) -> torch.Tensor:
    return torch.randn(numel, generator=torch.Generator().manual_seed(17 + rank)) * (1 + rank)


def dp_input(rank: int, numel: int) -> torch.Tensor:
    """Data-parallel-like: a gradient shared by all ranks plus each rank's own noise."""
    shared = torch.randn(numel, generator=torch.Generator().manual_seed(99))
    return shared + torch.randn(numel, generator=torch.Generator().manual_seed(5 + rank))


def _repeat(g, numel, steps, checkpoint_at, make_input=rank_input, device="cpu"):
    """``steps`` calls on this rank's input (on ``device``), the error-feedback state saved
    and restored through the wire format (host memory) before call ``checkpoint_at``."""
    x, state = make_input(g.rank, numel).to(device), collectives.OneBitState()
    outs = []
    for step in range(steps):
        if step == checkpoint_at:  # save and restore through the wire format mid-way
            saved = wire.encode(state.state_dict())
            state = collectives.OneBitState()
            state.load_state_dict(wire.decode(saved))
        outs.append(collectives.compressed_allreduce(x, state, g))
    return torch.stack(outs)


@pytest.fixture(scope="module", params=[2, 3, 4])
def ranks(request, cluster):
    yield from gloo_ranks(f"onebit{request.param}", request.param)


@pytest.mark.parametrize("numel", [1, 37, 1001])
def test_matches_simulation_and_is_identical_on_every_rank(ranks, numel):
    w = ranks.world_size
    assert numel % (8 * w)  # not a multiple of 8W: padding is exercised
    outs = ranks.invoke(GroupRank.run, "g", _repeat, numel, 6, 3)
    for o in outs[1:]:
        assert torch.equal(o, outs[0])  # bit-identical across ranks
    expected = simulate([rank_input(r, numel) for r in range(w)], 6)
    for step in range(6):
        torch.testing.assert_close(outs[0][step], expected[step], rtol=1e-6, atol=1e-6)


def _many_and_one_by_one(g, sizes, steps):
    """Three steps of several tensors through compressed_allreduce_many, and the same through
    one call each, with states of their own: (packed means of both, operations each made)."""
    def inputs(step):
        return [rank_input(g.rank + 7 * step, n) * (k + 1) for k, n in enumerate(sizes)]
    together, alone = [], []
    states_a = [collectives.OneBitState() for _ in sizes]
    states_b = [collectives.OneBitState() for _ in sizes]
    ops = [g.seq]
    for step in range(steps):
        together.append(collectives.compressed_allreduce_many(zip(inputs(step), states_a), g))
    ops.append(g.seq)
    for step in range(steps):
        alone.append([collectives.compressed_allreduce_packed(x, s, g)
                      for x, s in zip(inputs(step), states_b)])
    ops.append(g.seq)
    return together, alone, [ops[1] - ops[0], ops[2] - ops[1]]


def test_many_tensors_in_two_operations_equal_one_call_each(ranks):
    """Five tensors of different sizes: the batched exchange gives each tensor's packed mean
    bit for bit as its own call does, step after step (the error feedback carries over), in 2
    operations a step instead of 10."""
    sizes = [1, 37, 1001, 8, 300]
    for together, alone, ops in ranks.invoke(GroupRank.run, "g", _many_and_one_by_one, sizes, 3):
        assert ops == [2 * 3, 2 * 3 * len(sizes)]
        for a, b in zip(together, alone):
            for (sa, ca), (sb, cb) in zip(a, b):
                assert torch.equal(sa, sb) and torch.equal(ca, cb)


def test_error_feedback_running_mean_converges(ranks):
    w, numel = ranks.world_size, 999
    outs = ranks.invoke(GroupRank.run, "g", _repeat, numel, 200, -1, dp_input)[0]
    true_mean = torch.stack([dp_input(r, numel) for r in range(w)]).mean(0)

    def rel_error(steps: int) -> float:
        running = outs[:steps].mean(0)
        return float(torch.linalg.vector_norm(running - true_mean) /
                     torch.linalg.vector_norm(true_mean))

    assert rel_error(200) < 0.02, f"running mean off by {rel_error(200):.4f}"
    assert rel_error(1) > 0.2  # one call alone is coarse: the convergence is error feedback's
    assert rel_error(200) < 0.6 * rel_error(100)  # and it decays like 1/T


def test_state_checks():
    state = collectives.OneBitState()
    with pytest.raises(ValueError, match="both"):
        state.load_state_dict({"worker_error": torch.zeros(8), "server_error": None})
    with pytest.raises(ValueError, match="unknown keys"):
        state.load_state_dict({"momentum": None})
    state._buffers(64, 2, torch.device("cpu"))
    with pytest.raises(ValueError, match="one state per tensor"):
        state._buffers(128, 2, torch.device("cpu"))
    state.reset()
    assert state.worker_error is None
    assert collectives.padded_numel(37, 3) == 72 and collectives.padded_numel(37, 4) == 64
