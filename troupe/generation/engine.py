"""The one generation engine: continuous batching for a GPT with a KV cache. The server decodes
its requests with it, and the RLHF policy its rollouts (a batch of prompts queued at once and
run to the end), with the same sampler, so one prompt, seed and sampling parameters give the
same tokens in both. Sequences join the batch between decode steps and leave it when they
finish, so a long request does not hold back the ones behind it.

All sequences of the batch share the cache's columns: a sequence's tokens end at the current
column and start wherever its prompt began, with the columns before it marked invalid, exactly
as a left-padded batch would be (positions count real tokens only, see GPT.hidden). A newcomer
is prefilled on its own and its keys and values are right-aligned into the batch's columns;
when the columns run out, the ones that no sequence uses any more are dropped.
"""

from __future__ import annotations

import contextlib
import os
import threading
from collections import deque
from dataclasses import dataclass, field

import torch

from troupe.generation.detokenize import ByteDetokenizer, Detokenizer, TextDetokenizer
from troupe.generation.grammar import Grammars, Matcher
from troupe.generation.prefix_cache import PrefixCache
from troupe.generation.sampling import (NON_FINITE, LogitAdjust, SamplingParams, check_tokens,
                                        checked, draw, finite_rows)
from troupe.generation.decode_layers import DecodeLayers
from troupe.kernels.small_gemm import MAX_ROWS, DecodeWeights
from troupe.models import GPT, KVCache
from troupe.models.adapters import Adapters


SHARED_OPENING = 16  # tokens: a shorter opening shared by a prefill's prompts runs with each


def shared_opening(prompts: list[list[int]]) -> int:
    """How many first tokens all ``prompts`` share, leaving each at least one of its own."""
    return min(len(os.path.commonprefix(prompts)), min(len(x) for x in prompts) - 1)


@dataclass
class Event:
    """What one step did for one sequence: the token it chose, the text that is now final
    (``delta``), and why it finished (None while it goes on): "stop", "length", or "error"
    (``error`` says what; the sequence alone ends, the batch goes on)."""

    seq_id: str
    token: int | None
    delta: str
    finish_reason: str | None = None
    error: str | None = None
    logprob: float | None = None  # of ``token``, when the sequence asked for logprobs
    top_logprobs: list[tuple[int, float]] | None = None  # (token, log-probability), likeliest first
    sampled_logprob: float | None = None  # of ``token`` in the distribution it was sampled
    # from (before temperature, top-k and top-p), when that is not the model's own
    # (``logprob``): under a constraint's mask, a logit_bias or penalties


@dataclass
class _Sequence:
    seq_id: str
    prompt: list[int]
    params: SamplingParams
    generator: torch.Generator | None
    detok: Detokenizer
    out: list[int] = field(default_factory=list)
    text: str = ""      # decoded output so far
    sent: int = 0       # characters of ``text`` already handed out
    searched: int = 0   # characters of ``text`` already searched for stop strings
    matcher: Matcher | None = None  # its constraint's state (troupe.generation.grammar)
    adjust: LogitAdjust | None = None  # its logit_bias, penalties and min_tokens


