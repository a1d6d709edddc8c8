"""troupe's collectives: Communicator groups on gloo, NCCL (cupy) or UCC, rendezvous through Ray,
differentiable all_to_all and tensor parallelism's collectives, and 1-bit compressed allreduce with error feedback.

Inside a role worker, groups wired by ``ActorGraph.collective`` are found by name::

    grp = collectives.get_group("dp")
    grp.all_reduce(grad, op="mean")
    out = collectives.compressed_allreduce(momentum, state, group=grp)
"""

from troupe.collectives.autograd import (all_to_all, copy_in, gather_rows, gather_vocab,
                                        reduce_out, split_rows)
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
    "compressed_allreduce_many", "compressed_allreduce_packed", "copy_in", "create_store",
    "destroy_group", "find_group", "gather_rows", "gather_vocab", "get_group", "init_group",
    "list_groups", "padded_numel", "reduce_out", "release_store", "resolve_backend",
    "split_rows", "unpack_mean",
]
