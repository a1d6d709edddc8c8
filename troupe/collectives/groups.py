"""Named groups of this process: created by init_group, looked up by get_group."""

from __future__ import annotations

import time

import torch
from torch.distributed import Store

from troupe.collectives import rendezvous
from troupe.collectives.base import Communicator
from troupe.collectives.rendezvous import StoreAddress
from troupe.errors import CollectiveTimeoutError

BACKENDS = ("gloo", "nccl", "ucc", "auto")
_groups: dict[str, Communicator] = {}


def resolve_backend(backend: str, uses_gpu: bool) -> str:
    """'auto' means nccl for GPU workers and gloo otherwise."""
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    if backend == "auto":
        return "nccl" if uses_gpu else "gloo"
    return backend


def init_group(name: str, backend: str, rank: int, world_size: int,
               store: StoreAddress | Store, timeout_s: float = 300.0, generation: int = 0,
               local_ip: str | None = None) -> Communicator:
    """Join group ``name`` as ``rank`` of ``world_size`` through ``store``: a c10d Store
    (troupe's graphs pass one that Ray carries, troupe.actors.store) or the address of a
    TCPStore (``create_store``; it listens on every interface: for use outside Ray).

    Every member must call this; it returns once all have arrived, or raises
    CollectiveTimeoutError naming the ranks that did not arrive within ``timeout_s``.
    ``generation`` separates a rebuilt group (after a worker restart) from the old one.
    ``local_ip``: the address gloo's sockets bind (default: this machine's address on the
    route to the TCPStore's host).
    """
    if not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} is outside world_size {world_size}")
    backend = resolve_backend(backend, torch.cuda.is_available())
    if name in _groups:
        destroy_group(name)
    deadline = time.monotonic() + timeout_s
    if isinstance(store, StoreAddress):
        local_ip = local_ip or rendezvous.local_ip_towards(store.host)
        try:
            client = rendezvous.connect(store, timeout_s)
        except RuntimeError as e:  # TCPStore gives up when rank 0's store is gone
            raise CollectiveTimeoutError(name, [0], world_size, timeout_s,
                                         "serve the store") from e
    else:
        client, local_ip = store, local_ip or "127.0.0.1"
    try:
        pstore = rendezvous.arrive(client, f"{name}/{generation}/", rank, world_size, timeout_s,
                                   name)
    except RuntimeError as e:  # the store's host is gone
        raise CollectiveTimeoutError(name, [0], world_size, timeout_s, "serve the store") from e
    remaining = max(deadline - time.monotonic(), 1.0)
    if backend == "nccl":
        from troupe.collectives.nccl import NcclCommunicator, new_unique_id

        if rank == 0:
            pstore.set("nccl_uid", new_unique_id())
        comm: Communicator = NcclCommunicator(name, bytes(pstore.get("nccl_uid")), rank, world_size)
    else:
        from troupe.collectives.torch_backend import (
            TorchCommunicator,
            make_process_group,
        )

        pg = make_process_group(backend, rendezvous.PrefixStore("pg/", pstore), rank, world_size,
                                remaining, local_ip)
        comm = TorchCommunicator(name, backend, pg, rank, world_size, timeout_s)
    _groups[name] = comm
    return comm


def get_group(name: str) -> Communicator:
    """The group ``name`` this process joined; KeyError lists the groups it has."""
    try:
        return _groups[name]
    except KeyError:
        raise KeyError(f"no collective group {name!r} in this process; it has {sorted(_groups)}")


def find_group(name: str) -> Communicator | None:
    """The group ``name`` if this process joined it, else None (for optional groups, such as
    an expert-parallel group that a layout without expert parallelism does not wire)."""
    return _groups.get(name)


def list_groups() -> list[str]:
    return sorted(_groups)


def destroy_group(name: str) -> None:
    comm = _groups.pop(name, None)
    if comm is not None:
        comm.destroy()
