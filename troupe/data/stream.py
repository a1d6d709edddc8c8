"""Corpora larger than memory: a directory, glob or URL of parquet, jsonl and .txt shards,
tokenized once off the trainers and read window by window in a deterministic global order.

**Preparation** (``prepare``, on the driver before any trainer starts): one Ray task per shard
reads it (pyarrow for parquet; fsspec for a URL), tokenizes its documents and writes two token
files, the shard's training and validation documents end to end (each ending with the
end-of-text token), into a cache directory keyed by the shards (name, size, modification
time), the tokenizer and the split, so a second run, or a run resumed, reads them at once. A
task's output is its shard's rows in their order by construction, and a task holds one
shard; Ray Data's streaming executor would need ``preserve_order`` and an index over files of
its own naming, and its ``streaming_split`` hands blocks out by timing, which a resumed run
cannot repeat. A document goes to validation when its text's hash says so
(``val_fraction`` of the hash space), so the split is stable as shards are added.

**Reading** (``StreamDataset``): the training files laid end to end are N windows of
seq_len + 1 tokens. The global order of an epoch permutes chunks of ``CHUNK`` consecutive
windows by (seed, epoch) (the short last chunk, when N is not a multiple, comes last) and
the windows within each chunk by (seed, epoch, chunk): global
index g of the run is window ``order(g // N)[g % N]``, and step s's global batch is indices
(s - 1) B .. s B - 1, of which data-parallel rank r reads its B / W rows (tensor-parallel
ranks of the same data-parallel rank read the same). Every batch is a function of (seed,
step) and the corpus: a run resumed at step k, on any number of ranks, reads what an
uninterrupted one would. A rank reads its windows with ``os.pread`` from the token files:
its memory is the windows it holds, whatever the corpus (a memory map's resident pages would
grow with the corpus read).

**Bad data**: an unreadable shard, a row without the text column (or not a string), an empty
file: one line naming the file and row; with ``data.skip_bad`` the row (or file) is skipped and
counted in the preparation's report instead.
"""

from __future__ import annotations

import glob as globlib
import hashlib
import json
import os
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Iterator

import numpy as np
import torch

from troupe.cache import cache_dir
from troupe.errors import DataError

SUFFIXES = (".parquet", ".jsonl", ".txt")
CHUNK = 1024  # windows permuted together: the order's memory is N / CHUNK indices
_FORMAT = 1   # bump when what ``_tokenize_shard`` writes changes


def is_stream(source: str | list[str]) -> bool:
    """Whether ``data.source`` names a corpus to stream: a directory, a glob or a URL (a list
    of files, or one file, is read whole, as before)."""
    if not isinstance(source, str) or source == "stdlib":
        return False
    return "://" in source or any(c in source for c in "*?[") or Path(source).is_dir()


def list_shards(source: str) -> list[str]:
    """The shard files of ``source`` (parquet, jsonl and .txt, sorted): a directory (walked), a
    glob, or an fsspec URL of either (file:// tested; s3:// and gs:// with their packages)."""
    if "://" in source and not source.startswith("file://"):
        import fsspec
        fs, root = fsspec.core.url_to_fs(source)
        protocol = source.split("://", 1)[0]
        found = fs.glob(root) if any(c in root for c in "*?[") else fs.find(root)
        files = sorted(f"{protocol}://{f}" for f in found if f.endswith(SUFFIXES))
    else:
        path = source[len("file://"):] if source.startswith("file://") else source
        if any(c in path for c in "*?["):
            found = globlib.glob(path, recursive=True)
        else:
            found = [str(p) for p in Path(path).rglob("*") if p.is_file()]
        files = sorted(f for f in found if f.endswith(SUFFIXES))
    if not files:
        raise DataError(f"data.source={source!r}: no .parquet, .jsonl or .txt shards there")
    return files


