"""One generation engine: the same prompts, seeds and sampling parameters give the same tokens
through an RLHF rollout (the policy role, all prompts in one batch) and through the
OpenAI-compatible server (one HTTP request per prompt, arriving together)."""

import concurrent.futures as cf
import json
import urllib.request

import pytest

from troupe.rlhf.config import RLHFConfig
from troupe.rlhf.data.datasets import SortTask
from troupe.rlhf.data.experience import RolloutRequest
from troupe.rlhf.roles.policy import Policy
from troupe.serving import deploy as serve
from troupe.serving.config import ServeConfig
from troupe.serving.model import save_model

pytestmark = pytest.mark.waits  # a server answering a few clients

N, TEMPERATURE, TOP_P, SFT = 10, 0.9, 0.95, 60


@pytest.fixture(scope="module")
def policy_and_server(cluster, serve_port, tmp_path_factory):
    cfg = RLHFConfig(model=dict(gpt=dict(seq_len=48, n_layer=2, n_head=2, d_model=32)),
                     sft=dict(steps=SFT), step3=dict(max_new_tokens=N, temperature=TEMPERATURE,
                                                  top_p=TOP_P))
    policy = Policy(cfg, None, 0)
    policy.train.use_optimizer(cfg.sft.optimizer, SFT)
    for step in range(1, SFT + 1):  # some SFT, so that about half the responses end with eos
        policy.sft_step(SortTask().demonstrations(16, step), step)
    path = tmp_path_factory.mktemp("one-engine") / "policy.trp"
    save_model(policy.lm.gpt, path)
    # the rollout's weights (fp32), not the server's default W8A8: quantized logits move the
    # bounds between tokens, and a draw near one would then land on another token
    url = serve.deploy(ServeConfig(model={"file": str(path), "name": "policy"}, port=serve_port,
                                   quantize={}, limits={"max_tokens": N, "max_batch": 4}))
    yield policy, url
    serve.shutdown()


def complete(url: str, prompt: str, seed: int) -> dict:
    body = json.dumps({"model": "policy", "prompt": prompt, "max_tokens": N, "seed": seed,
                       "temperature": TEMPERATURE, "top_p": TOP_P}).encode()
    req = urllib.request.Request(f"{url}/v1/completions", data=body, method="POST",
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=120) as r:
        return json.loads(r.read())["choices"][0]


def test_rollout_and_server_give_the_same_tokens(policy_and_server):
    policy, url = policy_and_server
    prompts = SortTask().prompts(12, 7)
    seeds = [1000 + 17 * i for i in range(len(prompts))]
    rollout = policy.generate(RolloutRequest(prompts, seeds))
    with cf.ThreadPoolExecutor(len(prompts)) as pool:  # the server batches them its own way
        served = list(pool.map(lambda a: complete(url, *a), zip(prompts, seeds)))
    eos = policy.tok.eos_id
    ended = [bool((row == eos).any()) for row in rollout.ids[:, -N:]]
    assert [c["text"] for c in served] == rollout.responses
    assert [c["finish_reason"] for c in served] == ["stop" if e else "length" for e in ended]
    assert any(ended) and not all(ended)  # both ways of finishing are compared
    # and the seeds matter: other seeds give other samples
    other = policy.generate(RolloutRequest(prompts, [s + 1 for s in seeds]))
    assert other.responses != rollout.responses
