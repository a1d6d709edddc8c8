"""Weights from one trainer to inference replicas over a collective group: bucketed,
versioned and checksummed, with a deadline that names who did not come.

Group rank 0 is the trainer; group rank r >= 1 is replica r - 1. Both sides hold a model of
the same architecture and lay its parameters (shared ones once, adapters folded in and left
out: ``sync_tensors``) into the same byte buckets of at most ``bucket_bytes``; one broadcast
per bucket carries the bucket with its checksum in its last 24 bytes. A sync is:

1. a barrier (every member there, or the deadline names who is not), then a header
   (version, number of buckets, bytes, a hash of every tensor's name, shape and dtype): a
   replica whose model differs says which of these differs;
2. the buckets; each replica checks each bucket's checksum against the one the trainer
   wrote and copies a bucket into its weights only if it holds (a corrupted bucket is never
   applied, and its replica holds no usable version until the next good sync);
3. an all-gather of every member's verdict, so the trainer's call fails too, naming the
   replica and bucket at fault.

Every collective operation of the sync runs under ``timeout_s``: a member that does not
arrive, or whose connection goes away mid-sync (its host died), makes the others raise
WeightSyncError naming it as "replica k" (the communicator's own diagnosis,
troupe.collectives.straggler, finds who it was). The checksum reads the bucket
as a grid of 64-bit words, 512 to a row: the sum of all words, and the sums of the row sums
and of the column sums each weighted by position (1, 2, ...), wrapping. A flipped bit changes
the first; two different words swapped change the second (other rows) or the third (same
row). Three memory-bound reductions, where the bucket lives (host or GPU): 0.03 s for
512 MB on one core here, where a position-weighted sum over every word took 0.7 s.

The trainer's side reads its tensors as a stream (``send_stream``): the layout is made from
their names, shapes and dtypes alone (``sync_specs``), and the bytes are taken as each bucket
is packed, the next bucket packed while a thread broadcasts the one before it. A partitioned
(ZeRO-3) trainer streams its parameters unit by unit (``Zero3.stream``): no rank ever holds
the whole model, only what a training step gathers anyway.

A trainer that goes on computing while its weights travel (one-step-off rollouts) ``stage``s
them first, every bucket packed into a copy of its own, and a ``BackgroundSend`` broadcasts
that copy from a thread; the replicas' side does not change. (A partitioned trainer does not
stage: the copy would be the whole model on rank 0; it streams instead.)
"""

from __future__ import annotations

import contextlib
import threading
import time
import zlib
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Iterable, Iterator

import torch
from torch import nn

from troupe.collectives import Communicator
from troupe.errors import CollectiveTimeoutError, PeerLostError, TroupeError
from troupe.parallel.tensor import whole_shape

_ALIGN = 8       # every tensor starts on an 8-byte boundary of its bucket
_ROW = 512       # the checksum reads a bucket as rows of 512 int64 words
_TRAILER = 24    # the checksum: three int64 words after the payload


class WeightSyncError(TroupeError):
    """A weight sync that failed: a member that did not arrive within the deadline, a
    checksum that does not match, or a replica whose model differs from the trainer's.
    ``replicas`` are the replica indices at fault (group rank - 1; -1 for the trainer)."""

    def __init__(self, message: str, version: int, replicas: list[int]):
        self.version, self.replicas = version, replicas
        super().__init__(message)


def who(group_rank: int) -> str:
    return "the trainer" if group_rank == 0 else f"replica {group_rank - 1}"


def sync_tensors(model: nn.Module, dtype: torch.dtype | None = None
                 ) -> list[tuple[str, torch.Tensor]]:
    """The tensors a sync carries, in a fixed order: every parameter once (tied ones under
    their first name), LoRA adapters left out and the adapted layer under its plain name (the
    caller folds the adapters in first: troupe.models.lora.fuse_lora). ``dtype``: each cast
    to it (a copy) where it differs, for replicas that hold their weights so (bf16: half the
    bytes, and the same bits as an fp32 sync cast on arrival)."""
    return list(sync_stream(model.named_parameters(), dtype))


