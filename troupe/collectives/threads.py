"""Ranks as threads of one process, each with gloo communicators on shared in-memory stores:
for code that needs real collectives but not processes (the tests and benchmarks of tensor
parallelism's maths; a user's check of a parallel model), in a fraction of a second. gloo
releases the GIL while it waits, so the ranks run side by side.

    losses = run_ranks(2, lambda group: train_step(apply_tensor_parallel(model(), group)))
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from typing import Callable

import torch.distributed as dist

from troupe.collectives.rendezvous import PrefixStore
from troupe.collectives.torch_backend import TorchCommunicator, make_process_group

TIMEOUT_S = 120.0


def _communicator(name: str, store: dist.Store, rank: int, world: int) -> TorchCommunicator:
    pg = make_process_group("gloo", PrefixStore(f"{name}/", store), rank, world, TIMEOUT_S,
                            "127.0.0.1")
    return TorchCommunicator(name, "gloo", pg, rank, world, TIMEOUT_S)


def run_ranks(world: int, fn: Callable, *args) -> list:
    """``fn(group, *args)`` on ``world`` threads, each a rank of one gloo group; the results
    in rank order (a rank's exception is raised here)."""
    store = dist.HashStore()
    with ThreadPoolExecutor(world) as pool:
        futures = [pool.submit(lambda r: fn(_communicator("g", store, r, world), *args), r)
                   for r in range(world)]
        return [f.result() for f in futures]


def run_groups(world: int, kinds: dict[str, list[list[int]]], fn: Callable, *args) -> list:
    """``fn(groups, rank, *args)`` on ``world`` threads, ``groups`` holding this rank's
    communicator of each kind (``kinds[kind]``: that kind's groups, lists of ranks covering
    the world, such as troupe.parallel.layout.ParallelLayout.groups(); None for a group of
    one); the results in rank order."""
    stores = {(kind, i): dist.HashStore() for kind, groups in kinds.items()
              for i in range(len(groups))}

    def rank(r: int):
        groups = {}
        for kind, lists in kinds.items():
            i, members = next((i, g) for i, g in enumerate(lists) if r in g)
            groups[kind] = None if len(members) == 1 else _communicator(
                f"{kind}{i}", stores[kind, i], members.index(r), len(members))
        return fn(groups, r, *args)

    with ThreadPoolExecutor(world) as pool:
        return [f.result() for f in [pool.submit(rank, r) for r in range(world)]]
