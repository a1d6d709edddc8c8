import os

import ray

import troupe


def test_init_is_idempotent_and_reports_the_cluster(cluster):
    again = troupe.init()
    assert again.address == cluster.address and again.embedded
    assert cluster.num_cpus == 16 and cluster.nodes == 1 and cluster.num_gpus == 0
    assert cluster.dashboard_url.startswith("127.0.0.1:")


def test_embedded_cluster_runs_with_token_auth(cluster):
    from ray._raylet import AuthenticationMode, get_authentication_mode
    assert get_authentication_mode() == AuthenticationMode.TOKEN
    assert os.environ.get("RAY_AUTH_MODE") == "token" and cluster.auth_mode == "token"

    @ray.remote
    def worker_mode():
        return os.environ.get("RAY_AUTH_MODE")

    assert ray.get(worker_mode.remote()) == "token"  # workers inherit it
