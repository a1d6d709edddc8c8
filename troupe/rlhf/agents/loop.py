"""Multi-turn rollouts: the policy talks with an environment (troupe.rlhf.agents.environments)
until it is done, and the trajectory is trained on as one sequence whose loss covers only what
the model wrote.

A trajectory is the environment's opening (``reset(row)``), rendered through the chat template
with the generation prompt, then turns: the engine generates the assistant's turn (until its
eos, at most ``step3.max_new_tokens``), the turn is parsed as the server parses it (text, and
Hermes ``<tool_call>`` blocks into ``tool_calls``, troupe.generation.tools; a turn cut at that
limit is closed with the eos the model did not write, as the template's), the environment
answers with the messages that follow (tool results, a user's reply), a reward or None and
whether it is done. Their tokens are the chat template's rendering of the conversation with
them, from where the assistant's eos ended the turn, through the next generation prompt: the
model's own tokens are never re-rendered or re-tokenized, so the sequence trained on is the one
sampled. It ends when the environment says done, after ``env.max_turns`` assistant turns, when
its tokens would pass ``env.max_tokens``, when the model's context has no room left for a token
of the model's own (``context``: an environment that answers at length), or when the
environment fails (its cause counted; the trajectory then scores ``env.failure_score``). Each
trajectory's end is counted by cause in step 3's records (``trajectory_ends``).

Every turn after the first continues the previous one's tokens: the engine keeps each finished
turn's keys and values in its prefix cache (``keep_outputs``), so a turn runs only its new
tokens: the environment's and the last token of the previous turn (``prefill_tokens`` counts).
Trajectories run concurrently: while some wait for their environment, the others generate.

The trajectory's reward is the sum of the rewards its environment gave. ``generated`` marks the
model's tokens: the rollout's ``action`` (the loss, the KL and the advantages live on it) is 1
there and 0 on the environment's tokens and the template's scaffolding.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from troupe.generation import ContinuousBatcher, SamplingParams
from troupe.generation import tools as tool_calls
from troupe.rlhf.agents.environments import EnvironmentPool
from troupe.rlhf.data.experience import Rollout


@dataclass
class Trajectory:
    key: str
    seed: int
    prompt: list                  # the opening messages
    prompt_ids: list[int]         # the opening rendered, with the generation prompt
    messages: list = field(default_factory=list)   # the conversation so far
    tokens: list[int] = field(default_factory=list)       # every token after the opening
    generated: list[bool] = field(default_factory=list)   # per token: the model wrote it
    logprobs: list[float] = field(default_factory=list)   # per token (0.0 where not generated)
    turns: int = 0                # assistant turns
    tool_turns: int = 0           # assistant turns with at least one parsed tool call
    rewards: list[float] = field(default_factory=list)    # the environment's, as given
    end: str | None = None        # done, max_turns, max_tokens, context, failed
    error: str | None = None      # the environment's failure, with its cause first
    env_seconds: float = 0.0      # waiting for the environment, over the turns
    turn_tokens: list[int] = field(default_factory=list, repr=False)   # the turn being made
    turn_logprobs: list[float] = field(default_factory=list, repr=False)
    asked: float = field(default=0.0, repr=False)  # when the environment was asked

    @property
    def reward(self) -> float:
        return float(sum(self.rewards))

    def extend(self, tokens: list[int], logprobs: list[float] | None = None) -> None:
        """Append tokens: the model's with their ``logprobs``, or (None) the environment's and
        the template's, which are not trained on."""
        self.tokens += tokens
        self.generated += [logprobs is not None] * len(tokens)
        self.logprobs += logprobs if logprobs is not None else [0.0] * len(tokens)


