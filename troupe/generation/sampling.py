"""Sampling one token from next-token logits: a bias per token, presence, frequency and
repetition penalties, temperature, top-k, nucleus (top-p), a seed per sequence."""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Iterable

import torch

if TYPE_CHECKING:
    from troupe.generation.grammar import Constraint


@dataclass(frozen=True)
class SamplingParams:
    """max_tokens: tokens to generate at most; temperature 0 is greedy decoding; top_p keeps
    the smallest set of tokens whose probability adds up to it; seed makes sampling
    repeatable; stop: strings that end the text (not included in it); logprobs: report each
    chosen token's log-probability under the model (the log-softmax of its logits, before
    temperature and top-p) and that many of the most likely tokens beside it (None: none);
    constraint: what the output must be (troupe.generation.grammar: a JSON schema, any JSON
    object, a regex, a Lark grammar), enforced by masking the logits at every token; adapter:
    the LoRA adapter this sequence runs with (troupe.models.adapters; None: the base model).

    Adjusting the logits before temperature, top-k and top-p (OpenAI's and vLLM's fields, the
    same meanings; LogitAdjust applies them): ``logit_bias``, (token id, bias in [-100, 100])
    pairs (a dict is taken too), added to the token's logit; ``repetition_penalty`` (> 0, 1:
    off) divides the positive logits, and multiplies the negative ones, of every token the
    prompt or the output holds, as transformers' and vLLM's do; ``frequency_penalty`` and
    ``presence_penalty`` (in [-2, 2]) subtract, from each token's logit, its count in the
    output so far times the first and, once it occurs, the second. ``top_k`` keeps the k most
    likely tokens (0: all).

    Ending (vLLM's fields): ``stop_token_ids`` end the sequence as the end-of-text token does
    (each is counted in the output, none in the text); ``ignore_eos`` lets the end-of-text
    token pass as any other, so that only max_tokens, stop strings and stop_token_ids end the
    sequence; before ``min_tokens`` tokens, the end-of-text and stop tokens cannot be chosen
    and stop strings do not end it; ``include_stop_str_in_output`` keeps the stop string
    that ended the text in it."""

    max_tokens: int = 16
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    logprobs: int | None = None
    constraint: "Constraint | None" = None
    adapter: str | None = None
    logit_bias: tuple[tuple[int, float], ...] = ()
    repetition_penalty: float = 1.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    top_k: int = 0
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    min_tokens: int = 0
    include_stop_str_in_output: bool = False


MIN_TEMPERATURE = 1e-5  # below it, logits / temperature can overflow float32: greedy instead
SEED_RANGE = 2 ** 64    # a seed is 64 bits (``uniform``'s key)

# The draws are counter-based: the uniform number that picks a sequence's token at output
# position i is a function of (its seed, i) alone (SplitMix64's mixing of both), not the state
# of a generator that earlier draws advanced. A sequence's tokens then never depend on what
# else ran or in which order, and a device step (a captured CUDA graph, which cannot call a
# host generator) computes the same numbers from the same integers (``uniforms``). Before
# this, a seed drew from torch.Generator(seed): a seed's tokens changed once, with this.
_GOLDEN, _MIX1, _MIX2 = 0x9E3779B97F4A7C15, 0xBF58476D1CE4E5B9, 0x94D049BB133111EB
_MASK = (1 << 64) - 1


def _mix(z: int) -> int:
    z = ((z ^ (z >> 30)) * _MIX1) & _MASK
    z = ((z ^ (z >> 27)) * _MIX2) & _MASK
    return z ^ (z >> 31)


def uniform(seed: int, position: int) -> float:
    """The uniform number in [0, 1) of ``seed``'s draw at output ``position`` (53 bits)."""
    z = _mix((_mix((seed + _GOLDEN) & _MASK) + (position + 1) * _GOLDEN) & _MASK)
    return (z >> 11) * 2.0 ** -53


