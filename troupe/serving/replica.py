"""ServeReplica: one replica of the OpenAI-compatible server. It holds the quantized model and
its continuous batcher and answers /v1/completions, /v1/chat/completions (both streaming too),
/v1/models and /health. Ray Serve hosts it as a deployment (troupe.serving.deploy); every request
it refuses gets a 4xx with an OpenAI-style error body, and the replica goes on serving.

ServeRank: one expert-parallel rank of a served MoE model (the replica's experts spread over
several actors; troupe.serving.deploy wires them)."""

from __future__ import annotations

import asyncio
import json
import os
import time
import weakref
from dataclasses import dataclass, replace
from typing import Any, AsyncIterator

import torch

from troupe.actors import Dispatch, dispatch
from troupe.config import validate
from troupe.generation import ContinuousBatcher, Event, SamplingParams
from troupe.parallel import apply_expert_parallel
from troupe.runtime.topology import Group, Topology
from troupe.serving.auth import KeyDigest
from troupe.serving.metrics import ServerMetrics
from troupe.serving.model import (calibrate, load_served_model, load_source, placed,
                                  quantize_served, source_tokenizer, weight_bytes)
from troupe.serving.protocol import (
    ChatRequest,
    Choice,
    CompletionRequest,
    RequestError,
    ServeConfig,
    chunk,
    completion,
    completion_id,
    models,
    parse,
    usage_chunk,
)
from troupe.serving.runner import AsyncBatcher, SequenceFailed

COMPLETIONS, CHAT = "/v1/completions", "/v1/chat/completions"


