"""Communicators on torch.distributed process groups: gloo (CPU tensors) and ucc.

Each troupe group owns a standalone process group object, so a worker can be in any number of
groups without torch.distributed's global default group.
"""

from __future__ import annotations

import time
from datetime import timedelta
from typing import Sequence

import torch
import torch.distributed as dist

from troupe.collectives import straggler
from troupe.collectives.base import (
    ReduceOp,
    check_op,
    even_splits,
    gather_output,
    reduce_in_place,
    resolve_splits,
)

_TORCH_OPS = {
    "sum": dist.ReduceOp.SUM,
    "mean": dist.ReduceOp.SUM,  # divided afterwards: not every backend has AVG
    "max": dist.ReduceOp.MAX,
    "min": dist.ReduceOp.MIN,
    "prod": dist.ReduceOp.PRODUCT,
}


def ucc_available() -> bool:
    return bool(getattr(dist, "is_ucc_available", lambda: False)())


def make_process_group(backend: str, store: dist.Store, rank: int, world_size: int,
                       timeout_s: float, local_ip: str) -> dist.ProcessGroup:
    """A standalone gloo or ucc process group on ``store``."""
    timeout = timedelta(seconds=timeout_s)
    if backend == "gloo":
        opts = dist.ProcessGroupGloo._Options()
        opts._devices = [dist.ProcessGroupGloo.create_device(hostname=local_ip)]
        opts._timeout = timeout
        return dist.ProcessGroupGloo(store, rank, world_size, opts)
    if backend == "ucc":
        if not ucc_available():
            raise RuntimeError(
                "backend 'ucc' needs a torch build with UCC (torch.distributed.is_ucc_available() "
                f"is False for torch {torch.__version__}); use 'gloo' or 'nccl'")
        return dist.ProcessGroupUCC(store, rank, world_size, timeout)
    raise ValueError(f"unknown torch.distributed backend {backend!r}")