@dataclass(frozen=True)
class Shard:
    """What preparation made of one shard: its token files' tokens and documents, and the
    rows it skipped (``data.skip_bad``)."""

    source: str
    train_tokens: int
    val_tokens: int
    train_docs: int
    val_docs: int
    skipped: int
    skipped_first: str | None  # the first skipped row's reason


@dataclass(frozen=True)
class Prepared:
    """A corpus tokenized into ``directory`` (train-<i>.bin and val-<i>.bin per shard, of
    ``dtype`` tokens)."""

    directory: str
    dtype: str
    shards: list[Shard]
    key: str
    seconds: float = 0.0

    @property
    def train_tokens(self) -> int:
        return sum(s.train_tokens for s in self.shards)

    def report(self) -> dict:
        """A metrics record of the preparation."""
        return {"kind": "data", "shards": len(self.shards), "train_tokens": self.train_tokens,
                "val_tokens": sum(s.val_tokens for s in self.shards),
                "documents": sum(s.train_docs + s.val_docs for s in self.shards),
                "skipped_rows": sum(s.skipped for s in self.shards),
                "first_skipped": next((s.skipped_first for s in self.shards
                                       if s.skipped_first), None),
                "prepare_s": round(self.seconds, 2), "directory": self.directory}


def _fingerprint(files: list[str]) -> list:
    """Each shard's name, size and modification time (what decides whether the cached tokens
    still describe it)."""
    out = []
    for f in files:
        if "://" in f and not f.startswith("file://"):
            import fsspec
            fs, path = fsspec.core.url_to_fs(f)
            info = fs.info(path)
            out.append([f, info.get("size"), str(info.get("mtime") or info.get("LastModified"))])
        else:
            st = os.stat(f[len("file://"):] if f.startswith("file://") else f)
            out.append([f, st.st_size, st.st_mtime_ns])
    return out


def prepare(cfg, tokenizer_dir: str | None, root: str | Path | None = None,
            parallel: int | None = None) -> Prepared:
    """Tokenize the corpus ``cfg`` (a DataConfig whose source ``is_stream``) with the
    tokenizer of ``tokenizer_dir`` (None: troupe's bytes) into the cache (``root``: default
    troupe's cache, tokens/), one Ray task per shard (``parallel`` at a time, default the
    cluster's CPUs); what is there already for the same shards, tokenizer and split is
    reused. DataError naming the file and row of bad data (unless ``cfg.skip_bad``)."""
    import ray
    files = list_shards(cfg.source)
    ident = {"format": _FORMAT, "shards": _fingerprint(files), "tokenizer": tokenizer_dir,
             "val_fraction": cfg.val_fraction, "column": cfg.text_column,
             "skip_bad": cfg.skip_bad}
    key = hashlib.sha256(json.dumps(ident, sort_keys=True).encode()).hexdigest()[:20]
    directory = Path(root or cache_dir("tokens")) / key
    index = directory / "index.json"
    if index.exists():
        saved = json.loads(index.read_text())
        return Prepared(str(directory), saved["dtype"], [Shard(**s) for s in saved["shards"]],
                        key)
    directory.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    task = ray.remote(num_cpus=1)(_tokenize_shard)
    limit = parallel or max(int(ray.cluster_resources().get("CPU", 1)), 1)
    pending, done = [], {}

    def collect(ref) -> None:
        try:
            done.update(ray.get(ref))
        except ray.exceptions.RayTaskError as e:  # bad data: its own one line, no traceback
            if isinstance(e.cause, DataError):
                for other in pending:
                    ray.cancel(other)
                raise DataError(str(e.cause)) from None
            raise
    for i, f in enumerate(files):
        if len(pending) >= limit:  # at most ``limit`` shards in flight
            ready, pending = ray.wait(pending, num_returns=1)
            collect(ready[0])
        pending.append(task.remote(i, f, str(directory), tokenizer_dir, cfg.val_fraction,
                                   cfg.text_column, cfg.skip_bad))
    while pending:
        ref = pending.pop(0)
        collect(ref)
    shards = [done[i] for i in range(len(files))]
    dtype = "uint16" if _vocab(tokenizer_dir) <= 1 << 16 else "uint32"
    tmp = index.with_suffix(f".{os.getpid()}.tmp")
    tmp.write_text(json.dumps({"dtype": dtype, "shards": [asdict(s) for s in shards],
                               "ident": ident}))
    os.replace(tmp, index)  # complete only once every shard is written
    return Prepared(str(directory), dtype, shards, key, time.perf_counter() - t0)


