"""Ranks as threads of this process, each with gloo communicators on shared in-memory stores:
for the maths of tensor parallelism, which needs the collectives but not Ray."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from typing import Callable

import torch.distributed as dist

from troupe.collectives.rendezvous import PrefixStore
from troupe.collectives.torch_backend import TorchCommunicator, make_process_group
from troupe.parallel.layout import ParallelLayout

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


def run_layout(layout: ParallelLayout, fn: Callable, *args) -> list:
    """``fn(groups, rank, *args)`` on ``layout.world`` threads, ``groups`` holding this rank's
    communicator of each kind of ``layout`` ("tp", "dp", "ep", "edp"; None for a group of
    one); the results in rank order."""
    kinds = {"tp": layout.tp_groups, "dp": layout.dp_groups, "ep": layout.ep_groups,
             "edp": layout.edp_groups}
    stores = {(kind, i): dist.HashStore() for kind, groups in kinds.items()
              for i in range(len(groups))}

    def rank(r: int):
        groups = {}
        for kind, lists in kinds.items():
            i, members = next((i, g) for i, g in enumerate(lists) if r in g)
            groups[kind] = None if len(members) == 1 else _communicator(
                f"{kind}{i}", stores[kind, i], members.index(r), len(members))
        return fn(groups, r, *args)

    with ThreadPoolExecutor(layout.world) as pool:
        return [f.result() for f in [pool.submit(rank, r) for r in range(layout.world)]]
