"""Multi-turn rollouts (troupe.rlhf.agents.loop): a 4-turn trajectory runs only each turn's new
tokens through the model (the earlier turns' keys and values come from the prefix cache) and
samples what it samples without the cache; the rollout marks only the model's tokens as actions,
and the loss's gradient on the logits at the environment's tokens is exactly zero for every
algorithm's loss and the KL; the environment's messages go through the chat template."""

import os
import textwrap

import pytest
import torch

from troupe.data.tokenizer import ByteTokens
from troupe.generation import ContinuousBatcher
from troupe.generation.prefix_cache import PrefixCache
from troupe.models import GPT, GPTConfig
from troupe.rlhf import algorithms
from troupe.rlhf.agents.environments import EnvironmentPool
from troupe.rlhf.agents.loop import AgentLoop, Trajectory, rollout_of

MODULE = """
class Echo:
    '''Answers each assistant turn with a tool message; done after row["turns"] turns, the
    reward the number of characters the assistant wrote.'''

    def reset(self, row):
        self.turns, self.limit, self.chars = 0, row["turns"], 0
        return [{"role": "user", "content": row["prompt"]}]

    def step(self, messages, assistant):
        self.turns += 1
        self.chars += len(assistant["content"] or "")
        done = self.turns >= self.limit
        return ([{"role": "tool", "content": f"result {self.turns} of {len(messages)}"
                                             + "." * row_padding(self)}],
                float(self.chars) if done else None, done)


def row_padding(env):
    return getattr(env, "padding", 0)


class Chatty(Echo):
    '''Echo whose every answer is row["padding"] characters longer.'''

    def reset(self, row):
        self.padding = row["padding"]
        return super().reset(row)
"""