class TorchCommunicator:
    """Communicator over a torch.distributed process group (see base.Communicator)."""

    def __init__(self, name: str, backend: str, pg: dist.ProcessGroup, rank: int,
                 world_size: int, timeout_s: float):
        self.name, self.backend, self.pg = name, backend, pg
        self.rank, self.world_size = rank, world_size
        self.timeout_s = timeout_s
        self.timeout = timedelta(seconds=timeout_s)
        self.seq = 0  # operations started on this group; equal on ranks at the same operation
        self.in_op: str | None = None
        self.wait_s = 0.0  # seconds spent in operations since the start (their transfers)

    def _run(self, op: str, launch, peer: int | None = None) -> None:
        """Start one operation (``launch()`` returns its Work) and wait for it. A timeout
        becomes CollectiveTimeoutError naming the ranks that never reached this operation, a
        connection to a peer that went away PeerLostError naming the ranks that are gone.
        Point-to-point operations (with ``peer``) are not counted: only two ranks take part."""
        if peer is None:
            self.seq += 1
        self.in_op = op
        t0 = time.perf_counter()
        try:
            launch().wait(self.timeout)
        except RuntimeError as e:
            if straggler.peer_lost(e):
                raise straggler.lost_error(self, op, e, peer) from e
            if "timed out" not in str(e).lower() and "timeout" not in str(e).lower():
                raise
            raise straggler.timeout_error(self, op, e, peer) from e
        finally:
            self.in_op = None
            self.wait_s += time.perf_counter() - t0

    def all_reduce(self, x: torch.Tensor, op: ReduceOp = "sum") -> torch.Tensor:
        opts = dist.AllreduceOptions()
        opts.reduceOp = _TORCH_OPS.get(op, dist.ReduceOp.SUM)
        return reduce_in_place(x, op, self.world_size, lambda buf: self._run(
            "all_reduce", lambda: self.pg.allreduce([buf], opts)))

    def reduce_scatter(self, x: torch.Tensor, op: ReduceOp = "sum") -> torch.Tensor:
        check_op(op)
        even_splits(x.shape[0], self.world_size)
        if self.backend == "gloo" and op in ("sum", "mean"):
            # gloo's own reduce_scatter sends at 0.45 of a link's rate, an all_to_all and a
            # local sum at 0.6-0.7 (every rank sending to every other at once); a ring at
            # 0.87-0.89, as gloo's allgather (4 hosts at 1 Gbit/s, benchmarks/hosts.py)
            out = _Ring(self.pg, x.contiguous(), self.rank, self.world_size)
            self._run("reduce_scatter", lambda: out)
            out = out.result.view(x.shape[0] // self.world_size, *x.shape[1:])
            return out.div_(self.world_size) if op == "mean" else out
        chunks = list(x.contiguous().tensor_split(self.world_size))
        out = torch.empty_like(chunks[self.rank])
        opts = dist.ReduceScatterOptions()
        opts.reduceOp = _TORCH_OPS[op]
        self._run("reduce_scatter", lambda: self.pg.reduce_scatter([out], [chunks], opts))
        if op == "mean":
            out.div_(self.world_size)
        return out

    def all_gather(self, x: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        x = x.contiguous()
        out = gather_output(x, out, self.world_size)
        self._run("all_gather", lambda: self.pg.allgather([list(out.unbind(0))], [x]))
        return out

    def broadcast(self, x: torch.Tensor, src: int = 0) -> torch.Tensor:
        opts = dist.BroadcastOptions()
        opts.rootRank = src
        buf = x if x.is_contiguous() else x.contiguous()
        self._run("broadcast", lambda: self.pg.broadcast([buf], opts))
        if buf is not x:
            x.copy_(buf)
        return x

    def all_to_all(self, x: torch.Tensor, output_splits: Sequence[int] | None = None,
                   input_splits: Sequence[int] | None = None) -> torch.Tensor:
        x = x.contiguous()
        output_splits, input_splits = resolve_splits(self, x, output_splits, input_splits)
        out = x.new_empty((sum(output_splits), *x.shape[1:]))
        self._run("all_to_all", lambda: self.pg.alltoall_base(
            out, x, output_splits, input_splits, dist.AllToAllOptions()))
        return out

    def exchange_splits(self, input_splits: Sequence[int]) -> list[int]:
        """Tell every rank how many rows it gets from this one; returns rows to receive."""
        counts = torch.tensor(list(input_splits), dtype=torch.int64)  # host: gloo's memory
        out = torch.empty_like(counts)
        self._run("exchange_splits", lambda: self.pg.alltoall_base(
            out, counts, [1] * self.world_size, [1] * self.world_size, dist.AllToAllOptions()))
        return out.tolist()

    def send(self, x: torch.Tensor, dst: int, tag: int = 0) -> None:
        self._run(f"send to {dst}", lambda: self.pg.send([x.contiguous()], dst, tag), dst)

    def recv(self, x: torch.Tensor, src: int, tag: int = 0) -> torch.Tensor:
        buf = x if x.is_contiguous() else torch.empty_like(x, memory_format=torch.contiguous_format)
        self._run(f"recv from {src}", lambda: self.pg.recv([buf], src, tag), src)
        if buf is not x:
            x.copy_(buf)
        return x

    def barrier(self) -> None:
        self._run("barrier", lambda: self.pg.barrier(dist.BarrierOptions()))

    def destroy(self) -> None:
        shutdown = getattr(self.pg, "shutdown", None)
        if shutdown is not None:
            try:
                shutdown()
            except RuntimeError:
                pass
        self.pg = None


class _Ring:
    """A ring reduce-scatter of ``x`` over ``pg`` as a Work whose ``wait`` runs it: in step s
    (1..W-1) rank r sends its running sum of chunk r-s to rank r+1 and adds its own chunk
    r-s-1 to the sum rank r-1 sent, so that rank r ends with the sum of chunk r. Each rank
    sends one flow and receives one at a time, which a link carries at its rate. Every
    chunk's sum runs in the ring's order from the rank after its owner: the same on every
    run (and, with 2 ranks, the same as any other order)."""

    TAG = 0x7270  # its sends' tag, apart from the group's other point-to-point messages

    def __init__(self, pg: dist.ProcessGroup, x: torch.Tensor, rank: int, world: int):
        self.pg, self.chunks, self.rank, self.world = pg, x.view(world, -1), rank, world
        self.result = self.chunks[rank].clone() if world == 1 else None

    def wait(self, timeout: timedelta) -> None:
        if self.result is not None:
            return
        W, r = self.world, self.rank
        deadline = time.monotonic() + timeout.total_seconds()
        left = lambda: timedelta(seconds=max(deadline - time.monotonic(), 0.001))  # noqa: E731
        acc, buf = self.chunks[(r - 1) % W].clone(), torch.empty_like(self.chunks[0])
        for s in range(1, W):
            sent = self.pg.send([acc], (r + 1) % W, self.TAG)
            self.pg.recv([buf], (r - 1) % W, self.TAG).wait(left())
            sent.wait(left())
            acc, buf = buf.add_(self.chunks[(r - s - 1) % W]), acc
        self.result = acc