class ContinuousBatcher:
    """Decodes up to ``max_batch`` sequences at once with ``model`` (fp32 or quantized).

    ``add`` may be called from any thread; ``step`` (one thread at a time) admits waiting
    sequences, runs one decode step for the batch and returns an Event per sequence.
    Text comes from ``tokenizer`` (a Hugging Face tokenizer, detokenized incrementally) or,
    without one, from bytes (troupe's ByteTokenizer); ``eos_id`` ends a sequence (None: only
    max_tokens and stop strings do, as benchmarks want).

    With a ``prefix_cache`` (troupe.generation.prefix_cache), a prompt that begins as an
    earlier one did runs only from where the cached prefix ends; set ``cache_namespace`` when
    the weights change (a new version, another adapter), so that nothing computed under other
    weights is reused. ``prefill_tokens`` counts the prompt tokens the model ran. With
    ``keep_outputs`` a finished sequence's prompt and output are kept there too, so that a
    next turn that continues them (an agent's conversation) runs only its new tokens.

    A sequence whose parameters name an ``adapter`` runs with that LoRA adapter of
    ``adapters`` (troupe.models.adapters: applied per row, so sequences of different adapters
    share the batch).

    A sequence whose parameters carry a ``constraint`` samples only the tokens its grammar
    allows (``grammars``: troupe.generation.grammar.Grammars for the tokenizer) and ends when
    the grammar is complete.

    With ``lockstep`` every step runs exactly two forward passes (the decode and the prefill,
    a one-token stand-in for either when there is nothing to run): expert-parallel ranks,
    whose MoE layers exchange tokens with all_to_all, must all run the same passes.
    """

    def __init__(self, model: GPT, eos_id: int | None, max_batch: int = 16,
                 lockstep: bool = False, tokenizer=None,
                 packed_decode: "bool | DecodeWeights" = True, grammars: Grammars | None = None,
                 prefix_cache: PrefixCache | None = None, adapters: Adapters | None = None,
                 keep_outputs: bool = False):
        self.lockstep, self.tokenizer, self.grammars = lockstep, tokenizer, grammars
        self.adapters = adapters
        if prefix_cache is not None and lockstep:
            raise ValueError("prefix_cache: a lockstep engine runs one prefill pass a step on "
                             "every rank; a cache hit would add one on its rank alone")
        self.prefix_cache = prefix_cache
        if keep_outputs and prefix_cache is None:
            raise ValueError("keep_outputs: keeps finished sequences in the prefix cache, "
                             "which this engine does not have")
        self.keep_outputs = keep_outputs
        self.cache_namespace = ""  # what the cached keys were computed under (weights, adapter)
        self.prefill_tokens = 0    # prompt tokens run through the model
        self.model = model.eval()
        # decode steps multiply a few rows by every weight: fp32 CPU weights packed for that
        # (troupe.kernels.small_gemm; a copy of the linear weights while the engine lives, or
        # the caller's DecodeWeights of this model, kept between engines)
        self.packed = (packed_decode if isinstance(packed_decode, DecodeWeights)
                       else DecodeWeights(model) if packed_decode else None)
        # and the whole decode step in one native call (troupe.generation.decode_layers; None
        # for a model it does not cover), rebuilt when adapters are added (they wrap layers)
        self.fused = (DecodeLayers.of(model, self.packed) if packed_decode and not lockstep
                      else None)
        self._fused_adapters = self._adapters_version()
        self.cfg = model.cfg
        self.device = model.device
        self.eos_id = eos_id
        self.max_batch = max_batch
        self._waiting: deque[_Sequence] = deque()
        self._cancelled: set[str] = set()
        self._lock = threading.Lock()
        self.active: list[_Sequence] = []
        self.cache: KVCache | None = None
        self.valid: torch.Tensor | None = None  # (B, S): which columns hold real tokens

    # ---- requests -------------------------------------------------------------------------
    def weights_changed(self) -> None:
        """The model's weights were changed (trained in place, or replaced): decode from the
        new ones (the packed copy refreshed, the native step rebuilt). The caller also changes
        ``cache_namespace`` if a prefix cache holds keys computed under the old ones."""
        if self.packed:
            self.packed.refresh()
        if self.fused is not None:
            self.fused = DecodeLayers.of(self.model, self.packed)

    def add(self, seq_id: str, prompt: list[int], params: SamplingParams) -> None:
        """Queue a sequence; it joins the batch at the next step with room for it. ValueError
        (naming the field) for a request that cannot be served."""
        params = checked(params)
        if not prompt:
            raise ValueError("prompt: at least one token is needed")
        if len(prompt) + params.max_tokens > self.cfg.seq_len:
            raise ValueError(f"prompt ({len(prompt)} tokens) plus max_tokens "
                             f"({params.max_tokens}) exceed the model's context of "
                             f"{self.cfg.seq_len} tokens")
        gen = None
        if params.temperature > 0:
            gen = torch.Generator().manual_seed(params.seed if params.seed is not None
                                                else torch.seed())
        detok = (ByteDetokenizer() if self.tokenizer is None
                 else TextDetokenizer(self.tokenizer, list(prompt)))
        if params.adapter is not None and (self.adapters is None
                                           or params.adapter not in self.adapters.slots):
            raise ValueError(f"adapter: {params.adapter!r} is not loaded"
                             + (f" (loaded: {sorted(self.adapters.slots)})" if self.adapters
                                else ""))
        matcher = None
        if params.constraint is not None:
            if self.grammars is None:
                raise ValueError("constraint: this engine has no grammar support (it needs "
                                 "the model's Hugging Face tokenizer)")
            matcher = self.grammars.matcher(params.constraint)  # GrammarError, a ValueError
        check_tokens(params, self.cfg.vocab_size)
        enders = list(params.stop_token_ids) + (
            [self.eos_id] if self.eos_id is not None and not params.ignore_eos else [])
        adjust = LogitAdjust(params, prompt, self.cfg.vocab_size, enders) \
            if LogitAdjust.wanted(params) else None
        with self._lock:
            self._waiting.append(_Sequence(seq_id, list(prompt), params, gen, detok,
                                           matcher=matcher, adjust=adjust))

    def cancel(self, seq_id: str) -> None:
        """Drop a sequence (its client went away); it frees its slot at the next step."""
        with self._lock:
            self._cancelled.add(seq_id)

    def run_events(self) -> list[Event]:
        """Step until every queued sequence has finished; every event, in order."""
        events: list[Event] = []
        while self.has_work():
            events += self.step()
        return events

    def run(self) -> dict[str, list[int]]:
        """Step until every queued sequence has finished; the tokens each one chose (its eos
        included), by sequence id. The batch form the RLHF rollouts use: a sequence that
        fails (non-finite logits) raises RuntimeError naming it."""
        return self.run_with_logprobs()[0]

    def run_with_logprobs(self) -> tuple[dict[str, list[int]], dict[str, list[float]]]:
        """``run``, and the log-probability of each chosen token under the model's own
        distribution (softmax of the logits: no temperature, top-k or top-p; under a
        constraint, a logit_bias or penalties, of the adjusted logits it was sampled from) for
        the sequences whose parameters ask for logprobs (empty lists for the others)."""
        out: dict[str, list[int]] = {}
        logp: dict[str, list[float]] = {}
        while self.has_work():
            for ev in self.step():
                if ev.error is not None:
                    raise RuntimeError(f"sequence {ev.seq_id}: {ev.error}")
                out.setdefault(ev.seq_id, []).append(ev.token)
                lp = logp.setdefault(ev.seq_id, [])
                if ev.logprob is not None:  # adjusted: the distribution sampled
                    lp.append(ev.sampled_logprob if ev.sampled_logprob is not None
                              else ev.logprob)
        return out, logp

    def reset(self) -> list[str]:
        """Drop every sequence, running or waiting, and the cache (after a failed step, whose
        state cannot be trusted); returns the ids dropped."""
        with self._lock:
            dropped = [s.seq_id for s in self.active] + [s.seq_id for s in self._waiting]
            self._waiting.clear()
            self._cancelled.clear()
        self.active, self.cache, self.valid = [], None, None
        return dropped

    def has_work(self) -> bool:
        return bool(self.active or self._waiting)

    def waiting(self) -> int:
        """Sequences queued for a free slot."""
        with self._lock:
            return len(self._waiting)

    def kv_usage(self) -> tuple[int, int]:
        """(positions of the KV cache holding real tokens, max_batch x the model's context)."""
        used = int(self.valid.sum()) if self.valid is not None else 0
        return used, self.max_batch * self.cfg.seq_len

    def active_ids(self) -> list[str]:
        return [s.seq_id for s in self.active]

    # ---- the step ---------------------------------------------------------------------------
    @torch.no_grad()
    def step(self) -> list[Event]:
        """Admit waiting sequences (prefill), then one decode step for the rest of the batch.
        If the step raises, the batch's cache cannot be trusted: every sequence of the step
        ends with an "error" event, and the waiting ones start afresh at the next step."""
        self._drop_cancelled()
        events: list[Event] = []
        running = list(self.active)
        newcomers = self._admit()
        try:
            if running:
                events += self._decode(running)
            elif self.lockstep:
                self._stand_in()
            if newcomers:
                events += self._prefill(newcomers)
            elif self.lockstep:
                self._stand_in()
        except Exception as e:
            self.active, self.cache, self.valid = [], None, None
            return [Event(s.seq_id, None, "", "error", f"decode step failed: {e!r}")
                    for s in running + newcomers]
        finished = {e.seq_id for e in events if e.finish_reason is not None}
        if self.keep_outputs and finished and self.cache is not None:
            self._keep(finished)
        self._retire(finished)
        return events

    def _keep(self, seq_ids: set[str]) -> None:
        """The finished sequences' keys and values (prompt and output, all but the last token,
        which was sampled and never run) into the prefix cache."""
        L = self.cache.length
        for i, s in enumerate(self.active):
            if s.seq_id not in seq_ids or not s.out:
                continue
            tokens = s.prompt + s.out[:-1]
            if int(self.valid[i].sum()) != len(tokens):  # not this layout: keep nothing
                continue
            self.prefix_cache.insert(tokens, [t[i, :, L - len(tokens):L] for t in self.cache.k],
                                     [t[i, :, L - len(tokens):L] for t in self.cache.v],
                                     self._namespace(s.params.adapter))

    def _stand_in(self) -> None:
        """A one-token forward pass whose result is thrown away (see ``lockstep``)."""
        self.model.hidden(torch.zeros(1, 1, dtype=torch.long, device=self.device))

    def _admit(self) -> list[_Sequence]:
        with self._lock:
            room = self.max_batch - len(self.active)
            taken = [self._waiting.popleft() for _ in range(min(room, len(self._waiting)))]
        return taken

    def _drop_cancelled(self) -> None:
        with self._lock:
            gone, self._cancelled = self._cancelled, set()
            self._waiting = deque(s for s in self._waiting if s.seq_id not in gone)
        if gone:
            self._retire(gone)

    def _prefill(self, seqs: list[_Sequence]) -> list[Event]:
        """Run the newcomers' prompts and choose their first tokens. A prompt that several of
        them share (GRPO's samples, a request's n choices) runs once; with a prefix cache, a
        prompt whose start is cached runs from there (``_prefill_hit``); the others run
        together, left-padded (``_prefill_cold``), those that begin alike (requests over one
        system prompt arriving together) in a prefill of their own that runs their common
        opening once. The cache's hits count the tokens of either kind that were not run again."""
        cache = self.prefix_cache
        if cache is None:
            return self._prefill_cold(seqs)
        groups: dict[tuple, list[_Sequence]] = {}
        for s in seqs:
            groups.setdefault((tuple(s.prompt), s.params.adapter), []).append(s)
        events, starts = [], {}
        for (prompt, adapter), group in groups.items():
            n, blocks = cache.lookup(list(prompt), self._namespace(adapter))
            if n:
                cache.record(len(prompt), n)
                events += self._prefill_hit(list(prompt), n, blocks, group)
            else:  # by their first block and adapter (a short prompt: by itself)
                start = (prompt[:cache.block], adapter) if len(prompt) > cache.block else prompt
                starts.setdefault(start, []).append(((prompt, adapter), group))
        alone = []
        for members in starts.values():
            prompts = [list(prompt) for (prompt, _), _ in members]
            L = shared_opening(prompts) if len(prompts) > 1 else 0
            if L < SHARED_OPENING:
                L = 0
            for i, prompt in enumerate(prompts):
                cache.record(len(prompt), L if i else 0)
            together = [s for _, group in members for s in group]
            if L:
                events += self._prefill_cold(together)
            else:
                alone += together
        if alone:
            events += self._prefill_cold(alone)
        return events

    def _prefill_cold(self, seqs: list[_Sequence]) -> list[Event]:
        """Prompts run together (left-padded), their keys and values merged into the batch's
        cache (and kept in the prefix cache). An opening that every prompt shares (a chat
        template's system prompt: SHARED_OPENING tokens or more, under one adapter) runs once,
        its keys and values copied to every row, and each prompt's rest after it, left-padded
        (the gap between them is padding, as ``GPT.hidden`` allows)."""
        first: dict[tuple, int] = {}
        rows = [first.setdefault((tuple(s.prompt), s.params.adapter), len(first)) for s in seqs]
        prompts = [list(p) for p, _ in first]
        adapters = [a for _, a in first]
        B = len(prompts)
        L = shared_opening(prompts) if B > 1 and len(set(adapters)) == 1 else 0
        L = L if L >= SHARED_OPENING else 0
        rests = [x[L:] for x in prompts]
        R = max(len(x) for x in rests)
        # filled from Python lists in host memory, then moved to the model's device in one copy
        idx = torch.full((B, R), self.eos_id or 0, dtype=torch.long)  # host: padding
        valid = torch.zeros(B, L + R, dtype=torch.bool)  # host: (as idx)
        valid[:, :L] = True
        for i, x in enumerate(rests):
            idx[i, R - len(x):] = torch.tensor(x)  # host: (as idx)
            valid[i, L + R - len(x):] = True
        idx, valid = idx.to(self.device), valid.to(self.device)
        # room for the prompt and a few tokens; decoding grows it (see _make_room)
        cache = KVCache.empty(self.cfg, B, min(L + R + 16, self.cfg.seq_len),
                              device=self.device, dtype=self._dtype())
        if L:  # one row, under the adapter all the prompts use
            opening = KVCache.empty(self.cfg, 1, L, device=self.device, dtype=self._dtype())
            with self._routed(adapters[:1]):
                self.model.hidden(torch.tensor([prompts[0][:L]], device=self.device),
                                  valid_BS=valid[:1, :L], cache=opening)
            for ours, theirs in zip(cache.k + cache.v, opening.k + opening.v):
                ours[:, :, :L] = theirs
            cache.length = L
        with self._routed(adapters):
            h, _ = self.model.hidden(idx, valid_BS=valid, cache=cache)
        self.prefill_tokens += int(valid.sum()) - (B - 1) * L
        logits = self.model.logits(h[:, -1])
        if self.prefix_cache is not None:
            S = L + R
            for i, x in enumerate(rests):
                cols = list(range(L)) + list(range(S - len(x), S))
                self.prefix_cache.insert(prompts[i], [t[i, :, cols] for t in cache.k],
                                         [t[i, :, cols] for t in cache.v],
                                         self._namespace(adapters[i]))
        return self._admit_rows(cache, valid, logits, rows, seqs)

    def _prefill_hit(self, prompt: list[int], n: int, blocks: list, seqs: list[_Sequence]
                     ) -> list[Event]:
        """A prompt whose first ``n`` tokens' keys and values are cached (``blocks``): those
        copied in, the rest run, for ``seqs`` (the sequences of this prompt)."""
        T = len(prompt)
        cache = KVCache.empty(self.cfg, 1, min(T + 16, self.cfg.seq_len), device=self.device,
                              dtype=self._dtype())
        for layer in range(self.cfg.n_layer):
            cache.k[layer][0, :, :n] = torch.cat([b.k[layer] for b in blocks], 1)
            cache.v[layer][0, :, :n] = torch.cat([b.v[layer] for b in blocks], 1)
        cache.length = n
        valid = torch.ones(1, T, dtype=torch.bool, device=self.device)
        idx = torch.tensor([prompt[n:]], device=self.device)
        adapter = seqs[0].params.adapter
        # the few tokens after a cached prefix go through the packed product when there are
        # at most MAX_ROWS of them, as a decode step's do (MKL reads the weights at a third of
        # the speed for so few rows: kernels/small_gemm.py)
        with self._routed([adapter]), self._products():
            h, _ = self.model.hidden(idx, valid_BS=valid, cache=cache)
        self.prefill_tokens += T - n
        logits = self._logits(h[:, -1])
        self.prefix_cache.insert(prompt, [t[0, :, :T] for t in cache.k],
                                 [t[0, :, :T] for t in cache.v], self._namespace(adapter))
        return self._admit_rows(cache, valid, logits, [0] * len(seqs), seqs)

    def _admit_rows(self, cache: KVCache, valid: torch.Tensor, logits: torch.Tensor,
                    rows: list[int], seqs: list[_Sequence]) -> list[Event]:
        """Sequence i takes row ``rows[i]`` of a prefill's cache, valid mask and logits (its
        own copy, when prompts were shared): merged into the batch, first tokens chosen."""
        if len(rows) > cache.k[0].shape[0]:
            index = torch.tensor(rows, device=self.device)
            cache = KVCache([t.index_select(0, index) for t in cache.k],
                            [t.index_select(0, index) for t in cache.v], cache.length)
            valid, logits = valid.index_select(0, index), logits.index_select(0, index)
        self._merge(cache, valid, seqs)
        return self._choose(seqs, logits)

    def _decode(self, seqs: list[_Sequence]) -> list[Event]:
        self._make_room()
        idx = torch.tensor([[s.out[-1]] for s in seqs], device=self.device)
        self.valid = torch.cat([self.valid, self.valid.new_ones(len(seqs), 1)], 1)
        names = [s.params.adapter for s in seqs]
        fused = self._fused()
        if fused is not None and len(seqs) <= MAX_ROWS and self.cache.k[0].dtype == torch.float32:
            slots = self.adapters.slot_ids(names) if self._adapted() else None
            with self._routed(names) if fused.routed else contextlib.nullcontext():
                if fused.has_logits:
                    return self._choose(seqs, *fused.logits(idx, self.valid, self.cache, slots))
                h = fused.hidden(idx, self.valid, self.cache, slots)
            return self._choose(seqs, self._logits(h))
        with self._routed(names), self._products():
            h, _ = self.model.hidden(idx, valid_BS=self.valid, cache=self.cache)
        return self._choose(seqs, self._logits(h[:, -1]))

    def _products(self):
        """The packed products for the enclosed forwards, when the engine holds them."""
        return self.packed.active() if self.packed else contextlib.nullcontext()

    def _logits(self, h: torch.Tensor) -> torch.Tensor:
        """Next-token logits of hidden states, through the packed output projection when the
        engine holds one (it falls back to the model's for more rows than it takes)."""
        return self.packed.logits(h) if self.packed else self.model.logits(h)

    def _fused(self) -> DecodeLayers | None:
        """The native step (if any), rebuilt if adapters were added since it was built."""
        if self.fused is not None and self._fused_adapters != self._adapters_version():
            self.fused = DecodeLayers.of(self.model, self.packed)
            self._fused_adapters = self._adapters_version()
        return self.fused

    def _adapters_version(self) -> int:
        return self.adapters.version if self.adapters is not None else 0

    def _adapted(self) -> bool:
        """Whether adapters wrap any of the model's layers (loaded at start or since)."""
        return self.adapters is not None and bool(self.adapters.layers)

    def _routed(self, adapters: list[str | None]):
        """Rows of the enclosed forwards run with their sequences' adapters."""
        if self.adapters is None:
            return contextlib.nullcontext()
        return self.adapters.routed(adapters)

    def _namespace(self, adapter: str | None) -> str:
        """The prefix cache's namespace for a sequence: the weights' and its adapter's."""
        return self.cache_namespace if adapter is None else f"{self.cache_namespace}|{adapter}"

    def _choose(self, seqs: list[_Sequence], logits_BV: torch.Tensor,
                greedy: list[int] | None = None, finite: list[bool] | None = None
                ) -> list[Event]:
        """Each sequence's next token from its row of logits; ``greedy`` and ``finite``: each
        row's argmax and finiteness when the step computed them (the fused one does)."""
        events = []
        logits_BV = logits_BV.float().cpu()  # the generators are CPU ones: one copy per step
        # the finiteness test and the greedy choices of the whole batch at once
        if finite is None:
            finite = finite_rows(logits_BV).tolist()
        if greedy is None:
            greedy = logits_BV.argmax(-1).tolist()
        for i, (s, logits) in enumerate(zip(seqs, logits_BV)):
            sampled = None  # the logits sampled from, where they are not the model's
            try:
                if not finite[i]:
                    raise FloatingPointError(NON_FINITE)
                if s.adjust is not None:
                    sampled = s.adjust.apply(logits)
                if s.matcher is not None:  # only what the grammar allows
                    sampled = (logits if sampled is None else sampled).masked_fill(
                        ~s.matcher.allowed(), float("-inf"))
                if sampled is not None and s.params.temperature <= 0:
                    greedy[i] = int(sampled.argmax())
                token = greedy[i] if s.params.temperature <= 0 else \
                    draw(logits if sampled is None else sampled, s.params, s.generator)
                if s.matcher is not None:
                    s.matcher.accept(token)
                if s.adjust is not None:
                    s.adjust.accept(token)
            except Exception as e:  # this sequence ends; the others go on
                events.append(Event(s.seq_id, None, "", "error", f"{type(e).__name__}: {e}"))
                continue
            s.out.append(token)
            ev = self._advance(s, token)
            if s.params.logprobs is not None:
                logp = torch.log_softmax(logits, -1)
                ev.logprob = float(logp[token])
                if sampled is not None:
                    ev.sampled_logprob = float(torch.log_softmax(sampled, -1)[token])
                if s.params.logprobs:
                    top = logp.topk(s.params.logprobs)
                    ev.top_logprobs = list(zip(top.indices.tolist(), top.values.tolist()))
            events.append(ev)
        return events

    def _advance(self, s: _Sequence, token: int) -> Event:
        """Account for ``token``: extend the text, check stop strings and limits, and say how
        much text is final (text that could still become a stop string is held back)."""
        finish, p = None, s.params
        if (token == self.eos_id and not p.ignore_eos) or token in p.stop_token_ids:
            finish = "stop"
        else:
            s.text += s.detok.add(token)
            if s.matcher is not None and s.matcher.done:  # the grammar's output is complete
                finish = "stop"
        # a stop string counts where it ends in this token's text (none before min_tokens)
        longest = max((len(x) for x in p.stop), default=0)
        cut, stop = -1, ""
        if len(s.out) >= p.min_tokens:
            start = max(0, s.searched - longest + 1)
            cut, stop = min(((i, x) for x in p.stop if (i := s.text.find(x, start)) >= 0),
                            default=(-1, ""))
        s.searched = len(s.text)
        if cut >= 0:
            cut += len(stop) if p.include_stop_str_in_output else 0
            s.text, finish = s.text[:cut], "stop"
        elif finish is None and len(s.out) >= p.max_tokens:
            finish = "length"
        if finish is not None:
            s.text += s.detok.finish() if cut < 0 else ""
            ready = len(s.text)
        else:
            ready = len(s.text) - max(longest - 1, 0)
        delta = s.text[s.sent:max(ready, s.sent)]
        s.sent += len(delta)
        return Event(s.seq_id, token, delta, finish)

    # ---- the shared cache -------------------------------------------------------------------
    def _dtype(self) -> torch.dtype:
        return self.model.dtype

    def _make_room(self) -> None:
        """A free column for the next token: the cache doubles its columns (up to the
        model's context), and at the context drops the columns no sequence uses any more.
        The cache holds as many columns as the batch needs, not the whole context: copying
        it (retiring, merging) costs what the sequences use."""
        capacity = self.cache.k[0].shape[2]
        if self.cache.length + 1 <= capacity:
            return
        if capacity < self.cfg.seq_len:
            grown = min(max(2 * capacity, self.cache.length + 1), self.cfg.seq_len)
            self.cache, self.valid = _placed(self.cache, self.valid, self.cache.length, grown)
        else:
            self._compact()

    def _merge(self, cache: KVCache, valid: torch.Tensor, seqs: list[_Sequence]) -> None:
        if self.cache is None or not self.active:
            self.cache, self.valid = cache, valid
            self.active = list(seqs)
            return
        L = max(self.cache.length, cache.length)
        C = max(self.cache.k[0].shape[2], cache.k[0].shape[2], L)
        old, old_valid = _placed(self.cache, self.valid, L, C)
        new, new_valid = _placed(cache, valid, L, C)
        self.cache = KVCache([torch.cat([a, b]) for a, b in zip(old.k, new.k)],
                             [torch.cat([a, b]) for a, b in zip(old.v, new.v)], L)
        self.valid = torch.cat([old_valid, new_valid])
        self.active += seqs

    def _compact(self) -> None:
        """Drop leading columns that no sequence of the batch uses any more."""
        first = int(self.valid.float().argmax(1).min())  # earliest real column of any row
        if first == 0:
            raise RuntimeError("KV cache is full: a sequence reached the model's context")
        L = self.cache.length - first
        for t in self.cache.k + self.cache.v:
            t[:, :, :L] = t[:, :, first:first + L].clone()
        self.cache.length = L
        self.valid = self.valid[:, first:]

    def _retire(self, seq_ids: set[str]) -> None:
        keep = [i for i, s in enumerate(self.active) if s.seq_id not in seq_ids]
        if len(keep) == len(self.active):
            return
        self.active = [self.active[i] for i in keep]
        if not keep:
            self.cache, self.valid = None, None
            return
        index = torch.tensor(keep, device=self.device)
        self.cache = KVCache([t.index_select(0, index) for t in self.cache.k],
                             [t.index_select(0, index) for t in self.cache.v], self.cache.length)
        self.valid = self.valid.index_select(0, index)


def _placed(cache: KVCache, valid: torch.Tensor, L: int, C: int) -> tuple[KVCache, torch.Tensor]:
    """The cache with C columns, its filled ones moved right to end at column L; the columns
    before them are invalid (and zero: masked columns still enter the product, no NaN)."""
    d = L - cache.length
    if d == 0 and C == cache.k[0].shape[2]:
        return cache, valid
    k, v = [], []
    for src, dst in ((cache.k, k), (cache.v, v)):
        for t in src:
            B, H, _, D = t.shape
            moved = t.new_zeros(B, H, C, D)
            moved[:, :, d:L] = t[:, :, :cache.length]
            dst.append(moved)
    pad = valid.new_zeros(valid.shape[0], d)
    return KVCache(k, v, L), torch.cat([pad, valid], 1)
