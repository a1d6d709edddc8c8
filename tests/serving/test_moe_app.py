"""A MoE model served with its experts spread over two expert actors (all_to_all over gloo):
the same greedy text as the whole model decoding alone, for requests in flight together."""

import concurrent.futures as cf

import openai
import pytest

from tests.serving.test_app import alone
from troupe.models import GPT, GPTConfig
from troupe.serving import deploy as serve
from troupe.serving.config import ServeConfig
from troupe.serving.model import load_served_model, save_model

pytestmark = pytest.mark.waits  # a server answering a few clients

MOE = dict(num_experts=4, expert_interval=1, top_k=2, capacity_factor=1.0)


@pytest.fixture(scope="module")
def moe_app(cluster, serve_port, tmp_path_factory):
    path = tmp_path_factory.mktemp("serve-moe") / "moe.trp"
    save_model(GPT(GPTConfig(seq_len=64, n_layer=2, n_head=2, d_model=32, moe=MOE), seed=5),
               path)
    cfg = ServeConfig(model={"file": str(path), "name": "moe"}, quantize={"*": "w8a8"},
                      group_size=16, port=serve_port, expert_parallel=2, num_cpus=0.5,
                      api_key_env="TROUPE_TEST_NO_KEY")
    url = serve.deploy(cfg)
    model, modes = load_served_model(cfg)
    assert sum(name.endswith(".experts") for name in modes) == 2  # experts quantized too
    yield {"client": openai.OpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0,
                                   timeout=120), "model": model, "url": url}
    serve.shutdown()


def test_expert_parallel_replica_matches_the_whole_model(moe_app):
    import json
    import urllib.request

    with urllib.request.urlopen(moe_app["url"] + "/health", timeout=30) as r:
        health = json.loads(r.read())
    assert health["expert_parallel"] == 2 and len(health["weight_bytes"]) == 2
    prompts = [f"moe {i}: " + "ab" * i for i in range(5)]

    def ask(i):
        out = moe_app["client"].completions.create(model="moe", prompt=prompts[i],
                                                   max_tokens=10 + i, temperature=0)
        return out.choices[0].text

    with cf.ThreadPoolExecutor(5) as pool:
        together = list(pool.map(ask, range(5)))
    assert together == [alone(moe_app["model"], prompts[i], 10 + i) for i in range(5)]


def _serve_gang(dashboard: str):
    """(placement group id, [pid of each live rank]) of the one expert gang serving now."""
    import ray
    from ray.util.state import list_actors

    live = [pg_id for pg_id, pg in ray.util.placement_group_table().items()
            if pg["name"].startswith("serve-") and pg["state"] == "CREATED"]
    assert len(live) == 1, live
    ranks = list_actors(address=f"http://{dashboard}", detail=True, timeout=60,
                        filters=[("placement_group_id", "=", live[0]), ("state", "=", "ALIVE")])
    return live[0], [a.pid for a in ranks]


def test_a_dead_expert_rank_is_reported_and_replaced(moe_app, cluster):
    """Kill one rank of the gang (the last test of this module: it replaces the replica).
    /health answers 503 within 5 s (before: 200 forever, and every request 500), Serve
    replaces the replica within 60 s, the new one answers what the whole model answers, and
    the old gang's placement group and actors are gone."""
    import os
    import signal
    import time
    import urllib.error
    import urllib.request

    import ray

    old_pg, pids = _serve_gang(cluster.dashboard_url)
    assert len(pids) == 2
    os.kill(pids[1], signal.SIGKILL)
    killed = time.monotonic()

    def health() -> int:
        try:
            with urllib.request.urlopen(moe_app["url"] + "/health", timeout=2) as r:
                return r.status
        except urllib.error.HTTPError as e:
            return e.code
        except OSError:  # no replica answered in time: not ok either
            return 0

    while health() == 200:
        assert time.monotonic() - killed < 5, "/health still ok 5 s after a rank died"
        time.sleep(0.2)
    while True:
        try:
            out = moe_app["client"].completions.create(model="moe", prompt="moe 3: ababab",
                                                       max_tokens=13, temperature=0)
            break
        except Exception:  # 503 from the broken replica, or the proxy waiting for the new
            assert time.monotonic() - killed < 60, "no service 60 s after a rank died"
            time.sleep(0.5)
    assert out.choices[0].text == alone(moe_app["model"], "moe 3: ababab", 13)
    assert health() == 200
    assert ray.util.placement_group_table()[old_pg]["state"] == "REMOVED"
    new_pg, new_pids = _serve_gang(cluster.dashboard_url)
    assert new_pg != old_pg and len(new_pids) == 2 and not set(new_pids) & set(pids)
