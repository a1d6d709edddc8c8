"""Hosts on one machine (troupe.runtime.hosts): two network namespaces on a shaped bridge, a
Ray node in each; a job run from host 0 sees two nodes at two addresses, its gloo allreduce
between them crosses the veth links (their counters), and ``down`` leaves no namespace or
process behind. Skipped, with the reason, where root or ``ip``/``tc`` are missing."""

import json
import subprocess
import sys
import time
import textwrap

import pytest

from troupe.runtime.hosts import Hosts, HostsError, _namespaces, _pids, check_tools, main

try:
    check_tools()
    REASON = None
except HostsError as e:
    REASON = str(e)

pytestmark = pytest.mark.skipif(REASON is not None, reason=REASON or "")

JOB = textwrap.dedent("""
    import json, ray, torch
    import troupe
    from troupe import collectives
    from troupe.runtime import ActorGraph

    class Rank:
        def __init__(self, config=None):
            pass
        def where(self):
            return ray.util.get_node_ip_address()
        def reduce(self, n):
            t = torch.ones(n)
            collectives.get_group("dp").all_reduce(t)
            return float(t[0])

    info = troupe.init()
    g = ActorGraph("across").role("rank", Rank, 2, num_cpus=1, strategy="STRICT_SPREAD")
    g.collective("dp", ["rank"], backend="gloo")
    graph = g.build(timeout_s=60)
    print(json.dumps({"embedded": info.embedded, "nodes": info.nodes,
                      "where": graph["rank"].call("where"),
                      "sum": graph["rank"].call("reduce", 1 << 20)}))
    graph.shutdown()
""")


@pytest.fixture(scope="module")
def hosts():
    two = Hosts.up(2, name="trt", rate="1gbit", cpus=1, object_store_mb=128)
    yield two
    two.down()
    assert not [ns for ns in _namespaces() if ns.startswith("trt-")]


def test_a_job_from_host_0_spans_both_hosts_and_their_links(hosts):
    before = [hosts.tx_bytes(i) for i in range(2)]
    out = hosts.run(0, [sys.executable, "-c", JOB], timeout_s=240)
    assert out.returncode == 0, out.stderr[-2000:]
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result["embedded"] is False and result["nodes"] == 2  # not a cluster of its own
    assert sorted(result["where"]) == ["198.18.0.1", "198.18.0.2"]
    assert result["sum"] == [2.0, 2.0]
    sent = [hosts.tx_bytes(i) - b for i, b in enumerate(before)]
    assert min(sent) > 4 << 20  # a 4 MiB tensor each way, at least, over each veth
    rows = hosts.status()
    assert [(r["address"], r["up"], r["link"], r["rate"]) for r in rows] == [
        ("198.18.0.1", True, "up", "1gbit"), ("198.18.0.2", True, "up", "1gbit")]
    assert all(r["processes"] > 0 for r in rows)


def test_the_command_line_names_what_it_cannot_do(hosts, capsys):
    def cli(*argv):
        code = main(list(argv))
        out = capsys.readouterr()
        return code, out.out, out.err.strip()
    assert cli("--name", "trt", "up", "--hosts", "2") == (
        2, "", "error: hosts 'trt' are up already: `troupe hosts down --name trt` first")
    assert cli("--name", "trt", "cut", "5") == (2, "", "error: host 5: the hosts are 0 to 1")
    code, _, err = cli("--name", "trt", "shape", "1", "--rate", "fast")
    assert code == 2 and "a rate such as 100mbit" in err
    code, _, err = cli("--name", "nothere", "status")
    assert code == 2 and "no hosts named 'nothere'" in err
    code, out, _ = cli("--name", "trt", "status")
    assert code == 0 and [json.loads(line)["host"] for line in out.splitlines()] == [0, 1]


def _train_step(out) -> int:
    path = out / "metrics.jsonl"
    if not path.exists():
        return 0
    records = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return max((r["step"] for r in records if r["kind"] == "train"), default=0)


