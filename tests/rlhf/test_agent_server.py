"""Agent mode (troupe.rlhf.agents.server): an unmodified openai-client agent loop runs against
per-episode base URLs, its completions are recorded with the engine's log-probabilities, bad
requests are refused by name, and one GRPO update on the recorded samples changes the
policy's weights (and the server then answers from the new ones)."""

import pytest
import requests
import torch
from openai import OpenAI

from troupe.rlhf import algorithms
from troupe.rlhf.agents.server import RecordingServer
from troupe.rlhf.config import RLHFConfig
from troupe.rlhf.data.experience import Experience
from troupe.rlhf.roles.policy import Policy


def agent(client: OpenAI, task: str) -> str:
    """An agent program as its author wrote it: it knows a client, nothing of troupe."""
    messages = [{"role": "user", "content": task}]
    for _ in range(2):
        reply = client.chat.completions.create(model="policy", messages=messages,
                                               max_tokens=6, temperature=1.0)
        messages.append({"role": "assistant", "content": reply.choices[0].message.content})
        messages.append({"role": "user", "content": "check it and answer again"})
    return messages[-2]["content"]


@pytest.fixture(scope="module")
def policy():
    cfg = RLHFConfig(algorithm="grpo", model=dict(gpt=dict(seq_len=128, n_layer=2, n_head=2,
                                                           d_model=32)),
                     step3=dict(kl_coef=0.0, actor=dict(name="adamw", lr=1e-2, min_lr=1e-2)))
    policy = Policy(cfg, None, 0)
    policy.begin_step3(None)  # from its own weights, with step 3's optimizer
    return policy


def test_recorded_episodes_train_the_policy(policy):
    with RecordingServer(policy.lm.gpt, policy.tok, api_key="secret") as server:
        for task in ("sort 312", "sort 958"):
            for attempt in range(4):
                session = f"{task[-3:]}-{attempt}"
                client = OpenAI(base_url=server.base_url(session), api_key="secret")
                answer = agent(client, task)
                r = requests.post(f"{server.url}/sessions/{session}/reward",
                                  json={"reward": len(set(answer)), "group": task},
                                  headers={"Authorization": "Bearer secret"})
                assert r.status_code == 200
        ro = server.rollout()
        assert len(ro.responses) == 16 and ro.groups == [0] * 8 + [1] * 8
        # the recorded tokens are the sampled ones: actions exactly there, logprobs with them
        assert torch.equal(ro.action.sum(1), (ro.valid[:, ro.prompt_len:]).sum(1).float())
        assert ((ro.engine_logp != 0) <= (ro.action > 0)).all()
        reward, groups = ro.env_reward, torch.tensor(ro.groups)
        assert reward.unique().numel() > 1
        adv = algorithms.sequence_advantages(algorithms.grpo_advantages(reward, groups),
                                             ro.action)
        exp = Experience(ro.ids, ro.valid, ro.action, adv, prompt_len=ro.prompt_len,
                         engine_logp=ro.engine_logp)
        before = {k: v.clone() for k, v in policy.lm.state_dict().items()}
        stats = policy.rl_step(exp, 1, None)
        assert stats.tokens == int(ro.action.sum())
        assert any(not torch.equal(v, before[k]) for k, v in policy.lm.state_dict().items())
        server.weights_updated()
        assert server.engine.cache_namespace == "version 1"
        agent(OpenAI(base_url=server.base_url("after"), api_key="secret"), "sort 123")
        assert server.calls and server.calls[-1].session == "after"


def test_bad_requests_are_refused_by_name(policy):
    with RecordingServer(policy.lm.gpt, policy.tok, api_key="secret") as server:
        auth = {"Authorization": "Bearer secret"}
        url = f"{server.base_url('s')}/chat/completions"
        r = requests.post(url, json={"model": "policy", "messages": []}, headers=auth)
        assert r.status_code == 400 and r.json()["error"]["param"] == "messages"
        r = requests.post(url, json={"model": "other", "messages": [
            {"role": "user", "content": "hi"}]}, headers=auth)
        assert r.status_code == 404 and r.json()["error"]["param"] == "model"
        r = requests.post(url, json={"model": "policy", "messages": [
            {"role": "user", "content": "hi"}]})
        assert r.status_code == 401
        r = requests.post(f"{server.url}/sessions/nobody/reward", json={"reward": 1},
                          headers=auth)
        assert r.status_code == 404 and "nobody" in r.json()["error"]["message"]
        r = requests.post(f"{server.url}/sessions/s/reward", json={"score": 1}, headers=auth)
        assert r.status_code == 400 and r.json()["error"]["param"] == "reward"
        with pytest.raises(ValueError, match="no rewarded session"):
            server.rollout()
