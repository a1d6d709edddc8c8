"""The identity of the current worker: role, rank, world size, node and GPUs."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class WorkerContext:
    """Where a role worker sits in its graph. Set by troupe before the role class is built."""

    graph: str
    role: str
    rank: int
    world_size: int
    node_id: str
    node_ip: str
    gpu_ids: tuple[str, ...]


_current: WorkerContext | None = None


def get_context() -> WorkerContext:
    """The context of this worker; raises RuntimeError outside a troupe role worker."""
    if _current is None:
        raise RuntimeError("runtime.get_context() is only available inside a troupe role worker")
    return _current


def _set_context(ctx: WorkerContext | None) -> None:
    global _current
    _current = ctx
