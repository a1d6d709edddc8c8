"""A job's collective groups, declared once as a typed object (as torchtitan's ParallelDims):
the driver builds it from the recipe, declares its groups on the ActorGraph, and hands it to
the workers in their ``setup``, where each finds its own communicator through it. No group name
is a string that a driver and a worker must both spell.

    @dataclass(frozen=True)
    class MyTopology(Topology):
        dp: Group | None = None

    topo = MyTopology(dp=Group("dp", ("trainer",)) if workers > 1 else None)
    topo.declare(builder)                      # on the driver, before builder.build()
    comm = topo.dp and topo.dp.communicator()  # on a worker, once the groups are wired
"""

from __future__ import annotations

from dataclasses import dataclass, fields

from troupe import collectives
from troupe.collectives import Communicator
from troupe.runtime.graph import ActorGraph


@dataclass(frozen=True)
class Group:
    """One collective group: its name in the graph, the roles whose workers join it (members
    numbered in role order, then rank), its backend, and, for a group wired as several parts
    under one name (expert-parallel groups), each part's member numbers."""

    name: str
    roles: tuple[str, ...]
    backend: str = "auto"
    parts: tuple[tuple[int, ...], ...] | None = None

    def communicator(self) -> Communicator | None:
        """This worker's communicator in the group (its part's), or None when this process
        is not a member."""
        return collectives.find_group(self.name)


@dataclass(frozen=True)
class Topology:
    """The base of a job's topology: each field holding a Group is one of its groups (None:
    a group the job does not wire, e.g. data parallelism over one worker)."""

    def groups(self) -> list[Group]:
        return [g for f in fields(self) if isinstance(g := getattr(self, f.name), Group)]

    def declare(self, builder: ActorGraph) -> ActorGraph:
        """Declare every group on ``builder`` (troupe.runtime.ActorGraph.collective)."""
        for g in self.groups():
            builder.collective(g.name, list(g.roles), g.backend,
                               parts=None if g.parts is None else [list(p) for p in g.parts])
        return builder


def communicator(group: Group | None) -> Communicator | None:
    """``group``'s communicator on this worker, None for a group the job does not wire."""
    return None if group is None else group.communicator()
