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

import torch

from troupe.generation.batch_cache import merged, select_rows, with_room
from troupe.generation.decode_layers import DecodeLayers
from troupe.generation.grammar import Grammars
from troupe.generation.prefix_cache import PrefixCache
from troupe.generation.sampling import SamplingParams
from troupe.generation.sequence import Event, Sequence, choose
from troupe.kernels.small_gemm import MAX_ROWS, DecodeWeights
from troupe.models import GPT, KVCache
from troupe.models.adapters import Adapters


SHARED_OPENING = 16  # tokens: a shorter opening shared by a prefill's prompts runs with each


def shared_opening(prompts: list[list[int]]) -> int:
    """How many first tokens all ``prompts`` share, leaving each at least one of its own."""
    return min(len(os.path.commonprefix(prompts)), min(len(x) for x in prompts) - 1)


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

    structured_outputs = True  # constraints are sampled here (the serving Batcher protocol)

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
        self._waiting: deque[Sequence] = deque()
        self._cancelled: set[str] = set()
        self._lock = threading.Lock()
        self.active: list[Sequence] = []
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
        seq = Sequence.begin(seq_id, prompt, params, self.cfg, self.eos_id,
                             tokenizer=self.tokenizer, grammars=self.grammars,
                             adapters=self.adapters)
        with self._lock:
            self._waiting.append(seq)

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

    def _admit(self) -> list[Sequence]:
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

    def _prefill(self, seqs: list[Sequence]) -> list[Event]:
        """Run the newcomers' prompts and choose their first tokens. A prompt that several of
        them share (GRPO's samples, a request's n choices) runs once; with a prefix cache, a
        prompt whose start is cached runs from there (``_prefill_hit``); the others run
        together, left-padded (``_prefill_cold``), those that begin alike (requests over one
        system prompt arriving together) in a prefill of their own that runs their common
        opening once. The cache's hits count the tokens of either kind that were not run again."""
        cache = self.prefix_cache
        if cache is None:
            return self._prefill_cold(seqs)
        groups: dict[tuple, list[Sequence]] = {}
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

    def _prefill_cold(self, seqs: list[Sequence]) -> list[Event]:
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

    def _prefill_hit(self, prompt: list[int], n: int, blocks: list, seqs: list[Sequence]
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
                    rows: list[int], seqs: list[Sequence]) -> list[Event]:
        """Sequence i takes row ``rows[i]`` of a prefill's cache, valid mask and logits (its
        own copy, when prompts were shared): merged into the batch, first tokens chosen."""
        if len(rows) > cache.k[0].shape[0]:
            cache, valid = select_rows(cache, valid, rows)
            logits = logits.index_select(0, torch.tensor(rows, device=self.device))
        self._merge(cache, valid, seqs)
        return choose(seqs, self.eos_id, logits)

    def _decode(self, seqs: list[Sequence]) -> list[Event]:
        self._make_room()
        idx = torch.tensor([[s.out[-1]] for s in seqs], device=self.device)
        self.valid = torch.cat([self.valid, self.valid.new_ones(len(seqs), 1)], 1)
        names = [s.params.adapter for s in seqs]
        fused = self._fused()
        if fused is not None and len(seqs) <= MAX_ROWS and self.cache.k[0].dtype == torch.float32:
            slots = self.adapters.slot_ids(names) if self._adapted() else None
            with self._routed(names) if fused.routed else contextlib.nullcontext():
                if fused.has_logits:
                    return choose(seqs, self.eos_id,
                                  *fused.logits(idx, self.valid, self.cache, slots))
                h = fused.hidden(idx, self.valid, self.cache, slots)
            return choose(seqs, self.eos_id, self._logits(h))
        with self._routed(names), self._products():
            h, _ = self.model.hidden(idx, valid_BS=self.valid, cache=self.cache)
        return choose(seqs, self.eos_id, self._logits(h[:, -1]))

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

    # ---- the shared cache (troupe.generation.batch_cache) ------------------------------------
    def _dtype(self) -> torch.dtype:
        return self.model.dtype

    def _make_room(self) -> None:
        """A free column for the next token (troupe.generation.batch_cache.with_room)."""
        self.cache, self.valid = with_room(self.cache, self.valid, self.cfg.seq_len)

    def _merge(self, cache: KVCache, valid: torch.Tensor, seqs: list[Sequence]) -> None:
        if self.cache is None or not self.active:
            self.cache, self.valid = cache, valid
            self.active = list(seqs)
            return
        self.cache, self.valid = merged(self.cache, self.valid, cache, valid)
        self.active += seqs

    def _retire(self, seq_ids: set[str]) -> None:
        keep = [i for i, s in enumerate(self.active) if s.seq_id not in seq_ids]
        if len(keep) == len(self.active):
            return
        self.active = [self.active[i] for i in keep]
        if not keep:
            self.cache, self.valid = None, None
            return
        self.cache, self.valid = select_rows(self.cache, self.valid, keep)
