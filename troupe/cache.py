"""Where troupe keeps what it builds once per machine and reuses: the compiled kernels and the
parsed standard-library corpus. ``TROUPE_CACHE`` moves it (default ``~/.cache/troupe``);
everything under it can be deleted and is rebuilt on next use. (The SmolLM2 directory that
troupe.models.smollm2 builds has its own fixed default, ``~/.cache/troupe/smollm2-...``: the
recipes name that path.)"""

from __future__ import annotations

import os
from pathlib import Path


def cache_dir(*parts: str) -> Path:
    """The cache directory, or a directory under it (not created here)."""
    root = os.environ.get("TROUPE_CACHE") or Path.home() / ".cache" / "troupe"
    return Path(root).joinpath(*parts)
