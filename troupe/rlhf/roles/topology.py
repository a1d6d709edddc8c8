"""RLHF's collective groups (troupe.runtime.topology): one data-parallel group for each role
that trains and has more than one worker (policy, reward, critic), named after the role; the
frozen reference has one only with zero_stage 2 or 3 (its weights partitioned over it); with
``tensor_parallel`` T > 1, each role's ranks dT..dT+T-1 hold data-parallel rank d's model
between them ("<role>_tp", troupe.parallel.tensor) and the data-parallel groups join the ranks
t of every model (troupe.parallel.layout.ParallelLayout, tensor parallelism innermost); and,
with rollout replicas, ``weights``: the policy's rank 0 (group rank 0) and every replica
actor (group ranks 1..N; a replica split by step3.rollout.tensor_parallel is T of them, also
joined by "rollout_tp"), over which the policy sends its weights after each update
(troupe.parallel.weight_sync). The policy's other ranks are each a part of their own, so that
every member of the two roles finds the group by name."""

from __future__ import annotations

from dataclasses import dataclass

from troupe.parallel.layout import ParallelLayout
from troupe.rlhf.config import SPLIT_ROLES
from troupe.runtime.topology import Group, Topology

WEIGHTS = "weights"


@dataclass(frozen=True)
class RLHFTopology(Topology):
    policy: Group | None = None
    reward: Group | None = None
    critic: Group | None = None
    reference: Group | None = None  # zero_stage 2, 3: the frozen weights' partition group
    weights: Group | None = None    # rollout replicas: the policy's weights to them
    policy_tp: Group | None = None  # tensor_parallel > 1: the ranks of one model
    reward_tp: Group | None = None
    critic_tp: Group | None = None
    reference_tp: Group | None = None
    rollout_tp: Group | None = None  # step3.rollout.tensor_parallel > 1: a replica's ranks

    @classmethod
    def of(cls, roles: list[str], workers: int, zero_stage: int = 1,
           replicas: int = 0, tensor_parallel: dict[str, int] | None = None) -> "RLHFTopology":
        """The groups of the graph's ``roles`` with ``workers`` data-parallel ranks each of
        ``tensor_parallel[role]`` actors (1 where not given), and ``replicas`` rollout actors
        when "rollout" is one of them (``tensor_parallel["rollout"]`` of them a replica: every
        one receives the weights)."""
        named = ("policy", "reward", "critic") + (("reference",) if zero_stage != 1 else ())
        T = {r: (tensor_parallel or {}).get(r, 1) for r in SPLIT_ROLES}
        layouts = {r: ParallelLayout.of(workers * T[r], T[r]) for r in SPLIT_ROLES}
        grouped = {r: _group(r, r, layouts[r].dp_groups) for r in named if r in roles}
        grouped.update({f"{r}_tp": _group(f"{r}_tp", r, layouts[r].tp_groups)
                        for r in SPLIT_ROLES if r in roles})
        Tr = (tensor_parallel or {}).get("rollout", 1)
        if "rollout" in roles and Tr > 1:
            grouped["rollout_tp"] = _group("rollout_tp", "rollout",
                                           ParallelLayout.of(replicas, Tr).tp_groups)
        if "rollout" in roles and replicas > 0:
            # members: policy ranks 0..WT-1, then replicas WT..WT+N-1
            n = workers * T["policy"]
            parts = ((0, *range(n, n + replicas)), *((j,) for j in range(1, n)))
            grouped["weights"] = Group(WEIGHTS, ("policy", "rollout"), parts=parts)
        return cls(**{k: g for k, g in grouped.items() if g is not None})

    @classmethod
    def of_recipe(cls, roles: list[str], cfg, replicas: int | None = None) -> "RLHFTopology":
        """``of`` with the recipe's (an RLHFConfig) workers, zero_stage, each role's
        tensor_parallel and rollout actors (``replicas``: the graph's, when not the
        recipe's)."""
        return cls.of(roles, cfg.workers, cfg.zero_stage,
                      cfg.ranks("rollout") if replicas is None else replicas,
                      {**cfg.tp_sizes(), "rollout": cfg.tp_of("rollout")})


def _group(name: str, role: str, parts: list[list[int]]) -> Group | None:
    """The group of these parts of ``role``'s ranks (None when each has one member; no parts
    when it is one of every rank in order)."""
    if all(len(p) == 1 for p in parts):
        return None
    whole = len(parts) == 1 and parts[0] == sorted(parts[0])
    return Group(name, (role,), parts=None if whole else tuple(tuple(p) for p in parts))
