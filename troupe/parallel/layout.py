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