@pytest.fixture
def echo(tmp_path, monkeypatch):
    (tmp_path / "agent_envs.py").write_text(textwrap.dedent(MODULE))
    monkeypatch.setenv("PYTHONPATH", str(tmp_path) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    with EnvironmentPool("agent_envs:Echo", workers=2) as pool:
        yield pool


def _model(seq_len: int = 512) -> GPT:
    """A byte-level decoder whose eos logit is raised along the mean hidden state, so that
    sampled turns end after a few tokens (a random model would almost never end one)."""
    cfg = GPTConfig(vocab_size=257, seq_len=seq_len, n_layer=2, n_head=2, d_model=64,
                    positions="rope", norm="rmsnorm", mlp="swiglu", n_kv_head=1,
                    out_bias=False, mlp_bias=False)
    model = GPT(cfg, seed=0).eval()
    with torch.no_grad():
        h, _ = model.hidden(torch.randint(0, 256, (8, 64), generator=torch.Generator().manual_seed(0)))
        d = h.reshape(-1, 64).mean(0)
        model.tok_emb.weight[256] = d / d.norm() * 2.5
    return model


def _trajectories(pool, cached: bool, rows, seeds):
    tok, model = ByteTokens(), _model()
    engine = ContinuousBatcher(model, tok.eos_id, max_batch=4,
                               prefix_cache=PrefixCache(64 << 20) if cached else None,
                               keep_outputs=cached)
    loop = AgentLoop(tok, pool, max_turns=8, max_tokens=400, turn_tokens=40)
    return loop.run(engine, rows, seeds, temperature=1.0), engine


def _deltas(t: Trajectory) -> list[int]:
    """The lengths of the runs of the environment's tokens."""
    runs, n = [], 0
    for g in t.generated + [True]:
        if not g:
            n += 1
        elif n:
            runs.append(n)
            n = 0
    return runs


def test_each_turn_runs_only_its_new_tokens(echo):
    rows = [{"prompt": "count the steps", "turns": 4}]
    [t], engine = _trajectories(echo, True, rows, [7])
    assert t.end == "done" and t.turns == 4 and t.error is None
    deltas = _deltas(t)
    assert len(deltas) == 3  # the environment's answers between the 4 turns
    # the opening, then per later turn the previous turn's last token and the new messages
    assert engine.prefill_tokens == len(t.prompt_ids) + sum(d + 1 for d in deltas)
    # the same samples when every turn runs its whole conversation again
    [again], cold = _trajectories(echo, False, rows, [7])
    assert again.tokens == t.tokens and again.generated == t.generated
    assert cold.prefill_tokens > engine.prefill_tokens + 3 * len(t.prompt_ids)
    # the environment's tokens are its messages through the (byte) chat format
    text = ByteTokens().decode([x for x, g in zip(t.tokens, t.generated) if not g])
    assert text.count("tool: result") == 3 and text.endswith("assistant:")
    assert t.reward == float(sum(len(m["content"] or "") for m in t.messages
                                 if m["role"] == "assistant"))


def test_concurrent_trajectories_and_their_rollout(echo):
    rows = [{"prompt": f"task {i}", "turns": 1 + i % 3} for i in range(5)]
    trajs, _ = _trajectories(echo, True, rows, list(range(5)))
    assert [t.turns for t in trajs] == [1 + i % 3 for i in range(5)]
    ro = rollout_of(trajs, ByteTokens(), failure_score=-1.0)
    P = ro.prompt_len
    for i, t in enumerate(trajs):
        n = len(t.tokens)
        assert ro.ids[i, P:P + n].tolist() == t.tokens
        assert ro.valid[i, P:P + n].all() and not ro.valid[i, P + n:].any()
        assert ro.action[i, P - 1:P - 1 + n].tolist() == [float(g) for g in t.generated]
        assert ro.action[i, :P - 1].sum() == 0 and ro.action[i, P - 1 + n:].sum() == 0
        assert (ro.engine_logp[i] != 0).sum() <= sum(t.generated)
        assert ro.env_reward[i] == t.reward
    assert ro.agent["turns"] == sum(1 + i % 3 for i in range(5))
    assert ro.agent["ends"] == {"done": 5}
    part, rest = ro.split(2)
    assert part.agent == ro.agent and rest.agent is None  # counted once


def test_an_environment_that_answers_past_the_context_ends_its_trajectory(tmp_path, monkeypatch):
    """Answers that leave the model no room end the trajectory with the ``context`` cause,
    within the context: its rollout scores without a sequence longer than the model's."""
    (tmp_path / "agent_envs.py").write_text(textwrap.dedent(MODULE))
    monkeypatch.setenv("PYTHONPATH", str(tmp_path) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    tok, model = ByteTokens(), _model(seq_len=120)
    rows = [{"prompt": f"task {i}", "turns": 8, "padding": 25 + 10 * i} for i in range(3)]
    with EnvironmentPool("agent_envs:Chatty", workers=1) as pool:
        engine = ContinuousBatcher(model, tok.eos_id, max_batch=4)
        trajs = AgentLoop(tok, pool, max_turns=8, max_tokens=119, turn_tokens=20).run(
            engine, rows, [1, 2, 3], temperature=1.0)
    assert [t.end for t in trajs] == ["context"] * 3
    assert all(len(t.prompt_ids) + len(t.tokens) <= 120 for t in trajs)
    ro = rollout_of(trajs, tok, failure_score=0.0)
    assert ro.agent["ends"] == {"context": 3}
    with torch.no_grad():
        model.hidden(ro.ids, valid_BS=ro.valid)  # as the roles score it: every row fits


@pytest.mark.parametrize("name", ["ppo", "grpo", "rloo", "reinforce_pp", "gspo"])
def test_no_gradient_reaches_the_environments_tokens(name):
    """A trajectory with known environment tokens: every algorithm's loss, plus the KL, gives
    exactly zero gradient to the logits at the positions that predict them, and a nonzero one
    where the model's own tokens are predicted."""
    tok = ByteTokens()
    prompt = tok.chat([{"role": "user", "content": "add 12 and 30"}])
    env = tok.encode("\ntool: 42\nassistant:")
    first, second = tok.encode("call add") + [tok.eos_id], tok.encode("42") + [tok.eos_id]
    t = Trajectory("k", 0, [], prompt, tokens=first + env + second,
                   generated=[True] * len(first) + [False] * len(env) + [True] * len(second),
                   logprobs=[-1.0] * (len(first) + len(env) + len(second)), turns=2,
                   rewards=[1.0], end="done")
    ro = rollout_of([t, t], tok, 0.0)
    model = _model().train()
    logits = model(ro.ids)[0][:, :-1]  # (B, S-1, V): position t predicts token t+1
    logits.retain_grad()
    logp = torch.log_softmax(logits, -1).gather(-1, ro.ids[:, 1:, None]).squeeze(-1)
    alg, mask = algorithms.get(name), ro.action
    adv = algorithms.sequence_advantages(torch.tensor([1.0, -0.5]), mask)
    loss, _ = alg.policy_loss(logp, logp.detach() - 0.1, adv, mask, 0.2, 0.28)
    ref = logp.detach() + 0.05
    loss = loss + algorithms.masked_mean(algorithms.kl_estimate(logp, ref, "k3"), mask)
    loss.backward()
    grad = logits.grad.abs().sum(-1)  # (B, S-1)
    P, n1, ne = ro.prompt_len, len(first), len(env)
    env_positions = slice(P - 1 + n1, P - 1 + n1 + ne)
    assert torch.equal(grad[:, env_positions], torch.zeros_like(grad[:, env_positions]))
    assert torch.equal(grad[:, :P - 1], torch.zeros_like(grad[:, :P - 1]))
    assert (grad[:, P - 1:P - 1 + n1] > 0).all()
    assert (grad[:, P - 1 + n1 + ne:P - 1 + n1 + ne + len(second)] > 0).all()
