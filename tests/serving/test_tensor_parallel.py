"""A model served over three tensor-parallel actors (each its share of every layer's heads,
MLP and vocabulary; all-reduces over gloo): the greedy text of the whole model decoding alone
(fp32), for requests in flight together, structured outputs and the prefix cache; and what
does not split, refused before Ray starts."""

import concurrent.futures as cf
import json
import urllib.request

import openai
import pytest

from troupe.config import ConfigError
from troupe.models import GPT, GPTConfig
from troupe.serving import deploy as serve
from troupe.serving.config import ServeConfig
from troupe.serving.model import check_source, save_model

pytestmark = pytest.mark.waits  # a server answering a few clients

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


def test_what_does_not_split_is_refused_before_ray(model_file):
    with pytest.raises(ConfigError, match=r"tensor_parallel=4: model has 6 query and 3 "
                                          r"key/value heads.*\[1, 3, 6\]"):
        check_source(_config(model_file, 0).model_copy(update={"tensor_parallel": 4}))
    with pytest.raises(ValueError, match="tensor_parallel=3 with adapters"):
        _config(model_file, 0, adapters={"a": "/x"})


def test_three_ranks_serve_the_whole_models_text_structured_or_not(cluster, serve_port,
                                                                    tmp_path):
    """A Hugging Face Llama (6 query, 3 key/value heads) over three ranks, with its tokenizer
    and a prefix cache: requests in flight together get the whole model's greedy text (fp32);
    a regular expression's output is the whole model's under the same grammar (each rank
    masks the same tokens of the same gathered logits); and a prompt again, its keys and
    values now in each rank's prefix cache, gives the same text."""
    import re

    import transformers

    from tests.models.tiny import save_tiny_llama
    from troupe.generation import ContinuousBatcher, SamplingParams
    from troupe.generation.grammar import Constraint, Grammars
    from troupe.models import from_pretrained

    path = save_tiny_llama(tmp_path / "llama", num_attention_heads=6, num_key_value_heads=3,
                           hidden_size=48, intermediate_size=96, initializer_range=0.3)
    hf = transformers.AutoTokenizer.from_pretrained(path)
    whole = from_pretrained(path).eval()

    def alone_hf(prompt: str, **sampling) -> str:
        engine = ContinuousBatcher(whole, hf.eos_token_id, max_batch=1, tokenizer=hf,
                                   grammars=Grammars(hf, whole.cfg.vocab_size,
                                                     hf.eos_token_id))
        engine.add("x", hf.encode(prompt), SamplingParams(max_tokens=12, temperature=0,
                                                          **sampling))
        return "".join(e.delta for e in engine.run_events())

    pattern = "[0-9]{3} sort [0-9]+"
    prompts = [f"sort {'31' * (i + 1)}:" for i in range(4)]
    cfg = ServeConfig(model={"pretrained": str(path), "name": "tp"}, port=serve_port,
                      num_cpus=0.5, tensor_parallel=3, prefix_cache_mb=4,
                      api_key_env="TROUPE_TEST_NO_KEY")
    url = serve.deploy(cfg)
    try:
        with urllib.request.urlopen(url + "/health", timeout=30) as r:
            health = json.loads(r.read())
        assert health["tensor_parallel"] == 3 and len(health["weight_bytes"]) == 3
        texts = _ask_all(url, prompts, 12)
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0, timeout=120)

        def constrained():
            return client.completions.create(model="tp", prompt=prompts[0], max_tokens=12,
                                             temperature=0,
                                             extra_body={"guided_regex": pattern}
                                             ).choices[0].text
        first, again = constrained(), constrained()
    finally:
        serve.shutdown()
    assert texts == [alone_hf(p) for p in prompts]
    assert re.fullmatch(pattern, first) and again == first
    assert first == alone_hf(prompts[0], constraint=Constraint("regex", pattern))
