"""Hosts on one machine (troupe.runtime.hosts): four network namespaces on a shaped bridge, a
Ray node in each, the head (host 0) with no CPUs for workers, as production heads often are:
the driver, the GCS and Serve's proxy live there, the ranks on hosts 1-3. A job run from host
0 sees the nodes at their addresses and its allreduce crosses the veth links (their counters);
then the faults: a link cut shorter and longer than the collective timeout, a host killed
under pretraining (its corpus streamed from a directory of shards, each host's rank reading
its part of every global batch), under a weight sync to a rollout replica, and under a served load. The
module's hosts are removed at its end, and the session checks that no namespace or process of
theirs is left (tests/conftest.py). Skipped, with the reason, where root or ``ip``/``tc`` are
missing."""

import json
import re
import subprocess
import sys
import time
import textwrap

import pytest

from troupe.runtime import netns
from troupe.runtime.hosts import Hosts, HostsError, check_tools, main

try:
    check_tools()
    REASON = None
except HostsError as e:
    REASON = str(e)

# quiet: its cuts and deadlines are seconds long; it runs last, with nothing beside the suite
pytestmark = [pytest.mark.skipif(REASON is not None, reason=REASON or ""), pytest.mark.quiet]

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
    four = Hosts.up(4, name="trt", rate="1gbit", cpus=1, head_cpus=0, object_store_mb=128)
    yield four
    four.down()
    assert not [ns for ns in netns.namespaces() if ns.startswith("trt-")]


def test_a_job_from_host_0_spans_the_hosts_and_their_links(hosts):
    before = [hosts.tx_bytes(i) for i in range(4)]
    out = hosts.run(0, [sys.executable, "-c", JOB], timeout_s=240)
    assert out.returncode == 0, out.stderr[-2000:]
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result["embedded"] is False and result["nodes"] == 4  # not a cluster of its own
    ranks = [hosts.at(ip) for ip in result["where"]]
    assert len(set(ranks)) == 2 and 0 not in ranks  # the head runs no workers
    assert result["sum"] == [2.0, 2.0]
    sent = [hosts.tx_bytes(i) - b for i, b in enumerate(before)]
    assert all(sent[i] > 4 << 20 for i in ranks)  # a 4 MiB tensor each way, over each veth
    rows = hosts.status()
    assert [(r["address"], r["up"], r["link"], r["rate"]) for r in rows] == [
        (f"198.18.0.{i + 1}", True, "up", "1gbit") for i in range(4)]
    assert all(r["processes"] > 0 for r in rows)


def test_the_command_line_names_what_it_cannot_do(hosts, capsys):
    def cli(*argv):
        code = main(list(argv))
        out = capsys.readouterr()
        return code, out.out, out.err.strip()
    assert cli("--name", "trt", "up", "--hosts", "2") == (
        2, "", "error: hosts 'trt' are up already: `troupe hosts down --name trt` first")
    assert cli("--name", "trt", "cut", "5") == (2, "", "error: host 5: the hosts are 0 to 3")
    code, _, err = cli("--name", "trt", "shape", "1", "--rate", "fast")
    assert code == 2 and "a rate such as 100mbit" in err
    code, _, err = cli("--name", "nothere", "status")
    assert code == 2 and "no hosts named 'nothere'" in err
    code, out, _ = cli("--name", "trt", "status")
    assert code == 0 and [json.loads(line)["host"] for line in out.splitlines()] == [0, 1, 2, 3]


def _records(out) -> list[dict]:
    path = out / "metrics.jsonl"
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def _wait(out, proc, done, what: str, timeout_s: float = 120) -> list[dict]:
    """Wait until ``done(records)`` holds for the run writing ``out``; its records."""
    deadline = time.monotonic() + timeout_s
    while not done(records := _records(out)):
        assert proc.poll() is None, proc.communicate()[1][-3000:]
        assert time.monotonic() < deadline, f"{what}: not so after {timeout_s}s"
        time.sleep(0.05)
    return records


def _step(kind: str, step: int):
    return lambda records: any(r["kind"] == kind and r["step"] >= step for r in records)


