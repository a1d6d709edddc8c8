"""Which ranks share experts: DeepSpeed's layout of expert-parallel and expert-data-parallel
groups over a data-parallel world."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ExpertLayout:
    """ep_groups: contiguous blocks of ep_size ranks, which split the experts between them;
    edp_groups: ranks that hold the same experts (strided by ep_size), which reduce their
    gradients together."""

    world_size: int
    ep_size: int
    ep_groups: list[list[int]]
    edp_groups: list[list[int]]


def expert_layout(world_size: int, ep_size: int) -> ExpertLayout:
    """The groups for ``world_size`` data-parallel ranks with expert-parallel size ``ep_size``.

    >>> expert_layout(4, 2).ep_groups, expert_layout(4, 2).edp_groups
    ([[0, 1], [2, 3]], [[0, 2], [1, 3]])
    """
    if ep_size < 1 or world_size % ep_size:
        raise ValueError(f"ep_size={ep_size} must divide the data-parallel world {world_size}")
    ep = [list(range(s, s + ep_size)) for s in range(0, world_size, ep_size)]
    edp = [list(range(r, world_size, ep_size)) for r in range(ep_size)]
    return ExpertLayout(world_size, ep_size, ep, edp)


@dataclass(frozen=True)
class ParallelLayout:
    """tp x ep x dp over ``world`` ranks, tensor parallelism innermost: rank g is
    tensor-parallel rank g % tp of data-parallel rank g // tp, so a tensor-parallel group is
    ``tp`` consecutive ranks (on one node where the placement packs them: it exchanges the
    most). The data-parallel world of dp = world / tp ranks splits into expert-parallel
    groups as without tensor parallelism (``expert_layout``), once for each tensor-parallel
    rank t (ranks t of every tensor-parallel group dispatch their own share of the tokens:
    troupe.models.moe.MoE). Every group below is a list of global ranks.

    tp_groups: each data-parallel rank's tensor-parallel ranks; dp_groups: for each t, the
    ranks t of every tensor-parallel group, which reduce the gradients of their (identical)
    shards; ep_groups: for each t, the expert-parallel groups among them; edp_groups: the
    ranks holding the same experts, whatever their t (the experts are not split by tensor
    parallelism: each rank t computes them for its share of the tokens).

    >>> layout = ParallelLayout.of(8, tp=2, ep=2)
    >>> layout.tp_groups, layout.dp_groups
    ([[0, 1], [2, 3], [4, 5], [6, 7]], [[0, 2, 4, 6], [1, 3, 5, 7]])
    >>> layout.ep_groups, layout.edp_groups
    ([[0, 2], [4, 6], [1, 3], [5, 7]], [[0, 1, 4, 5], [2, 3, 6, 7]])
    """

    world: int
    tp: int
    ep: int
    tp_groups: list[list[int]]
    dp_groups: list[list[int]]
    ep_groups: list[list[int]]
    edp_groups: list[list[int]]

    @classmethod
    def of(cls, world: int, tp: int = 1, ep: int = 1) -> "ParallelLayout":
        if tp < 1 or world % tp:
            raise ValueError(f"tensor_parallel={tp} must divide the {world} ranks")
        dp = world // tp
        experts = expert_layout(dp, ep)
        tp_groups = [[d * tp + t for t in range(tp)] for d in range(dp)]
        dp_groups = [[d * tp + t for d in range(dp)] for t in range(tp)]
        ep_groups = [[d * tp + t for d in g] for t in range(tp) for g in experts.ep_groups]
        edp_groups = [sorted(d * tp + t for d in g for t in range(tp))
                      for g in experts.edp_groups]
        return cls(world, tp, ep, tp_groups, dp_groups, ep_groups, edp_groups)

    @property
    def dp(self) -> int:
        """The data-parallel world: how many different batches a step reads."""
        return self.world // self.tp

    def groups(self) -> dict[str, list[list[int]]]:
        """Each kind's groups by name ("tp", "dp", "ep", "edp")."""
        return {"tp": self.tp_groups, "dp": self.dp_groups, "ep": self.ep_groups,
                "edp": self.edp_groups}

    def coords(self, rank: int) -> tuple[int, int]:
        """(data-parallel rank, tensor-parallel rank) of global rank ``rank``."""
        return rank // self.tp, rank % self.tp

    def check(self) -> None:
        """Every rank in exactly one group of each kind, each group's ranks sharing what the
        kind says they share (the written-down order, checked)."""
        for name, groups in (("tp", self.tp_groups), ("dp", self.dp_groups),
                             ("ep", self.ep_groups), ("edp", self.edp_groups)):
            ranks = sorted(r for g in groups for r in g)
            if ranks != list(range(self.world)):
                raise AssertionError(f"{name} groups {groups} do not cover {self.world} ranks "
                                     "once each")
        for g in self.tp_groups:
            assert len({self.coords(r)[0] for r in g}) == 1, g
        for g in self.dp_groups + self.ep_groups:
            assert len({self.coords(r)[1] for r in g}) == 1, g
        slices = [{(self.coords(r)[0] % self.ep) for r in g} for g in self.edp_groups]
        assert all(len(s) == 1 for s in slices), self.edp_groups
