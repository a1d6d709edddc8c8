"""The one generation engine: continuous batching for a GPT with a KV cache. The server decodes
its requests with it, and the RLHF policy its rollouts (a batch of prompts queued at once and
run to the end), with the same sampler, so one prompt, seed and sampling parameters give the
same tokens in both. Sequences join the batch between decode steps and leave it when they
finish, so a long request does not hold back the ones behind it.

Each sequence of the batch has a row of the KV cache, a slot, with a length of its own
(troupe.generation.slots): a step writes each row's new keys and values at that row's position,
in place. A newcomer is prefilled straight into a free slot (prompts of different lengths
together, right-padded: the padding's keys are not written); a sequence that finishes gives
its slot up. Nothing else in the cache is
copied when sequences join and leave, and rows may advance by different counts.
"""

from __future__ import annotations

import contextlib
import threading
from collections import deque

import torch

from troupe.generation import admission, speculative
from troupe.generation.decode_layers import DecodeLayers
from troupe.generation.grammar import Grammars
from troupe.generation.prefix_cache import PrefixCache
from troupe.generation.sampling import SamplingParams
from troupe.generation.sequence import Event, Sequence, choose, chosen, drawn_on_device
from troupe.generation.slots import Slots, right_padded
from troupe.generation.static_step import StaticDecode
from troupe.kernels.small_gemm import MAX_ROWS, DecodeWeights
from troupe.models import GPT
from troupe.models.adapters import Adapters


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
    ``adapters`` (troupe.models.adapters: per row, so adapters share the batch); one whose
    parameters carry a ``constraint`` samples only the tokens its grammar allows
    (``grammars``: troupe.generation.grammar.Grammars) and ends when the grammar is complete.

    With ``lockstep`` every step runs exactly two forward passes (the decode and the prefill,
    a one-token stand-in for either when there is nothing to run): expert-parallel ranks,
    whose MoE layers exchange tokens with all_to_all, must all run the same passes.

    With ``static`` the decode steps run in fixed shapes over a cache preallocated to
    ``static_len`` positions a row (a prompt and its max_tokens; default: the model's
    context), drawing on the device (troupe.generation.static_step), compiled with ``compile``
    (a torch.compile mode, "reduce-overhead" capturing a CUDA graph per batch bucket, or a
    backend; None: not compiled): what a GPU needs. A step with a sequence that the device
    draw cannot serve (a grammar, logit adjustments, an adapter, top log-probabilities) runs
    eagerly. ``static`` may be an earlier engine's ``self.static``: its slots and compiled
    graphs serve this one (an RL policy's engine of each rollout, say).

    With ``speculate`` = k, batches of at most ``speculate_batch`` sequences decode
    speculatively (troupe.generation.speculative): up to k tokens proposed by prompt lookup or
    by a ``draft`` model (troupe.generation.draft.DraftModel), verified in one pass, the same
    tokens as without; ``speculation`` counts passes, tokens proposed and those accepted.
    """

    structured_outputs = True  # constraints are sampled here (the serving Batcher protocol)

    def __init__(self, model: GPT, eos_id: int | None, max_batch: int = 16,
                 lockstep: bool = False, tokenizer=None,
                 packed_decode: "bool | DecodeWeights" = True, grammars: Grammars | None = None,
                 prefix_cache: PrefixCache | None = None, adapters: Adapters | None = None,
                 keep_outputs: bool = False, static: "bool | StaticDecode" = False,
                 compile: str | None = None, static_len: int | None = None,
                 speculate: int = 0, speculate_batch: int = 4, draft=None):
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
        self.active: list[Sequence] = []  # sequence i holds slot i
        self.slots: Slots | None = None   # made at the first prefill
        self.static: StaticDecode | None = None
        self.speculate, self.speculate_batch, self.draft = speculate, speculate_batch, draft
        self.speculation = {"passes": 0, "proposed": 0, "accepted": 0}
        if static:  # every slot a bucket may pad to, every column, at once
            self.static = StaticDecode.of(model, max_batch, static, compile, static_len)
            self.slots = self.static.slots

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
        if self.static is not None and len(prompt) + params.max_tokens > self.slots.context:
            raise ValueError(f"prompt ({len(prompt)} tokens) plus max_tokens "
                             f"({params.max_tokens}) exceed this engine's static cache of "
                             f"{self.slots.context} positions a row")
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
        self._drop_all()
        return dropped

    def has_work(self) -> bool:
        return bool(self.active or self._waiting)

    def waiting(self) -> int:
        """Sequences queued for a free slot."""
        with self._lock:
            return len(self._waiting)

    def kv_usage(self) -> tuple[int, int]:
        """(positions of the KV cache holding real tokens, max_batch x the model's context)."""
        used = self.slots.used(len(self.active)) if self.slots is not None else 0
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
            self._drop_all()
            return [Event(s.seq_id, None, "", "error", f"decode step failed: {e!r}")
                    for s in running + newcomers]
        finished = {e.seq_id for e in events if e.finish_reason is not None}
        if self.keep_outputs and finished:
            self._keep(finished)
        self._retire(finished, {e.seq_id for e in events if e.finish_reason == "error"})
        return events

    def _keep(self, seq_ids: set[str]) -> None:
        """The finished sequences' keys and values (prompt and output, all but the last token,
        which was sampled and never run) into the prefix cache."""
        for i, s in enumerate(self.active):
            if s.seq_id not in seq_ids or not s.out:
                continue
            tokens = s.prompt + s.out[:-1]
            if self.slots.host[i] != len(tokens):  # not what the row holds: keep nothing
                continue
            self.prefix_cache.insert(tokens, *self.slots.keys(i),
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
        """Run the newcomers' prompts and choose their first tokens, as
        troupe.generation.admission plans them: from a cached prefix (``_prefill_hit``) or
        together (``_prefill_cold``)."""
        if self.prefix_cache is None:
            return self._prefill_cold(seqs)
        hits, groups = admission.plan(seqs, self.prefix_cache, self._namespace)
        events = []
        for prompt, n, blocks, group in hits:
            events += self._prefill_hit(prompt, n, blocks, group)
        for group in groups:
            events += self._prefill_cold(group)
        return events

    def _prefill_cold(self, seqs: list[Sequence]) -> list[Event]:
        """Prompts run together, each written into a free slot from its first column (the
        shorter right-padded), and kept in the prefix cache. An opening that every prompt
        shares (a chat template's system prompt: SHARED_OPENING tokens or more, under one
        adapter: troupe.generation.admission.opening) runs once, in the first slot, and is
        copied to the others before each prompt's rest runs after it."""
        first: dict[tuple, int] = {}
        rows = [first.setdefault((tuple(s.prompt), s.params.adapter), len(first)) for s in seqs]
        prompts = [list(p) for p, _ in first]
        adapters = [a for _, a in first]
        B, base = len(prompts), len(self.active)
        L = admission.opening(prompts, adapters)
        slots = self._slots(base + len(seqs), max(len(x) for x in prompts))
        if L:  # one row, under the adapter all the prompts use
            with self._routed(adapters[:1]):
                self.model.hidden(torch.tensor([prompts[0][:L]], device=self.device),
                                  cache=slots.view(base, base + 1, L))
            for j in range(1, B):
                slots.copy(base, base + j)
        idx, counts = right_padded([x[L:] for x in prompts], self.eos_id or 0)
        with self._routed(adapters):
            h, _ = self.model.hidden(idx.to(self.device),
                                     cache=slots.view(base, base + B, idx.shape[1], counts))
        self.prefill_tokens += L + sum(counts)
        last = torch.tensor(counts, device=self.device) - 1
        logits = self.model.logits(h[torch.arange(B, device=self.device), last])
        if self.prefix_cache is not None:
            for i, prompt in enumerate(prompts):
                self.prefix_cache.insert(prompt, *slots.keys(base + i),
                                         self._namespace(adapters[i]))
        return self._admit_rows(logits, rows, seqs)

    def _prefill_hit(self, prompt: list[int], n: int, blocks: list, seqs: list[Sequence]
                     ) -> list[Event]:
        """A prompt whose first ``n`` tokens' keys and values are cached (``blocks``): those
        copied into a free slot, the rest run after them, for ``seqs`` (the sequences of this
        prompt)."""
        base = len(self.active)
        slots = self._slots(base + len(seqs), len(prompt))
        slots.fill(base, [torch.cat([b.k[layer] for b in blocks], 1)
                          for layer in range(self.cfg.n_layer)],
                   [torch.cat([b.v[layer] for b in blocks], 1)
                    for layer in range(self.cfg.n_layer)])
        idx = torch.tensor([prompt[n:]], device=self.device)
        adapter = seqs[0].params.adapter
        # the few tokens after a cached prefix go through the packed product when there are
        # at most MAX_ROWS of them, as a decode step's do (MKL reads the weights at a third of
        # the speed for so few rows: kernels/small_gemm.py)
        with self._routed([adapter]), self._products():
            h, _ = self.model.hidden(idx, cache=slots.view(base, base + 1, len(prompt) - n))
        self.prefill_tokens += len(prompt) - n
        logits = self._logits(h[:, -1])
        self.prefix_cache.insert(prompt, *slots.keys(base), self._namespace(adapter))
        return self._admit_rows(logits, [0] * len(seqs), seqs)

    def _admit_rows(self, logits: torch.Tensor, rows: list[int],
                    seqs: list[Sequence]) -> list[Event]:
        """The prefill's sequences join the batch: sequence i continues prompt ``rows[i]``,
        which the prefill wrote in slot base + rows[i] (base: the first it took); the first
        sequence of each prompt holds that slot, the others a copy of it. Their first tokens
        chosen from the prompts' ``logits``."""
        base, extra = len(self.active), []
        holders: list[Sequence | None] = [None] * (max(rows) + 1)
        for s, r in zip(seqs, rows):
            if holders[r] is None:
                holders[r] = s
            else:
                extra.append((s, r))
        for j, (_, r) in enumerate(extra):
            self.slots.copy(base + r, base + len(holders) + j)
        order = holders + [s for s, _ in extra]
        self.active += order
        at = torch.tensor(list(range(len(holders))) + [r for _, r in extra], device=self.device)
        return choose(order, self.eos_id, logits.index_select(0, at))

    def _decode(self, seqs: list[Sequence]) -> list[Event]:
        """One token for every sequence of the batch (slots 0 .. B - 1), each at its own row's
        position."""
        if self.speculate and len(seqs) <= self.speculate_batch:
            events = speculative.step(self, seqs, self.speculate)
            if events is not None:
                return events
        if self.static is not None and all(map(drawn_on_device, seqs)):
            return chosen(seqs, self.eos_id, *self.static(
                [(s.out[-1], s.params.temperature, s.params.top_k, s.params.top_p,
                  s.seed or 0, len(s.out)) for s in seqs]))
        idx = torch.tensor([[s.out[-1]] for s in seqs], device=self.device)
        names = [s.params.adapter for s in seqs]
        fused = self._fused()
        cache = self.slots.view(0, len(seqs), 1)
        if fused is not None and len(seqs) <= MAX_ROWS and self.slots.dtype == torch.float32:
            slots = self.adapters.slot_ids(names) if self._adapted() else None
            with self._routed(names) if fused.routed else contextlib.nullcontext():
                if fused.has_logits:
                    return choose(seqs, self.eos_id, *fused.logits(idx, None, cache, slots))
                h = fused.hidden(idx, None, cache, slots)
            return choose(seqs, self.eos_id, self._logits(h))
        with self._routed(names), self._products():
            h, _ = self.model.hidden(idx, cache=cache)
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

    # ---- the slots (troupe.generation.slots) ---------------------------------------------
    def _slots(self, rows: int, columns: int) -> Slots:
        """The engine's slots, with at least ``rows`` of room for ``columns`` positions and a
        few tokens after them (made at the first prefill)."""
        columns = min(columns + 16, self.slots.context if self.slots else self.cfg.seq_len)
        if self.slots is None:
            self.slots = Slots(self.cfg, self.max_batch, rows, columns, self.device,
                               self.model.dtype, kv_heads=self.model.cache_heads)
        self.slots.reserve(rows, columns)
        return self.slots

    def _retire(self, seq_ids: set[str], failed: set[str] = frozenset()) -> None:
        """The sequences ``seq_ids`` give their slots up (those of ``failed``, whose logits
        were not finite, zeroed); the others keep the first slots."""
        live = [i for i, s in enumerate(self.active) if s.seq_id not in seq_ids]
        if len(live) == len(self.active):
            return
        spoilt = [i for i, s in enumerate(self.active) if s.seq_id in failed]
        order = self.slots.keep(live, spoilt)
        if self.draft is not None:
            self.draft.keep(live)
        self.active = [self.active[i] for i in order]

    def _drop_all(self) -> None:
        self.active = []
        for cache in (self.slots, self.draft):
            if cache is not None:
                cache.clear()