def _rank_host(hosts, records, role: str, rank: int = 0) -> int:
    """The host where ``role``'s rank ran, from the run's latest placement record."""
    placement = [r for r in records if r["kind"] == "placement"][-1]
    return hosts.at(placement["nodes"][role][rank])


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    """A directory of shards the hosts' ranks stream from (troupe.data.stream), its tokens
    where every host reaches them (the hosts share this machine's filesystem)."""
    from tests.data.corpus import make_corpus
    root = tmp_path_factory.mktemp("corpus")
    return make_corpus(root / "shards", shards=4, docs=200), root / "tokens"


def _pretrain(out, corpus) -> list[str]:
    """Pretraining with one rank a host, from a streamed corpus, checkpoints every 20 steps,
    collectives that wait 5 s."""
    shards, tokens = corpus
    return [sys.executable, "apps/pretrain.py", "--config", "dense-tiny", "workers=2",
            "train.strategy=STRICT_SPREAD", "train.steps=120", "train.eval_every=0",
            "train.checkpoint_every=20", "collective_timeout_s=5", "max_restarts=2",
            f"data.source={shards}", f"data.cache_dir={tokens}", f"out_dir={out}"]


def _losses(out) -> list[tuple]:
    """The run's records but its recoveries and placements, as (kind, step, loss,
    val_loss)."""
    return [(r["kind"], r["step"], r.get("loss"), r.get("val_loss")) for r in _records(out)
            if r["kind"] not in ("recovery", "placement", "links")]


@pytest.fixture(scope="module")
def uncut(hosts, tmp_path_factory, corpus):
    """The losses of the run nobody cut or killed."""
    out = tmp_path_factory.mktemp("uncut")
    plain = hosts.run(0, _pretrain(out, corpus), timeout_s=240)
    assert plain.returncode == 0, plain.stderr[-3000:]
    [links] = [r for r in _records(out) if r["kind"] == "links"]  # the ranks span two hosts
    assert len(links["pairs"]) == 2 and all(p["mb_per_s"] > 10 for p in links["pairs"])
    assert links["slowest"] is None  # two ranks: no host is in two pairs of its own
    return _losses(out)


