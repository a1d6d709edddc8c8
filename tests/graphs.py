"""Graphs kept between tests (tests/conftest.py: ``rlhf_graphs``, ``pretrain_graphs``): a run
whose roles, ranks and groups match a graph an earlier test left is run on it (the drivers'
``reuse_graph``: every worker given the new recipe and its role built afresh) instead of
starting its processes again, about two thirds of a small RLHF run's time. Tests that kill
workers, or look at a graph's processes, build graphs of their own."""

from __future__ import annotations

import contextlib
from collections import OrderedDict
from typing import Any, Callable, Iterator


class Graphs:
    """Graphs by what each is built from (``key(cfg, ...)``), the ``keep`` most recently used
    (each holds its workers' processes and memory). ``run(cfg, ...)`` is the driver's
    ``run(cfg, ..., graph=...)`` on a kept graph, or on a new one (``build(cfg, ...)``) kept
    after; a graph whose run failed is shut down, in whatever state the failure left it.
    ``use(cfg)`` lends a graph set up for ``cfg`` (``reuse(graph, cfg)`` on a kept one) to
    code that drives it by hand."""

    def __init__(self, key: Callable[..., tuple], build: Callable[..., Any],
                 run: Callable[..., Any], reuse: Callable[[Any, Any], Any], keep: int = 2):
        self.key, self.build, self.runner, self.reuse, self.keep = key, build, run, reuse, keep
        self.graphs: OrderedDict[tuple, Any] = OrderedDict()

    def run(self, cfg, *args, **kwargs):
        with self._lend(cfg, *args) as (graph, _):
            return self.runner(cfg, *args, graph=graph, **kwargs)

    @contextlib.contextmanager
    def use(self, cfg) -> Iterator[Any]:
        with self._lend(cfg) as (graph, fresh):
            yield graph if fresh else self.reuse(graph, cfg)

    @contextlib.contextmanager
    def _lend(self, cfg, *args) -> Iterator[tuple[Any, bool]]:
        """A kept graph of ``cfg``'s key, or a new one (fresh: True), kept again after the
        block; shut down if the block fails."""
        key = self.key(cfg, *args)
        graph = self.graphs.pop(key, None)
        fresh = graph is None
        if fresh:
            while len(self.graphs) >= self.keep:
                self.graphs.popitem(last=False)[1].shutdown()
            graph = self.build(cfg, *args)
        try:
            yield graph, fresh
        except BaseException:
            graph.shutdown()
            raise
        self.graphs[key] = graph

    def close(self) -> None:
        while self.graphs:
            self.graphs.popitem()[1].shutdown()


def rlhf_graphs() -> Graphs:
    from troupe.rlhf import driver as rlhf
    from troupe.rlhf.config import STEP3

    def steps_of(steps) -> tuple:
        return tuple(STEP3 if s == "ppo" else s for s in steps)

    def key(cfg, steps=rlhf.STEPS) -> tuple:
        r = cfg.step3.rollout
        return (tuple(rlhf.graph_roles(cfg, steps_of(steps))), cfg.workers, cfg.zero_stage,
                r.replicas, cfg.colocate, cfg.num_cpus, cfg.num_gpus, cfg.device,
                cfg.max_restarts, r.max_restarts, r.num_cpus, cfg.collective_timeout_s)

    # three kept: tests/rlhf/test_driver.py's role sets recur three apart (12 graphs built
    # with two kept, 8 with three; a tiny model's worker holds about 0.3 GB)
    return Graphs(key, lambda cfg, steps=rlhf.STEPS: rlhf.build_graph(cfg, steps=steps_of(steps)),
                  rlhf.run, rlhf.reuse_graph, keep=3)


def pretrain_graphs() -> Graphs:
    from troupe.pretrain import driver as pretrain
    from troupe.pretrain.topology import PretrainTopology

    def key(cfg) -> tuple:
        T = cfg.train
        return (cfg.workers, T.offload, PretrainTopology.of(cfg), cfg.threads, cfg.num_gpus,
                cfg.device, T.strategy, T.shard_cpus, cfg.max_restarts, cfg.collective_timeout_s)

    return Graphs(key, pretrain.build_graph, pretrain.run, pretrain.reuse_graph)
