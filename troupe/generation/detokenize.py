"""Turning a sequence's tokens into text as they come, never emitting half a character.

``ByteDetokenizer``: troupe's byte-level models (token t < 256 is byte t), decoded with an
incremental UTF-8 decoder. ``TextDetokenizer``: a Hugging Face tokenizer, decoded the way
streaming servers do it: the text of the tokens since a prefix offset is decoded again at each
step, and only the part past what was already emitted goes out, held back while it ends in an
incomplete character (U+FFFD) or while a byte-level merge could still change it.
"""

from __future__ import annotations

import codecs
from typing import Protocol


class Detokenizer(Protocol):
    def add(self, token: int) -> str:
        """The text that ``token`` makes final (possibly empty)."""
        ...

    def finish(self) -> str:
        """Whatever is held back, at the end of the sequence."""
        ...


class ByteDetokenizer:
    """Tokens below 256 are bytes; others (eos, specials) add no text."""

    def __init__(self) -> None:
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def add(self, token: int) -> str:
        return self._decoder.decode(bytes([token])) if 0 <= token < 256 else ""

    def finish(self) -> str:
        return self._decoder.decode(b"", final=True)


class TextDetokenizer:
    """Incremental detokenization with a Hugging Face tokenizer (``decode(ids,
    skip_special_tokens=True)``); ``context`` is how many earlier tokens are decoded with the
    new ones, so that a tokenizer whose spacing depends on the previous token decodes as a
    whole sequence would."""

    def __init__(self, tokenizer, prompt: list[int] | None = None, context: int = 5):
        self.tok = tokenizer
        self.ids = list(prompt or [])[-context:]
        self.prefix = 0               # ids[prefix:read] decode to text already emitted
        self.read = len(self.ids)

    def _decode(self, ids: list[int]) -> str:
        return self.tok.decode(ids, skip_special_tokens=True)

    def add(self, token: int) -> str:
        self.ids.append(token)
        before = self._decode(self.ids[self.prefix:self.read])
        after = self._decode(self.ids[self.prefix:])
        if len(after) <= len(before) or after.endswith("\ufffd"):
            return ""  # nothing final yet: an incomplete character, or nothing new
        new = after[len(before):]
        self.prefix, self.read = self.read, len(self.ids)
        return new

    def finish(self) -> str:
        before = self._decode(self.ids[self.prefix:self.read])
        after = self._decode(self.ids[self.prefix:])
        self.prefix = self.read = len(self.ids)
        return after[len(before):] if len(after) > len(before) else ""