class AgentLoop:
    """Runs trajectories of ``pool``'s environment with an engine (see the module's
    docstring). ``tools``: OpenAI tool specs the chat template renders in every turn."""

    def __init__(self, tok, pool: EnvironmentPool, max_turns: int, max_tokens: int,
                 turn_tokens: int, tools: list[dict] | None = None):
        self.tok, self.pool, self.tools = tok, pool, tools or None
        self.max_turns, self.max_tokens, self.turn_tokens = max_turns, max_tokens, turn_tokens

    def run(self, engine: ContinuousBatcher, rows: list[dict], seeds: list[int],
            temperature: float, top_p: float = 1.0, top_k: int = 0) -> list[Trajectory]:
        """One trajectory per row (``seeds[i]`` its sampling stream's seed), concurrently, on
        ``engine`` (its prefix cache with ``keep_outputs`` makes later turns cheap)."""
        trajs = {}
        for i, (row, seed) in enumerate(zip(rows, seeds)):
            key = f"{time.monotonic_ns()}-{i}"  # unique in the pool across calls
            trajs[key] = Trajectory(key, seed, [], [])
            self.pool.reset(key, row)
        self.temperature, self.top_p, self.top_k = temperature, top_p, top_k
        open_ = set(trajs)
        while open_:
            for reply in self.pool.poll(0.0 if engine.has_work() else 0.05):
                t = trajs[reply.traj]
                if reply.error is not None:
                    self._finish(t, "failed", open_, f"{reply.cause}: {reply.error}")
                elif reply.op == "reset":
                    t.prompt, t.messages = reply.messages, list(reply.messages)
                    t.prompt_ids = self.tok.chat(t.messages, self.tools)
                    self._generate(engine, t, open_)
                else:
                    self._answered(engine, t, reply, open_)
            if engine.has_work():
                for ev in engine.step():
                    self._event(engine, trajs, ev, open_)
            elif open_ and not self.pool.pending():
                raise RuntimeError(f"agent loop: trajectories {sorted(open_)[:4]} wait for "
                                   "nothing (neither the engine nor the environment has them)")
        return [trajs[k] for k in trajs]

    def _generate(self, engine: ContinuousBatcher, t: Trajectory, open_: set) -> None:
        context_room = engine.cfg.seq_len - len(t.prompt_ids) - len(t.tokens)
        room = min(self.turn_tokens, self.max_tokens - len(t.tokens), context_room)
        if room < 1:
            self._finish(t, "context" if context_room < 1 else "max_tokens", open_)
            return
        params = SamplingParams(max_tokens=room, temperature=self.temperature, top_p=self.top_p,
                                top_k=self.top_k, seed=(t.seed + 7919 * t.turns) % (1 << 62),
                                logprobs=0)
        engine.add(f"{t.key}/{t.turns}", t.prompt_ids + t.tokens, params)
        t.turn_tokens, t.turn_logprobs = [], []

    def _event(self, engine: ContinuousBatcher, trajs: dict, ev, open_: set) -> None:
        t = trajs[ev.seq_id.rsplit("/", 1)[0]]
        if ev.error is not None:
            raise RuntimeError(f"trajectory {t.key}, turn {t.turns}: {ev.error}")
        t.turn_tokens.append(ev.token)
        t.turn_logprobs.append(ev.sampled_logprob if ev.sampled_logprob is not None
                               else ev.logprob or 0.0)
        if ev.finish_reason is None:
            return
        t.extend(t.turn_tokens, t.turn_logprobs)
        t.turns += 1
        ended = t.turn_tokens[-1] == self.tok.eos_id
        if not ended:  # cut at step3.max_new_tokens: the template closes the turn (not trained)
            if len(t.prompt_ids) + len(t.tokens) + 1 > engine.cfg.seq_len:
                self._finish(t, "context", open_)
                return
            if len(t.tokens) + 1 >= self.max_tokens:
                self._finish(t, "max_tokens", open_)
                return
            t.extend([self.tok.eos_id])
        content, calls = tool_calls.parse(self.tok.decode(t.turn_tokens[:-1] if ended
                                                          else t.turn_tokens))
        assistant = {"role": "assistant", "content": content}
        if calls:
            assistant["tool_calls"] = [c.body() for c in calls]
            t.tool_turns += 1
        t.messages.append(assistant)
        t.asked = time.perf_counter()
        self.pool.step(t.key, t.messages, assistant)

    def _answered(self, engine: ContinuousBatcher, t: Trajectory, reply, open_: set) -> None:
        t.env_seconds += time.perf_counter() - t.asked
        if reply.reward is not None:
            t.rewards.append(reply.reward)
        if reply.done:
            self._finish(t, "done", open_)
            return
        if t.turns >= self.max_turns:
            self._finish(t, "max_turns", open_)
            return
        before = self.tok.chat(t.messages, self.tools, add_generation_prompt=False)
        t.messages += reply.messages
        after = self.tok.chat(t.messages, self.tools)
        cut = self._turn_end(before)
        if after[:cut] != before[:cut]:
            raise ValueError(
                "model.chat_template: the conversation renders differently once the "
                "environment's messages follow it (first difference at token "
                f"{next(i for i, (a, b) in enumerate(zip(after, before)) if a != b)}); "
                "multi-turn rollouts need a template that renders a conversation's start the "
                "same whatever comes after it")
        delta = after[cut:]
        if len(t.prompt_ids) + len(t.tokens) + len(delta) >= engine.cfg.seq_len:
            # the environment's answer leaves the model no room for a token of its own
            self._finish(t, "context", open_)
            return
        if len(t.tokens) + len(delta) >= self.max_tokens:
            self._finish(t, "max_tokens", open_)
            return
        t.extend(delta)
        self._generate(engine, t, open_)

    def _turn_end(self, rendered: list[int]) -> int:
        """Where the last assistant turn's own tokens end in ``rendered`` (the conversation
        without a generation prompt): after its last eos where the template writes one (what
        the model generated ends there; what follows, such as ChatML's newline, is the
        template's), else at the end."""
        eos = self.tok.eos_id
        return max((i + 1 for i, x in enumerate(rendered) if x == eos), default=len(rendered))

    def _finish(self, t: Trajectory, end: str, open_: set, error: str | None = None) -> None:
        t.end, t.error = end, error
        open_.discard(t.key)
        if end != "failed":
            self.pool.close(t.key)


