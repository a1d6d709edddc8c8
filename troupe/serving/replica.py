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
import threading
import time
import weakref
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace
from typing import Any, AsyncIterator

import torch

from troupe.actors import Dispatch, dispatch
from troupe.config import validate
from troupe.data.tokenizer import TemplateKwargsError
from troupe.generation import ContinuousBatcher, Event, SamplingParams
from troupe.generation.sampling import check_tokens
from troupe.generation.grammar import Constraint, GrammarError, Grammars
from troupe.generation.prefix_cache import PrefixCache
from troupe.kernels.small_gemm import DecodeWeights
from troupe.models.adapters import Adapters, load_peft
from troupe.parallel import apply_expert_parallel
from troupe.runtime.topology import Group, Topology
from troupe.generation import tools
from troupe.serving.admission import Admission, Place
from troupe.serving.auth import KeyDigest
from troupe.serving.metrics import ServerMetrics
from troupe.serving.model import (calibrate, load_served_model, load_source, placed,
                                  quantize_served, source_tokenizer, weight_bytes)
from troupe.serving.protocol import (
    ChatRequest,
    Choice,
    CompletionRequest,
    DetokenizeRequest,
    RequestError,
    ServeConfig,
    TokenizeRequest,
    chunk,
    completion,
    completion_id,
    models,
    named_field,
    parse,
    usage_chunk,
)
from troupe.serving.runner import AsyncBatcher, SequenceFailed

