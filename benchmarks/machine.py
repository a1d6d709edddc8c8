"""What the benchmarks' JSON lines say of the machine: the CPU model, its cores and the flags
that matter to the kernels, and the GPU when there is one (never the host name: figures move
between CPUs, not between hosts)."""

from __future__ import annotations

import os
import platform
from functools import lru_cache

import torch

from troupe.devices import cpu_info


@lru_cache(maxsize=None)
def machine() -> str:
    model, flags = cpu_info()
    model, flags = model or platform.processor() or platform.machine(), flags or set()
    wanted = [f for f in ("avx2", "avx512f", "avx512_vnni", "amx_tile", "amx_int8") if f in flags]
    out = f"{model}, {os.cpu_count()} cores" + (f" ({' '.join(wanted)})" if wanted else "")
    if torch.cuda.is_available():
        out += f", {torch.cuda.get_device_name()}"
    return out
