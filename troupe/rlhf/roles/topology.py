"""RLHF's collective groups (troupe.runtime.topology): one data-parallel group for each role
that trains and has more than one worker (policy, reward, critic), named after the role; the
frozen reference has one only with zero_stage 3 (its weights partitioned over it); and, with
rollout replicas, ``weights``: the policy's rank 0 (group rank 0) and every replica (group
ranks 1..N), over which the policy sends its weights after each update
(troupe.parallel.weight_sync). The policy's other ranks are each a part of their own, so that
every member of the two roles finds the group by name."""

from __future__ import annotations

from dataclasses import dataclass

from troupe.runtime.topology import Group, Topology

WEIGHTS = "weights"


@dataclass(frozen=True)
class RLHFTopology(Topology):
    policy: Group | None = None
    reward: Group | None = None
    critic: Group | None = None
    reference: Group | None = None  # zero_stage 3: the frozen weights' partition group
    weights: Group | None = None    # rollout replicas: the policy's weights to them

    @classmethod
    def of(cls, roles: list[str], workers: int, zero_stage: int = 1,
           replicas: int = 0) -> "RLHFTopology":
        """The groups of the graph's ``roles`` with ``workers`` ranks each (and ``replicas``
        rollout replicas when "rollout" is one of them)."""
        named = ("policy", "reward", "critic") + (("reference",) if zero_stage == 3 else ())
        grouped = {r: Group(r, (r,)) for r in named if r in roles and workers > 1}
        if "rollout" in roles and replicas > 0:
            # members: policy ranks 0..W-1, then replicas W..W+N-1
            parts = ((0, *range(workers, workers + replicas)),
                     *((j,) for j in range(1, workers)))
            grouped["weights"] = Group(WEIGHTS, ("policy", "rollout"), parts=parts)
        return cls(**grouped)
