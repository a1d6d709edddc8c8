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


def test_a_driver_whose_head_is_gone_says_so_in_one_line_and_exits():
    """The head watch (troupe.runtime.cluster) on an address where nothing listens, with a
    2 s limit: the process ends with status 1 and one line on stderr, without waiting out
    what it was doing."""
    import socket
    import subprocess
    import sys
    import time
    with socket.socket() as s:  # a port that was free a moment ago, now closed
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    code = ("import time\nfrom troupe.runtime.cluster import _watch_head\n"
            f"_watch_head('127.0.0.1:{port}', timeout_s=2)\ntime.sleep(60)\n")
    t0 = time.monotonic()
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert p.returncode == 1 and time.monotonic() - t0 < 20
    [line] = p.stderr.strip().splitlines()
    assert line.startswith(f"error: the Ray cluster's head at 127.0.0.1:{port} has not "
                           "answered for 2s") and "last checkpoint" in line
