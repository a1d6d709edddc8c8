"""Agent mode: an OpenAI-compatible endpoint that records what an agent program does, so that an
existing agent (one that knows only a ``base_url``) trains the model unchanged.

Each episode gets a base URL of its own, ``{server.url}/sessions/{session}/v1``; the program
uses it as any OpenAI endpoint (``POST .../chat/completions``, streaming aside, tools included:
its calls come back parsed into ``tool_calls``, as the server returns them). Every completion is
answered by the model being trained, through troupe's engine, and recorded: the prompt's tokens
as the chat template rendered them, the tokens sampled and their log-probabilities. When the
episode is over, its reward is given (``reward(session, value, group)`` or ``POST
/sessions/{session}/reward`` with ``{"reward": ..., "group": ...}``); ``rollout()`` then lays
every recorded completion of the rewarded sessions out as a training sample: its prompt, its
sampled tokens as the only actions, the session's reward, and the group (sessions with the same
group, e.g. attempts at one task, are one group for GRPO-style estimators). The program's own
rendering of its history never enters the loss: only the tokens the model sampled do.

Requests need ``Authorization: Bearer <key>`` when the server has a key. Bad requests get the
server's 400s (troupe.serving.protocol), naming the field; an unknown session's reward is 404.
The HTTP side is the standard library's threading server (one thread per request), the engine
one thread of its own; nothing is pickled.
"""

from __future__ import annotations

import json
import queue
import threading
from dataclasses import dataclass, field, replace
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import torch

from troupe.generation import ContinuousBatcher
from troupe.generation.prefix_cache import PrefixCache
from troupe.rlhf.agents.loop import lay_out
from troupe.rlhf.data.experience import Rollout
from troupe.serving.auth import KeyDigest, authorize
from troupe.serving.config import Limits
from troupe.serving.endpoints import Chat
from troupe.serving.protocol import ChatRequest, RequestError, parse
from troupe.serving.responses import Choice


_CHAT = Chat()


@dataclass
class Call:
    """One recorded completion."""

    session: str
    prompt_ids: list[int]
    tokens: list[int]
    logprobs: list[float]
    messages: list = field(default_factory=list)


