"""Every Communicator op among 2, 3 and 4 graph actors against single-process results."""

import pytest
import torch

from troupe import collectives
from troupe.runtime import ActorGraph, connect_group
from troupe.errors import CollectiveTimeoutError

from tests.collectives.helpers import GroupRank, gloo_ranks


def data(rank: int, shape=(5, 3), dtype=torch.float32, seed=0) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 * seed + rank)
    if dtype.is_floating_point:
        return torch.randn(shape, generator=g).to(dtype)
    return torch.randint(-50, 50, shape, generator=g).to(dtype)


@pytest.fixture(scope="module", params=[2, 3, 4])
def ranks(request, cluster):
    yield from gloo_ranks(f"ops{request.param}", request.param)


def run(ranks, fn, *args):
    return ranks.invoke(GroupRank.run, "g", fn, *args)


def _all_reduce(g, op, dtype):
    return g.all_reduce(data(g.rank, dtype=dtype), op)


REFERENCE = {"sum": lambda xs: xs.sum(0), "max": lambda xs: xs.amax(0),
             "min": lambda xs: xs.amin(0), "prod": lambda xs: xs.prod(0),
             "mean": lambda xs: xs.mean(0)}


@pytest.mark.parametrize("dtype", [torch.float32, torch.int64])
@pytest.mark.parametrize("op", ["sum", "max", "min", "prod", "mean"])
def test_all_reduce(ranks, op, dtype):
    if op == "mean" and dtype == torch.int64:
        with pytest.raises(Exception, match="floating-point"):
            run(ranks, _all_reduce, op, dtype)
        return
    expected = REFERENCE[op](torch.stack([data(r, dtype=dtype) for r in range(ranks.world_size)]))
    for out in run(ranks, _all_reduce, op, dtype):
        if dtype.is_floating_point:
            torch.testing.assert_close(out, expected, rtol=1e-6, atol=1e-6)
        else:
            assert torch.equal(out, expected)


def _reduce_scatter(g, op):
    return g.reduce_scatter(data(g.rank, shape=(2 * g.world_size, 3)), op)


@pytest.mark.parametrize("op", ["sum", "mean"])
def test_reduce_scatter(ranks, op):
    w = ranks.world_size
    total = torch.stack([data(r, shape=(2 * w, 3)) for r in range(w)]).sum(0)
    if op == "mean":
        total /= w
    for r, out in enumerate(run(ranks, _reduce_scatter, op)):
        torch.testing.assert_close(out, total[2 * r:2 * r + 2], rtol=1e-6, atol=1e-6)


def _all_gather(g, dtype):
    return g.all_gather(data(g.rank, dtype=dtype))


@pytest.mark.parametrize("dtype", [torch.float32, torch.int32])
def test_all_gather(ranks, dtype):
    expected = torch.stack([data(r, dtype=dtype) for r in range(ranks.world_size)])
    for out in run(ranks, _all_gather, dtype):
        assert torch.equal(out, expected)


def _broadcast(g):
    return g.broadcast(data(g.rank), src=g.world_size - 1)


def test_broadcast(ranks):
    expected = data(ranks.world_size - 1)
    for out in run(ranks, _broadcast):
        assert torch.equal(out, expected)


def splits_for(rank: int, w: int) -> list[int]:
    """Uneven rows rank -> each peer, with empty splits: (rank + 2 * peer) % 3."""
    return [(rank + 2 * peer) % 3 for peer in range(w)]


def _all_to_all(g, known_output_splits: bool):
    w = g.world_size
    ins = splits_for(g.rank, w)
    x = data(g.rank, shape=(sum(ins), 4), dtype=torch.int64)
    outs = [splits_for(src, w)[g.rank] for src in range(w)] if known_output_splits else None
    return g.all_to_all(x, outs, ins)


@pytest.mark.parametrize("known_output_splits", [True, False])
def test_all_to_all_uneven_and_empty_splits(ranks, known_output_splits):
    w = ranks.world_size
    sent = []  # sent[src][dst] = rows src sends to dst
    for src in range(w):
        x = data(src, shape=(sum(splits_for(src, w)), 4), dtype=torch.int64)
        sent.append(list(x.split(splits_for(src, w))))
    for dst, out in enumerate(run(ranks, _all_to_all, known_output_splits)):
        assert torch.equal(out, torch.cat([sent[src][dst] for src in range(w)]))


