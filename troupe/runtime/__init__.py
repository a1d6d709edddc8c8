"""Driver side: cluster init, ActorGraph, and the worker context."""

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
from troupe.runtime.context import WorkerContext, get_context
from troupe.runtime.graph import ActorGraph, CollectiveSpec, RoleSpec, connect_group, rewire
from troupe.runtime.handle import Graph, RoleGroup, split_batch

__all__ = [
    "ActorGraph", "CallTimeoutError", "ClusterConnectionError", "ClusterInfo",
    "CollectiveSpec", "CollectiveTimeoutError", "Graph", "PlacementTimeoutError", "RoleGroup",
    "RoleSpec", "TroupeError", "WorkerCallError", "WorkerContext", "WorkerDiedError",
    "WorkerError", "connect_group", "get_context", "init", "rewire", "shutdown", "split_batch",
]
