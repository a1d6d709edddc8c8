"""Deterministic language-model batches: documents shuffled by a seed, split into train and
validation token streams, and windows drawn as a function of (seed, step) alone, so that a
resumed run sees exactly the batches an uninterrupted one would."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
from pydantic import Field

from troupe.config import Config
from troupe.data.corpus import file_documents, stdlib_documents
from troupe.data.tokenizer import ByteTokenizer, HFTokens


class DataConfig(Config):
    """source: "stdlib" (docstrings of Python's standard library), a .txt, .jsonl or .parquet
    file or a list of them (read whole into memory), or a corpus to stream: a directory, a
    glob or an fsspec URL of such shards (troupe.data.stream: tokenized once off the trainers,
    read window by window; the kind of source decides). val_fraction of the documents (at
    least one) is held out for validation (streamed: by each document's hash, stable as
    shards are added); max_chars: keep at most this many tokens of each stream (bytes, for
    the byte tokenizer; in-memory sources). text_column: the field of a jsonl or parquet row
    that holds the text. skip_bad: a streamed corpus' bad rows and files (no text, not
    readable, empty) are skipped and counted instead of stopping the run (the count and the
    first one in metrics.jsonl's "data" record). cache_dir: where a streamed corpus' tokens
    go (default troupe's cache, tokens/): a directory every trainer's node reaches."""

    source: str | list[str] = "stdlib"
    val_fraction: float = Field(default=0.05, gt=0, lt=1)
    seed: int = 1234
    max_chars: int | None = Field(default=None, ge=1)
    text_column: str = "text"
    skip_bad: bool = False
    cache_dir: str | None = None


class TokenDataset:
    """Train and validation token streams of one corpus, tokenized by troupe's byte tokenizer
    or a Hugging Face model's (HFTokens), each document ending with the end-of-text token."""

    def __init__(self, cfg: DataConfig, tokenizer: ByteTokenizer | HFTokens | None = None):
        self.cfg, self.tokenizer = cfg, tokenizer or ByteTokenizer()
        docs = stdlib_documents() if cfg.source == "stdlib" else file_documents(
            [cfg.source] if isinstance(cfg.source, str) else [Path(p) for p in cfg.source],
            cfg.text_column)
        if len(docs) < 2:
            raise ValueError("data: need at least 2 documents for a train/validation split")
        order = np.random.default_rng(cfg.seed).permutation(len(docs))
        n_val = max(1, round(cfg.val_fraction * len(docs)))
        val, train = [docs[i] for i in order[:n_val]], [docs[i] for i in order[n_val:]]
        self.train = self._stream(train)
        self.val = self._stream(val)

    def _stream(self, docs: list[str]) -> np.ndarray:
        tok = self.tokenizer
        if isinstance(tok, HFTokens):  # the fast tokenizer encodes the batch in parallel
            eos = [tok.eos_id]
            ids = np.concatenate([np.asarray(d + eos, dtype=np.int32) for d in
                                  tok.hf(docs, add_special_tokens=False)["input_ids"]])
        else:
            ids = np.concatenate([tok.encode(d, eos=True) for d in docs])
        return ids[:self.cfg.max_chars] if self.cfg.max_chars else ids

    def train_batch(self, step: int, batch_size: int, seq_len: int, rank: int = 0,
                    world: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
        """Rank ``rank``'s rows of global batch ``step`` (batch_size rows in all): inputs and
        next-token targets, each (batch_size / world, seq_len)."""
        if batch_size % world:
            raise ValueError(f"batch_size={batch_size} does not split over {world} ranks")
        if len(self.train) <= seq_len + 1:
            raise ValueError(f"training stream of {len(self.train)} tokens is shorter than "
                             f"seq_len={seq_len}")
        rng = np.random.default_rng([self.cfg.seed, step])
        starts = rng.integers(0, len(self.train) - seq_len - 1, size=batch_size)
        per = batch_size // world
        return self._windows(self.train, starts[rank * per:(rank + 1) * per], seq_len)

    def val_batches(self, num_batches: int, batch_size: int, seq_len: int, rank: int = 0,
                    world: int = 1):
        """The same fixed validation windows every time (evenly spaced over the stream)."""
        total = num_batches * batch_size
        span = len(self.val) - seq_len - 1
        if span <= 0:
            raise ValueError(f"validation stream of {len(self.val)} tokens is shorter than "
                             f"seq_len={seq_len}; raise data.val_fraction")
        starts = np.linspace(0, span, total).astype(np.int64)
        per = batch_size // world
        for b in range(num_batches):
            rows = starts[b * batch_size:(b + 1) * batch_size][rank * per:(rank + 1) * per]
            yield self._windows(self.val, rows, seq_len)

    @staticmethod
    def _windows(stream: np.ndarray, starts: np.ndarray, seq_len: int):
        idx = starts[:, None] + np.arange(seq_len + 1)[None, :]
        w = torch.from_numpy(stream[idx].astype(np.int64))
        return w[:, :-1], w[:, 1:]


def open_dataset(cfg: DataConfig, tokenizer_dir: str | None = None,
                tokenizer: ByteTokenizer | HFTokens | None = None):
    """The dataset ``cfg`` names: a streamed corpus (troupe.data.stream.StreamDataset, its
    tokens prepared once, ``tokenizer_dir``'s tokenizer or troupe's bytes) or the in-memory
    TokenDataset (``tokenizer``); both give ``train_batch`` and ``val_batches``."""
    from troupe.data.stream import StreamDataset, is_stream, prepare
    if is_stream(cfg.source):
        return StreamDataset(prepare(cfg, tokenizer_dir, cfg.cache_dir), cfg.seed)
    return TokenDataset(cfg, tokenizer)


def micro_batches(n: int, size: int | None) -> list[slice]:
    """Row slices of a batch of ``n`` rows, ``size`` rows each (None: one slice): the
    micro-batches a rank runs forward and backward one at a time, accumulating gradients."""
    size = size or max(n, 1)
    return [slice(i, min(i + size, n)) for i in range(0, n, size)]


def token_micro_batches(lengths: list[int], budget: int) -> list[slice]:
    """Row slices of consecutive rows whose ``lengths`` (real tokens) add up to at most
    ``budget`` each (a row longer than the budget makes a slice of its own): micro-batches
    of a token budget, for packed batches (troupe.models.packing), whatever the rows'
    lengths."""
    out, start, total = [], 0, 0
    for i, n in enumerate(lengths):
        if i > start and total + n > budget:
            out.append(slice(start, i))
            start, total = i, 0
        total += n
    if lengths:
        out.append(slice(start, len(lengths)))
    return out