def _all_to_all_even(g):
    return g.all_to_all(data(g.rank, shape=(2 * g.world_size, 3)))


def test_all_to_all_even(ranks):
    w = ranks.world_size
    for dst, out in enumerate(run(ranks, _all_to_all_even)):
        expected = torch.cat([data(src, shape=(2 * w, 3))[2 * dst:2 * dst + 2] for src in range(w)])
        assert torch.equal(out, expected)


def _ring(g):
    nxt, prv = (g.rank + 1) % g.world_size, (g.rank - 1) % g.world_size
    buf = torch.empty(5, 3)
    if g.rank % 2 == 0:
        g.send(data(g.rank), nxt, tag=3)
        g.recv(buf, prv, tag=3)
    else:
        g.recv(buf, prv, tag=3)
        g.send(data(g.rank), nxt, tag=3)
    g.barrier()
    return buf


def test_send_recv_ring_and_barrier(ranks):
    w = ranks.world_size
    for r, out in enumerate(run(ranks, _ring)):
        assert torch.equal(out, data((r - 1) % w))


def _probe(g):
    from troupe.collectives import straggler
    return straggler.probe_links(g, 1 << 16)


def test_the_link_probe_times_every_pair_and_names_a_slow_one(ranks):
    """Every rank gets the same seconds, one per pair r -> r + 1; slowest_rank names the rank
    of the two slow pairs (here made up: the probe's own links are all loopback)."""
    w = ranks.world_size
    answers = run(ranks, _probe)
    assert all(a == answers[0] for a in answers) and len(answers[0]) == w
    assert all(0 < s < 10 for s in answers[0])
    from troupe.collectives.straggler import slowest_rank
    assert slowest_rank([0.03, 0.3, 0.3, 0.03]) == 2 and slowest_rank([0.3, 0.3, 0.03]) == 1
    assert slowest_rank([0.3, 0.03, 0.03, 0.3]) == 0  # the pair 3 -> 0 and 0 -> 1
    assert slowest_rank([0.03] * 4) is None and slowest_rank([0.3, 0.03]) is None
    assert slowest_rank([0.3, 0.05, 0.03, 0.03]) is None  # one slow pair: no host in two


def _a2a_grad(g):
    ins = [1, 3] if g.rank == 0 else [2, 0]
    x = data(g.rank, shape=(sum(ins), 3)).requires_grad_(True)
    out = collectives.all_to_all(x, g, input_splits=ins)
    weight = data(10 + g.rank, shape=out.shape)
    (out * weight).sum().backward()
    return out.detach(), x.grad


