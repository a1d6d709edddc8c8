"""Text corpora that need no download: the docstrings of Python's standard library, or the
user's own .txt / .jsonl files."""

from __future__ import annotations

import ast
import hashlib
import json
import os
import sys
import sysconfig
import tempfile
from pathlib import Path
from typing import Iterator

from troupe.cache import cache_dir
from troupe.errors import DataError


def stdlib_documents(min_chars: int = 40) -> list[str]:
    """One document per standard-library module: its docstrings (module, classes, functions)
    in source order. Deterministic for a given Python installation, so it is parsed once (a
    few seconds) and then read from troupe's cache (troupe.cache): every process of a run
    builds its dataset from it."""
    root = Path(sysconfig.get_paths()["stdlib"])
    key = hashlib.sha256(f"{_CORPUS_VERSION}|{root}|{sys.version}|{min_chars}".encode())
    cached = cache_dir("corpus") / f"stdlib-{key.hexdigest()[:16]}.json"
    try:
        docs = json.loads(cached.read_text(encoding="utf-8"))
        if isinstance(docs, list) and docs and all(isinstance(d, str) for d in docs):
            return docs
    except (OSError, ValueError):
        pass  # not built yet, or damaged: parse again
    docs = _parse_stdlib(root, min_chars)
    try:
        cached.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile("w", dir=cached.parent, delete=False,
                                         encoding="utf-8") as f:
            json.dump(docs, f)
        os.replace(f.name, cached)  # atomic: a concurrent reader never sees half a file
    except OSError:
        pass  # a read-only home: parse every time
    return docs


_CORPUS_VERSION = 1  # bump when _parse_stdlib changes what it returns


def _parse_stdlib(root: Path, min_chars: int) -> list[str]:
    skip = {"site-packages", "test", "tests", "idle_test", "__pycache__"}
    docs = []
    for path in sorted(root.rglob("*.py")):
        if skip.intersection(path.relative_to(root).parts):
            continue
        try:
            tree = ast.parse(path.read_text(encoding="utf-8"))
        except (SyntaxError, UnicodeDecodeError, ValueError):
            continue
        parts = []
        for node in ast.walk(tree):
            if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
                doc = ast.get_docstring(node)
                if doc and len(doc) >= min_chars:
                    parts.append(doc)
        if parts:
            docs.append("\n\n".join(parts))
    if not docs:
        raise FileNotFoundError(f"no docstrings found under the standard library at {root}")
    return docs


def jsonl_objects(path: Path) -> Iterator[tuple[int, dict]]:
    """(line number, object) for each non-blank line of a JSON-lines file (UTF-8, a byte-order
    mark allowed); a line that is not UTF-8 or not a JSON object raises DataError naming the
    file and line."""
    with path.open("rb") as f:
        for i, raw in enumerate(f, 1):
            try:
                line = raw.decode("utf-8-sig" if i == 1 else "utf-8")
            except UnicodeDecodeError as e:
                raise DataError(f"{path}:{i}: not UTF-8 text (byte {e.start + 1} of the "
                                "line)") from None
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                raise DataError(f"{path}:{i}: not valid JSON ({e.msg})") from None
            if not isinstance(row, dict):
                raise DataError(f"{path}:{i}: expected a JSON object")
            yield i, row


def parquet_rows(path: Path):
    """(row number, row) of a parquet file (pyarrow, when it is installed); null columns
    left out of a row."""
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise ImportError(f"{path}: reading parquet needs pyarrow (pip install pyarrow), or "
                          "give the rows as JSON lines") from None
    for i, row in enumerate(pq.read_table(path).to_pylist(), 1):
        yield i, {k: v for k, v in row.items() if v is not None}


def file_documents(paths: list[str | Path], text_key: str = "text") -> list[str]:
    """Documents from .txt files (one per file), .jsonl files (one per line, the string
    under ``text_key``) and .parquet files (one per row, the same column). Errors name the
    file and line (row)."""
    docs = []
    for p in map(Path, paths):
        if not p.is_file():
            raise FileNotFoundError(f"data file {p} does not exist")
        if p.suffix == ".txt":
            try:
                docs.append(p.read_text(encoding="utf-8-sig"))
            except UnicodeDecodeError as e:
                raise DataError(f"{p}: not UTF-8 text (byte {e.start + 1})") from None
        elif p.suffix in (".jsonl", ".parquet"):
            rows = jsonl_objects(p) if p.suffix == ".jsonl" else parquet_rows(p)
            for i, row in rows:
                if not isinstance(row.get(text_key), str):
                    raise DataError(f"{p}:{i}: expected an object with a string "
                                     f"{text_key!r} field")
                docs.append(row[text_key])
        else:
            raise DataError(f"data file {p}: expected .txt, .jsonl or .parquet, got "
                            f"{p.suffix!r}")
    if not docs:
        raise DataError(f"no documents in {[str(p) for p in paths]}")
    return docs
