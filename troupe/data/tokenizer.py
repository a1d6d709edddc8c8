"""Byte-level tokenizer: UTF-8 bytes are the tokens 0..255, 256 ends a document."""

from __future__ import annotations

import numpy as np


class ByteTokenizer:
    """Encodes any text losslessly; vocab_size = 257 (bytes + end of document)."""

    vocab_size = 257
    eos_id = 256

    def encode(self, text: str, eos: bool = False) -> np.ndarray:
        ids = np.frombuffer(text.encode("utf-8"), dtype=np.uint8).astype(np.uint16)
        return np.append(ids, np.uint16(self.eos_id)) if eos else ids

    def decode(self, ids) -> str:
        data = bytes(int(i) for i in ids if int(i) < 256)
        return data.decode("utf-8", errors="replace")