class ServeReplica:
    """Built as ``ServeReplica(config, key_digest)`` with a ServeConfig as a dict and the API
    key's salted digest (troupe.serving.auth; None: the key, if any, is read from the
    replica's own environment, ``api_key_env``)."""

    def __init__(self, config: dict[str, Any], key_digest: dict[str, str] | None = None):
        self.cfg = validate(ServeConfig, config, "serve config")
        torch.set_num_threads(self.cfg.threads)
        self.tok = source_tokenizer(self.cfg.model)
        self.batcher, self.details = self._make_batcher()
        self.seq_len = self.details["seq_len"]
        self.engine = AsyncBatcher(self.batcher)
        key = os.environ.get(self.cfg.api_key_env)
        self.key = (KeyDigest(**key_digest) if key_digest is not None
                    else KeyDigest.of(key) if key else None)
        self.created = int(time.time())
        self.in_flight = 0
        self.receiving = 0  # requests whose bodies are still arriving
        self.metrics = ServerMetrics()

    def _make_batcher(self) -> tuple[Any, dict[str, Any]]:
        """The batcher this replica decodes with, and what /health reports of its model."""
        model, modes = load_served_model(self.cfg, self.tok)
        batcher = ContinuousBatcher(model, self.tok.eos_id, self.cfg.limits.max_batch,
                                    tokenizer=self.tok.hf)
        return batcher, {"seq_len": model.cfg.seq_len, "weight_bytes": weight_bytes(model),
                         "quantized": modes, "expert_parallel": 1,
                         "device": str(model.tok_emb.weight.device)}

    def _metrics(self):
        from starlette.responses import PlainTextResponse

        waiting = getattr(self.batcher, "waiting", lambda: 0)()
        used, capacity = getattr(self.batcher, "kv_usage", lambda: (0, 0))()
        return PlainTextResponse(self.metrics.render(self.in_flight, waiting, used, capacity),
                                 media_type="text/plain; version=0.0.4")

    def info(self) -> dict[str, Any]:
        return {"model": self.cfg.model.name, **self.details, "in_flight": self.in_flight,
                "decode_steps": self.engine.steps}

    async def __call__(self, request):
        from starlette.responses import JSONResponse

        try:
            path = request.url.path.rstrip("/") or "/"
            if path == "/health":  # unauthenticated: for load balancers and Serve's probes
                self._method(request, "GET")
                return JSONResponse({"status": "ok", **self.info()})
            if path != "/metrics" or not self.cfg.metrics_open:
                self._authorize(request.headers.get("authorization"))
            if path == "/metrics":
                self._method(request, "GET")
                return self._metrics()
            if path == "/v1/models":
                self._method(request, "GET")
                return JSONResponse(models(self.cfg.model.name, self.created))
            if path in (COMPLETIONS, CHAT):
                self._method(request, "POST")
                return await self._complete(request, chat=path == CHAT)
            raise RequestError(404, f"no route {path}; this server has /v1/completions, "
                               "/v1/chat/completions, /v1/models, /health and /metrics")
        except RequestError as e:
            headers = ({"WWW-Authenticate": "Bearer"} if e.status == 401 else
                       {"Retry-After": "1"} if e.status == 429 else None)
            return JSONResponse(e.body(), status_code=e.status, headers=headers)

    # ---- checks -----------------------------------------------------------------------------
    def _authorize(self, header: str | None) -> None:
        if self.key is None:
            return
        scheme, _, token = (header or "").partition(" ")
        if scheme.lower() != "bearer" or not self.key.matches(token.strip()):
            raise RequestError(401, "missing or wrong API key: send 'Authorization: Bearer "
                               "<key>'", type="authentication_error")

    @staticmethod
    def _method(request, allowed: str) -> None:
        if request.method != allowed:
            raise RequestError(405, f"{request.url.path} takes {allowed}, not {request.method}")

    async def _receive(self, request) -> bytes:
        """The body, within ``limits.body_timeout_s`` (408), while at most
        ``limits.max_receiving`` requests are still sending theirs (429)."""
        lim = self.cfg.limits
        if self.receiving >= lim.max_receiving:
            raise RequestError(429, f"{self.receiving} requests are still sending their bodies, "
                               "the limit of this replica; retry later", type="rate_limit_error")
        self.receiving += 1
        try:
            return await asyncio.wait_for(self._body(request), lim.body_timeout_s)
        except asyncio.TimeoutError:
            raise RequestError(408, f"the request body did not arrive within "
                               f"{lim.body_timeout_s:g}s") from None
        finally:
            self.receiving -= 1

    async def _body(self, request) -> bytes:
        limit = self.cfg.limits.max_body_bytes
        declared = request.headers.get("content-length")
        if declared is not None and declared.isdigit() and int(declared) > limit:
            raise RequestError(413, f"request body of {declared} bytes exceeds the limit of "
                               f"{limit} bytes")
        body = bytearray()
        async for part in request.stream():
            body += part
            if len(body) > limit:
                raise RequestError(413, f"request body exceeds the limit of {limit} bytes")
        return bytes(body)

    def _prompt(self, req, chat: bool) -> tuple[list[int], SamplingParams]:
        lim = self.cfg.limits
        if req.model != self.cfg.model.name:
            raise RequestError(404, f"model {req.model!r} is not served here; GET /v1/models "
                               f"lists {self.cfg.model.name!r}", "model", "model_not_found")
        field = "messages" if chat else "prompt"
        try:
            ids = self.tok.chat(req.conversation()) if chat else self.tok.encode(req.prompt)
        except Exception as e:  # the model's chat template refused the conversation
            raise RequestError(400, f"{field}: {e}", field) from None
        if not ids:
            raise RequestError(400, f"{field}: the prompt is empty", field)
        if len(ids) > lim.max_prompt_tokens:
            raise RequestError(400, f"{field}: {len(ids)} tokens; this server accepts at most "
                               f"{lim.max_prompt_tokens}", field)
        context = self.seq_len
        if len(ids) >= context:
            raise RequestError(400, f"{field}: {len(ids)} tokens fill the model's context of "
                               f"{context} tokens", field)
        # a chat answer runs to the end of the context (or the limit), as OpenAI's does
        params = req.sampling(context - len(ids) if chat else 16, lim)
        if len(ids) + params.max_tokens > context:
            raise RequestError(400, f"{field} ({len(ids)} tokens) plus max_tokens "
                               f"({params.max_tokens}) exceed the model's context of {context} "
                               "tokens", "max_tokens")
        return ids, params

    # ---- completions ------------------------------------------------------------------------
    def _refuse_if_full(self) -> None:
        if self.in_flight >= self.cfg.limits.max_concurrent:
            raise RequestError(429, f"{self.in_flight} requests in flight, the limit of this "
                               "replica; retry later", type="rate_limit_error")

    def _admit(self) -> "_Slot":
        """A slot among ``limits.max_concurrent``, or 429. The check and the count happen with
        no await between them: requests whose bodies arrived together cannot all pass the
        check before any of them is counted (they did: 150 in flight against a limit of 32)."""
        self._refuse_if_full()
        return _Slot(self)

    async def _complete(self, request, chat: bool):
        self._refuse_if_full()  # full already: refused before any reading or parsing
        req = parse(ChatRequest if chat else CompletionRequest, await self._receive(request))
        ids, params = self._prompt(req, chat)
        slot = self._admit()  # a body still arriving holds no slot (max_receiving bounds those)
        try:
            return await self._answer(req, chat, ids, params, slot)
        finally:
            slot.release()  # idempotent: a stream gives its own back when it ends

    async def _answer(self, req, chat: bool, ids: list[int], params: SamplingParams,
                      slot: "_Slot"):
        """Answer an admitted request (JSON, or a stream that holds ``slot`` until it ends)."""
        from starlette.responses import JSONResponse, StreamingResponse

        rid = completion_id(chat)
        self.metrics.prompt_tokens += len(ids)
        route, start = CHAT if chat else COMPLETIONS, time.monotonic()
        # n choices: sequences of their own (the engine prefills the shared prompt once),
        # choice i seeded with seed + i, so that it equals a single request with that seed
        samples = [(f"{rid}-{i}", replace(params, seed=None if params.seed is None
                                          else params.seed + i)) for i in range(req.n)]
        if req.stream:  # the stream holds the slot until its last event (see _stream)
            body = self._stream(rid, ids, samples, chat, req.include_usage(), start, slot)
            weakref.finalize(body, slot.release, True)  # a stream dropped before it started
            slot.handed_over = True
            return StreamingResponse(body, media_type="text/event-stream")
        tasks = [asyncio.ensure_future(self._collect(sid, ids, p, start)) for sid, p in samples]
        try:
            choices = await asyncio.gather(*tasks)
        except SequenceFailed as e:
            self.metrics.finished(route, "error")
            raise RequestError(500, f"generation failed for this request: {e}",
                               type="server_error") from None
        finally:
            for t in tasks:
                t.cancel()  # the other choices' sequences, when one failed
        self.metrics.finished(route, "ok")
        return JSONResponse(completion(rid, self.cfg.model.name, choices, len(ids), chat))

    async def _timed(self, seq_id: str, ids: list[int], params: SamplingParams,
                     start: float) -> AsyncIterator[Event]:
        """The sequence's events, counted into the metrics (tokens, time to the first, time
        between them)."""
        last = None
        async for ev in self.engine.generate(seq_id, ids, params):
            now = time.monotonic()
            if last is None:
                self.metrics.ttft.observe(now - start)
            else:
                self.metrics.tpot.observe(now - last)
            last = now
            self.metrics.generated_tokens += 1
            yield ev

    async def _collect(self, seq_id: str, ids: list[int], params: SamplingParams,
                       start: float) -> Choice:
        c = Choice(logprobs=[] if params.logprobs is not None else None)
        async for ev in self._timed(seq_id, ids, params, start):
            c.text, c.finish, c.tokens = c.text + ev.delta, ev.finish_reason, c.tokens + 1
            if c.logprobs is not None and self._reported(ev):
                c.logprobs.append(self._logprob(ev))
        return c

    def _reported(self, ev: Event) -> bool:
        """A token whose log-probability is reported: not the end-of-text that stopped it."""
        return ev.logprob is not None and not (ev.finish_reason == "stop"
                                               and ev.token == self.tok.eos_id)

    def _logprob(self, ev: Event) -> tuple[str, float, list[tuple[str, float]]]:
        text = self.tok.decode([ev.token])
        return text, ev.logprob, [(self.tok.decode([t]), lp) for t, lp in ev.top_logprobs or []]

    async def _stream(self, rid: str, ids: list[int], samples: list[tuple[str, SamplingParams]],
                      chat: bool, include_usage: bool, start: float,
                      slot: "_Slot") -> AsyncIterator[str]:
        """Server-sent events, the choices' chunks as they come (each names its index); a
        failed sequence ends the stream with an error event; with include_usage a last chunk
        carries the usage. It holds the request's slot and gives it back at its end (one that
        never starts, the client gone first, gives it back when it is dropped)."""
        name = self.cfg.model.name
        queue: asyncio.Queue = asyncio.Queue()

        async def pump(index: int, seq_id: str, params: SamplingParams) -> None:
            try:
                async for ev in self._timed(seq_id, ids, params, start):
                    await queue.put((index, ev))
            except SequenceFailed as e:
                await queue.put((index, e))
            finally:
                await queue.put((index, None))

        tasks = [asyncio.ensure_future(pump(i, sid, p)) for i, (sid, p) in enumerate(samples)]
        generated, offsets, open_ = 0, [0] * len(samples), len(samples)
        try:
            if chat:
                for i in range(len(samples)):
                    yield _sse(chunk(rid, name, "", None, chat, first=True, index=i))
            while open_:
                index, ev = await queue.get()
                if ev is None:
                    open_ -= 1
                    continue
                if isinstance(ev, SequenceFailed):
                    self.metrics.finished(CHAT if chat else COMPLETIONS, "error")
                    yield _sse(RequestError(500, f"generation failed for this request: {ev}",
                                            type="server_error").body())
                    break
                generated += 1
                lp = [self._logprob(ev)] if self._reported(ev) else None
                if ev.delta or ev.finish_reason or lp:
                    yield _sse(chunk(rid, name, ev.delta, ev.finish_reason, chat, index=index,
                                     logprobs=lp if ev.logprob is not None else None,
                                     offset=offsets[index]))
                    offsets[index] += len(ev.delta)
            else:
                self.metrics.finished(CHAT if chat else COMPLETIONS, "ok")
                if include_usage:
                    yield _sse(usage_chunk(rid, name, chat, len(ids), generated))
        finally:
            for t in tasks:
                t.cancel()
            slot.release(final=True)
        yield "data: [DONE]\n\n"


