"""The RLHF tests' runs share their graphs: a run whose roles, ranks and groups match a graph
an earlier test left is run on it (troupe.rlhf.driver.reuse_graph: every worker given the new
recipe, every role built afresh) instead of starting its processes again, which is about two
thirds of a small run's time. Tests that kill workers build graphs of their own."""

from collections import OrderedDict

import pytest

from troupe.rlhf import driver as rlhf
from troupe.rlhf.config import STEP3


class Graphs:
    """Graphs kept between tests by what a graph is built from, the ``keep`` most recently
    used (each holds its workers' processes and memory)."""

    def __init__(self, keep: int = 2):
        self.keep, self.graphs = keep, OrderedDict()

    @staticmethod
    def key(cfg, steps) -> tuple:
        r = cfg.step3.rollout
        return (tuple(rlhf.graph_roles(cfg, steps)), cfg.workers, cfg.zero_stage, r.replicas,
                cfg.colocate, cfg.num_cpus, cfg.num_gpus, cfg.device, cfg.max_restarts,
                r.max_restarts, r.num_cpus, cfg.collective_timeout_s)

    def run(self, cfg, steps=rlhf.STEPS, **kwargs) -> dict:
        """``rlhf.run(cfg, steps, **kwargs)`` on a kept graph (or a new one, kept after)."""
        steps = tuple(STEP3 if s == "ppo" else s for s in steps)
        key = self.key(cfg, steps)
        graph = self.graphs.pop(key, None)
        if graph is None:
            while len(self.graphs) >= self.keep:
                self.graphs.popitem(last=False)[1].shutdown()
            graph = rlhf.build_graph(cfg, steps=steps)
        try:
            summary = rlhf.run(cfg, steps, graph=graph, **kwargs)
        except BaseException:
            graph.shutdown()  # in whatever state the failure left it: not kept
            raise
        self.graphs[key] = graph
        return summary

    def close(self) -> None:
        while self.graphs:
            self.graphs.popitem()[1].shutdown()


@pytest.fixture(scope="session")
def rlhf_graphs(cluster):
    graphs = Graphs()
    yield graphs
    graphs.close()
