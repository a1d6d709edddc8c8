"""ServeReplica: one replica of the OpenAI-compatible server. It holds the quantized model and
its continuous batcher and answers /v1/completions and /v1/chat/completions (both streaming
too; troupe.serving.endpoints says how the two differ), /v1/models, /tokenize, /detokenize,
/v1/load_lora_adapter, /metrics and /health. Ray Serve hosts it as a deployment
(troupe.serving.deploy); every request it refuses gets a 4xx with an OpenAI-style error body,
and the replica goes on serving. An expert-parallel replica is a subclass whose model lives in
other actors (troupe.serving.ranks)."""

from __future__ import annotations

import asyncio
import json
import os
import threading
import time
import weakref
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from typing import Any, AsyncIterator

import torch

from troupe.config import validate
from troupe.generation import ContinuousBatcher, Event, SamplingParams
from troupe.generation.draft import DraftModel
from troupe.generation.grammar import Constraint, GrammarError, Grammars
from troupe.generation.prefix_cache import PrefixCache
from troupe.generation.sampling import check_tokens
from troupe.kernels.small_gemm import DecodeWeights
from troupe.models.adapters import Adapters, load_peft
from troupe.serving.admission import Admission, Place, lower_priority
from troupe.serving.auth import KeyDigest, authorize
from troupe.serving.config import ServeConfig
from troupe.serving.endpoints import ENDPOINTS, Endpoint, StreamedChoices, sse
from troupe.serving.metrics import ServerMetrics
from troupe.serving.model import load_draft, load_served_model, source_tokenizer, weight_bytes
from troupe.serving.prompts import Prompts
from troupe.serving.protocol import (ChatRequest, DetokenizeRequest, RequestError,
                                     TokenizeRequest, named_field, parse)
