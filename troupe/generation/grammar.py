"""Constrained decoding: a JSON schema, any JSON object, a regular expression or a Lark grammar,
enforced token by token in the engine's sampler, so that the server's structured outputs and
the rollouts use the same mask.

llguidance does the work (a maintained Rust library, also behind vLLM's, SGLang's and
llama.cpp's "guidance" backends): ``Grammars`` holds its view of one tokenizer (built once,
half a second for a 49k vocabulary) and the grammars compiled from each ``Constraint``
(cached: the same schema over many requests compiles once); a ``Matcher`` follows one
sequence, gives the tokens allowed next as a mask over the vocabulary and takes each token
chosen. Measured against xgrammar on SmolLM2's tokenizer (benchmarks/structured.py,
benchmarks/RESULTS.md "Structured outputs"): xgrammar's masks are faster (0.013 ms median
against 0.036), but both are a few hundredths of a decode step; llguidance compiles a new
schema in 2 ms against 134 ms (a server meets many schemas, each request may bring its own)
and needs no other package, where xgrammar pulls triton and a TVM runtime.

Which log-probabilities: the engine samples from the masked distribution (the model's logits
with the disallowed tokens at -inf, renormalised) and reports a chosen token's log-probability
under both, the model's own (``Event.logprob``, as without a grammar) and the masked one
(``Event.sampled_logprob``); a policy trained on constrained rollouts is asked for the
distribution it samples from, so the RL side takes the masked one when a constraint is set.
"""

from __future__ import annotations

import json
import threading
from dataclasses import dataclass
from typing import Literal

import numpy as np
import torch

Kind = Literal["json_object", "json_schema", "regex", "grammar"]
# JSON as json.dumps writes it, one space after "," and ":", none elsewhere: free whitespace
# would let a sampled output run to max_tokens in blanks, and a bounded schema must end
JSON_LAYOUT = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


class GrammarError(ValueError):
    """A constraint the grammar library cannot compile; the message names the construct."""


@dataclass(frozen=True)
class Constraint:
    """What the output must be: ``json_object`` (any JSON object), ``json_schema`` (``spec``:
    the schema as JSON text), ``regex`` (``spec``: a regular expression the whole output
    matches) or ``grammar`` (``spec``: a Lark grammar whose ``start`` rule the output is)."""

    kind: Kind
    spec: str = ""

    def source(self) -> str:
        """The grammar in llguidance's form."""
        import llguidance

        M = llguidance.LLMatcher
        if self.kind == "json_object":
            return M.grammar_from_json_schema({"type": "object"}, defaults=JSON_LAYOUT)
        if self.kind == "json_schema":
            try:
                schema = json.loads(self.spec)
            except json.JSONDecodeError as e:
                raise GrammarError(f"the schema is not valid JSON: {e}") from None
            if not isinstance(schema, (dict, bool)):
                raise GrammarError("the schema must be a JSON object")
            return M.grammar_from_json_schema(schema, defaults=JSON_LAYOUT)
        if self.kind == "regex":
            return M.grammar_from_regex(self.spec)
        if self.kind == "grammar":
            return M.grammar_from_lark(self.spec)
        raise GrammarError(f"unknown constraint kind {self.kind!r}")


class Grammars:
    """llguidance's view of one tokenizer (a Hugging Face fast tokenizer, ``vocab_size`` the
    width of the model's logits) and the grammars compiled for it, shared by every sequence
    and thread."""

    def __init__(self, hf_tokenizer, vocab_size: int, eos_id: int):
        try:
            import llguidance
        except ImportError:
            raise ImportError("structured outputs need llguidance: pip install "
                              "'troupe[grammar]'") from None
        from copy import copy

        backend = copy(hf_tokenizer.backend_tokenizer)  # its own JSON, added tokens included
        backend.no_padding()
        backend.no_truncation()
        self.llg = llguidance
        self.tokenizer = llguidance.LLTokenizer(backend.to_str(), n_vocab=vocab_size,
                                                eos_token=eos_id)
        self.vocab_size = vocab_size
        self._compiled: dict[Constraint, str] = {}
        self._lock = threading.Lock()

    def check(self, c: Constraint) -> str:
        """``c`` compiled (and cached); GrammarError naming what is wrong with it."""
        with self._lock:
            if c in self._compiled:
                return self._compiled[c]
        try:
            source = c.source()
        except ValueError as e:
            raise GrammarError(str(e)) from None
        bad, messages = self.llg.LLMatcher.validate_grammar_with_warnings(source, self.tokenizer)
        if bad:
            raise GrammarError(messages[0])
        with self._lock:
            self._compiled[c] = source
        return source

    def matcher(self, c: Constraint) -> "Matcher":
        """A new sequence's matcher at the start of the output."""
        m = self.llg.LLMatcher(self.tokenizer, self.check(c), log_level=0)
        if m.is_error():
            raise GrammarError(m.get_error())
        return Matcher(m, self.vocab_size)


class Matcher:
    """One sequence's place in its grammar."""

    def __init__(self, matcher, vocab_size: int):
        self.m, self.vocab_size = matcher, vocab_size

    def allowed(self) -> torch.Tensor:
        """(V,) bool: the tokens that keep the output inside the grammar (eos once it may
        end)."""
        bits = np.unpackbits(np.frombuffer(self.m.compute_bitmask(), dtype=np.uint8),
                             bitorder="little")  # token t is bit t % 32 of word t // 32
        return torch.from_numpy(bits[:self.vocab_size].view(np.bool_))

    def accept(self, token: int) -> None:
        """Take the chosen token; RuntimeError if the grammar refuses it (a bug: the mask
        allowed it)."""
        if not self.m.consume_token(token) or self.m.is_error():
            raise RuntimeError(f"the grammar refused token {token}: {self.m.get_error()}")

    @property
    def done(self) -> bool:
        """Nothing more may follow (the output is complete)."""
        return self.m.is_stopped()
