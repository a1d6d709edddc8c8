import json
import os
import re
import time

import pytest
import ray
import torch
from ray.util.state import list_actors

from troupe import collectives
from troupe.errors import CollectiveTimeoutError, RunFailedError
from tests.runtime.helpers import eventually, kill_worker, live_placement_groups
from troupe.runtime import (
    ActorGraph,
    CallTimeoutError,
    PlacementTimeoutError,
    WorkerCallError,
    WorkerDiedError,
    get_context,
)

pytestmark = pytest.mark.waits  # ranks sleeping past deadlines, one actor at a time


class Policy:
    def __init__(self, config):
        self.config = config
        self.ctx = get_context()  # available while the role object is built

    def whoami(self):
        c = get_context()
        return {"role": c.role, "rank": c.rank, "world": c.world_size, "pid": os.getpid(),
                "lr": self.config["lr"]}

    def double(self, x):
        return x * 2

    def shard_sum(self, batch, offset=0):
        return float(batch.sum()) + offset

    def fail(self):
        raise ValueError("bad batch in rank %d" % get_context().rank)

    def sleep(self, s):
        time.sleep(s)


class Summer:
    """All ranks but ``sleeper`` enter an allreduce; ``sleeper`` dozes in a helper first."""

    def reduce(self, sleeper, seconds):
        if get_context().rank == sleeper:
            self.doze(seconds)
        t = torch.ones(4)
        collectives.get_group("dp").all_reduce(t)
        return t[0].item()

    def doze(self, seconds):
        time.sleep(seconds)


class Reference:
    def whoami(self):
        c = get_context()
        return {"role": c.role, "rank": c.rank, "world": c.world_size, "pid": os.getpid()}


def _bundle_of(actor, dashboard: str) -> tuple[str, int]:
    """(placement group, bundle index) as Ray's own state API records it."""
    for attempt in range(5):  # the state API can lag behind a busy 2-core machine
        try:
            [info] = list_actors(address=f"http://{dashboard}", detail=True, timeout=60,
                                 filters=[("actor_id", "=", actor._actor_id.hex())])
            break
        except ray.exceptions.RpcError:
            if attempt == 4:
                raise
            time.sleep(2)
    for key in info.required_resources:
        m = re.fullmatch(r"CPU_group_(\d+)_(\w+)", key)
        if m:
            return m.group(2), int(m.group(1))
    raise AssertionError(f"no bundle resource in {info.required_resources}")


@pytest.fixture(scope="module")
def rlhf_like(cluster):
    g = ActorGraph("two-roles")
    g.role("actor", Policy, 2, num_cpus=1, config={"lr": 0.1})
    g.role("reference", Reference, 2, num_cpus=0.5, colocate_with="actor")
    graph = g.build(timeout_s=60, call_timeout_s=60, reuse_workers=False)  # in its bundles
    yield graph
    graph.shutdown()


def test_rank_ordered_results(rlhf_like):
    out = rlhf_like["actor"].call("whoami")
    assert [(o["role"], o["rank"], o["world"], o["lr"]) for o in out] == [
        ("actor", 0, 2, 0.1), ("actor", 1, 2, 0.1)]
    ref = rlhf_like["reference"].call("whoami")
    assert [(o["role"], o["rank"]) for o in ref] == [("reference", 0), ("reference", 1)]
    assert len({o["pid"] for o in out + ref}) == 4  # four separate worker processes
    assert rlhf_like["actor"].call("double", 21) == [42, 42]
    assert rlhf_like["actor"].call_rank(1, "double", x=5) == 10


def test_colocated_workers_share_bundles(rlhf_like, cluster):
    actor_bundles = [_bundle_of(a, cluster.dashboard_url) for a in rlhf_like["actor"].actors]
    ref_bundles = [_bundle_of(a, cluster.dashboard_url) for a in rlhf_like["reference"].actors]
    assert actor_bundles == ref_bundles
    assert [b for _, b in actor_bundles] == [0, 1]
    assert len({pg for pg, _ in actor_bundles}) == 1


def test_scatter_sends_each_worker_its_slice(rlhf_like):
    batch = torch.arange(10.0)
    assert rlhf_like["actor"].scatter("shard_sum", batch, offset=1) == [
        float(batch[:5].sum()) + 1, float(batch[5:].sum()) + 1]
    call = rlhf_like["actor"].call_async("double", 3)
    assert call.result() == [6, 6] and rlhf_like["actor"].get(call) == [6, 6]