from troupe.serving.responses import Choice, ModelList, TokenLogprobItem
from troupe.serving.runner import AsyncBatcher, Batcher, SequenceFailed


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
        self.prompts = Prompts(self.tok, self.cfg.limits, self.seq_len,
                               self.details["vocab_size"])
        self.engine = AsyncBatcher(self.batcher)
        key = os.environ.get(self.cfg.api_key_env)
        self.key = (KeyDigest(**key_digest) if key_digest is not None
                    else KeyDigest.of(key) if key else None)
        self.created = int(time.time())
        self.admission = Admission(self.cfg.limits)
        # JSON, chat template and tokenizer run here, not on the event loop (admission's gate
        # 2): one thread at a lower CPU priority, so that huge prompts take what the decode
        # loop, the event loop and the proxy leave, and queue behind each other
        self._prepare_pool = ThreadPoolExecutor(1, thread_name_prefix="prepare",
                                                initializer=lower_priority)
        self._grammars_lock = threading.Lock()
        self.metrics = ServerMetrics()

    def _make_batcher(self) -> tuple[Batcher, dict[str, Any]]:
        """The batcher this replica decodes with, and what /health reports of its model."""
        model, modes = load_served_model(self.cfg, self.tok)
        mb, limits = self.cfg.prefix_cache_mb, self.cfg.limits
        draft = load_draft(self.cfg, model)
        draft = None if draft is None else DraftModel(draft, limits.max_batch)
        adapters = Adapters(model)
        for name, path in self.cfg.adapters.items():
            adapters.add(load_peft(path, model, name))
        batcher = ContinuousBatcher(model, self.tok.eos_id, self.cfg.limits.max_batch,
                                    tokenizer=self.tok.hf,
                                    packed_decode=DecodeWeights(model, huge_pages=True),
                                    prefix_cache=PrefixCache(int(mb * 2**20)) if mb else None,
                                    adapters=adapters,
                                    static=self.cfg.decode_graphs and model.device.type == "cuda",
                                    compile="reduce-overhead",
                                    static_len=limits.max_prompt_tokens + limits.max_tokens,
                                    speculate=self.cfg.speculate, draft=draft)
        return batcher, {"seq_len": model.cfg.seq_len, "vocab_size": model.cfg.vocab_size,
                         "weight_bytes": weight_bytes(model),
                         "quantized": modes, "expert_parallel": 1, "tensor_parallel": 1,
                         "device": str(model.device)}

    def _metrics(self):
        from starlette.responses import PlainTextResponse

        b = self.batcher
        used, capacity = b.kv_usage()
        cache = b.prefix_cache
        prefix = ((cache.lookup_tokens, cache.hit_tokens, b.prefill_tokens)
                  if cache is not None else (0, 0, b.prefill_tokens))
        return PlainTextResponse(self.metrics.render(self.admission.in_flight, b.waiting(), used,
                                                     capacity, prefix, b.speculation),
                                 media_type="text/plain; version=0.0.4")

    def info(self) -> dict[str, Any]:
        return {"model": self.cfg.model.name, **self.details,
                "in_flight": self.admission.in_flight, "queued": self.admission.queued,
                "decode_steps": self.engine.steps}

    # ---- health -------------------------------------------------------------------------------
    def broken(self) -> str | None:
        """Why this replica can serve no more (Serve replaces it), or None. A replica whose
        model lives in other actors (ExpertParallelReplica) breaks when one of them dies."""
        return None

    async def probe(self) -> None:
        """Look for what would break this replica (its own actors' deaths)."""

    async def check_health(self) -> None:
        """Ray Serve's periodic health check: raising makes Serve replace this replica."""
        await self.probe()
        reason = self.broken()
        if reason is not None:
            raise RuntimeError(reason)

    def refuse_if_broken(self) -> None:
        reason = self.broken()
        if reason is not None:
            raise self._out_of_service(reason)

    @staticmethod
    def _out_of_service(reason: str) -> RequestError:
        return RequestError(503, f"this replica is out of service and being replaced "
                            f"({reason}); retry shortly", type="server_error")

    def _failure(self, e: SequenceFailed) -> RequestError:
        """The error a failed generation answers: 503 when the replica broke, else 500."""
        reason = self.broken()
        if reason is not None:
            return self._out_of_service(reason)
        return RequestError(500, f"generation failed for this request: {e}",
                            type="server_error")

    async def __call__(self, request):
        from starlette.responses import JSONResponse

        try:
            path = request.url.path.rstrip("/") or "/"
            if path == "/health":  # unauthenticated: for load balancers and Serve's probes
                self._method(request, "GET")
                await self.probe()
                reason = self.broken()
                if reason is not None:
                    return JSONResponse({"status": "unhealthy", "reason": reason},
                                        status_code=503)
                return JSONResponse({"status": "ok", **self.info()})
            if path != "/metrics" or not self.cfg.metrics_open:
                authorize(request.headers.get("authorization"), self.key)
            if path == "/metrics":
                self._method(request, "GET")
                return self._metrics()
            if path == "/v1/models":
                self._method(request, "GET")
                return JSONResponse(ModelList.of(self.cfg.model.name, self.created,
                                                 self.adapter_names()).body())
            if path == "/v1/load_lora_adapter":
                self._method(request, "POST")
                return await self._load_adapter(request)
            if path in ENDPOINTS:
                self._method(request, "POST")
                return await self._complete(request, ENDPOINTS[path])
            if path in ("/tokenize", "/detokenize"):
                self._method(request, "POST")
                return await self._tokens(request, path == "/tokenize")
            raise RequestError(404, f"no route {path}; this server has /v1/completions, "
                               "/v1/chat/completions, /v1/models, /v1/load_lora_adapter, "
                               "/tokenize, /detokenize, /health and /metrics")
        except RequestError as e:
            headers = ({"WWW-Authenticate": "Bearer"} if e.status == 401 else
                       {"Retry-After": "1"} if e.status in (429, 503) else None)
            return JSONResponse(e.body(), status_code=e.status, headers=headers)

    # ---- checks -----------------------------------------------------------------------------
    @staticmethod
    def _method(request, allowed: str) -> None:
        if request.method != allowed:
            raise RequestError(405, f"{request.url.path} takes {allowed}, not {request.method}")

    def adapter_names(self) -> list[str]:
        adapters = self.batcher.adapters
        return list(adapters.slots) if adapters is not None else []

    async def _load_adapter(self, request):
        """POST /v1/load_lora_adapter {"lora_name", "lora_path"} (vLLM's route): a PEFT
        directory on this replica's machine, served from then on as model ``lora_name``.
        Loaded off the event loop and added between two decode steps."""
        from starlette.responses import JSONResponse

        body = await self.admission.body(request.receive)
        try:
            spec = json.loads(body)
            name, path = spec["lora_name"], spec["lora_path"]
        except (ValueError, KeyError, TypeError):
            raise RequestError(400, 'the body must be {"lora_name": ..., "lora_path": ...}')
        adapters = self.batcher.adapters
        if adapters is None:
            raise RequestError(400, "this server's engine (expert-parallel) takes no adapters")
        if not isinstance(name, str) or not name or name == self.cfg.model.name \
                or name in adapters.slots:
            raise RequestError(400, f"lora_name: {name!r} is taken or empty", "lora_name")
        loop = asyncio.get_running_loop()
        try:
            adapter = await loop.run_in_executor(self._prepare_pool, load_peft, path,
                                                 self.batcher.model, name)
        except (OSError, ValueError) as e:
            raise RequestError(400, f"lora_path: {e}", "lora_path") from None
        await self.engine.between_steps(adapters.add, adapter)
        return JSONResponse({"status": "ok", "lora_name": name})

    def _prompt(self, req, endpoint: Endpoint) -> tuple[list[list[int]], SamplingParams]:
        """The request's prompts as token ids (chat: one; completions: one or more) and its
        sampling parameters, each checked against the limits and the model."""
        adapter = self._served(req.model)
        prompts = endpoint.prompts(req, self.prompts)
        return prompts, self._params(req, endpoint, prompts, adapter)

    def _served(self, model: str) -> str | None:
        """The adapter a request's ``model`` names (None: the base model), or a 404."""
        if model == self.cfg.model.name:
            return None
        if model not in self.adapter_names():
            served = [self.cfg.model.name, *self.adapter_names()]
            raise RequestError(404, f"model {model!r} is not served here; GET /v1/models "
                               f"lists {served}", "model", "model_not_found")
        return model

    def _params(self, req, endpoint: Endpoint, prompts: list[list[int]],
                adapter: str | None) -> SamplingParams:
        """The request's sampling parameters for its prompts, checked against the model (its
        context, its vocabulary, the grammar library)."""
        context = self.seq_len
        params = replace(req.sampling(endpoint.default_max_tokens(context, prompts),
                                      self.cfg.limits), adapter=adapter)
        if params.constraint is not None:
            self._check_constraint(*req.constraint())
        try:
            check_tokens(params, self.details["vocab_size"])
        except ValueError as e:
            raise RequestError(400, str(e), named_field(str(e))) from None
        for i, ids in enumerate(prompts):
            if len(ids) + params.max_tokens > context:
                field = endpoint.prompt_field(i, len(prompts))
                raise RequestError(400, f"{field} ({len(ids)} tokens) plus max_tokens "
                                   f"({params.max_tokens}) exceed the model's context of "
                                   f"{context} tokens", "max_tokens")
        return params

    def _check_constraint(self, constraint: Constraint, field: str) -> None:
        """The request's constraint compiles for this model's tokenizer (compiled once and
        cached; the engine's grammar support is made at the first one), or a 400 naming the
        field and what the grammar library could not take."""
        if not self.batcher.structured_outputs:
            raise RequestError(400, f"{field}: this server's engine (expert-parallel) has no "
                               "structured outputs", field)
        with self._grammars_lock:
            if self.batcher.grammars is None:
                hf = getattr(self.tok, "hf", None)
                if hf is None:
                    raise RequestError(400, f"{field}: structured outputs need a Hugging Face "
                                       "tokenizer; this model reads bytes", field)
                self.batcher.grammars = Grammars(hf, self.details["vocab_size"],
                                                 self.tok.eos_id)
        try:
            self.batcher.grammars.check(constraint)
        except GrammarError as e:
            raise RequestError(400, f"{field}: {e}", field) from None

    async def _tokens(self, request, encode: bool):
        """POST /tokenize and /detokenize, run where requests are tokenized (off the event
        loop, behind the same body limits)."""
        from starlette.responses import JSONResponse

        self.refuse_if_broken()
        body = await self.admission.body(request.receive)
        out = await asyncio.get_running_loop().run_in_executor(
            self._prepare_pool, self._tokenize if encode else self._detokenize, body)
        return JSONResponse(out)

    def _tokenize(self, body: bytes) -> dict[str, Any]:
        req = parse(TokenizeRequest, body)
        self._served(req.model)
        ids = self.prompts.text(req.prompt, "prompt") if req.prompt is not None else \
            self.prompts.chat(ChatRequest(model=req.model, messages=req.messages,
                                          tools=req.tools,
                                          chat_template_kwargs=req.chat_template_kwargs),
                              req.add_generation_prompt)
        return {"count": len(ids), "max_model_len": self.seq_len, "tokens": ids}

    def _detokenize(self, body: bytes) -> dict[str, Any]:
        req = parse(DetokenizeRequest, body)
        self._served(req.model)
        self.prompts.check_vocabulary(req.tokens, "tokens")
        return {"prompt": self.tok.decode(req.tokens)}

    # ---- completions ------------------------------------------------------------------------
    async def _complete(self, request, endpoint: Endpoint):
        """Admission's three gates (troupe.serving.admission), then the answer."""
        self.refuse_if_broken()
        self.admission.refuse_if_full()  # full already: refused before any reading or parsing
        body = await self.admission.body(request.receive)
        req, prompts, params = await asyncio.get_running_loop().run_in_executor(
            self._prepare_pool, self._prepare, body, endpoint)
        place = await self.admission.place()
        try:
            return await self._answer(req, endpoint, prompts, params, place)
        finally:
            place.release()  # idempotent: a stream gives its own back when it ends

    def _prepare(self, body: bytes, endpoint: Endpoint):
        req = parse(endpoint.request, body)
        return (req, *self._prompt(req, endpoint))

    async def _answer(self, req, endpoint: Endpoint, prompts: list[list[int]],
                      params: SamplingParams, place: Place):
        """Answer an admitted request (JSON, or a stream that holds ``place`` until it
        ends)."""
        from starlette.responses import JSONResponse, StreamingResponse

        rid, start = endpoint.new_id(), time.monotonic()
        prompt_tokens = sum(map(len, prompts))
        self.metrics.prompt_tokens += prompt_tokens
        # each prompt's n choices: sequences of their own (the engine prefills a shared prompt
        # once), choice j seeded with seed + j, so that it equals a single request with that
        # seed; prompt i's choices at indices i * n + j
        samples = [(f"{rid}-{i * req.n + j}", ids,
                    replace(params, seed=None if params.seed is None else params.seed + j))
                   for i, ids in enumerate(prompts) for j in range(req.n)]
        if req.stream:  # the stream holds the place until its last event (see _stream)
            body = self._stream(req, endpoint, rid, samples, prompt_tokens, start, place)
            weakref.finalize(body, place.release, True)  # a stream dropped before it started
            place.handed_over = True
            return StreamingResponse(body, media_type="text/event-stream")
        tasks = [asyncio.ensure_future(self._collect(sid, ids, p, start, req.return_token_ids))
                 for sid, ids, p in samples]
        try:
            choices = await asyncio.gather(*tasks)
        except SequenceFailed as e:
            self.metrics.finished(endpoint.route, "error")
            raise self._failure(e) from None
        finally:
            for t in tasks:
                t.cancel()  # the other choices' sequences, when one failed
        self.metrics.finished(endpoint.route, "ok")
        endpoint.finish(req, choices)
        return JSONResponse(endpoint.answer(
            rid, self.cfg.model.name, choices, prompt_tokens,
            [ids for _, ids, _ in samples] if req.return_token_ids else None).body())

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
                       start: float, token_ids: bool = False) -> Choice:
        c = Choice(logprobs=[] if params.logprobs is not None else None,
                   token_ids=[] if token_ids else None)
        async for ev in self._timed(seq_id, ids, params, start):
            c.text, c.finish, c.tokens = c.text + ev.delta, ev.finish_reason, c.tokens + 1
            if token_ids:
                c.token_ids.append(ev.token)
            if c.logprobs is not None and self._reported(ev):
                c.logprobs.append(self._logprob(ev))
        return c

    def _reported(self, ev: Event) -> bool:
        """A token whose log-probability is reported: not the end-of-text that stopped it."""
        return ev.logprob is not None and not (ev.finish_reason == "stop"
                                               and ev.token == self.tok.eos_id)

    def _logprob(self, ev: Event) -> TokenLogprobItem:
        text = self.tok.decode([ev.token])
        return text, ev.logprob, [(self.tok.decode([t]), lp) for t, lp in ev.top_logprobs or []]

    async def _pump(self, queue: asyncio.Queue, index: int, seq_id: str, ids: list[int],
                    params: SamplingParams, start: float) -> None:
        """Choice ``index``'s events into ``queue`` (its failure, then None at its end)."""
        try:
            async for ev in self._timed(seq_id, ids, params, start):
                await queue.put((index, ev))
        except SequenceFailed as e:
            await queue.put((index, e))
        finally:
            await queue.put((index, None))

    async def _stream(self, req, endpoint: Endpoint, rid: str,
                      samples: list[tuple[str, list[int], SamplingParams]], prompt_tokens: int,
                      start: float, place: Place) -> AsyncIterator[str]:
        """Server-sent events, the choices' chunks as they come (each names its index;
        troupe.serving.endpoints.StreamedChoices makes them); a failed sequence ends the
        stream with an error event; with include_usage a last chunk carries the usage. It
        holds the request's place and gives it back at its end (one that never starts, the
        client gone first, gives it back when it is dropped)."""
        queue: asyncio.Queue = asyncio.Queue()
        tasks = [asyncio.ensure_future(self._pump(queue, i, *sample, start))
                 for i, sample in enumerate(samples)]
        name = self.cfg.model.name
        choices = StreamedChoices(endpoint, rid, name, [ids for _, ids, _ in samples],
                                  endpoint.parses_tools(req), req.return_token_ids)
        try:
            for body in filter(None, map(choices.opening, range(len(samples)))):
                yield sse(body.body())
            open_ = len(samples)
            while open_:
                index, ev = await queue.get()
                if ev is None:
                    open_ -= 1
                elif isinstance(ev, SequenceFailed):
                    self.metrics.finished(endpoint.route, "error")
                    yield sse(self._failure(ev).body())
                    break
                else:
                    logprob = self._logprob(ev) if self._reported(ev) else None
                    for body in choices.chunks(index, ev.token, ev.delta, ev.finish_reason,
                                               logprob):
                        yield sse(body.body())
            else:
                self.metrics.finished(endpoint.route, "ok")
                if req.include_usage():
                    yield sse(endpoint.usage_chunk(rid, name, prompt_tokens,
                                                   choices.generated).body())
        finally:
            for t in tasks:
                t.cancel()
            place.release(final=True)
        yield "data: [DONE]\n\n"
