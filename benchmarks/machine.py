"""What the benchmarks' JSON lines say of the machine: the CPU model, its cores and the flags
that matter to the kernels, and the GPU when there is one (never the host name: figures move
between CPUs, not between hosts)."""

from __future__ import annotations

import os
import platform
from functools import lru_cache


@lru_cache(maxsize=None)
def machine() -> str:
    model, flags = platform.processor() or platform.machine(), set()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                key, _, value = line.partition(":")
                if key.strip() == "model name":
                    model = value.strip()
                elif key.strip() == "flags":
                    flags = set(value.split())
    except OSError:
        pass
    wanted = [f for f in ("avx2", "avx512f", "avx512_vnni", "amx_tile", "amx_int8") if f in flags]
    out = f"{model}, {os.cpu_count()} cores" + (f" ({' '.join(wanted)})" if wanted else "")
    try:
        import torch
        if torch.cuda.is_available():
            out += f", {torch.cuda.get_device_name()}"
    except ImportError:
        pass
    return out