def sync_specs(model: nn.Module, dtype: torch.dtype | None = None
               ) -> list[tuple[str, torch.Size, torch.dtype]]:
    """What ``sync_tensors`` would give, as (name, shape, dtype), read from the parameters'
    shapes alone (a partitioned model's need not be gathered; a tensor-parallel model's are
    the whole tensors', which the trainer sends put together: troupe.parallel.tensor)."""
    return [(name, whole_shape(model, name, t.shape), dtype or t.dtype)
            for name, t in _named(model.named_parameters())]


def sync_stream(named: Iterable[tuple[str, torch.Tensor]], dtype: torch.dtype | None = None
                ) -> Iterator[tuple[str, torch.Tensor]]:
    """``sync_tensors`` one at a time from ``named`` (a model's ``named_parameters()``, or a
    partitioned model's stream that gathers unit by unit: troupe.parallel.zero3)."""
    for name, t in _named(named):
        yield name, t.detach() if dtype is None or t.dtype == dtype else t.detach().to(dtype)


def _named(named: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
    """The synced parameters of ``named``: LoRA's pairs left out, an adapted layer under its
    plain name."""
    for name, t in named:
        if ".lora_a" not in name and ".lora_b" not in name:
            yield name.replace(".base.", "."), t


def specs_of(tensors: list[tuple[str, torch.Tensor]]) -> list[tuple[str, torch.Size, torch.dtype]]:
    return [(name, t.shape, t.dtype) for name, t in tensors]


@dataclass
class Layout:
    """Where each tensor lies: bucket, byte offset and byte length, by tensor index."""

    buckets: list[int]                       # each bucket's payload bytes
    places: list[tuple[int, int, int]]       # (bucket, offset, nbytes) per tensor
    signature: int                           # crc32 of the names, shapes and dtypes

    @classmethod
    def of(cls, specs: list[tuple[str, torch.Size, torch.dtype]], bucket_bytes: int) -> "Layout":
        """The layout of tensors given as (name, shape, dtype), from their shapes alone."""
        buckets, places, used = [], [], None
        sig = zlib.crc32(b"")
        for name, shape, dtype in specs:
            n = shape.numel() * dtype.itemsize
            step = -(-n // _ALIGN) * _ALIGN
            if used is None or (used + step > bucket_bytes and used > 0):
                buckets.append(0)
                used = 0
            places.append((len(buckets) - 1, used, n))
            used += step
            buckets[-1] = used
            sig = zlib.crc32(f"{name}:{tuple(shape)}:{dtype};".encode(), sig)
        row = _ROW * 8  # whole rows of the checksum's grid, the tail zeros
        return cls([-(-b // row) * row for b in buckets], places, sig)

    @property
    def nbytes(self) -> int:
        return sum(self.buckets)

    def by_bucket(self) -> list[list[tuple[int, int, int]]]:
        """Each bucket's tensors as (tensor index, offset, nbytes), in order."""
        out: list[list[tuple[int, int, int]]] = [[] for _ in self.buckets]
        for i, (b, off, n) in enumerate(self.places):
            out[b].append((i, off, n))
        return out


def checksum(payload: torch.Tensor) -> torch.Tensor:
    """(3,) int64: the sum of the payload's 64-bit words, and the position-weighted sums of
    its row sums and column sums (rows of 512 words; see the module doc). ``payload`` is
    uint8, whole rows of 4096 bytes."""
    grid = payload.view(torch.int64).view(-1, _ROW)
    rows, cols = grid.sum(1), grid.sum(0)
    at = torch.arange(1, max(rows.numel(), _ROW) + 1, dtype=torch.int64, device=grid.device)
    return torch.stack([rows.sum(), (rows * at[:rows.numel()]).sum(), (cols * at[:_ROW]).sum()])


@contextlib.contextmanager
def deadline(comm: Communicator, timeout_s: float):
    """Run the enclosed operations of ``comm`` under ``timeout_s`` (communicators that keep
    an operation timeout: gloo and ucc; NCCL's wait has none, the caller's own call timeout
    covers it)."""
    old = getattr(comm, "timeout_s", None)
    if old is None:
        yield
        return
    from datetime import timedelta
    comm.timeout_s, comm.timeout = timeout_s, timedelta(seconds=timeout_s)
    try:
        yield
    finally:
        comm.timeout_s, comm.timeout = old, timedelta(seconds=old)


@dataclass
class SyncReport:
    """What one sync moved: its version, buckets and bytes, and its seconds on this member."""

    version: int
    buckets: int
    bytes: int
    seconds: float


def send(comm: Communicator, tensors: list[tuple[str, torch.Tensor]], version: int,
         bucket_bytes: int, timeout_s: float) -> SyncReport:
    """The trainer's side (group rank 0): every tensor to every replica of ``comm``."""
    return send_stream(comm, specs_of(tensors), iter(tensors), version, bucket_bytes,
                       timeout_s, tensors[0][1].device)


def send_stream(comm: Communicator, specs: list[tuple[str, torch.Size, torch.dtype]],
                stream: Iterator[tuple[str, torch.Tensor]], version: int, bucket_bytes: int,
                timeout_s: float, device) -> SyncReport:
    """The trainer's side, the tensors of ``specs`` taken from ``stream`` as they come (a
    partitioned model's, gathered unit by unit): each bucket packed while the one before it
    is broadcast from a thread, into two buffers of the largest bucket's size, so that no
    more than two buckets of the weights exist here at once beyond the model's own."""
    t0 = time.perf_counter()
    layout = Layout.of(specs, bucket_bytes)
    buffers = [torch.empty(max(layout.buckets) + _TRAILER, dtype=torch.uint8, device=device)
               for _ in range(min(2, len(layout.buckets)))]
    parts = (_pack_from(buffers[b % len(buffers)][:size + _TRAILER], stream, members, specs)
             for b, (size, members) in enumerate(zip(layout.buckets, layout.by_bucket())))
    _transfer(comm, layout, parts, version, timeout_s, device, overlap=True)
    return SyncReport(version, len(layout.buckets), layout.nbytes, time.perf_counter() - t0)


@dataclass
class Staged:
    """Every bucket of a sync packed, checksum included, into one buffer of its own: what a
    background send broadcasts while the weights it was taken from change."""

    layout: Layout
    parts: list[torch.Tensor]
    buffer: torch.Tensor


def stage(tensors: list[tuple[str, torch.Tensor]], bucket_bytes: int,
          into: torch.Tensor | None = None) -> Staged:
    """A copy of ``tensors`` laid out as ``send`` lays them (the model's bytes once more), in
    ``into`` when it is the right size (an earlier sync's ``Staged.buffer``: no new pages)."""
    layout = Layout.of(specs_of(tensors), bucket_bytes)
    total = layout.nbytes + len(layout.buckets) * _TRAILER
    big = into if into is not None and into.numel() == total else torch.empty(
        total, dtype=torch.uint8, device=tensors[0][1].device)
    parts, at = [], 0
    for size, members in zip(layout.buckets, layout.by_bucket()):
        parts.append(_pack(big[at:at + size + _TRAILER], tensors, members))
        at += size + _TRAILER
    return Staged(layout, parts, big)


class BackgroundSend:
    """``stage``d weights sent by a thread of their own (the trainer goes on computing): the
    same operations, deadline and checks as ``send``. ``result()`` waits for it and returns
    its report or raises its error. Nothing else may use ``comm`` until then."""

    def __init__(self, comm: Communicator, staged: Staged, version: int, timeout_s: float):
        self.nbytes, self.buckets = staged.layout.nbytes, len(staged.parts)
        self._report: SyncReport | None = None
        self._error: BaseException | None = None

        def run() -> None:
            t0 = time.perf_counter()
            try:
                _transfer(comm, staged.layout, staged.parts, version, timeout_s,
                          staged.parts[0].device)
                self._report = SyncReport(version, self.buckets, self.nbytes,
                                          time.perf_counter() - t0)
            except BaseException as e:  # handed to whoever asks for the result
                self._error = e

        self._thread = threading.Thread(target=run, name=f"weight-sync-{version}", daemon=True)
        self._thread.start()

    def result(self) -> SyncReport:
        self._thread.join()
        if self._error is not None:
            raise self._error
        return self._report


def _pack(part: torch.Tensor, tensors: list[tuple[str, torch.Tensor]],
          members: list[tuple[int, int, int]]) -> torch.Tensor:
    """One bucket's tensors into ``part`` (payload, then the checksum in its last 24 bytes),
    the alignment gaps and the tail zeroed; returns ``part``."""
    specs = {i: (tensors[i][0], tensors[i][1].shape, tensors[i][1].dtype) for i, _, _ in members}
    return _pack_from(part, (tensors[i] for i, _, _ in members), members, specs)


def _pack_from(part: torch.Tensor, stream: Iterator[tuple[str, torch.Tensor]],
               members: list[tuple[int, int, int]],
               specs) -> torch.Tensor:
    """One bucket's tensors, taken from ``stream`` in order, into ``part`` (payload, then the
    checksum in its last 24 bytes), the alignment gaps and the tail zeroed; each checked to
    be the one the layout has there and copied in before the next is taken (a partitioned
    model's stream frees a unit once it has moved past it). Returns ``part``."""
    size, end = part.numel() - _TRAILER, 0
    for i, off, n in members:
        name, tensor = next(stream)
        want, shape, dtype = specs[i]
        if (name, tensor.shape, tensor.dtype) != (want, shape, dtype):
            raise ValueError(f"weight sync: the stream gave {name} {tuple(tensor.shape)} "
                             f"{tensor.dtype} where the layout has {want} {tuple(shape)} {dtype}")
        part[end:off].zero_()  # the alignment gap before it
        part[off:off + n].copy_(tensor.contiguous().view(-1).view(torch.uint8))
        end = off + n
    part[end:size].zero_()
    part[size:].view(torch.int64).copy_(checksum(part[:size]))
    return part


def _transfer(comm: Communicator, layout: Layout, parts, version: int, timeout_s: float,
              device, overlap: bool = False) -> None:
    """The trainer's operations of a sync: the barrier, the header, one broadcast per packed
    bucket of ``parts`` (an iterable: packed as it is read; with ``overlap`` each broadcast
    runs on a thread while the next bucket is packed), the verdicts."""
    with _translated(comm, version), deadline(comm, timeout_s):
        comm.barrier()  # every member here, or the deadline names who is not
        _header(comm, layout, version, device)
        if overlap:
            with ThreadPoolExecutor(1, thread_name_prefix="weight-sync") as pool:
                sending = None
                for part in parts:  # packed here while the one before it is on its way
                    if sending is not None:
                        sending.result()
                    sending = pool.submit(comm.broadcast, part, src=0)
                if sending is not None:
                    sending.result()
        else:
            for part in parts:
                comm.broadcast(part, src=0)
        _verdicts(comm, version, ok=True, bad_bucket=-1, device=device)


def receive(comm: Communicator, tensors: list[tuple[str, torch.Tensor]], version: int,
            bucket_bytes: int, timeout_s: float) -> SyncReport:
    """A replica's side: the trainer's tensors copied into ``tensors`` (its own model's, as
    ``sync_tensors`` gives them), each bucket only once its checksum holds. Raises
    WeightSyncError (after every member has finished the sync's operations, so none is left
    waiting) when the model differs or a bucket arrived corrupted; the weights may then be
    partly updated, and the caller must not use them until a sync succeeds."""
    t0 = time.perf_counter()
    layout = Layout.of(specs_of(tensors), bucket_bytes)
    device = tensors[0][1].device
    me = who(comm.rank)
    with _translated(comm, version), deadline(comm, timeout_s):
        comm.barrier()
        theirs = _header(comm, layout, version, device)
        problem, bad = None, -1
        mine = (version, len(layout.buckets), layout.nbytes, layout.signature)
        if tuple(theirs[:4]) != mine:
            what = ["version", "number of buckets", "bytes", "tensor names/shapes/dtypes"]
            diff = [f"{w} {t} (here {m})" for w, t, m in zip(what, theirs, mine) if t != m]
            problem = (f"weight sync: {me}'s model differs from the trainer's: the trainer "
                       f"sends {', '.join(diff)}")
        sizes = theirs[4:]  # what the trainer sends, whatever this side expected
        buf = torch.empty(max(sizes, default=0) + _TRAILER, dtype=torch.uint8, device=device)
        differs = problem is not None
        members = layout.by_bucket()  # this side's: used only when the layouts agree
        for b, size in enumerate(sizes):
            part = comm.broadcast(buf[:size + _TRAILER], src=0)
            if differs:
                continue
            got, want = checksum(part[:size]), part[size:].view(torch.int64)
            if not torch.equal(got, want):
                if problem is None:
                    problem, bad = (f"weight sync to version {version}: bucket {b} of "
                                    f"{len(sizes)} arrived at {me} with checksum "
                                    f"{got.tolist()}, the trainer's is {want.tolist()}; "
                                    "it was not applied"), b
                continue
            for i, off, n in members[b]:
                tensors[i][1].view(-1).view(torch.uint8).copy_(part[off:off + n])
        _verdicts(comm, version, ok=problem is None, bad_bucket=bad, device=device)
    if problem:
        raise WeightSyncError(problem, version, [comm.rank - 1])
    return SyncReport(version, len(layout.buckets), layout.nbytes, time.perf_counter() - t0)


def _header(comm: Communicator, layout: Layout, version: int, device) -> list[int]:
    """Rank 0's header (version, buckets, bytes, signature, then each bucket's size) to every
    member; returns it. Its length goes first, so a replica whose own layout has another
    number of buckets still takes part in every operation."""
    n = torch.tensor([len(layout.buckets)], dtype=torch.int64, device=device)
    n = int(comm.broadcast(n, src=0).item())
    head = torch.zeros(4 + n, dtype=torch.int64, device=device)
    if comm.rank == 0:
        head.copy_(torch.tensor([version, n, layout.nbytes, layout.signature, *layout.buckets],
                                dtype=torch.int64, device=device))
    return comm.broadcast(head, src=0).tolist()


def _verdicts(comm: Communicator, version: int, ok: bool, bad_bucket: int,
              device) -> None:
    """Every member's verdict to every member; the trainer raises for the replicas at fault
    (each replica raises its own)."""
    mine = torch.tensor([int(ok), bad_bucket], dtype=torch.int64, device=device)
    all_ = comm.all_gather(mine).view(comm.world_size, 2).tolist()
    bad = [(r, b) for r, (good, b) in enumerate(all_) if not good]
    if bad and comm.rank == 0:
        raise WeightSyncError(
            f"weight sync to version {version} failed at "
            + ", ".join(f"{who(r)} (bucket {b})" if b >= 0 else who(r) for r, b in bad),
            version, [r - 1 for r, _ in bad])


@contextlib.contextmanager
def _translated(comm: Communicator, version: int):
    """A member that did not arrive or went away, said in the sync's terms (replica k, not
    group rank), with the seconds this member spent in the sync before it knew."""
    t0 = time.perf_counter()
    try:
        yield
    except CollectiveTimeoutError as e:
        names = ", ".join(who(r) for r in e.missing)
        raise WeightSyncError(
            f"weight sync to version {version}: {names} did not arrive within "
            f"{e.timeout_s:g}s (group {comm.name!r} rank(s) {e.missing}; {who(comm.rank)} "
            f"waited {time.perf_counter() - t0:.1f}s)\n{e}", version,
            [r - 1 for r in e.missing]) from e
    except PeerLostError as e:
        names = ", ".join(who(r) for r in e.missing) or "a member"
        raise WeightSyncError(
            f"weight sync to version {version}: {names} went away during it (group "
            f"{comm.name!r} rank(s) {e.missing}; {who(comm.rank)} saw it "
            f"{time.perf_counter() - t0:.1f}s into the sync: {e.cause})",
            version, [r - 1 for r in e.missing]) from e