def _vocab(tokenizer_dir: str | None) -> int:
    if tokenizer_dir is None:
        return 257
    from troupe.data.tokenizer import load_tokenizer
    return load_tokenizer(tokenizer_dir).vocab_size


def in_val(text: str, fraction: float) -> bool:
    """Whether a document is held out: its hash, not its place (stable as shards come)."""
    h = int.from_bytes(hashlib.blake2b(text.encode("utf-8", "surrogatepass"),
                                       digest_size=8).digest(), "little")
    return h / 2**64 < fraction


def _documents(path: str, column: str, skip_bad: bool) -> Iterator[tuple[str | None, str]]:
    """(text, where) of each row of a shard; a bad row gives (None, its reason) with
    ``skip_bad``, else DataError naming the file and row."""
    def bad(reason: str):
        if not skip_bad:
            raise DataError(f"{path}: {reason}")
        return None, f"{path}: {reason}"

    import fsspec
    with fsspec.open(path, "rb") as f:
        if path.endswith(".txt"):
            raw = f.read()
            if not raw.strip():
                yield bad("an empty file")
                return
            try:
                yield raw.decode("utf-8-sig"), path
            except UnicodeDecodeError as e:
                yield bad(f"not UTF-8 text (byte {e.start + 1})")
            return
        if path.endswith(".jsonl"):
            seen = False
            for i, line in enumerate(f, 1):
                if not line.strip():
                    continue
                seen = True
                try:
                    row = json.loads(line)
                except (ValueError, UnicodeDecodeError) as e:
                    yield bad(f"line {i}: not a JSON object ({type(e).__name__})")
                    continue
                text = row.get(column) if isinstance(row, dict) else None
                if not isinstance(text, str):
                    yield bad(f"line {i}: no string {column!r} field")
                    continue
                yield text, f"{path}:{i}"
            if not seen:
                yield bad("an empty file")
            return
        yield from _parquet_documents(f, path, column, bad)


def _parquet_documents(f, path: str, column: str, bad) -> Iterator[tuple[str | None, str]]:
    """``_documents`` of a parquet file: one row group in memory at a time."""
    import pyarrow.parquet as pq
    try:
        parquet = pq.ParquetFile(f)
    except Exception as e:  # pyarrow's own errors: a file that is not parquet
        yield bad(f"not a readable parquet file ({type(e).__name__}: {e})")
        return
    if column not in parquet.schema_arrow.names:
        yield bad(f"no column {column!r} (its columns: {parquet.schema_arrow.names})")
        return
    if parquet.metadata.num_rows == 0:
        yield bad("an empty file")
        return
    row = 0
    for group in range(parquet.num_row_groups):
        try:
            values = parquet.read_row_group(group, columns=[column]).column(0).to_pylist()
        except Exception as e:
            yield bad(f"row group {group}: unreadable ({type(e).__name__}: {e})")
            continue
        for text in values:
            row += 1
            if not isinstance(text, str):
                yield bad(f"row {row}: {column!r} is {type(text).__name__}, not text")
                continue
            yield text, f"{path} row {row}"