def uniforms(seeds: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """``uniform`` elementwise on int64 tensors (seeds as two's complement), on any device,
    without leaving it: float64, bit for bit the host's numbers."""
    def shr(z, k):  # a logical shift of the 64 bits (torch's >> keeps the sign)
        return (z >> k) & ((1 << (64 - k)) - 1)

    def mix(z):
        z = (z ^ shr(z, 30)) * as_int64(_MIX1)  # int64 products wrap, as the host's mask does
        z = (z ^ shr(z, 27)) * as_int64(_MIX2)
        return z ^ shr(z, 31)
    z = mix(mix(seeds + as_int64(_GOLDEN)) + (positions + 1) * as_int64(_GOLDEN))
    return shr(z, 11).double() * 2.0 ** -53


def as_int64(x: int) -> int:
    """A 64-bit pattern (a seed of SEED_RANGE, a mixing constant) as the int64 that holds
    it."""
    return x - (1 << 64) if x >= 1 << 63 else x


def checked(p: SamplingParams) -> SamplingParams:
    """``p`` within the ranges the sampler is safe in: a temperature under MIN_TEMPERATURE is
    greedy decoding, a seed is taken modulo 2**64. ValueError naming the field for values no
    range fixes (a non-finite temperature, top_p outside (0, 1], max_tokens < 1)."""
    if not (isinstance(p.max_tokens, int) and p.max_tokens >= 1):
        raise ValueError(f"max_tokens: must be a whole number >= 1, got {p.max_tokens!r}")
    if not (math.isfinite(p.temperature) and p.temperature >= 0):
        raise ValueError(f"temperature: must be a finite number >= 0, got {p.temperature!r}")
    if not (math.isfinite(p.top_p) and 0 < p.top_p <= 1):
        raise ValueError(f"top_p: must be in (0, 1], got {p.top_p!r}")
    if p.logprobs is not None and not (isinstance(p.logprobs, int) and 0 <= p.logprobs <= 20):
        raise ValueError(f"logprobs: must be a whole number in [0, 20], got {p.logprobs!r}")
    if not (math.isfinite(p.repetition_penalty) and p.repetition_penalty > 0):
        raise ValueError(f"repetition_penalty: must be a finite number > 0, got "
                         f"{p.repetition_penalty!r}")
    for name in ("frequency_penalty", "presence_penalty"):
        value = getattr(p, name)
        if not (math.isfinite(value) and -2 <= value <= 2):
            raise ValueError(f"{name}: must be in [-2, 2], got {value!r}")
    if not (isinstance(p.top_k, int) and p.top_k >= 0):
        raise ValueError(f"top_k: must be a whole number >= 0 (0: every token), got {p.top_k!r}")
    if not (isinstance(p.min_tokens, int) and 0 <= p.min_tokens <= p.max_tokens):
        raise ValueError(f"min_tokens: must be a whole number in [0, max_tokens="
                         f"{p.max_tokens}], got {p.min_tokens!r}")
    if not all(isinstance(t, int) and not isinstance(t, bool) and t >= 0
               for t in p.stop_token_ids):
        raise ValueError(f"stop_token_ids: token ids are whole numbers >= 0, got "
                         f"{list(p.stop_token_ids)!r}")
    temperature = p.temperature if p.temperature >= MIN_TEMPERATURE else 0.0
    seed = p.seed % SEED_RANGE if p.seed is not None else None
    return replace(p, temperature=temperature, seed=seed, stop=tuple(p.stop),
                   logit_bias=_bias_pairs(p.logit_bias), stop_token_ids=tuple(p.stop_token_ids))


def check_tokens(p: SamplingParams, vocab_size: int) -> None:
    """ValueError naming the field for a token id of ``p`` outside the vocabulary."""
    for field, tokens in (("logit_bias", [t for t, _ in p.logit_bias]),
                          ("stop_token_ids", p.stop_token_ids)):
        outside = [t for t in tokens if t >= vocab_size]
        if outside:
            raise ValueError(f"{field}: token {outside[0]} is not in the model's vocabulary "
                             f"(ids 0 to {vocab_size - 1})")


def _bias_pairs(bias: dict | Iterable) -> tuple[tuple[int, float], ...]:
    """``logit_bias`` as sorted (token, bias) pairs, each checked."""
    pairs = bias.items() if isinstance(bias, dict) else bias
    out = {}
    for token, value in pairs:
        if isinstance(token, bool) or not isinstance(token, int) or token < 0:
            raise ValueError(f"logit_bias: token ids are whole numbers >= 0, got {token!r}")
        if isinstance(value, bool) or not isinstance(value, (int, float)) \
                or not -100 <= value <= 100:  # NaN fails the comparison too
            raise ValueError(f"logit_bias: the bias of token {token} must be a number in "
                             f"[-100, 100], got {value!r}")
        out[token] = float(value)
    return tuple(sorted(out.items()))


class LogitAdjust:
    """One sequence's ``logit_bias``, penalties and ``min_tokens`` (SamplingParams), with what
    they read: the tokens its prompt holds, how often each occurs in its output, and the
    tokens that would end it (``enders``: end-of-text and stop tokens, banned before
    min_tokens). ``apply`` gives the adjusted logits of a step (a new tensor); ``accept``
    counts the token chosen."""

    def __init__(self, p: SamplingParams, prompt: list[int], vocab_size: int,
                 enders: list[int] = ()):
        self.p = p
        # every tensor here is the host's: the engine samples from logits copied to the host
        # (its generators are CPU ones). All of them are short lists of token ids, so that a
        # step's adjustments touch those tokens, not the whole vocabulary.
        self.generated = 0
        self.enders = torch.tensor(sorted(set(enders)), dtype=torch.long)  # host: see above
        self.bias = None
        if p.logit_bias:
            self.bias = tuple(torch.tensor(v) for v in zip(*p.logit_bias))  # host: see above
        self.counts: dict[int, int] = {}  # the output's count of each token
        self.penalty = None  # (ids, what to subtract) of the frequency and presence penalties
        self.seen = set(prompt) if p.repetition_penalty != 1.0 else None  # prompt and output
        self.seen_ids = None if self.seen is None else self._ids(self.seen)

    @staticmethod
    def _ids(tokens) -> torch.Tensor:
        return torch.tensor(sorted(tokens), dtype=torch.long)  # host: see __init__

    @staticmethod
    def wanted(p: SamplingParams) -> bool:
        """Whether ``p`` samples from other than the model's own distribution."""
        return bool(p.logit_bias) or p.repetition_penalty != 1.0 \
            or p.frequency_penalty != 0 or p.presence_penalty != 0 or p.min_tokens > 0

    def apply(self, logits_V: torch.Tensor) -> torch.Tensor:
        p, out = self.p, logits_V.float().clone()
        if self.seen_ids is not None:
            hit = out[self.seen_ids]
            out[self.seen_ids] = torch.where(hit > 0, hit / p.repetition_penalty,
                                             hit * p.repetition_penalty)
        if self.penalty is not None:
            out.index_add_(0, *self.penalty)
        if self.bias is not None:
            out.index_add_(0, *self.bias)
        if self.generated < p.min_tokens and len(self.enders):
            out[self.enders] = float("-inf")
        return out

    def accept(self, token: int) -> None:
        p = self.p
        self.generated += 1
        self.counts[token] = self.counts.get(token, 0) + 1
        if p.frequency_penalty or p.presence_penalty:
            ids = self._ids(self.counts)
            counts = torch.tensor([float(self.counts[t]) for t in ids.tolist()])  # host: above
            self.penalty = (ids, -(p.frequency_penalty * counts + p.presence_penalty))
        if self.seen is not None and token not in self.seen:
            self.seen.add(token)
            self.seen_ids = self._ids(self.seen)


NON_FINITE = "the model produced non-finite logits for this sequence"


def sample(logits_V: torch.Tensor, p: SamplingParams, u: float | None = None) -> int:
    """A token from one sequence's logits (V,): argmax at temperature 0, else a draw from the
    tempered (and top-k/top-p truncated) distribution with the uniform number ``u`` (see
    ``uniform``; None: the draw of ``p.seed`` at position 0, or of a fresh seed without one).
    Raises FloatingPointError for logits that are not all finite."""
    if not bool(torch.isfinite(logits_V).all()):
        raise FloatingPointError(NON_FINITE)
    if p.temperature <= 0:
        return int(logits_V.argmax())
    if u is None:
        u = uniform(p.seed if p.seed is not None else torch.seed() % SEED_RANGE, 0)
    return draw(logits_V, p, u)


def finite_rows(logits_BV: torch.Tensor) -> torch.Tensor:
    """(B,) bool: which rows hold only finite values. Two reductions over the batch (a NaN
    carries through max and min, an infinity shows in one of them) instead of an elementwise
    test per row: 8 rows of a 49152-token vocabulary cost 1.2 ms a decode step that way."""
    return torch.isfinite(logits_BV.amax(-1)) & torch.isfinite(logits_BV.amin(-1))


def draw(logits_V: torch.Tensor, p: SamplingParams, u: float) -> int:
    """``sample``'s draw at a temperature above 0, for logits already known to be finite:
    top-k first, then top-p over what top-k kept. One uniform number ``u`` in [0, 1) picks
    the token through the distribution's cumulative sum (torch.multinomial took 1.2 ms for
    one draw over SmolLM2's 49,152 tokens, a quarter of a decode step at batch 8; this takes
    0.04 ms)."""
    logits, ids = logits_V.float().cpu() / p.temperature, None
    if 0 < p.top_k < logits.numel():
        logits, ids = logits.topk(p.top_k)  # the likeliest first
    probs = torch.softmax(logits, -1)
    if p.top_p < 1.0:
        if ids is None:
            probs, ids = _likeliest(probs, p.top_p)
        keep = int((probs.cumsum(0) - probs < p.top_p).sum())  # the first token is always kept
        probs, ids = probs[:keep], ids[:keep]
    if ids is None:
        return _inverse_cdf(probs, u)
    # the kept tokens in the vocabulary's order, not the probabilities': two nearly equal
    # probabilities that swap places under rounding (another batch, another kernel) would
    # otherwise swap which of them a draw lands on
    ids, order = ids.sort()
    return int(ids[_inverse_cdf(probs[order], u)])


def _likeliest(probs: torch.Tensor, mass: float) -> tuple[torch.Tensor, torch.Tensor]:
    """The likeliest tokens, in order, enough of them to hold ``mass``: the top 64, else the
    top 1024, else all of them sorted (sorting SmolLM2's 49,152 takes 2-4 ms a draw; a model's
    distribution is mostly far narrower than 64 tokens)."""
    for k in (64, 1024):
        if k < probs.numel():
            top = probs.topk(k)
            if float(top.values.sum()) >= mass:
                return top.values, top.indices
    return probs.sort(descending=True)


def _inverse_cdf(probs: torch.Tensor, u: float) -> int:
    """The index whose share of the cumulative sum holds ``u`` times the total: each index
    with the probability it has, a zero-probability one never."""
    cdf = probs.double().cumsum(0)
    i = int(torch.searchsorted(cdf, cdf[-1:] * u, right=True))
    if i >= len(cdf):  # u rounded up to the total: the last index that has probability
        i = int((probs > 0).nonzero()[-1])
    return i


def draw_rows(logits_BV: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor,
              top_p: torch.Tensor, seeds: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """``draw`` (and greedy where a row's temperature is 0) for every row at once, on the
    logits' device and without leaving it: fixed shapes and no host read, as a captured
    decode step needs. Per row (B,): temperature, top_k (0: all), top_p, seed (int64, two's
    complement) and output position; returns the tokens (B,) int64. The kept tokens' cumulative
    sum runs in the vocabulary's order, in float64, as ``draw``'s: the same tokens, but for a
    uniform number within rounding of a boundary between two tokens."""
    B, V = logits_BV.shape
    greedy = logits_BV.argmax(-1)
    warm = temperature > 0
    logits = logits_BV.float() / torch.where(warm, temperature, 1.0)[:, None]
    ordered, order = logits.sort(-1, descending=True)
    k = torch.where((top_k > 0) & (top_k < V), top_k, V)
    ranks = torch.arange(V, device=logits.device)[None]
    ordered = ordered.masked_fill(ranks >= k[:, None], float("-inf"))  # top-k, then top-p
    probs = torch.softmax(ordered, -1)
    kept = ((probs.cumsum(-1) - probs < top_p[:, None]) | (top_p[:, None] >= 1.0)) \
        & (ranks < k[:, None])
    probs = torch.zeros_like(probs).scatter(-1, order, probs * kept)  # the vocabulary's order
    cdf = probs.double().cumsum(-1)
    u = uniforms(seeds, positions) * cdf[:, -1]
    token = torch.searchsorted(cdf, u[:, None], right=True)[:, 0]
    last = V - 1 - (probs > 0).flip(-1).int().argmax(-1)  # u rounded up to the total
    token = torch.minimum(token, last)
    return torch.where(warm, token, greedy)
