"""RLHF's collective groups (troupe.runtime.topology): one data-parallel group for each role
that trains and has more than one worker (policy, reward, critic), named after the role; the
frozen reference has one only with zero_stage 3 (its weights partitioned over it)."""

from __future__ import annotations

from dataclasses import dataclass

from troupe.runtime.topology import Group, Topology


@dataclass(frozen=True)
class RLHFTopology(Topology):
    policy: Group | None = None
    reward: Group | None = None
    critic: Group | None = None
    reference: Group | None = None  # zero_stage 3: the frozen weights' partition group

    @classmethod
    def of(cls, roles: list[str], workers: int, zero_stage: int = 1) -> "RLHFTopology":
        """The groups of the graph's ``roles`` with ``workers`` ranks each."""
        named = ("policy", "reward", "critic") + (("reference",) if zero_stage == 3 else ())
        grouped = [r for r in named if r in roles and workers > 1]
        return cls(**{r: Group(r, (r,)) for r in grouped})