def _tokenize_shard(index: int, path: str, directory: str, tokenizer_dir: str | None,
                    val_fraction: float, column: str, skip_bad: bool) -> dict[int, Shard]:
    """One Ray task: shard ``index``'s documents tokenized into train-<index>.bin and
    val-<index>.bin (written to temporary names, then renamed)."""
    from troupe.data.tokenizer import ByteTokenizer, load_tokenizer
    tok = ByteTokenizer() if tokenizer_dir is None else load_tokenizer(tokenizer_dir)
    dtype = np.uint16 if tok.vocab_size <= 1 << 16 else np.uint32
    out = Path(directory)
    tmp = f"{os.getpid()}.tmp"  # a task of another run preparing the same shard: no clash
    files = {k: open(out / f"{k}-{index}.bin.{tmp}", "wb") for k in ("train", "val")}
    counts = {"train": [0, 0], "val": [0, 0]}
    skipped, first = 0, None
    batch: list[str] = []

    def flush():
        if not batch:
            return
        if tokenizer_dir is None:
            encoded = [tok.encode(t, eos=True) for t in batch]
        else:
            eos = [tok.eos_id]
            encoded = [np.asarray(ids + eos, dtype=dtype) for ids in
                       tok.hf(batch, add_special_tokens=False)["input_ids"]]
        for text, ids in zip(batch, encoded):
            kind = "val" if in_val(text, val_fraction) else "train"
            files[kind].write(np.asarray(ids, dtype=dtype).tobytes())
            counts[kind][0] += len(ids)
            counts[kind][1] += 1
        batch.clear()

    try:
        for text, where in _documents(path, column, skip_bad):
            if text is None:
                skipped, first = skipped + 1, first or where
                continue
            batch.append(text)
            if len(batch) >= 256:
                flush()
        flush()
    finally:
        for f in files.values():
            f.close()
    for k in files:
        os.replace(out / f"{k}-{index}.bin.{tmp}", out / f"{k}-{index}.bin")
    return {index: Shard(path, counts["train"][0], counts["val"][0], counts["train"][1],
                         counts["val"][1], skipped, first)}


class _Tokens:
    """Token files read as one stream by position (``os.pread``: nothing kept but what is
    read)."""

    def __init__(self, paths: list[Path], counts: list[int], dtype: str):
        keep = [(p, n) for p, n in zip(paths, counts) if n]
        self.paths = [p for p, _ in keep]
        self.dtype = np.dtype(dtype)
        self.starts = np.cumsum([0] + [n for _, n in keep])
        self.total = int(self.starts[-1])
        self._fds: list[int] | None = None

    def _open(self) -> list[int]:
        if self._fds is None or self._pid != os.getpid():
            self._fds, self._pid = [os.open(p, os.O_RDONLY) for p in self.paths], os.getpid()
        return self._fds

    def read(self, start: int, n: int) -> np.ndarray:
        """Tokens [start, start + n) of the stream (across files where it must)."""
        fds, out, got = self._open(), np.empty(n, self.dtype), 0
        size = self.dtype.itemsize
        while got < n:
            pos = start + got
            f = int(np.searchsorted(self.starts, pos, side="right")) - 1
            take = min(n - got, int(self.starts[f + 1]) - pos)
            raw = os.pread(fds[f], take * size, (pos - int(self.starts[f])) * size)
            out[got:got + take] = np.frombuffer(raw, self.dtype)
            got += take
        return out

    def __getstate__(self):  # file descriptors do not cross processes
        return {**self.__dict__, "_fds": None}


