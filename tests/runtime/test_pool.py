"""Pooled workers (troupe.runtime.pool), on the suite's cluster, which reuses workers
(tests/conftest.py): a role finds its process as a fresh one, a worker with leftovers is not
reused, a restarted worker hosts its role again, and a graph may opt out."""

import os
import subprocess
import sys
import threading
import time

import psutil
import pytest
import ray
import torch

from tests.runtime.helpers import kill_worker
from troupe.errors import WorkerDiedError
from troupe.runtime import ActorGraph, get_context
from troupe.runtime import pool as pooling


class Probe:
    """Reports its process and the state a role could have changed, then changes it."""

    def __init__(self, config=None):
        self.config = config

    def look(self) -> dict:
        c = get_context()
        return {"role": c.role, "rank": c.rank, "world": c.world_size, "pid": os.getpid(),
                "threads": torch.get_num_threads(), "omp": os.environ.get("OMP_NUM_THREADS"),
                "mark": os.environ.get("TROUPE_TEST_MARK"), "dtype": str(torch.get_default_dtype()),
                "draw": torch.rand(2).tolist(), "grad": torch.is_grad_enabled(),
                "resources": ray.get_runtime_context().get_assigned_resources()}

    def dirty(self) -> None:
        os.environ["TROUPE_TEST_MARK"] = "left by a role"
        torch.set_default_dtype(torch.float64)
        torch.manual_seed(1)
        torch.set_grad_enabled(False)

    def start_child(self) -> None:
        """A child that would serve the role for as long as its stdin stays open (a Popen
        dropped while its child runs keeps its pipe open: the child outlives the role)."""
        self.child = subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.read()"],
                                      stdin=subprocess.PIPE)

    def leave_a_thread(self) -> None:
        stop = threading.Event()
        self.stop = stop  # dropped with the role, but the thread runs on: a leftover
        threading.Thread(target=stop.wait, name="left-running", daemon=True).start()


def _graph(num_workers=2, num_cpus=1.0, **build):
    return ActorGraph("pooled").role("w", Probe, num_workers, num_cpus=num_cpus).build(
        timeout_s=60, **build)


def test_a_role_finds_its_pooled_process_as_a_fresh_one(cluster):
    with _graph() as first:
        before = first["w"].call("look")
        first["w"].call("dirty")
    with _graph(num_cpus=2) as second:
        after = second["w"].call("look")
    assert {a["pid"] for a in after} == {b["pid"] for b in before}  # the same processes
    by_pid = {b["pid"]: b for b in before}
    for a in after:
        b = by_pid[a["pid"]]
        assert (a["role"], a["world"], a["mark"], a["dtype"], a["grad"]) == (
            "w", 2, None, "torch.float32", True)
        assert (a["threads"], a["omp"]) == (2, "2") and (b["threads"], b["omp"]) == (1, "1")
        assert a["draw"] == b["draw"]  # torch's default generator from its first seed again
    assert sorted(a["rank"] for a in after) == [0, 1]
    assert before[0]["resources"] == {}  # outside the bundle, which holds the CPUs


def test_a_worker_whose_role_left_a_thread_running_is_ended(cluster):
    with _graph(num_workers=1) as first:
        [pid] = [o["pid"] for o in first["w"].call("look")]
        first["w"].call("leave_a_thread")
    with _graph(num_workers=1) as second:
        [again] = [o["pid"] for o in second["w"].call("look")]
    assert again != pid
    deadline = time.monotonic() + 30
    while psutil.pid_exists(pid):
        assert time.monotonic() < deadline, f"the worker with a leftover thread (pid {pid}) runs on"
        time.sleep(0.2)


def test_the_child_processes_a_role_leaves_are_ended_with_it(cluster):
    with _graph(num_workers=1) as first:
        [pid] = [o["pid"] for o in first["w"].call("look")]
        first["w"].call("start_child")
        [child] = psutil.Process(pid).children()
    with _graph(num_workers=1) as second:
        [again] = [o["pid"] for o in second["w"].call("look")]
    assert again == pid and not psutil.pid_exists(child.pid)


def test_a_restarted_pooled_worker_hosts_its_role_again(cluster):
    graph = ActorGraph("pooled-restart").role("w", Probe, 2, num_cpus=1, max_restarts=1).build(
        timeout_s=60)
    with graph:
        assert graph["w"].pool is not None
        before = graph["w"].call("look")
        kill_worker(graph["w"].actors[1], restart=True)
        graph["w"].wait_ready(60)
        after = graph["w"].call("look")
        kill_worker(graph["w"].actors[1], restart=True)  # its one restart is spent
        with pytest.raises(WorkerDiedError) as e:
            graph["w"].wait_ready(60)
    assert after[0]["pid"] == before[0]["pid"] and after[1]["pid"] != before[1]["pid"]
    assert (after[1]["role"], after[1]["rank"], after[1]["world"]) == ("w", 1, 2)
    assert (e.value.role, e.value.rank) == ("w", 1) and "restarts are spent" in str(e.value)


def test_a_graph_may_keep_workers_of_its_own(cluster):
    with _graph(num_workers=1, reuse_workers=False) as own:
        assert own["w"].pool is None
        [info] = own["w"].call("look")
    assert info["resources"] == {"CPU": 1.0}, info  # as its bundle gave it; a pooled one has {}


def test_gpu_roles_and_runtime_environments_get_workers_of_their_own():
    from troupe.runtime.graph import RoleSpec
    assert pooling.may_host(RoleSpec(name="a", cls=Probe, num_cpus=2, max_restarts=3))
    assert not pooling.may_host(RoleSpec(name="a", cls=Probe, num_gpus=1))
    assert not pooling.may_host(RoleSpec(name="a", cls=Probe,
                                         runtime_env={"env_vars": {"A": "1"}}))


@pytest.fixture(autouse=True)
def _reuse_is_on(cluster):
    assert pooling.current() is not None, "tests/conftest.py's cluster reuses workers"