def test_remote_exception_names_role_rank_and_traceback(rlhf_like):
    with pytest.raises(WorkerCallError) as e:
        rlhf_like["actor"].call("fail")
    err = e.value
    assert err.role == "actor" and err.rank in (0, 1) and err.method == "fail"
    assert "bad batch in rank" in err.remote_traceback
    assert "in fail" in err.remote_traceback and "\x1b[" not in err.remote_traceback
    assert err.node_id and err.node_id in str(err)
    with pytest.raises(WorkerCallError, match="no public method 'nope'"):
        rlhf_like["actor"].call("nope")


def test_call_timeout_names_ranks_and_shows_stacks(rlhf_like):
    group = rlhf_like["actor"]
    refs = [group.actors[0].call.remote("double", (1,), {}),
            group.actors[1].call.remote("sleep", (8,), {})]
    with pytest.raises(CallTimeoutError) as e:
        group.get(refs, "sleep", timeout_s=1.0)
    assert e.value.ranks == [1]
    assert "time.sleep(s)" in e.value.stacks[1] and "in flight: sleep" in e.value.stacks[1]
    ray.get(refs[1])


def test_collective_timeout_names_the_sleeping_rank_and_its_stack(cluster):
    g = ActorGraph("hang").role("trainer", Summer, 3, num_cpus=0.5)
    g.collective("dp", ["trainer"], backend="gloo")
    graph = g.build(timeout_s=60, collective_timeout_s=3)
    try:
        assert graph["trainer"].call("reduce", -1, 0) == [3.0, 3.0, 3.0]
        t0 = time.monotonic()
        with pytest.raises(WorkerCallError) as e:
            graph["trainer"].call("reduce", 1, 30)
        waited = time.monotonic() - t0
        assert waited < 20, waited  # the waiting ranks raised, not the sleeper's return
        err = e.value.cause
        assert e.value.rank in (0, 2) and isinstance(err, CollectiveTimeoutError)
        assert err.group == "dp" and err.missing == [1]
        assert "reach all_reduce (operation #2" in str(err)
        assert "rank 1 on node" in err.stacks[1] and "in doze" in err.stacks[1]
        assert "time.sleep(seconds)" in err.stacks[1] and "in flight: reduce" in err.stacks[1]
        assert "in doze" in str(e.value)  # the driver's error shows the stack too
    finally:
        graph.shutdown()


def test_gpu_request_on_cpu_cluster_times_out_with_typed_error(cluster):
    g = ActorGraph("wants-gpu").role("trainer", Policy, 1, num_gpus=1, config={"lr": 1})
    t0 = time.monotonic()
    with pytest.raises(PlacementTimeoutError) as e:
        g.build(timeout_s=5)
    assert time.monotonic() - t0 < 20
    assert e.value.role == "trainer" and "GPU" in str(e.value) and "trainer" in str(e.value)
    assert e.value.bundle["GPU"] == 1
    eventually(lambda: not live_placement_groups("wants-gpu/trainer"),
               "placement group wants-gpu/trainer removed")


def test_two_graphs_of_one_name_coexist(cluster):
    # as two jobs running the same app on one cluster do (placement-group names must differ)
    first = ActorGraph("twin").role("critic", Reference, 1, num_cpus=0.5).build(timeout_s=60)
    try:
        second = ActorGraph("twin").role("critic", Reference, 1, num_cpus=0.5).build(timeout_s=60)
        try:
            pids = [g["critic"].call("whoami")[0]["pid"] for g in (first, second)]
            assert pids[0] != pids[1] and len(live_placement_groups("twin/critic")) == 2
        finally:
            second.shutdown()
    finally:
        first.shutdown()
    with pytest.raises(RuntimeError, match="graph 'twin' was shut down"):
        first["critic"]


def test_killed_worker_gives_typed_error(cluster):
    graph = ActorGraph("victim").role("critic", Reference, 2, num_cpus=0.5).build(timeout_s=60)
    try:
        kill_worker(graph["critic"].actors[1], restart=False)
        with pytest.raises(WorkerDiedError) as e:
            graph["critic"].call("whoami")
        assert e.value.role == "critic" and e.value.rank == 1
        assert "critic" in str(e.value) and "rank 1" in str(e.value)
    finally:
        graph.shutdown()


