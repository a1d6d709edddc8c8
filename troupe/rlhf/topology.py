"""RLHF's collective groups (troupe.runtime.topology): one data-parallel group for each role
that trains and has more than one worker (policy, reward, critic), named after the role. The
frozen reference has none."""

from __future__ import annotations

from dataclasses import dataclass

from troupe.runtime.topology import Group, Topology


@dataclass(frozen=True)
class RLHFTopology(Topology):
    policy: Group | None = None
    reward: Group | None = None
    critic: Group | None = None

    @classmethod
    def of(cls, roles: list[str], workers: int) -> "RLHFTopology":
        """The groups of the graph's ``roles`` with ``workers`` ranks each."""
        trained = [r for r in ("policy", "reward", "critic") if r in roles and workers > 1]
        return cls(**{r: Group(r, (r,)) for r in trained})
