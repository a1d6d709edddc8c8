"""troupe's collectives: Communicator groups on gloo, NCCL (cupy) or UCC, rendezvous through Ray,
differentiable all_to_all, and 1-bit compressed allreduce with error feedback.

Inside a role worker, groups wired by ``ActorGraph.collective`` are found by name::

    grp = collectives.get_group("dp")
    grp.all_reduce(grad, op="mean")
    out = collectives.compressed_allreduce(momentum, state, group=grp)
"""

from troupe.collectives.autograd import all_to_all
from troupe.collectives.base import REDUCE_OPS, Communicator, ReduceOp
from troupe.collectives.compressed import (Folded, OneBitState, compressed_allreduce,
                                          compressed_allreduce_many,
                                          compressed_allreduce_packed, padded_numel,
                                          unpack_mean)
from troupe.collectives.groups import (
    BACKENDS,
    destroy_group,
    find_group,
    get_group,
    init_group,
    list_groups,
    resolve_backend,
)
from troupe.collectives.rendezvous import StoreAddress, create_store, release_store
from troupe.errors import CollectiveError, CollectiveTimeoutError

__all__ = [
    "BACKENDS", "REDUCE_OPS", "CollectiveError", "CollectiveTimeoutError", "Communicator",
    "Folded", "OneBitState", "ReduceOp", "StoreAddress", "all_to_all", "compressed_allreduce",
    "compressed_allreduce_many", "compressed_allreduce_packed", "create_store",
    "destroy_group", "find_group", "get_group", "init_group", "list_groups", "padded_numel",
    "release_store", "resolve_backend", "unpack_mean",
]