def test_all_to_all_gradient_matches_single_process(cluster):
    graph = (ActorGraph("a2a-grad").role("w", GroupRank, 2, num_cpus=1)
             .collective("g", ["w"], backend="gloo").build(timeout_s=60))
    try:
        results = graph["w"].invoke(GroupRank.run, "g", _a2a_grad)
    finally:
        graph.shutdown()
    # single process: concatenate, route rows, differentiate the same loss
    x0 = data(0, shape=(4, 3)).requires_grad_(True)
    x1 = data(1, shape=(2, 3)).requires_grad_(True)
    out0 = torch.cat([x0[:1], x1[:2]])
    out1 = torch.cat([x0[1:], x1[2:]])
    loss = (out0 * data(10, shape=out0.shape)).sum() + (out1 * data(11, shape=out1.shape)).sum()
    loss.backward()
    assert torch.equal(results[0][0], out0.detach()) and torch.equal(results[1][0], out1.detach())
    torch.testing.assert_close(results[0][1], x0.grad, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(results[1][1], x1.grad, rtol=1e-6, atol=1e-6)


def test_member_that_never_joins_is_named(cluster):
    graph = ActorGraph("late").role("w", GroupRank, 3, num_cpus=1).build(timeout_s=60)
    try:
        busy = graph["w"].actors[2].call.remote("sleep", (20,), {})  # rank 2 cannot join
        with pytest.raises(CollectiveTimeoutError) as e:
            connect_group(graph, "g", [("w", 0), ("w", 1), ("w", 2)], "gloo", timeout_s=3)
        assert e.value.missing == [2] and e.value.group == "g"
        assert "rank(s) [2]" in str(e.value)
        del busy
    finally:
        graph.shutdown()


def test_a_timeout_names_the_ranks_behind_and_not_those_gone_on():
    """The ranks named are those whose count of operations is behind the waiting rank's: one
    that finished the operation (its part sent before a link stalled) and waits in the next
    reached it, and with every rank there the error blames the link; a rank that does not
    answer the probe is named with where it is; one still inside an earlier operation, which
    the waiting rank finished, is waiting for data that did not arrive: the link again."""
    from types import SimpleNamespace

    from troupe.collectives import straggler

    comm = SimpleNamespace(name="dp", rank=0, world_size=3, seq=7, timeout_s=5.0)
    seen = {1: {"seq": 7, "in_op": "all_gather"}, 2: {"seq": 6, "in_op": None}}

    def error(states):
        straggler.set_probe(lambda group, ranks: {r: {"report": "...", "where": f"host {r}",
                                                      **states[r]} for r in ranks})
        try:
            return straggler.timeout_error(comm, "all_gather", RuntimeError("Timed out"))
        finally:
            straggler.set_probe(None)

    assert error(seen).missing == [2]  # behind: it never reached operation 7
    ahead = error({**seen, 2: {"seq": 8, "in_op": "reduce_scatter"}})
    assert ahead.missing == [] and "every rank reached it" in str(ahead)
    assert "host 1, host 2" in str(ahead)
    done = error({**seen, 2: {"seq": 7, "in_op": None}})  # it finished 7 and computes
    assert done.missing == [] and "a stalled or cut link" in str(done)
    silent = error({**seen, 2: {"seq": -1, "in_op": None, "answered": False}})
    assert silent.missing == [2] and "host 2 did not answer" in str(silent)
    # behind but inside operation 6, which rank 0 finished: its data is what did not arrive
    stuck = error({**seen, 2: {"seq": 6, "in_op": "reduce_scatter"}})
    assert stuck.missing == [2] and "a stalled or cut link" in str(stuck)
    assert "host 2 is still in reduce_scatter (operation #6)" in str(stuck)
    assert "stalled" not in str(error(seen))  # behind and computing: it did not reach it


def test_ucc_says_clearly_when_unavailable():
    from troupe.collectives.torch_backend import make_process_group, ucc_available
    if ucc_available():
        pytest.skip("this torch build has UCC")
    with pytest.raises(RuntimeError, match="UCC"):
        make_process_group("ucc", None, 0, 1, 1.0, "127.0.0.1")


def test_a_group_opens_no_port_on_a_wildcard_address(cluster):
    """The rendezvous goes through Ray (no TCPStore port) and gloo binds 127.0.0.1 on one node:
    every socket a group adds to its workers listens on loopback (issue 14)."""
    import psutil

    graph = ActorGraph("ports").role("w", _Pid, 2, num_cpus=0.5).build(60)
    try:
        pids = set(graph["w"].invoke(_Pid.pid))

        def listening():
            return {(c.pid, c.laddr.ip, c.laddr.port) for c in psutil.net_connections("inet")
                    if c.status == psutil.CONN_LISTEN and c.pid in pids}

        before = listening()
        connect_group(graph, "g", [("w", 0), ("w", 1)], "gloo", 60)
        added = listening() - before
        assert graph["w"].invoke(_Pid.allreduce_one) == [2.0, 2.0]
    finally:
        graph.shutdown()
    assert added and all(ip == "127.0.0.1" for _, ip, _ in added), added


class _Pid:
    def pid(self):
        import os
        return os.getpid()

    def allreduce_one(self):
        import torch
        from troupe import collectives
        return collectives.get_group("g").all_reduce(torch.ones(1)).item()