class StreamDataset:
    """A prepared corpus (``prepare``) as the trainers read it: ``train_batch`` and
    ``val_batches`` as TokenDataset's, windows in the global order of the module's docstring.
    ``position(step, batch_size, seq_len)`` says where a step is: epoch, tokens consumed, the
    shard its first window comes from."""

    def __init__(self, prepared: Prepared, seed: int):
        d = Path(prepared.directory)
        n = len(prepared.shards)
        self.prepared, self.seed = prepared, seed
        self.train = _Tokens([d / f"train-{i}.bin" for i in range(n)],
                             [s.train_tokens for s in prepared.shards], prepared.dtype)
        self.val = _Tokens([d / f"val-{i}.bin" for i in range(n)],
                           [s.val_tokens for s in prepared.shards], prepared.dtype)
        self._perm: dict = {}

    def windows(self, seq_len: int) -> int:
        """How many training windows of seq_len + 1 tokens the corpus holds."""
        return self.train.total // (seq_len + 1)

    def _order(self, epoch: int, N: int, i: int) -> int:
        """Window at place ``i`` of epoch ``epoch``'s order of N windows: the full chunks in
        an order of (seed, epoch), then the short last one (N % CHUNK windows), each chunk's
        windows in an order of (seed, epoch, chunk)."""
        full = N // CHUNK
        key = ("chunks", epoch, N)
        if key not in self._perm:
            self._perm = {key: np.random.default_rng([self.seed, epoch, N]).permutation(full)}
        c = int(self._perm[key][i // CHUNK]) if i < full * CHUNK else full
        size = CHUNK if c < full else N - full * CHUNK
        inner = ("inner", epoch, c)
        if inner not in self._perm:
            if len(self._perm) > 64:  # a few chunks' orders kept: the reads go chunk by chunk
                self._perm = {key: self._perm[key]}
            self._perm[inner] = np.random.default_rng([self.seed, epoch, c, 1]).permutation(size)
        return c * CHUNK + int(self._perm[inner][i % CHUNK])

    def _places(self, step: int, batch_size: int, seq_len: int) -> list[tuple[int, int]]:
        N = self.windows(seq_len)
        if N < 1:
            raise ValueError(f"the corpus' {self.train.total} training tokens are fewer than "
                             f"one window of seq_len={seq_len} + 1")
        first = (step - 1) * batch_size
        return [divmod(g, N) for g in range(first, first + batch_size)]

    def train_batch(self, step: int, batch_size: int, seq_len: int, rank: int = 0,
                    world: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
        """Rank ``rank``'s rows of global batch ``step`` (1-based): (batch_size / world,
        seq_len) inputs and next-token targets."""
        if batch_size % world:
            raise ValueError(f"batch_size={batch_size} does not split over {world} ranks")
        per = batch_size // world
        places = self._places(step, batch_size, seq_len)[rank * per:(rank + 1) * per]
        N, L = self.windows(seq_len), seq_len + 1
        rows = np.stack([self.train.read(self._order(e, N, i) * L, L) for e, i in places])
        w = torch.from_numpy(rows.astype(np.int64))
        return w[:, :-1], w[:, 1:]

    def val_batches(self, num_batches: int, batch_size: int, seq_len: int, rank: int = 0,
                    world: int = 1):
        """The same validation windows every time, evenly spaced over the held-out stream."""
        span = self.val.total - seq_len - 1
        if span <= 0:
            raise ValueError(f"the held-out documents hold {self.val.total} tokens, fewer than "
                             f"seq_len={seq_len}; raise data.val_fraction")
        starts = np.linspace(0, span, num_batches * batch_size).astype(np.int64)
        per = batch_size // world
        for b in range(num_batches):
            rows = starts[b * batch_size:(b + 1) * batch_size][rank * per:(rank + 1) * per]
            w = torch.from_numpy(np.stack([self.val.read(int(s), seq_len + 1)
                                           for s in rows]).astype(np.int64))
            yield w[:, :-1], w[:, 1:]

    def position(self, step: int, batch_size: int, seq_len: int) -> dict:
        """Where the run is after ``step``: its epoch, the tokens consumed, and the shard that
        step's first window was read from."""
        N = self.windows(seq_len)
        epoch, i = divmod((step - 1) * batch_size, N)
        start = self._order(epoch, N, i) * (seq_len + 1)
        shard = int(np.searchsorted(self.train.starts, start, side="right")) - 1
        return {"epoch": epoch, "tokens_consumed": step * batch_size * seq_len,
                "shard": Path(self.train.paths[shard]).name if self.train.paths else None}