@pytest.mark.parametrize("declare, field", [
    (lambda g: g.role("a", Policy, 1).role("a", Policy, 1), "declared twice"),
    (lambda g: g.role("a", Policy, 1, num_cpus=0), "num_cpus"),
    (lambda g: g.role("a", Policy, 1, num_gpus=-1), "num_gpus"),
    (lambda g: g.role("a", Policy, 0), "num_workers"),
    (lambda g: g.role("a", Policy, 1, resources={"TPU": 0}), "resources"),
    (lambda g: g.role("a", Policy, 1, strategy="RANDOM"), "strategy"),
    (lambda g: g.collective("dp", ["a"], backend="mpi"), "backend"),
])
def test_invalid_declarations_name_the_field(declare, field):
    with pytest.raises(ValueError, match=field):
        declare(ActorGraph("bad"))


@pytest.mark.parametrize("declare, field", [
    (lambda g: g.role("a", Policy, 1, colocate_with="ghost"), "colocate_with='ghost'"),
    (lambda g: g.role("a", Policy, 2).role("b", Policy, 3, colocate_with="a"), "num_workers=3"),
    (lambda g: g.role("a", Policy, 1).collective("dp", ["a", "zz"]), "zz"),
    (lambda g: g.role("a", Policy, 1, num_gpus=0.75).role("b", Policy, 1, num_gpus=0.5,
                                                          colocate_with="a"), "num_gpus"),
    (lambda g: g.role("a", Policy, 1, colocate_with="b").role("b", Policy, 1,
                                                              colocate_with="a"), "cycle"),
])
def test_invalid_graphs_fail_at_build(cluster, declare, field):
    g = ActorGraph("bad")
    declare(g)
    with pytest.raises(ValueError, match=re.escape(field)):
        g.build(timeout_s=5)


class BrokenInit:
    def __init__(self, config):
        raise RuntimeError(f"cannot load checkpoint {config['path']}")


def test_constructor_failure_fails_the_build_and_names_the_role(cluster):
    g = ActorGraph("broken").role("reward", BrokenInit, 2, num_cpus=0.5,
                                  config={"path": "/nowhere/rm.pt"})
    with pytest.raises(WorkerDiedError) as e:
        g.build(timeout_s=60)
    assert e.value.role == "reward" and e.value.rank in (0, 1)
    assert "cannot load checkpoint /nowhere/rm.pt" in str(e.value)
    eventually(lambda: not live_placement_groups("broken/reward"),
               "placement group broken/reward removed")


def test_an_error_ends_the_run_at_once_and_a_fault_is_retried(rlhf_like, cluster, tmp_path):
    """The failure policy tells a fault (retried) from an error raised by code for the same
    inputs (the run ends at once, nothing restored), by the cause's type, and takes an
    error raised while a peer died and came back for that death's echo (a fault)."""
    from troupe.runtime.recovery import FailurePolicy

    policy = FailurePolicy("job", rlhf_like, max_restarts=3, out_dir=tmp_path)
    with pytest.raises(WorkerCallError) as e:
        rlhf_like["actor"].call("fail")
    assert not policy.is_fault(e.value)
    restored = []
    with pytest.raises(RunFailedError) as stop:
        policy.recover(e.value, 7, lambda: restored.append(1))
    assert restored == [] and str(stop.value).startswith(
        "job stopped at step 7 by an error, not retried (the same inputs raise it again): "
        "role 'actor' rank ")
    assert str(stop.value).splitlines()[0].endswith("ValueError: bad batch in rank 0") or \
        str(stop.value).splitlines()[0].endswith("ValueError: bad batch in rank 1")
    failure = json.loads((tmp_path / "failure.json").read_text())["failures"]
    assert [f["fault"] for f in failure] == [False]
    timeout = CollectiveTimeoutError("dp", [1], 2, 5.0)
    assert policy.is_fault(WorkerCallError("actor", 0, "n", "step", "...", timeout))
    assert policy.is_fault(WorkerCallError("actor", 0, "n", "step",
                                           "troupe.errors.CollectiveTimeoutError: group 'dp'"))

    graph = ActorGraph("echo").role("critic", Reference, 1, num_cpus=0.5,
                                    max_restarts=1).build(timeout_s=60)
    try:
        echo = FailurePolicy("job", graph, max_restarts=1, out_dir=tmp_path)
        error = WorkerCallError("critic", 0, "n", "step", "ValueError: a peer went away",
                                ValueError("a peer went away"))
        assert not echo.is_fault(error)
        kill_worker(graph["critic"].actors[0], restart=True)
        graph["critic"].wait_ready(60)
        assert echo.is_fault(error)  # its process is not the one it was
    finally:
        graph.shutdown()