def lay_out(prompts: list[list[int]], tokens: list[list[int]], generated: list[list[bool]],
            logprobs: list[list[float]], pad_id: int):
    """Samples as rollout tensors: each prompt left-padded to the longest, its tokens after it
    padded on the right (invalid); ``action`` 1 where the target is a generated token, the
    engine's log-probability there. Returns (ids, valid, action, engine_logp, prompt_len)."""
    P, R, B = max(map(len, prompts)), max(max(map(len, tokens)), 1), len(prompts)
    ids = torch.full((B, P + R), pad_id, dtype=torch.long)  # host: a rollout
    valid = torch.zeros(B, P + R, dtype=torch.bool)  # host: (as ids)
    action = torch.zeros(B, P + R - 1)  # host: (as ids)
    logp = torch.zeros(B, P + R - 1)  # host: (as ids)
    for i, (prompt, toks) in enumerate(zip(prompts, tokens)):
        n = len(toks)
        ids[i, P - len(prompt):P] = torch.tensor(prompt)  # host: (as ids)
        valid[i, P - len(prompt):P + n] = True
        if n:
            ids[i, P:P + n] = torch.tensor(toks)  # host: (as ids)
            action[i, P - 1:P - 1 + n] = torch.tensor(generated[i],  # host: (as ids)
                                                      dtype=torch.float)
            logp[i, P - 1:P - 1 + n] = torch.tensor(logprobs[i])  # host: (as ids)
    return ids, valid, action, logp * action, P


def rollout_of(trajs: list[Trajectory], tok, failure_score: float) -> Rollout:
    """The trajectories as a rollout (``lay_out``: ``action`` on the generated tokens only),
    each trajectory's reward (``failure_score`` for a failed one) in ``env_reward`` and the
    loop's figures in ``agent``."""
    ids, valid, action, logp, P = lay_out([t.prompt_ids for t in trajs],
                                          [t.tokens for t in trajs],
                                          [t.generated for t in trajs],
                                          [t.logprobs for t in trajs], tok.eos_id)
    reward = torch.tensor([failure_score if t.end == "failed" else t.reward  # host: (as ids)
                           for t in trajs], dtype=torch.float)
    ends: dict[str, int] = {}
    for t in trajs:
        ends[t.end] = ends.get(t.end, 0) + 1
    agent = {"turns": sum(t.turns for t in trajs), "tool_turns": sum(t.tool_turns for t in trajs),
             "trajectories": len(trajs), "ends": ends,
             "env_failures": [t.error for t in trajs if t.error],
             "env_seconds": sum(t.env_seconds for t in trajs)}
    return Rollout(ids, valid, action, [t.prompt for t in trajs],
                   [tok.decode(t.tokens) for t in trajs], prompt_len=P,
                   engine_logp=logp, env_reward=reward, agent=agent)
