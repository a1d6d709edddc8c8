"""The generic driver side: cluster init, ActorGraph and its handles (typed dispatch), the
failure policy, sharded checkpoints over a graph, metrics, worker processes kept between
graphs (reuse_workers). get_context is re-exported for
role code (it lives in troupe.context)."""

from troupe.actors.dispatch import Dispatch, PerRank, dispatch
from troupe.context import WorkerContext, get_context
from troupe.errors import (
    CallTimeoutError,
    ClusterConnectionError,
    CollectiveTimeoutError,
    PlacementTimeoutError,
    TroupeError,
    WorkerCallError,
    WorkerDiedError,
    WorkerError,
)
from troupe.runtime.cluster import ClusterInfo, init, shutdown
from troupe.runtime.graph import ActorGraph, CollectiveSpec, RoleSpec, connect_group, rewire
from troupe.actors.dispatch import split as split_batch
from troupe.runtime.handle import Call, Graph, RoleGroup
from troupe.runtime.pool import reuse_workers

__all__ = [
    "ActorGraph", "Call", "CallTimeoutError", "ClusterConnectionError", "ClusterInfo",
    "CollectiveSpec", "CollectiveTimeoutError", "Dispatch", "Graph", "PerRank",
    "PlacementTimeoutError", "RoleGroup", "RoleSpec", "TroupeError", "WorkerCallError",
    "WorkerContext", "WorkerDiedError", "WorkerError", "connect_group", "dispatch",
    "get_context", "init", "reuse_workers", "rewire", "shutdown", "split_batch",
]
