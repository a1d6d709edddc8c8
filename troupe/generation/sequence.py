"""A sequence as the engine (troupe.generation.engine) carries it, and what one step does for
it: its next token chosen from its row of logits (``choose``: the sampler, its constraint's
mask, its logit adjustments, its log-probabilities) and the text that token makes final
(``Sequence.advance``: stop strings, limits, text held back while it could still become a
stop string). The Event is what the engine hands out for it."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from troupe.generation.detokenize import ByteDetokenizer, Detokenizer, TextDetokenizer
from troupe.generation.grammar import Grammars, Matcher
from troupe.generation.sampling import (NON_FINITE, SEED_RANGE, LogitAdjust, SamplingParams,
                                        check_tokens, checked, draw, finite_rows, uniform)
from troupe.models.adapters import Adapters


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
class Sequence:
    """A sequence of the batch: its prompt, parameters and seed, its output so far and
    what turns tokens into text (detokenizer, stop strings, constraint, logit adjustments)."""

    seq_id: str
    prompt: list[int]
    params: SamplingParams
    seed: int | None  # the draws' key (sampling.uniform): None when greedy
    detok: Detokenizer
    out: list[int] = field(default_factory=list)
    text: str = ""      # decoded output so far
    sent: int = 0       # characters of ``text`` already handed out
    searched: int = 0   # characters of ``text`` already searched for stop strings
    matcher: Matcher | None = None  # its constraint's state (troupe.generation.grammar)
    adjust: LogitAdjust | None = None  # its logit_bias, penalties and min_tokens
    lookup: Any = None  # its proposer, when the engine speculates (generation.speculative)

    @classmethod
    def begin(cls, seq_id: str, prompt: list[int], params: SamplingParams, cfg,
              eos_id: int | None, tokenizer=None, grammars: Grammars | None = None,
              adapters: Adapters | None = None) -> Sequence:
        """A new sequence of a model whose config is ``cfg`` (its context and vocabulary),
        its request checked: ValueError naming the field for one that cannot be served."""
        params = checked(params)
        if not prompt:
            raise ValueError("prompt: at least one token is needed")
        if len(prompt) + params.max_tokens > cfg.seq_len:
            raise ValueError(f"prompt ({len(prompt)} tokens) plus max_tokens "
                             f"({params.max_tokens}) exceed the model's context of "
                             f"{cfg.seq_len} tokens")
        seed = None
        if params.temperature > 0:  # an unseeded request draws from a seed of its own
            seed = params.seed if params.seed is not None else torch.seed() % SEED_RANGE
        detok = (ByteDetokenizer() if tokenizer is None
                 else TextDetokenizer(tokenizer, list(prompt)))
        if params.adapter is not None and (adapters is None
                                           or params.adapter not in adapters.slots):
            raise ValueError(f"adapter: {params.adapter!r} is not loaded"
                             + (f" (loaded: {sorted(adapters.slots)})" if adapters
                                else ""))
        matcher = None
        if params.constraint is not None:
            if grammars is None:
                raise ValueError("constraint: this engine has no grammar support (it needs "
                                 "the model's Hugging Face tokenizer)")
            matcher = grammars.matcher(params.constraint)  # GrammarError, a ValueError
        check_tokens(params, cfg.vocab_size)
        enders = list(params.stop_token_ids) + (
            [eos_id] if eos_id is not None and not params.ignore_eos else [])
        adjust = LogitAdjust(params, prompt, cfg.vocab_size, enders) \
            if LogitAdjust.wanted(params) else None
        return cls(seq_id, list(prompt), params, seed, detok, matcher=matcher, adjust=adjust)

    def advance(self, token: int, eos_id: int | None) -> Event:
        """Account for ``token``: extend the text, check stop strings and limits, and say how
        much text is final (text that could still become a stop string is held back)."""
        finish, p = None, self.params
        if (token == eos_id and not p.ignore_eos) or token in p.stop_token_ids:
            finish = "stop"
        else:
            self.text += self.detok.add(token)
            if self.matcher is not None and self.matcher.done:  # the grammar's output is complete
                finish = "stop"
        # a stop string counts where it ends in this token's text (none before min_tokens)
        longest = max((len(x) for x in p.stop), default=0)
        cut, stop = -1, ""
        if len(self.out) >= p.min_tokens:
            start = max(0, self.searched - longest + 1)
            cut, stop = min(((i, x) for x in p.stop if (i := self.text.find(x, start)) >= 0),
                            default=(-1, ""))
        self.searched = len(self.text)
        if cut >= 0:
            cut += len(stop) if p.include_stop_str_in_output else 0
            self.text, finish = self.text[:cut], "stop"
        elif finish is None and len(self.out) >= p.max_tokens:
            finish = "length"
        if finish is not None:
            self.text += self.detok.finish() if cut < 0 else ""
            ready = len(self.text)
        else:
            ready = len(self.text) - max(longest - 1, 0)
        delta = self.text[self.sent:max(ready, self.sent)]
        self.sent += len(delta)
        return Event(self.seq_id, token, delta, finish)


def choose(seqs: list[Sequence], eos_id: int | None, logits_BV: torch.Tensor,
           greedy: list[int] | None = None, finite: list[bool] | None = None) -> list[Event]:
    """Each sequence's next token from its row of logits (drawn with its own seed,
    under its constraint and logit adjustments), and the event it makes; ``greedy`` and
    ``finite``: each row's argmax and finiteness when the step computed them (the fused one
    does). A sequence whose row fails ends with an "error" event; the others go on."""
    events = []
    logits_BV = logits_BV.float().cpu()  # one copy per step
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
                draw(logits if sampled is None else sampled, s.params,
                     uniform(s.seed, len(s.out)))
            if s.matcher is not None:
                s.matcher.accept(token)
            if s.adjust is not None:
                s.adjust.accept(token)
        except Exception as e:  # this sequence ends; the others go on
            events.append(Event(s.seq_id, None, "", "error", f"{type(e).__name__}: {e}"))
            continue
        s.out.append(token)
        ev = s.advance(token, eos_id)
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


def chosen(seqs: list[Sequence], eos_id: int | None, tokens: list[int], logprobs: list[float],
           finite: list[bool]) -> list[Event]:
    """The events of tokens a step drew itself (troupe.generation.static_step), for sequences
    it can serve (``drawn_on_device``): each with its log-probability when asked for; a row
    that was not finite ends its sequence with an "error" event."""
    events = []
    for s, token, logp, ok in zip(seqs, tokens, logprobs, finite):
        if not ok:
            events.append(Event(s.seq_id, None, "", "error", f"FloatingPointError: {NON_FINITE}"))
            continue
        s.out.append(token)
        ev = s.advance(token, eos_id)
        if s.params.logprobs is not None:
            ev.logprob = logp
        events.append(ev)
    return events


def drawn_on_device(s: Sequence) -> bool:
    """Whether a device step's draw serves ``s``: no grammar, logit adjustments, adapter or
    top log-probabilities (those are chosen on the host, ``choose``)."""
    return (s.matcher is None and s.adjust is None and s.params.adapter is None
            and not s.params.logprobs)