class _Slot:
    """A request's place among ``limits.max_concurrent``, held from admission (before its body
    is read) until its answer is done. ``release`` is idempotent; once a stream has taken the
    slot over (``handed_over``), only the stream's own release (``final``) or the stream
    being dropped gives it back."""

    def __init__(self, replica: "ServeReplica"):
        self._replica, self._held, self.handed_over = replica, True, False
        replica.in_flight += 1

    def release(self, final: bool = False) -> None:
        if self._held and (final or not self.handed_over):
            self._held = False
            self._replica.in_flight -= 1


def _sse(obj: dict[str, Any]) -> str:
    return f"data: {json.dumps(obj)}\n\n"


@dataclass(frozen=True)
class RankModel:
    """What an expert-parallel rank holds once set up."""

    seq_len: int
    weight_bytes: int
    quantized: dict[str, str]  # module name -> quantization mode


@dataclass(frozen=True)
class ServingTopology(Topology):
    """An expert-parallel replica's one group: "ep" over its ranks (NCCL between GPU ranks,
    else gloo)."""

    ep: Group = Group("ep", ("expert",))


class ServeRank:
    """Expert-parallel rank r of a served MoE model: every dense weight (quantized as the
    config says), experts r*n .. (r+1)*n - 1 of each MoE layer, and a continuous batcher over
    the sequences given to this rank. All ranks step together (lockstep), since each forward
    pass exchanges tokens with the other ranks' experts through all_to_all over the topology's
    "ep" group."""

    def __init__(self, config: dict[str, Any]):
        self.cfg = validate(ServeConfig, config, "serve config")
        torch.set_num_threads(self.cfg.threads)
        self.batcher: ContinuousBatcher | None = None

    @dispatch(Dispatch.ALL)
    def setup(self, topology: ServingTopology) -> RankModel:
        tok = source_tokenizer(self.cfg.model)
        model = placed(load_source(self.cfg.model), self.cfg)
        outliers = calibrate(model, self.cfg, tok)  # on the whole model: the same on every rank
        model = apply_expert_parallel(model, topology.ep.communicator())
        modes = quantize_served(model, self.cfg, outliers)
        self.batcher = ContinuousBatcher(model, tok.eos_id, self.cfg.limits.max_batch,
                                         lockstep=True, tokenizer=tok.hf)
        return RankModel(model.cfg.seq_len, weight_bytes(model), modes)

    @dispatch(Dispatch.ALL)
    def step(self, work: tuple[list, list]) -> list[Event]:
        """Take new sequences (seq_id, prompt, SamplingParams) and cancellations, then one
        lockstep step; returns its events (give each rank its own work with PerRank)."""
        adds, cancels = work
        for seq_id, prompt, params in adds:
            self.batcher.add(seq_id, prompt, params)
        for seq_id in cancels:
            self.batcher.cancel(seq_id)
        return self.batcher.step()
