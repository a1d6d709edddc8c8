"""Autoscaling on one machine: Ray's fake multi-node provider starts "GPU" worker nodes when a
graph asks for more than the head has, a gloo collective runs across them, and the nodes go
away after the graph is shut down and the idle timeout passes."""

import json
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from tests.runtime.helpers import RAY, free_port, stop_head

pytestmark = [pytest.mark.own_cluster, pytest.mark.slow]

IDLE_TIMEOUT_MIN = 0.1  # 6 s


def cluster_config(gcs_address: str) -> dict:
    """A fake_multinode cluster: a head with no GPU, and worker nodes of one CPU and one GPU
    (logical: nothing runs on a device). Written here because the Ray wheel ships no example."""
    return {
        "cluster_name": "troupe-fake",
        "max_workers": 4,
        "upscaling_speed": 2.0,
        "idle_timeout_minutes": IDLE_TIMEOUT_MIN,
        "provider": {"type": "fake_multinode", "use_node_id_as_ip": True,
                     "disable_node_updaters": True, "disable_launch_config_check": True,
                     "gcs_address": gcs_address},
        "auth": {"ssh_user": "ubuntu"},
        "head_node_type": "ray.head.default",
        "available_node_types": {
            "ray.head.default": {"resources": {"CPU": 1}, "node_config": {}, "max_workers": 0},
            "gpu.worker": {"resources": {"CPU": 1, "GPU": 1}, "node_config": {},
                           "min_workers": 0, "max_workers": 3},
        },
        "docker": {}, "file_mounts": {}, "cluster_synced_files": [],
        "file_mounts_sync_continuously": False, "rsync_exclude": [], "rsync_filter": [],
        "initialization_commands": [], "setup_commands": [], "head_setup_commands": [],
        "worker_setup_commands": [], "head_start_ray_commands": [],
        "worker_start_ray_commands": [],
    }


DRIVER = textwrap.dedent("""
    import json, logging, time
    import ray, torch
    import troupe
    from troupe import collectives
    from troupe.runtime import ActorGraph

    def alive():
        return sum(1 for n in ray.nodes() if n["Alive"])

    class Summer:
        def allreduce(self, x):
            t = torch.tensor([float(x)])
            collectives.get_group("dp").all_reduce(t)
            return t.item(), ray.get_runtime_context().get_node_id()

    logging.basicConfig(level=logging.INFO)
    troupe.init()
    print(json.dumps({"t": time.time(), "nodes": alive()}), flush=True)
    g = ActorGraph("scale").role("trainer", Summer, 2, num_cpus=1, num_gpus=1)
    g.collective("dp", ["trainer"], backend="gloo")
    graph = g.build(timeout_s=150)
    out = graph["trainer"].invoke(Summer.allreduce, 3)
    print(json.dumps({"t": time.time(), "nodes": alive(), "results": out}), flush=True)
    graph.shutdown()
    deadline = time.time() + 90
    while alive() > 1 and time.time() < deadline:
        time.sleep(1)
    print(json.dumps({"t": time.time(), "nodes": alive()}), flush=True)
""")


def test_graph_grows_the_cluster_and_idle_nodes_go(tmp_path):
    t0 = time.monotonic()
    port, ip = free_port(), "127.0.0.1"
    config = tmp_path / "cluster.json"
    config.write_text(json.dumps(cluster_config(f"{ip}:{port}")))
    (tmp_path / "home").mkdir()
    token = tmp_path / "token"
    token.write_text("f" * 64)
    env = {**os.environ, "RAY_FAKE_CLUSTER": "1", "AUTOSCALER_UPDATE_INTERVAL_S": "1",
           "RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN_PATH": str(token),
           "HOME": str(tmp_path / "home")}
    env.pop("RAY_ADDRESS", None)
    head = subprocess.Popen(
        [RAY, "start", "--head", f"--port={port}", f"--autoscaling-config={config}",
         f"--node-ip-address={ip}", "--num-cpus=1", "--num-gpus=0",
         "--include-dashboard=false", "--block"],
        env=env, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        driver = tmp_path / "driver.py"
        driver.write_text(DRIVER)
        out = subprocess.run([sys.executable, str(driver)], capture_output=True, text=True,
                             timeout=170, cwd=Path(__file__).parents[2],
                             env={**env, "RAY_ADDRESS": f"{ip}:{port}",
                                  "PYTHONPATH": str(Path(__file__).parents[2])})
        lines = [json.loads(x) for x in out.stdout.splitlines() if x.startswith("{")]
        assert out.returncode == 0 and len(lines) == 3, out.stdout + out.stderr
        print(lines, f"{time.monotonic() - t0:.0f}s")
        before, during, after = lines
        assert before["nodes"] == 1
        assert during["nodes"] >= 3
        assert [r[0] for r in during["results"]] == [6.0, 6.0]
        assert during["results"][0][1] != during["results"][1][1]  # two different nodes
        assert after["nodes"] == 1
        assert "waiting for 2 x {CPU: 1, GPU: 1} (roles [['trainer']])" in out.stderr
    finally:
        stop_head(head)
