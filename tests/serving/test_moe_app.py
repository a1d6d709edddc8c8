"""A MoE model served with its experts spread over two expert actors (all_to_all over gloo):
the same greedy text as the whole model decoding alone, for requests in flight together."""

import concurrent.futures as cf

import openai
import pytest

from tests.serving.test_app import alone
from troupe.models import GPT, GPTConfig
from troupe.serving import deploy as serve
from troupe.serving.model import load_served_model, save_model
from troupe.serving.protocol import ServeConfig

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
