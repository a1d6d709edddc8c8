"""Text corpora that need no download: the docstrings of Python's standard library, or the
user's own .txt / .jsonl files."""

from __future__ import annotations

import ast
import json
import sysconfig
from pathlib import Path
from typing import Iterator

from troupe.errors import DataError


def stdlib_documents(min_chars: int = 40) -> list[str]:
    """One document per standard-library module: its docstrings (module, classes, functions)
    in source order. Deterministic for a given Python version."""
    root = Path(sysconfig.get_paths()["stdlib"])
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
    """(line number, object) for each non-blank line of a JSON-lines file; a line that is not
    a JSON object raises ValueError naming the file and line."""
    with path.open(encoding="utf-8") as f:
        for i, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                raise DataError(f"{path}:{i}: not valid JSON ({e.msg})") from None
            if not isinstance(row, dict):
                raise DataError(f"{path}:{i}: expected a JSON object")
            yield i, row


def file_documents(paths: list[str | Path], text_key: str = "text") -> list[str]:
    """Documents from .txt files (one per file) and .jsonl files (one per line, the string
    under ``text_key``). Errors name the file and line."""
    docs = []
    for p in map(Path, paths):
        if not p.is_file():
            raise FileNotFoundError(f"data file {p} does not exist")
        if p.suffix == ".txt":
            docs.append(p.read_text(encoding="utf-8"))
        elif p.suffix == ".jsonl":
            for i, row in jsonl_objects(p):
                if not isinstance(row.get(text_key), str):
                    raise DataError(f"{p}:{i}: expected an object with a string "
                                     f"{text_key!r} field")
                docs.append(row[text_key])
        else:
            raise DataError(f"data file {p}: expected .txt or .jsonl, got {p.suffix!r}")
    if not docs:
        raise DataError(f"no documents in {[str(p) for p in paths]}")
    return docs