class RecordingServer:
    """See the module's docstring. ``model``: the GPT to answer with (its weights as they are
    at each call: train it between episodes, then ``weights_updated``); ``name``: the model name
    requests use."""

    def __init__(self, model, tok, name: str = "policy", host: str = "127.0.0.1",
                 port: int = 0, max_batch: int = 8, api_key: str | None = None,
                 limits: Limits | None = None):
        self.tok, self.name = tok, name
        self.key = KeyDigest.of(api_key) if api_key else None
        self.limits = limits or Limits()
        self.engine = ContinuousBatcher(model, tok.eos_id, max_batch, tokenizer=tok.hf,
                                        prefix_cache=PrefixCache(64 << 20), keep_outputs=True)
        self.calls: list[Call] = []
        self.version = 0  # of the weights (weights_updated)
        self.rewards: dict[str, tuple[float, str]] = {}
        self._waiting: dict[str, queue.Queue] = {}
        self._lock, self._work, self._closed = threading.Lock(), threading.Event(), False
        self._engine = threading.Thread(target=self._run_engine, daemon=True,
                                        name="agent-server-engine")
        self._engine.start()
        server = self
        self.http = ThreadingHTTPServer((host, port), type("Handler", (_Handler,),
                                                           {"server_": server}))
        self._http = threading.Thread(target=self.http.serve_forever, daemon=True,
                                      name="agent-server-http")
        self._http.start()

    @property
    def url(self) -> str:
        host, port = self.http.server_address[:2]
        return f"http://{host}:{port}"

    def base_url(self, session: str) -> str:
        """What an episode's agent program takes as its OpenAI base_url."""
        return f"{self.url}/sessions/{session}/v1"

    # ---- the engine -------------------------------------------------------------------------
    def _run_engine(self) -> None:
        while not self._closed:
            if not self.engine.has_work():
                self._work.wait(0.05)
                self._work.clear()
                continue
            for ev in self.engine.step():
                with self._lock:
                    q = self._waiting.get(ev.seq_id)
                if q is not None:
                    q.put(ev)

    def complete(self, session: str, body: bytes) -> dict:
        """Answer a chat completion request of ``session`` and record it."""
        req = parse(ChatRequest, body)
        if req.stream or req.n != 1:
            raise RequestError(400, "stream and n > 1: agent mode answers one choice at a time, "
                               "not streamed", "stream" if req.stream else "n")
        if req.model != self.name:
            raise RequestError(404, f"model {req.model!r} is not served here; this endpoint "
                               f"serves {self.name!r}", "model", "model_not_found")
        specs = req.tool_specs()
        try:
            ids = self.tok.chat(req.conversation(), specs)
        except Exception as e:  # the chat template refused the conversation
            raise RequestError(400, f"messages: {e}", "messages") from None
        room = self.engine.cfg.seq_len - len(ids)
        if room < 1:
            raise RequestError(400, f"messages: {len(ids)} tokens fill the model's context of "
                               f"{self.engine.cfg.seq_len} tokens", "messages")
        params = req.sampling(room, self.limits)
        params = replace(params, max_tokens=min(params.max_tokens, room),
                         logprobs=params.logprobs or 0)  # the engine's log-probs: recorded
        seq_id = _CHAT.new_id()
        q: queue.Queue = queue.Queue()
        with self._lock:
            self._waiting[seq_id] = q
        try:
            self.engine.add(seq_id, ids, params)
            self._work.set()
            tokens, logprobs, text, finish = [], [], "", None
            while finish is None:
                ev = q.get(timeout=600)
                if ev.error is not None:
                    raise RequestError(500, f"generation failed: {ev.error}", type="server_error")
                tokens.append(ev.token)
                logprobs.append(ev.sampled_logprob if ev.sampled_logprob is not None
                                else ev.logprob)
                text, finish = text + ev.delta, ev.finish_reason
        finally:
            with self._lock:
                self._waiting.pop(seq_id, None)
        choice = Choice(text=text, finish=finish, tokens=len(tokens))
        _CHAT.finish(req, [choice])  # the model's <tool_call> blocks become tool_calls
        with self._lock:
            self.calls.append(Call(session, ids, tokens, logprobs, req.conversation()))
        return _CHAT.answer(seq_id, self.name, [choice], len(ids)).body()

    def weights_updated(self) -> None:
        """The model was trained: decode from its new weights (the packed copy refreshed) and
        never reuse keys and values computed under the old ones. Call between episodes."""
        self.engine.weights_changed()
        self.version += 1
        self.engine.cache_namespace = f"version {self.version}"

    # ---- rewards and training samples -------------------------------------------------------
    def reward(self, session: str, value: float, group: str | None = None) -> None:
        """The episode ``session`` is over and scored ``value``; ``group``: the sessions its
        reward is compared with (default: its own)."""
        with self._lock:
            if not any(c.session == session for c in self.calls):
                raise KeyError(session)
            self.rewards[session] = (float(value), group or session)

    def rollout(self) -> Rollout:
        """The rewarded sessions' completions as training samples (and forget them): each
        completion a row, its sampled tokens the actions, its session's reward in
        ``env_reward``, its group in ``groups`` (numbered in order of first appearance)."""
        with self._lock:
            calls = [c for c in self.calls if c.session in self.rewards]
            rewards = dict(self.rewards)
            self.calls = [c for c in self.calls if c.session not in rewards]
            self.rewards = {}
        if not calls:
            raise ValueError("no rewarded session has a recorded completion")
        ids, valid, action, logp, P = lay_out([c.prompt_ids for c in calls],
                                              [c.tokens for c in calls],
                                              [[True] * len(c.tokens) for c in calls],
                                              [c.logprobs for c in calls], self.tok.eos_id)
        names: dict[str, int] = {}
        groups = [names.setdefault(rewards[c.session][1], len(names)) for c in calls]
        return Rollout(ids, valid, action, [c.messages for c in calls],
                       [self.tok.decode(c.tokens) for c in calls], prompt_len=P,
                       groups=groups, engine_logp=logp,
                       env_reward=torch.tensor(  # host: a rollout
                           [rewards[c.session][0] for c in calls]),
                       agent={"turns": len(calls), "tool_turns": 0,
                              "trajectories": len(rewards),
                              "ends": {"recorded": len(rewards)}, "env_failures": [],
                              "env_seconds": 0.0})

    def close(self) -> None:
        self._closed = True
        self._work.set()
        self.http.shutdown()
        self.http.server_close()
        self._engine.join(timeout=10)

    def __enter__(self) -> "RecordingServer":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class _Handler(BaseHTTPRequestHandler):
    server_: RecordingServer
    protocol_version = "HTTP/1.1"

    def log_message(self, *args) -> None:  # quiet: the records are the log
        pass

    def do_POST(self) -> None:
        s = self.server_
        try:
            authorize(self.headers.get("Authorization"), s.key)
            parts = self.path.rstrip("/").split("/")  # "", sessions, id, v1, chat, completions
            length = int(self.headers.get("Content-Length") or 0)
            if length > s.limits.max_body_bytes:
                raise RequestError(413, f"the body is {length} bytes; at most "
                                   f"{s.limits.max_body_bytes}")
            body = self.rfile.read(length)
            if len(parts) == 6 and parts[1] == "sessions" and parts[3:] == ["v1", "chat",
                                                                          "completions"]:
                self._reply(200, s.complete(parts[2], body))
            elif len(parts) == 4 and parts[1] == "sessions" and parts[3] == "reward":
                try:
                    got = json.loads(body)
                    value, group = float(got["reward"]), got.get("group")
                    if group is not None and not isinstance(group, str):
                        raise TypeError("group must be a string")
                except (ValueError, TypeError, KeyError, AttributeError) as e:
                    raise RequestError(400, 'reward: the body must be {"reward": number, '
                                       f'"group": optional string}} ({e!r})', "reward") from None
                try:
                    s.reward(parts[2], value, group)
                except KeyError:
                    raise RequestError(404, f"session {parts[2]!r} has no recorded completion",
                                       "session") from None
                self._reply(200, {"session": parts[2], "recorded": True})
            else:
                raise RequestError(404, f"no route {self.path}; this endpoint has "
                                   "/sessions/<id>/v1/chat/completions and /sessions/<id>/reward")
        except RequestError as e:
            self._reply(e.status, e.body())
        except Exception as e:  # a bug of ours: the client gets a 500 saying what, not a hang
            self._reply(500, RequestError(500, f"{type(e).__name__}: {e}",
                                          type="server_error").body())

    def _reply(self, status: int, body: dict) -> None:
        data = json.dumps(body).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