COMPLETIONS, CHAT = "/v1/completions", "/v1/chat/completions"
# A prompt longer than this many characters per allowed token is refused before it is
# rendered or tokenized: it cannot fit (no vocabulary averages that many characters a token
# over a whole prompt), and rendering it would only spend the replica's time.
CHARS_PER_TOKEN = 32


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
        self.admission = Admission(self.cfg.limits)
        # JSON, chat template and tokenizer run here, not on the event loop (admission's gate
        # 2): one thread at a lower CPU priority, so that huge prompts take what the decode
        # loop, the event loop and the proxy leave, and queue behind each other
        self._prepare_pool = ThreadPoolExecutor(1, thread_name_prefix="prepare",
                                                initializer=_lower_priority)
        self._grammars_lock = threading.Lock()
        self.metrics = ServerMetrics()

    def _make_batcher(self) -> tuple[Any, dict[str, Any]]:
        """The batcher this replica decodes with, and what /health reports of its model."""
        model, modes = load_served_model(self.cfg, self.tok)
        mb = self.cfg.prefix_cache_mb
        adapters = Adapters(model)
        for name, path in self.cfg.adapters.items():
            adapters.add(load_peft(path, model, name))
        batcher = ContinuousBatcher(model, self.tok.eos_id, self.cfg.limits.max_batch,
                                    tokenizer=self.tok.hf,
                                    packed_decode=DecodeWeights(model, huge_pages=True),
                                    prefix_cache=PrefixCache(int(mb * 2**20)) if mb else None,
                                    adapters=adapters)
        return batcher, {"seq_len": model.cfg.seq_len, "vocab_size": model.cfg.vocab_size,
                         "weight_bytes": weight_bytes(model),
                         "quantized": modes, "expert_parallel": 1,
                         "device": str(model.device)}

    def _metrics(self):
        from starlette.responses import PlainTextResponse

        waiting = getattr(self.batcher, "waiting", lambda: 0)()
        used, capacity = getattr(self.batcher, "kv_usage", lambda: (0, 0))()
        cache = getattr(self.batcher, "prefix_cache", None)
        prefix = ((cache.lookup_tokens, cache.hit_tokens, self.batcher.prefill_tokens)
                  if cache is not None else (0, 0, getattr(self.batcher, "prefill_tokens", 0)))
        return PlainTextResponse(self.metrics.render(self.admission.in_flight, waiting, used,
                                                     capacity, prefix),
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
                self._authorize(request.headers.get("authorization"))
            if path == "/metrics":
                self._method(request, "GET")
                return self._metrics()
            if path == "/v1/models":
                self._method(request, "GET")
                return JSONResponse(models(self.cfg.model.name, self.created,
                                           self.adapter_names()))
            if path == "/v1/load_lora_adapter":
                self._method(request, "POST")
                return await self._load_adapter(request)
            if path in (COMPLETIONS, CHAT):
                self._method(request, "POST")
                return await self._complete(request, chat=path == CHAT)
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

    def adapter_names(self) -> list[str]:
        adapters = getattr(self.batcher, "adapters", None)
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
        adapters = getattr(self.batcher, "adapters", None)
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

    def _prompt(self, req, chat: bool) -> tuple[list[list[int]], SamplingParams]:
        """The request's prompts as token ids (chat: one; completions: one or more) and its
        sampling parameters, each checked against the limits and the model."""
        adapter = self._served(req.model)
        if chat:
            prompts = [self._chat_ids(req)]
            self._check_length(prompts[0], "messages")
        else:
            many = len(req.prompts()) > 1
            prompts = [self._completion_ids(one, f"prompt.{i}" if many else "prompt")
                       for i, one in enumerate(req.prompts())]
        return prompts, self._params(req, chat, prompts, adapter)

    def _served(self, model: str) -> str | None:
        """The adapter a request's ``model`` names (None: the base model), or a 404."""
        if model == self.cfg.model.name:
            return None
        if model not in self.adapter_names():
            served = [self.cfg.model.name, *self.adapter_names()]
            raise RequestError(404, f"model {model!r} is not served here; GET /v1/models "
                               f"lists {served}", "model", "model_not_found")
        return model

    def _chat_ids(self, req, add_generation_prompt: bool = True) -> list[int]:
        """A chat's ids through the model's chat template (its tools rendered), its texts
        checked against the prompt limit before they are rendered."""
        self._check_chars(sum(m.chars() for m in req.messages), "messages")
        for i, m in enumerate(req.messages):
            self._check_text(m.content or "", f"messages.{i}.content")
        try:
            return self.tok.chat(req.conversation(), req.tool_specs(),
                                 add_generation_prompt=add_generation_prompt,
                                 template_kwargs=req.chat_template_kwargs)
        except TemplateKwargsError as e:
            raise RequestError(400, str(e), "chat_template_kwargs") from None
        except Exception as e:  # the model's chat template refused the conversation
            raise RequestError(400, f"messages: {e}", "messages") from None

    def _text_ids(self, text: str, field: str) -> list[int]:
        """A text's ids, the text checked against the prompt limit before it is tokenized."""
        self._check_chars(len(text), field)
        self._check_text(text, field)
        return self.tok.encode(text)

    def _completion_ids(self, prompt: str | list[int], field: str) -> list[int]:
        """One completion prompt: text, tokenized, or token ids, checked against the
        vocabulary and run as they are."""
        ids = list(prompt) if isinstance(prompt, list) else self._text_ids(prompt, field)
        self._check_length(ids, field)
        if isinstance(prompt, list):
            self._check_vocabulary(ids, field)
        return ids

    def _check_vocabulary(self, ids: list[int], field: str) -> None:
        vocab = self.details["vocab_size"]
        outside = next((i for i, t in enumerate(ids) if t >= vocab), None)
        if outside is not None:
            raise RequestError(400, f"{field}.{outside}: token {ids[outside]} is not in this "
                               f"model's vocabulary (ids 0 to {vocab - 1})", field)

    def _check_chars(self, chars: int, field: str) -> None:
        """Refused before rendering or tokenizing: more characters than the prompt limit can
        hold (see CHARS_PER_TOKEN)."""
        limit = self.cfg.limits.max_prompt_tokens
        if chars > CHARS_PER_TOKEN * limit:
            raise RequestError(400, f"{field}: {chars} characters; this server accepts at "
                               f"most {limit} tokens (and at most {CHARS_PER_TOKEN} "
                               "characters a token before tokenizing)", field)

    def _check_text(self, text: str, field: str) -> None:
        over = self._over_limit(text, self.cfg.limits.max_prompt_tokens)
        if over is not None:
            raise RequestError(400, f"{field}: more than {over} tokens; this server accepts "
                               f"at most {self.cfg.limits.max_prompt_tokens}", field)

    def _check_length(self, ids: list[int], field: str) -> None:
        limit = self.cfg.limits.max_prompt_tokens
        if not ids:
            raise RequestError(400, f"{field}: the prompt is empty", field)
        if len(ids) > limit:
            raise RequestError(400, f"{field}: {len(ids)} tokens; this server accepts at most "
                               f"{limit}", field)
        if len(ids) >= self.seq_len:
            raise RequestError(400, f"{field}: {len(ids)} tokens fill the model's context of "
                               f"{self.seq_len} tokens", field)

    def _params(self, req, chat: bool, prompts: list[list[int]],
                adapter: str | None) -> SamplingParams:
        """The request's sampling parameters for its prompts, checked against the model (its
        context, its vocabulary, the grammar library)."""
        context = self.seq_len
        # a chat answer runs to the end of the context (or the limit), as OpenAI's does
        params = replace(req.sampling(context - len(prompts[0]) if chat else 16,
                                      self.cfg.limits), adapter=adapter)
        if params.constraint is not None:
            self._check_constraint(*req.constraint())
        try:
            check_tokens(params, self.details["vocab_size"])
        except ValueError as e:
            raise RequestError(400, str(e), named_field(str(e))) from None
        for i, ids in enumerate(prompts):
            if len(ids) + params.max_tokens > context:
                field = "messages" if chat else "prompt" if len(prompts) == 1 else f"prompt.{i}"
                raise RequestError(400, f"{field} ({len(ids)} tokens) plus max_tokens "
                                   f"({params.max_tokens}) exceed the model's context of "
                                   f"{context} tokens", "max_tokens")
        return params

    def _check_constraint(self, constraint: Constraint, field: str) -> None:
        """The request's constraint compiles for this model's tokenizer (compiled once and
        cached; the engine's grammar support is made at the first one), or a 400 naming the
        field and what the grammar library could not take."""
        if not hasattr(self.batcher, "grammars"):
            raise RequestError(400, f"{field}: this server's engine (expert-parallel) has no "
                               "structured outputs", field)
        with self._grammars_lock:
            if self.batcher.grammars is None:
                hf = getattr(self.tok, "hf", None)
                if hf is None:
                    raise RequestError(400, f"{field}: structured outputs need a Hugging Face "
                                       "tokenizer; this model reads bytes", field)
                self.batcher.grammars = Grammars(hf, self.batcher.cfg.vocab_size,
                                                 self.tok.eos_id)
        try:
            self.batcher.grammars.check(constraint)
        except GrammarError as e:
            raise RequestError(400, f"{field}: {e}", field) from None

    def _over_limit(self, text: str, limit: int) -> int | None:
        """For a text longer than 4 characters a token at the limit: the tokens of growing
        prefixes (4 x limit characters, then doubling), so that a text over the limit is
        refused after tokenizing about as much as a prompt at the limit takes, not all of it.
        A prefix's token count once it passes the limit, else None."""
        size = 4 * limit
        while size < len(text):
            n = len(self.tok.encode(text[:size]))
            if n > limit + 1:  # a cut splits at most one token in two
                return n - 1
            size *= 2
        return None

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
        ids = self._text_ids(req.prompt, "prompt") if req.prompt is not None else \
            self._chat_ids(ChatRequest(model=req.model, messages=req.messages, tools=req.tools,
                                       chat_template_kwargs=req.chat_template_kwargs),
                           req.add_generation_prompt)
        return {"count": len(ids), "max_model_len": self.seq_len, "tokens": ids}

    def _detokenize(self, body: bytes) -> dict[str, Any]:
        req = parse(DetokenizeRequest, body)
        self._served(req.model)
        self._check_vocabulary(req.tokens, "tokens")
        return {"prompt": self.tok.decode(req.tokens)}

    # ---- completions ------------------------------------------------------------------------
    async def _complete(self, request, chat: bool):
        """Admission's three gates (troupe.serving.admission), then the answer."""
        self.refuse_if_broken()
        self.admission.refuse_if_full()  # full already: refused before any reading or parsing
        body = await self.admission.body(request.receive)
        req, prompts, params = await asyncio.get_running_loop().run_in_executor(
            self._prepare_pool, self._prepare, body, chat)
        place = await self.admission.place()
        try:
            return await self._answer(req, chat, prompts, params, place)
        finally:
            place.release()  # idempotent: a stream gives its own back when it ends

    def _prepare(self, body: bytes, chat: bool):
        req = parse(ChatRequest if chat else CompletionRequest, body)
        return (req, *self._prompt(req, chat))

    async def _answer(self, req, chat: bool, prompts: list[list[int]], params: SamplingParams,
                      place: Place):
        """Answer an admitted request (JSON, or a stream that holds ``place`` until it
        ends)."""
        from starlette.responses import JSONResponse, StreamingResponse

        rid = completion_id(chat)
        prompt_tokens = sum(map(len, prompts))
        self.metrics.prompt_tokens += prompt_tokens
        route, start = CHAT if chat else COMPLETIONS, time.monotonic()
        # each prompt's n choices: sequences of their own (the engine prefills a shared prompt
        # once), choice j seeded with seed + j, so that it equals a single request with that
        # seed; prompt i's choices at indices i * n + j
        samples = [(f"{rid}-{i * req.n + j}", ids,
                    replace(params, seed=None if params.seed is None else params.seed + j))
                   for i, ids in enumerate(prompts) for j in range(req.n)]
        if req.stream:  # the stream holds the place until its last event (see _stream)
            body = self._stream(rid, samples, prompt_tokens, chat, req.include_usage(), start,
                                place, chat and req.uses_tools(), req.return_token_ids)
            weakref.finalize(body, place.release, True)  # a stream dropped before it started
            place.handed_over = True
            return StreamingResponse(body, media_type="text/event-stream")
        tasks = [asyncio.ensure_future(self._collect(sid, ids, p, start, req.return_token_ids))
                 for sid, ids, p in samples]
        try:
            choices = await asyncio.gather(*tasks)
        except SequenceFailed as e:
            self.metrics.finished(route, "error")
            raise self._failure(e) from None
        finally:
            for t in tasks:
                t.cancel()  # the other choices' sequences, when one failed
        self.metrics.finished(route, "ok")
        if chat and req.uses_tools():  # the model's <tool_call> blocks become tool_calls
            for c in choices:
                c.text, c.tool_calls = tools.parse(c.text)
                c.finish = "tool_calls" if c.tool_calls else c.finish
        return JSONResponse(completion(
            rid, self.cfg.model.name, choices, prompt_tokens, chat,
            [ids for _, ids, _ in samples] if req.return_token_ids else None))

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

    def _logprob(self, ev: Event) -> tuple[str, float, list[tuple[str, float]]]:
        text = self.tok.decode([ev.token])
        return text, ev.logprob, [(self.tok.decode([t]), lp) for t, lp in ev.top_logprobs or []]

    async def _stream(self, rid: str, samples: list[tuple[str, list[int], SamplingParams]],
                      prompt_tokens: int, chat: bool, include_usage: bool, start: float,
                      place: Place, parse_tools: bool = False,
                      token_ids: bool = False) -> AsyncIterator[str]:
        """Server-sent events, the choices' chunks as they come (each names its index); a
        failed sequence ends the stream with an error event; with include_usage a last chunk
        carries the usage. It holds the request's place and gives it back at its end (one that
        never starts, the client gone first, gives it back when it is dropped). With
        ``parse_tools`` each choice's text goes through a troupe.generation.tools.ToolStream:
        content as it comes, each call as one ``tool_calls`` delta once its block closes.
        With ``token_ids`` every token gets a chunk carrying it, and each choice's first
        chunk its prompt's."""
        name = self.cfg.model.name
        queue: asyncio.Queue = asyncio.Queue()

        async def pump(index: int, seq_id: str, ids: list[int], params: SamplingParams) -> None:
            try:
                async for ev in self._timed(seq_id, ids, params, start):
                    await queue.put((index, ev))
            except SequenceFailed as e:
                await queue.put((index, e))
            finally:
                await queue.put((index, None))

        tasks = [asyncio.ensure_future(pump(i, *sample)) for i, sample in enumerate(samples)]
        generated, offsets, open_ = 0, [0] * len(samples), len(samples)
        splitters = [tools.ToolStream() for _ in samples]
        prompts = [ids if token_ids else None for _, ids, _ in samples]  # until first sent
        try:
            if chat:
                for i in range(len(samples)):
                    yield _sse(chunk(rid, name, "", None, chat, first=True, index=i,
                                     prompt_ids=prompts[i]))
                    prompts[i] = None
            while open_:
                index, ev = await queue.get()
                if ev is None:
                    open_ -= 1
                    continue
                if isinstance(ev, SequenceFailed):
                    self.metrics.finished(CHAT if chat else COMPLETIONS, "error")
                    yield _sse(self._failure(ev).body())
                    break
                generated += 1
                lp = [self._logprob(ev)] if self._reported(ev) else None
                text, finish, calls = ev.delta, ev.finish_reason, []
                if parse_tools:
                    text, calls = splitters[index].feed(text)
                    if finish is not None:
                        text += splitters[index].end()
                        finish = "tool_calls" if splitters[index].calls else finish
                sent = splitters[index].calls - len(calls)  # the choice's calls before these
                for k, call in enumerate(calls):
                    yield _sse(chunk(rid, name, "", None, chat, index=index,
                                     tool_calls=[call.body(index=sent + k)]))
                if text or finish or lp or token_ids:
                    yield _sse(chunk(rid, name, text, finish, chat, index=index,
                                     logprobs=lp if ev.logprob is not None else None,
                                     offset=offsets[index],
                                     token_ids=[ev.token] if token_ids else None,
                                     prompt_ids=prompts[index]))
                    offsets[index] += len(text)
                    prompts[index] = None
            else:
                self.metrics.finished(CHAT if chat else COMPLETIONS, "ok")
                if include_usage:
                    yield _sse(usage_chunk(rid, name, chat, prompt_tokens, generated))
        finally:
            for t in tasks:
                t.cancel()
            place.release(final=True)
        yield "data: [DONE]\n\n"


def _lower_priority(niceness: int = 10) -> None:
    """Lower the calling thread's CPU priority (Linux schedules threads apart; elsewhere this
    does nothing)."""
    try:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), niceness)
    except (AttributeError, OSError):
        pass


def _sse(obj: dict[str, Any]) -> str:
    return f"data: {json.dumps(obj)}\n\n"


@dataclass(frozen=True)
class RankModel:
    """What an expert-parallel rank holds once set up."""

    seq_len: int
    weight_bytes: int
    quantized: dict[str, str]  # module name -> quantization mode
    vocab_size: int


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
        return RankModel(model.cfg.seq_len, weight_bytes(model), modes, model.cfg.vocab_size)

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
