"""Host buffers on huge pages, for weights a kernel streams through at the memory's speed.

A decode step at batch 1 reads every weight once; with 4 KiB pages the packed fp32 layers of
SmolLM2 (a few MB each, allocated one by one) read at about 25 GB/s on the 2-core EPYC where a
sum over a large buffer reads 31; the same bytes in one buffer on 2 MiB pages read at 30.6
(benchmarks/RESULTS.md, "Decoding at batch 1"): fewer TLB misses, and the hardware prefetcher
does not stop at every 4 KiB boundary. Linux gives transparent huge pages to a region that asks
(``madvise(MADV_HUGEPAGE)``, the default "madvise" policy) when it is 2 MiB aligned; elsewhere,
or when the kernel says no, the buffer is ordinary memory and nothing else changes.
"""

from __future__ import annotations

import ctypes
import sys

import torch

HUGE_PAGE = 2 << 20
_MADV_HUGEPAGE = 14  # linux/mman.h


def huge_page_empty(numel: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """An uninitialised 1-D CPU tensor of ``numel`` elements starting on a 2 MiB boundary, its
    whole 2 MiB pages advised to be huge pages (Linux)."""
    size = torch.empty((), dtype=dtype).element_size()  # host: only its element size is read
    raw = torch.empty(numel * size + HUGE_PAGE, dtype=torch.uint8)  # host: CPU pages by design
    start = -raw.data_ptr() % HUGE_PAGE
    buf = raw[start:start + numel * size]
    if sys.platform.startswith("linux") and len(buf) >= HUGE_PAGE:
        try:
            ctypes.CDLL(None, use_errno=True).madvise(
                ctypes.c_void_p(buf.data_ptr()), ctypes.c_size_t(len(buf) // HUGE_PAGE * HUGE_PAGE),
                _MADV_HUGEPAGE)
        except (OSError, AttributeError):  # no libc symbol: ordinary pages
            pass
    return buf.view(dtype)
