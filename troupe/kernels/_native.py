"""Optional native CPU loops, compiled on first use and cached by content hash: C sources in
csrc/ built with the system C compiler and loaded with ctypes (``load``), and the C++
kernels, one torch extension built with torch.utils.cpp_extension from csrc/native.cpp
(``extension``; a kernel's bindings: ``load_extension``). Without a compiler (or
with TROUPE_NATIVE=0) both return None and callers use their torch path."""

from __future__ import annotations

import ctypes
import fcntl
import functools
import hashlib
import importlib.util
import logging
import os
import shutil
import subprocess
import sysconfig
import tempfile
from pathlib import Path

from troupe.cache import cache_dir

_CSRC = Path(__file__).parent / "csrc"
log = logging.getLogger(__name__)


def _cache_dir() -> Path:
    return cache_dir("kernels")


@functools.lru_cache(maxsize=None)
def load(name: str) -> ctypes.CDLL | None:
    """The shared library built from csrc/<name>.c, or None when it cannot be built."""
    if os.environ.get("TROUPE_NATIVE", "1") == "0":
        return None
    compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        return None
    # ISO C: no contraction of a * b + c into one rounding (the loops match torch's ops bit
    # for bit); no errno from sqrtf, so that it vectorizes
    flags = ["-O3", "-march=native", "-std=c99", "-ffp-contract=off", "-fno-math-errno"]
    source = (_CSRC / f"{name}.c").read_bytes()
    digest = hashlib.sha256(source + " ".join([compiler, *flags]).encode()).hexdigest()[:16]
    target = _cache_dir() / f"{name}-{digest}.so"
    if not target.exists():
        target.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
            out = Path(tmp) / target.name
            cmd = [compiler, *flags, "-shared", "-fPIC", str(_CSRC / f"{name}.c"), "-o",
                   str(out), "-lm"]
            if subprocess.run(cmd, capture_output=True).returncode != 0:
                return None
            os.replace(out, target)  # atomic: concurrent builders never load half a file
    return ctypes.CDLL(str(target))


@functools.lru_cache(maxsize=None)
def load_extension(name: str):
    """The bindings of csrc/<name>.cpp: a submodule of the one extension every C++ kernel is
    built into (``extension``), or None when it cannot be built here."""
    built = extension()
    return None if built is None else getattr(built, name)


@functools.lru_cache(maxsize=None)
def extension():
    """The torch extension built from csrc/native.cpp, which includes every C++ kernel
    (-O3 -march=native, OpenMP for at::parallel_for's threads), or None when it cannot be
    built here. A build is keyed by the sources, the flags, torch's version and Python's ABI,
    so every environment with the same torch on this machine (a second virtual environment,
    the workers' processes) imports the same build without compiling or even checking it."""
    if os.environ.get("TROUPE_NATIVE", "1") == "0":
        return None
    try:
        import torch
        from torch.utils import cpp_extension
        flags = ["-O3", "-march=native", "-fopenmp"]
        files = {f.name: f.read_bytes() for f in sorted(_CSRC.iterdir())
                 if f.suffix in (".cpp", ".h")}
        abi = f"{torch.__version__}|{sysconfig.get_config_var('EXT_SUFFIX')}"
        digest = hashlib.sha256(b"".join(files.values()) + " ".join(flags).encode()
                                + abi.encode()).hexdigest()[:12]
        build, module = _cache_dir() / f"native-{digest}", f"troupe_native_{digest}"
        if (build / "built").is_file():
            return _import(module, build / f"{module}.so")
        build.mkdir(parents=True, exist_ok=True)
        # compiled from copies in the build directory: the same paths from every checkout
        for file_name, data in files.items():
            copy = build / file_name
            if not copy.is_file() or copy.read_bytes() != data:
                copy.write_bytes(data)
        # torch's own lock file stays behind when a build is killed (Ctrl-C during the first
        # compile), and every later load would wait for it forever. An flock is released by
        # the kernel when its holder dies: whoever holds it knows any torch lock is stale.
        with open(build / "troupe.lock", "w") as held:
            fcntl.flock(held, fcntl.LOCK_EX)
            if (build / "built").is_file():  # another process built it while this one waited
                return _import(module, build / f"{module}.so")
            if (build / "lock").exists():
                log.warning("native kernels: removing the lock of a build that was "
                            "interrupted (%s)", build / "lock")
                (build / "lock").unlink()
            log.info("building the native kernels (once per machine and torch version)")
            loaded = cpp_extension.load(name=module, sources=[str(build / "native.cpp")],
                                        extra_cflags=flags, extra_ldflags=["-fopenmp"],
                                        build_directory=str(build), verbose=False)
            (build / "built").touch()  # the library is whole: it has just been imported
            return loaded
    except Exception as e:  # no compiler, no headers: callers keep their torch path
        log.warning("native kernels unavailable (%s): using the torch paths", e)
        return None


def _import(module: str, path: Path):
    """The extension module in ``path``, imported as ``module``."""
    spec = importlib.util.spec_from_file_location(module, path)
    loaded = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(loaded)
    return loaded
