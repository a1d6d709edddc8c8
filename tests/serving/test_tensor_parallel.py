"""A model served over three tensor-parallel actors (each its share of every layer's heads,
MLP and vocabulary; all-reduces over gloo): the greedy text of the whole model decoding alone
(fp32), for requests in flight together; then W8A8, each rank quantizing its own shards."""

import concurrent.futures as cf
import json
import urllib.request

import openai
import pytest

from tests.serving.test_app import alone
from troupe.config import ConfigError
from troupe.models import GPT, GPTConfig
from troupe.serving import deploy as serve
from troupe.serving.config import ServeConfig
from troupe.serving.model import check_source, load_source, save_model

# Llama's kind (rotary positions, RMSNorm, SwiGLU), 6 query heads over 3 key/value heads
LLAMA = dict(vocab_size=257, seq_len=64, n_layer=2, n_head=6, n_kv_head=3, d_model=48,
             d_ff=96, norm="rmsnorm", positions="rope", mlp="swiglu", out_bias=False,
             mlp_bias=False)


@pytest.fixture(scope="module")
def model_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("serve-tp") / "llama.trp"
    save_model(GPT(GPTConfig(**LLAMA), seed=5), path)
    return path


def _config(path, port, **over) -> ServeConfig:
    return ServeConfig(model={"file": str(path), "name": "tp"}, port=port, num_cpus=0.5,
                       tensor_parallel=3, api_key_env="TROUPE_TEST_NO_KEY", **over)


def _ask_all(url: str, prompts: list[str], n: int) -> list[str]:
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0, timeout=120)

    def ask(prompt):
        out = client.completions.create(model="tp", prompt=prompt, max_tokens=n,
                                        temperature=0)
        return out.choices[0].text
    with cf.ThreadPoolExecutor(len(prompts)) as pool:
        return list(pool.map(ask, prompts))


def test_three_tensor_parallel_ranks_serve_the_whole_models_text(cluster, serve_port,
                                                                model_file):
    cfg = _config(model_file, serve_port, quantize={})
    url = serve.deploy(cfg)
    try:
        with urllib.request.urlopen(url + "/health", timeout=30) as r:
            health = json.loads(r.read())
        assert health["tensor_parallel"] == 3 and len(health["weight_bytes"]) == 3
        whole = load_source(cfg.model)
        prompts = [f"tp {i}: " + "ab" * i for i in range(4)]
        assert _ask_all(url, prompts, 12) == [alone(whole, p, 12) for p in prompts]
    finally:
        serve.shutdown()


def test_what_does_not_split_is_refused_before_ray(model_file):
    with pytest.raises(ConfigError, match=r"tensor_parallel=4: model has 6 query and 3 "
                                          r"key/value heads.*\[1, 3, 6\]"):
        check_source(_config(model_file, 0).model_copy(update={"tensor_parallel": 4}))
    with pytest.raises(ValueError, match="tensor_parallel=3 with adapters"):
        _config(model_file, 0, adapters={"a": "/x"})
