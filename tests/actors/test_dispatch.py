"""Worker methods declare their dispatch; the driver calls them by reference."""

from dataclasses import dataclass

import pytest

from troupe.actors import Dispatch, PerRank, dispatch, split
from troupe.runtime import ActorGraph, get_context


@dataclass
class Rows:
    values: list[int]
    tag: str

    def split(self, n):
        return [Rows(self.values[r::n], self.tag) for r in range(n)]


class Echo:
    @dispatch(Dispatch.SHARD)
    def shard(self, batch, scale=1):
        return get_context().rank, batch, scale

    @dispatch(Dispatch.RANK0)
    def first(self, x):
        return get_context().rank, x

    def everyone(self, x, y=None):  # undeclared: ALL
        return get_context().rank, x, y


class Other:
    def everyone(self, x, y=None):
        return x


@pytest.fixture(scope="module")
def echo(cluster):
    graph = ActorGraph("dispatch").role("echo", Echo, 3, num_cpus=0.5).build(60)
    yield graph["echo"]
    graph.shutdown()


def test_shard_splits_the_first_argument_and_repeats_the_rest(echo):
    assert echo.invoke(Echo.shard, list(range(7)), scale=2) == [
        (0, [0, 1, 2], 2), (1, [3, 4], 2), (2, [5, 6], 2)]
    # an object that knows how to split itself (the dataclasses crossing Ray)
    out = echo.invoke(Echo.shard, Rows(list(range(6)), "t"))
    assert [r[1] for r in out] == [Rows([0, 3], "t"), Rows([1, 4], "t"), Rows([2, 5], "t")]


def test_per_rank_arguments_and_all_and_rank0(echo):
    assert echo.invoke(Echo.everyone, "x", y=PerRank(["a", "b", "c"])) == [
        (0, "x", "a"), (1, "x", "b"), (2, "x", "c")]
    assert echo.invoke(Echo.first, 5) == (0, 5)
    started = [echo.invoke_async(Echo.first, i) for i in range(3)]
    assert [c.result() for c in started] == [(0, 0), (0, 1), (0, 2)]


def test_a_method_of_another_class_is_refused(echo):
    with pytest.raises(TypeError, match="runs Echo, which has no method Other.everyone"):
        echo.invoke(Other.everyone, 1)
    with pytest.raises(ValueError, match="PerRank holds 2 items for 3 ranks"):
        echo.invoke(Echo.everyone, PerRank([1, 2]))


def test_split_is_contiguous_and_near_even():
    assert split([1, 2, 3, 4, 5], 2) == [[1, 2, 3], [4, 5]]
    assert [len(s) for s in split(list(range(10)), 4)] == [3, 3, 2, 2]
    with pytest.raises(ValueError, match="cannot split a batch of type int"):
        split(3, 2)


def test_a_tensor_parallel_role_is_called_by_data_parallel_rank():
    """Ranks 2d and 2d+1 hold one model: they get data-parallel rank d's slice (and a PerRank
    of one item per data-parallel rank), and SHARD's results come back one per model."""
    from troupe.actors.dispatch import per_rank_args, results_of
    calls = per_rank_args(Dispatch.SHARD, ([0, 1, 2, 3, 4, 5],), {"k": PerRank(["a", "b"])},
                          world_size=4, tensor_parallel=2)
    assert [(a[0], kw["k"]) for a, kw in calls] == [([0, 1, 2], "a"), ([0, 1, 2], "a"),
                                                    ([3, 4, 5], "b"), ([3, 4, 5], "b")]
    every = per_rank_args(Dispatch.ALL, (PerRank([0, 1, 2, 3]),), {}, 4, 2)
    assert [a[0] for a, _ in every] == [0, 1, 2, 3]
    assert results_of(Dispatch.SHARD, ["d0", "d0'", "d1", "d1'"], 2) == ["d0", "d1"]
    assert results_of(Dispatch.ALL, [0, 1, 2, 3], 2) == [0, 1, 2, 3]
    with pytest.raises(ValueError, match="3 items for 4 ranks or 2 data-parallel ranks"):
        per_rank_args(Dispatch.ALL, (PerRank([0, 1, 2]),), {}, 4, 2)