def _wait_step(out, step: int, proc, timeout_s: float = 120) -> None:
    deadline = time.monotonic() + timeout_s
    while _train_step(out) < step:
        assert proc.poll() is None, proc.communicate()[1][-3000:]
        assert time.monotonic() < deadline, f"step {step} not reached in {timeout_s}s"
        time.sleep(0.05)


def _pretrain(out) -> list[str]:
    """Pretraining with one rank a host, checkpoints every 20 steps, collectives that wait
    5 s."""
    return [sys.executable, "apps/pretrain.py", "--config", "dense-tiny", "workers=2",
            "train.strategy=STRICT_SPREAD", "train.steps=120", "train.eval_every=0",
            "train.checkpoint_every=20", "collective_timeout_s=5", "max_restarts=2",
            f"out_dir={out}"]


def _losses(out) -> list[tuple]:
    """The run's records but its recoveries, as (kind, step, loss, val_loss)."""
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return [(r["kind"], r["step"], r.get("loss"), r.get("val_loss")) for r in records
            if r["kind"] != "recovery"]


@pytest.fixture(scope="module")
def uncut(hosts, tmp_path_factory):
    """The losses of the run nobody cut or killed."""
    out = tmp_path_factory.mktemp("uncut")
    plain = hosts.run(0, _pretrain(out), timeout_s=240)
    assert plain.returncode == 0, plain.stderr[-3000:]
    return _losses(out)


def test_a_short_cut_is_ridden_out_and_a_long_one_restarts_the_run(hosts, tmp_path, uncut):
    """Pretraining with one rank a host: a cut of the link shorter than collective_timeout_s
    (5 s) costs a pause; a longer one (8 s, less than Ray's 10 s to declare the node lost)
    fails the collective, naming the peer and its host, a fault: the run goes back to its
    last checkpoint and completes, with the losses of a run nobody cut (bit for bit)."""
    cut = tmp_path / "cut"
    proc = hosts.exec(0, _pretrain(cut), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                      text=True)
    try:
        _wait_step(cut, 25, proc)
        hosts.set_cut(1, True)
        time.sleep(2)
        hosts.set_cut(1, False)
        _wait_step(cut, 65, proc)
        hosts.set_cut(1, True)
        time.sleep(8)
        hosts.set_cut(1, False)
        out, err = proc.communicate(timeout=240)
    finally:
        hosts.set_cut(1, False)
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, err[-3000:]
    records = [json.loads(line) for line in (cut / "metrics.jsonl").read_text().splitlines()]
    [recovery] = [r for r in records if r["kind"] == "recovery"]  # the long cut alone
    assert recovery["fault"] and 60 <= recovery["step"] <= 120, recovery
    assert "CollectiveTimeoutError" in recovery["cause"] and "within 5s" in recovery["cause"]
    assert "every rank reached it" in recovery["cause"] and "198.18.0." in recovery["cause"]
    assert _losses(cut) == uncut


def test_a_killed_host_is_a_lost_node_and_the_run_resumes_when_it_returns(hosts, tmp_path,
                                                                         uncut):
    """Every process of host 1 killed mid-pretraining (its trainer, its Ray node): the run
    notices (a dead worker, or a collective that times out first), waits for the rank to come
    back (the hosts have no spare CPU, so on host 1 once it restarts), goes back to its last
    checkpoint and completes with an uninterrupted run's losses, bit for bit."""
    out = tmp_path / "killed"
    proc = hosts.exec(0, _pretrain(out), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        _wait_step(out, 50, proc)
        hosts.kill(1)
        assert _pids(hosts.namespace(1)) == []
        time.sleep(12)  # Ray declares the node dead after 10 s of missed health checks
        hosts.restart(1)
        _, err = proc.communicate(timeout=300)
    finally:
        if proc.poll() is None:
            proc.kill()
        hosts.wait_nodes(2, timeout_s=90)
    assert proc.returncode == 0, err[-3000:]
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    recoveries = [r for r in records if r["kind"] == "recovery"]
    assert recoveries and all(r["fault"] for r in recoveries), recoveries
    assert _losses(out) == uncut
