"""The NCCL communicator (cupy.cuda.nccl) between two GPU actors: every op against the
single-process result, as test_ops does for gloo, and compressed_allreduce equal to gloo's bit
for bit on the same inputs. NCCL wants one GPU per rank: these need two."""

import pytest
import torch

from tests.collectives.helpers import GroupRank, gloo_ranks
from tests.collectives.test_compressed import _repeat
from tests.collectives.test_ops import data, splits_for
from troupe.runtime import ActorGraph

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")]


@pytest.fixture(scope="module")
def ranks(cluster):
    graph = (ActorGraph("nccl2").role("w", GroupRank, 2, num_cpus=1, num_gpus=1)
             .collective("g", ["w"], backend="nccl").build(timeout_s=120, call_timeout_s=300))
    try:
        yield graph["w"]
    finally:
        graph.shutdown()


def _ops(g):
    """Each op on CUDA tensors; the results come back to the host (troupe.devices.to_host)."""
    dev = torch.device("cuda", torch.cuda.current_device())
    w, r = g.world_size, g.rank
    out = {"sum": g.all_reduce(data(r).to(dev), "sum"),
           "max": g.all_reduce(data(r, dtype=torch.int64).to(dev), "max"),
           "mean": g.all_reduce(data(r).to(dev), "mean"),
           "scatter": g.reduce_scatter(data(r, shape=(2 * w, 3)).to(dev), "sum"),
           "gather": g.all_gather(data(r, dtype=torch.int32).to(dev)),
           "bcast": g.broadcast(data(r).to(dev), src=w - 1)}
    ins = splits_for(r, w)
    x = data(r, shape=(sum(ins), 4), dtype=torch.int64).to(dev)
    outs = [splits_for(src, w)[r] for src in range(w)]
    out["a2a_known"] = g.all_to_all(x, outs, ins)
    out["a2a_exchanged"] = g.all_to_all(x, None, ins)  # the splits exchanged first
    out["a2a_empty"] = g.all_to_all(torch.empty(0, 4, device=dev), [0] * w, [0] * w)
    buf = torch.empty(5, 3, device=dev)
    if r == 0:
        g.send(data(r).to(dev), 1)
    else:
        g.recv(buf, 0)
    g.barrier()
    out["recv"] = buf
    out["on_cuda"] = all(t.is_cuda for t in out.values() if isinstance(t, torch.Tensor))
    return out


def test_every_op_on_two_gpus(ranks):
    results = ranks.invoke(GroupRank.run, "g", _ops)
    w = 2
    assert all(r.pop("on_cuda") for r in results)
    stack = lambda **kw: torch.stack([data(r, **kw) for r in range(w)])  # noqa: E731
    for r, out in enumerate(results):
        torch.testing.assert_close(out["sum"], stack().sum(0), rtol=1e-6, atol=1e-6)
        assert torch.equal(out["max"], stack(dtype=torch.int64).amax(0))
        torch.testing.assert_close(out["mean"], stack().mean(0), rtol=1e-6, atol=1e-6)
        total = stack(shape=(2 * w, 3)).sum(0)
        torch.testing.assert_close(out["scatter"], total[2 * r:2 * r + 2], rtol=1e-6, atol=1e-6)
        assert torch.equal(out["gather"], stack(dtype=torch.int32))
        assert torch.equal(out["bcast"], data(w - 1))
        sent = [data(src, shape=(sum(splits_for(src, w)), 4), dtype=torch.int64)
                .split(splits_for(src, w)) for src in range(w)]
        want = torch.cat([sent[src][r] for src in range(w)])
        assert torch.equal(out["a2a_known"], want) and torch.equal(out["a2a_exchanged"], want)
        assert out["a2a_empty"].shape == (0, 4)
    assert torch.equal(results[1]["recv"], data(0))


@pytest.fixture(scope="module")
def gloo(cluster):
    yield from gloo_ranks("gloo-vs-nccl", 2)


def _compressed_on_cuda(g, numel, steps):
    """test_compressed's run on this rank's GPU (the state goes through host memory mid-way)."""
    return _repeat(g, numel, steps, steps // 2, device=torch.cuda.current_device())


@pytest.mark.parametrize("numel", [37, 1001, 100_003])
def test_compressed_allreduce_on_nccl_equals_gloo_bit_for_bit(ranks, gloo, numel):
    """The same inputs through both backends: the packed signs, scales and errors agree, so
    every output of six calls is the same bytes (troupe.kernels.onebit: the scale is a double
    sum on either device)."""
    nccl = ranks.invoke(GroupRank.run, "g", _compressed_on_cuda, numel, 6)
    reference = gloo.invoke(GroupRank.run, "g", _repeat, numel, 6, 3)
    for a, b in zip(nccl, reference):
        assert torch.equal(a, b)