def _run(hosts, argv) -> subprocess.Popen:
    return hosts.exec(0, argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def test_a_short_cut_is_ridden_out_and_a_long_one_restarts_the_run(hosts, tmp_path, uncut,
                                                                   corpus):
    """Pretraining with one rank a host: a cut of a rank's link shorter than
    collective_timeout_s (5 s) costs a pause; a longer one (8 s, less than Ray's 10 s to
    declare the node lost) fails the collective, naming the peer and its host, a fault: the
    run goes back to its last checkpoint and completes, with the losses of a run nobody cut
    (bit for bit)."""
    cut = tmp_path / "cut"
    proc = _run(hosts, _pretrain(cut, corpus))
    victim = None
    try:
        victim = _rank_host(hosts, _wait(cut, proc, _step("train", 25), "step 25"), "trainer", 1)
        hosts.set_cut(victim, True)
        time.sleep(2)
        hosts.set_cut(victim, False)
        _wait(cut, proc, _step("train", 65), "step 65")
        hosts.set_cut(victim, True)
        time.sleep(8)
        hosts.set_cut(victim, False)
        out, err = proc.communicate(timeout=240)
    finally:
        if victim is not None:
            hosts.set_cut(victim, False)
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, err[-3000:]
    [recovery] = [r for r in _records(cut) if r["kind"] == "recovery"]  # the long cut alone
    assert recovery["fault"] and 60 <= recovery["step"] <= 120, recovery
    assert "CollectiveTimeoutError" in recovery["cause"] and "within 5s" in recovery["cause"]
    # the peer it waited for, by rank and host: there and silent (the link cut before it
    # sent), still in the operation before (what this rank sent it did not arrive), or not
    # answering while the link is still down
    cause = recovery["cause"]
    assert "a stalled or cut link" in cause or "did not answer" in cause, cause
    assert f"rank 1 ('trainer') on {hosts.hosts[victim].address}" in cause, cause
    assert _losses(cut) == uncut


def test_a_killed_host_is_a_lost_node_and_the_run_resumes_on_the_hosts_left(hosts, tmp_path,
                                                                           uncut, corpus):
    """Every process of a rank's host killed mid-pretraining (its trainer, its Ray node): the
    run notices (a dead worker, or a collective that times out first), Ray moves the rank to
    the spare host once it declares the node dead (10 s), and the run goes back to its last
    checkpoint and completes with an uninterrupted run's losses, bit for bit."""
    out = tmp_path / "killed"
    proc = _run(hosts, _pretrain(out, corpus))
    victim = None
    try:
        victim = _rank_host(hosts, _wait(out, proc, _step("train", 50), "step 50"), "trainer", 1)
        hosts.kill(victim)
        assert netns.pids(hosts.namespace(victim)) == []
        _, err = proc.communicate(timeout=300)
    finally:
        if proc.poll() is None:
            proc.kill()
        if victim is not None:
            hosts.restart(victim)
            hosts.wait_nodes(4, timeout_s=90)
    assert proc.returncode == 0, err[-3000:]
    records = _records(out)
    recoveries = [r for r in records if r["kind"] == "recovery"]
    assert recoveries and all(r["fault"] for r in recoveries), recoveries
    moved = [r for r in records if r["kind"] == "placement"][-1]["nodes"]["trainer"]
    assert hosts.hosts[victim].address not in moved and len(set(moved)) == 2
    assert _losses(out) == uncut


def test_a_replica_host_killed_during_a_weight_sync(hosts, tmp_path):
    """GRPO with one rollout replica on a host of its own, its link slowed to 8 Mbit/s so
    that a sync (1.45 MB) lasts about 1.5 s; the host killed while the replica receives: the
    policy's side of the sync fails within sync_timeout_s (5 s) naming replica 0, the replica
    is rebuilt on the spare host and brought to the policy's weights, and the run completes
    every iteration with every later sync on the new host."""
    out = tmp_path / "grpo"
    argv = [sys.executable, "apps/rlhf.py", "algorithm=grpo",
            "reward.function=apps.rewards:sort_digits", "sft.steps=4", "step3.iterations=6",
            "step3.prompts_per_iter=4", "step3.max_new_tokens=6", "step3.eval_every=100",
            "step3.checkpoint_every=0", "task.eval_examples=8", "workers=1",
            "step3.rollout.replicas=1", "step3.rollout.num_cpus=1",
            "step3.rollout.sync_timeout_s=5", "collective_timeout_s=5", f"out_dir={out}"]
    for i in range(1, 4):
        hosts.shape(i, rate="8mbit")
    proc = _run(hosts, argv)
    victim = None
    try:
        records = _wait(out, proc, _step("step3", 1), "iteration 1", timeout_s=180)
        victim = _rank_host(hosts, records, "rollout")
        last = hosts.rx_bytes(victim)
        while (now := hosts.rx_bytes(victim)) - last < 30_000:  # 0.1 s of a sync's bytes
            last = now
            time.sleep(0.1)
            assert proc.poll() is None, proc.communicate()[1][-3000:]
        hosts.kill(victim)
        _, err = proc.communicate(timeout=240)
    finally:
        if proc.poll() is None:
            proc.kill()
        for i in range(1, 4):
            hosts.shape(i, rate="1gbit")
        if victim is not None:
            hosts.restart(victim)
            hosts.wait_nodes(4, timeout_s=90)
    assert proc.returncode == 0, err[-3000:]
    records = _records(out)
    [restart] = [r for r in records if r["kind"] == "rollout_restart"]
    assert restart["replica"] == 0 and restart["node"] != hosts.hosts[victim].address
    assert restart["sync_error"].startswith(f"weight sync to version {restart['step']}: replica 0")
    waited = float(re.search(r"(?:waited|saw it) ([\d.]+)s", restart["sync_error"]).group(1))
    assert waited < 5 + 3, restart["sync_error"]  # the deadline, and the diagnosis after it
    steps = [r for r in records if r["kind"] == "step3"]
    assert [r["step"] for r in steps] == list(range(1, 7))
    assert [r.get("weight_version") for r in steps[:-1]] == list(range(1, 6))


LOAD = textwrap.dedent("""
    # in host 0: four clients sending completions one after another, and /health polled
    # every 0.5 s, for SECONDS; prints each request's (start, seconds, status) as JSON
    import json, sys, threading, time, urllib.error, urllib.request
    url, seconds, t0, wall = sys.argv[1], float(sys.argv[2]), time.monotonic(), time.time()
    sent, health = [], []
    def ask(path, body=None):
        req = urllib.request.Request(url + path, body, {"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=60) as r:
                return r.status
        except urllib.error.HTTPError as e:
            return e.code
        except OSError as e:
            return type(e).__name__
    def client(k):
        i = 0
        while time.monotonic() - t0 < seconds:
            body = json.dumps({"model": "tiny", "prompt": f"hello {k} {i}", "max_tokens": 32,
                               "temperature": 0}).encode()
            t = time.monotonic()
            status = ask("/v1/completions", body)
            sent.append((t - t0, time.monotonic() - t, status))
            i += 1
    def poll():
        while time.monotonic() - t0 < seconds:
            t = time.monotonic()
            status = ask("/health")
            health.append((t - t0, time.monotonic() - t, status))
            time.sleep(0.5)
    threads = [threading.Thread(target=client, args=(k,)) for k in range(4)]
    threads.append(threading.Thread(target=poll))
    [t.start() for t in threads]
    [t.join() for t in threads]
    print(json.dumps({"t0": wall, "sent": sorted(sent), "health": health}))
    """)


def test_a_serving_replica_host_killed_under_load(hosts, tmp_path):
    """The server (one replica, its HTTP proxy on the head) under four clients; the replica's
    host killed: the requests in flight end with an error (500, or 408 at the proxy's
    request_timeout_s, 4 s here), none hangs; /health answers an error, not 200, while no
    replica is left (a poll sent in the gap and answered once the new replica is up is 200);
    Serve starts one on another host (within 28 s) and both answer 200 again."""
    from troupe.models import GPT, GPTConfig
    from troupe.serving.model import save_model
    model = tmp_path / "tiny.trp"
    save_model(GPT(GPTConfig(seq_len=128, n_layer=2, n_head=2, d_model=64), seed=5), model)
    server = _run(hosts, [sys.executable, "apps/serve.py", "--config", "serve-tiny",
                          "model.checkpoint=null", f"model.file={model}", "model.name=tiny",
                          "host=198.18.0.1", "port=8000", "num_cpus=1",
                          "limits.request_timeout_s=4"])
    load = victim = None
    try:
        deadline = time.monotonic() + 120
        while not (found := hosts.find("ray::ServeReplica")) or hosts.run(
                0, ["curl", "-sf", "198.18.0.1:8000/health"]).returncode != 0:
            assert server.poll() is None, server.communicate()[1][-3000:]
            assert time.monotonic() < deadline, "the server did not come up in 120 s"
            time.sleep(0.5)
        [victim] = found
        load = hosts.exec(0, [sys.executable, "-c", LOAD, "http://198.18.0.1:8000", "40"],
                          stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        time.sleep(6)
        hosts.kill(victim)
        killed_at = time.time()
        out, err = load.communicate(timeout=120)
        assert load.returncode == 0, err[-2000:]
    finally:
        for p in (load, server):
            if p is not None and p.poll() is None:
                p.kill()
        if victim is not None:
            hosts.restart(victim)
    got = json.loads(out)
    sent, health, killed = got["sent"], got["health"], killed_at - got["t0"]
    assert all(seconds < 4.5 for _, seconds, _ in sent)  # no request waited past the proxy's
    before = [s for t, _, s in sent if t + 1 < killed]
    after = [s for t, _, s in sent if t > killed + 28]
    assert before and set(before) == {200} and after and set(after) == {200}
    failed = [s for _, _, s in sent if s != 200]
    assert failed and set(failed) <= {500, 408}, failed  # those in flight, and in the gap
    assert all(seconds < 4.5 for _, seconds, _ in health)
    gap = [s for t, _, s in health if t > killed and s != 200]
    assert gap and set(gap) <= {408, 500, 503}, health  # no replica: /health is not 200
    assert health[-1][2] == 200
    [now] = hosts.find("ray::ServeReplica")
    assert now not in (0, victim)
