"""Three Ray nodes on one machine (ray.cluster_utils.Cluster): pretraining trainers spread one
per node, checkpoints on a directory every node reaches, and resume across the nodes."""

import pytest

import troupe
from tests.pretrain.test_driver import _cfg, _train_key
from troupe.pretrain import driver as pretrain
from troupe.runtime.cluster import _enable_token_auth

pytestmark = pytest.mark.own_cluster


@pytest.fixture
def three_nodes(monkeypatch):
    from ray.cluster_utils import Cluster

    # token authentication, as `ray start` clusters run since Ray 2.5x (Ray reads the mode
    # once per process, so this process is told again)
    monkeypatch.setenv("RAY_AUTH_MODE", "token")
    _enable_token_auth()
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1})
    for _ in range(2):
        cluster.add_node(num_cpus=1)
    cluster.wait_for_nodes()
    info = troupe.init(address=cluster.address)
    yield info
    troupe.shutdown()
    cluster.shutdown()


def test_spread_trainers_checkpoint_and_resume_across_nodes(three_nodes, tmp_path):
    assert three_nodes.nodes == 3 and not three_nodes.embedded
    nodes = []

    def where(step, graph):
        nodes.append(list(graph["trainer"].node_ids))

    over = dict(model__moe=None, workers=3, train__batch_size=6, train__steps=6,
                train__checkpoint_every=3, train__eval_every=3, train__strategy="SPREAD")
    full = pretrain.run(_cfg(tmp_path, "full", **over), resume=None, progress=False,
                        on_step=where)
    assert len(set(nodes[0])) == 3  # one trainer per node
    cfg = _cfg(tmp_path, "split", **over)
    first = pretrain.run(cfg, resume=None, stop_after=3, progress=False)
    second = pretrain.run(cfg, resume="auto", progress=False)
    assert _train_key(first + second) == _train_key(full)
