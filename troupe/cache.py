"""Where troupe keeps what it builds once per machine and reuses: compiled kernels, the parsed
standard-library corpus, converted checkpoints. ``TROUPE_CACHE`` moves it (default
``~/.cache/troupe``); everything under it can be deleted and is rebuilt on next use."""

from __future__ import annotations

import os
from pathlib import Path


def cache_dir(*parts: str) -> Path:
    """The cache directory, or a directory under it (not created here)."""
    root = os.environ.get("TROUPE_CACHE") or Path.home() / ".cache" / "troupe"
    return Path(root).joinpath(*parts)
