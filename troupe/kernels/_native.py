"""Optional native CPU loops: C sources in csrc/ compiled on first use with the system C
compiler, cached by content hash, and loaded with ctypes. Without a compiler (or with
TROUPE_NATIVE=0) ``load`` returns None and callers use their torch path."""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

_CSRC = Path(__file__).parent / "csrc"


def _cache_dir() -> Path:
    root = os.environ.get("TROUPE_CACHE") or Path.home() / ".cache" / "troupe"
    return Path(root) / "kernels"


@functools.lru_cache(maxsize=None)
def load(name: str) -> ctypes.CDLL | None:
    """The shared library built from csrc/<name>.c, or None when it cannot be built."""
    if os.environ.get("TROUPE_NATIVE", "1") == "0":
        return None
    compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        return None
    source = (_CSRC / f"{name}.c").read_bytes()
    digest = hashlib.sha256(source + compiler.encode()).hexdigest()[:16]
    target = _cache_dir() / f"{name}-{digest}.so"
    if not target.exists():
        target.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
            out = Path(tmp) / target.name
            cmd = [compiler, "-O3", "-march=native", "-shared", "-fPIC", "-std=c99",
                   str(_CSRC / f"{name}.c"), "-o", str(out)]
            if subprocess.run(cmd, capture_output=True).returncode != 0:
                return None
            os.replace(out, target)  # atomic: concurrent builders never load half a file
    return ctypes.CDLL(str(target))
