"""fp32 linear layers for a few rows (decoding) with weights packed for them.

A decode step multiplies a handful of rows (one token per sequence) by every weight of the
model, so a linear layer is a matrix-vector product in disguise: each weight element is read
once and used M <= 16 times. MKL's sgemm reaches about a quarter of this CPU's memory bandwidth
at that shape (benchmarks/RESULTS.md, "Decoding in fp32"). Packed as (N/16, K, 16), each
16-wide vector of weights is loaded once and multiplied by every row's input broadcast
(troupe/kernels/csrc/small_gemm.h), the outputs stay in registers, and the layer runs at
the speed the memory gives.

``DecodeWeights(model)`` packs a model's fp32 CPU linear layers (and its output embedding)
and, inside ``with weights.active():``, makes them use the packed product for inputs of at most
``MAX_ROWS`` rows without autograd; everything else goes to ``F.linear`` as before. The packed
copy belongs to the engine that made it (troupe.generation.ContinuousBatcher): a server builds
its engine once, RLHF's policy once per batch of rollouts (its weights change in between; the
copy is not checked against them). The C++
source is compiled on first use (torch.utils.cpp_extension, cached); without a compiler, on
a GPU, or with TROUPE_NATIVE=0 the model is left as it is.

Which product is faster depends on the machine: on the 2-core EPYC the packed one is 2.5x
MKL's at every decode shape; on a 16-core AMX Xeon MKL's was the faster one at every point
measured (the packed one 0.60-0.86x of it, at 1 and 8 rows on 2 and 8 threads). So each weight
shape is measured once per machine (``choices``: both products at 4 and at 8 rows over copies
of the weight larger than the caches, as a decode step streams them), and a layer keeps MKL for
the rows where MKL won. The answers are cached beside the compiled kernels, keyed by the CPU
model and flags, the threads, torch's version and the kernel's source;
TROUPE_DECODE_PRODUCT=packed (or mkl) skips the measurement.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import hashlib
import json
import math
import os
import time

import torch
import torch.nn.functional as F
from torch import nn

from troupe.cache import cache_dir
from troupe.devices import cpu_info
from troupe.kernels import _native
from troupe.kernels.memory import huge_page_empty
from troupe.kernels.quant import QuantizedWeight

MAX_ROWS = 16
SMALL_ROWS = 4  # rows 1..4 follow the measurement at 4 rows, 5..MAX_ROWS the one at 8


def _extension():
    """The compiled extension, or None when it cannot be built here."""
    return _native.load_extension("small_gemm")


def available() -> bool:
    return _extension() is not None


def pack(weight: torch.Tensor) -> torch.Tensor:
    """(N, K) -> (ceil(N / 16), K, 16), the output rows padded with zeros to a multiple of 16."""
    N, K = weight.shape
    padded = F.pad(weight.detach().float(), (0, 0, 0, -N % 16))
    return padded.view(-1, 16, K).transpose(1, 2).contiguous()


def linear(x: torch.Tensor, packed: torch.Tensor, n_out: int,
           bias: torch.Tensor | None = None) -> torch.Tensor:
    """x (..., K) @ W^T + bias for at most MAX_ROWS rows, W given ``pack``ed."""
    rows = x.reshape(-1, x.shape[-1]).contiguous()
    y = _extension().linear(rows, packed, None if bias is None else
                            F.pad(bias.detach(), (0, packed.shape[0] * 16 - bias.shape[0])))
    return y[:, :n_out].reshape(*x.shape[:-1], n_out)


class DecodeWeights:
    """A model's fp32 CPU linear layers (and tied output projection) packed for decoding;
    ``active()`` switches them to the packed product (for few-row, no-grad inputs).
    ``huge_pages``: hold them on 2 MiB pages (for a copy that is kept: see the note below)."""

    def __init__(self, model: nn.Module, huge_pages: bool = False):
        self.model, self.layers, self.logits_weight = model, {}, None
        self.uses: dict = {}  # module (None: the logits) -> packed at (few rows, more rows)
        if not available():
            return
        weights = {module: module.weight for module in model.modules()
                   if type(module) is nn.Linear and module.weight.dtype == torch.float32
                   and module.weight.device.type == "cpu"}
        emb = getattr(model, "tok_emb", None)  # a tensor-parallel rank's is a shard: not packed
        if getattr(getattr(model, "cfg", None), "tie_embeddings", False) and emb is not None \
                and getattr(model, "lm_head", None) is None \
                and getattr(model, "tp", None) is None \
                and emb.weight.dtype == torch.float32 and emb.weight.device.type == "cpu":
            weights[None] = emb.weight
        chosen = choices({tuple(w.shape) for w in weights.values()})
        self.uses = {m: chosen[tuple(w.shape)] for m, w in weights.items()}
        weights = {m: w for m, w in weights.items() if any(self.uses[m])}
        # one buffer for all of them; on huge pages for a copy that lives long (a server's, or
        # one kept between rollouts): ~20% faster reads, but the kernel may compact memory to
        # find the pages, ~1 s for SmolLM2's 0.5 GB here (troupe.kernels.memory)
        shapes = {m: (-(-w.shape[0] // 16), w.shape[1], 16) for m, w in weights.items()}
        numel = sum(math.prod(s) for s in shapes.values())
        arena = huge_page_empty(numel) if huge_pages else torch.empty(numel)  # host: CPU weights
        offset = 0
        for module, w in weights.items():
            packed = arena[offset:offset + math.prod(shapes[module])].view(shapes[module])
            offset += packed.numel()
            _pack_into(packed, w)
            if module is None:
                self.logits_weight = packed
            else:
                self.layers[module] = packed
        if huge_pages:
            _int8_onto_huge_pages(model)

    def __bool__(self) -> bool:  # a quantized model may have no fp32 layer but the logits
        return bool(self.layers) or self.logits_weight is not None

    def refresh(self) -> None:
        """Pack the model's current weights into the buffers already held (no allocation:
        fresh pages cost more than the copy)."""
        for module, packed in self.layers.items():
            _pack_into(packed, module.weight)
        if self.logits_weight is not None:
            _pack_into(self.logits_weight, self.model.tok_emb.weight)

    @contextlib.contextmanager
    def active(self):
        if not self.layers:
            yield
            return
        for module, packed in self.layers.items():
            module.forward = functools.partial(_forward, module, packed, self.uses[module])
        try:
            yield
        finally:
            for module in self.layers:
                del module.forward  # back to the class's forward

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        """The model's next-token logits of hidden states (..., C), packed when it can."""
        if self.logits_weight is not None and _small(h, self.uses[None]):
            return linear(h, self.logits_weight, self.model.cfg.vocab_size)
        with self.active():
            return self.model.logits(h)


def _int8_onto_huge_pages(model: nn.Module) -> None:
    """Move the INT8 weights of a model's W8A8 layers packed for the native kernel into one
    buffer on huge pages (the same values; the layers then read them there). At batch 1 their
    product read 22 GB/s on ordinary pages where the same kernel read 37 from huge ones
    (benchmarks/RESULTS.md, "Decoding at batch 1")."""
    layers = [m for m in model.modules() if isinstance(getattr(m, "qw", None), QuantizedWeight)
              and m.qw.layout == "vnni" and m.qw.q.device.type == "cpu"]
    if not layers:
        return
    sizes = [-(-m.qw.q.numel() // 64) * 64 for m in layers]  # each on a cache line of its own
    arena = huge_page_empty(sum(sizes), torch.int8)
    offset = 0
    for module, size in zip(layers, sizes):
        q = module.qw.q
        moved = arena[offset:offset + q.numel()].view(q.shape)
        moved.copy_(q)
        module.qw = dataclasses.replace(module.qw, q=moved)
        offset += size


def _pack_into(packed: torch.Tensor, weight: torch.Tensor) -> None:
    N, K = weight.shape
    whole = N // 16 * 16
    packed[:N // 16].copy_(weight.detach()[:whole].view(-1, 16, K).transpose(1, 2))
    if whole < N:
        packed[-1].copy_(pack(weight[whole:])[0])


def _small(x: torch.Tensor, uses: tuple[bool, bool] = (True, True)) -> bool:
    """Whether the packed product takes ``x``: few rows, no autograd, and the rows' bucket one
    where it was measured faster (``uses``: at most SMALL_ROWS rows, more)."""
    rows = x.numel() // max(x.shape[-1], 1)
    return rows <= MAX_ROWS and uses[rows > SMALL_ROWS] and not (
        torch.is_grad_enabled() and x.requires_grad)


def _forward(module: nn.Linear, packed: torch.Tensor, uses: tuple[bool, bool],
             x: torch.Tensor) -> torch.Tensor:
    if _small(x, uses) and not (torch.is_grad_enabled() and module.weight.requires_grad):
        return linear(x, packed, module.out_features, module.bias)
    return F.linear(x, module.weight, module.bias)


# ---- which product, per machine ----------------------------------------------------------
def choices(shapes: set[tuple[int, int]]) -> dict[tuple[int, int], tuple[bool, bool]]:
    """For each weight shape (N, K): whether the packed product beats MKL's at few rows (4) and
    at more (8) on this machine with the threads set; measured once and cached (see the
    module's docstring)."""
    forced = os.environ.get("TROUPE_DECODE_PRODUCT")
    if forced in ("packed", "mkl"):
        return {shape: (forced == "packed",) * 2 for shape in shapes}
    path = _choices_file()
    try:
        known = json.loads(path.read_text())
    except (OSError, ValueError):
        known = {}
    missing = [s for s in shapes if f"{s[0]}x{s[1]}" not in known]
    for N, K in missing:
        known[f"{N}x{K}"] = [_packed_wins(N, K, rows) for rows in (SMALL_ROWS, 8)]
    if missing:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps(known, indent=0, sort_keys=True))
        os.replace(tmp, path)  # whole, or not at all, for a process reading it meanwhile
    return {s: tuple(bool(b) for b in known[f"{s[0]}x{s[1]}"]) for s in shapes}


def _choices_file():
    model, flags = cpu_info()
    source = (_native._CSRC / "small_gemm.h").read_bytes()  # the kernel
    # the rows measured are in the key: choices once measured at 1 row are not reused
    key = hashlib.sha256(repr((model, sorted(flags or ()), torch.get_num_threads(),
                               torch.__version__, SMALL_ROWS)).encode() + source).hexdigest()[:16]
    return cache_dir("kernels") / f"decode-product-{key}.json"


def _packed_wins(N: int, K: int, rows: int, stream_bytes: int = 64 << 20) -> bool:
    """Time both products on ``rows`` rows over enough copies of an (N, K) weight to stream
    ``stream_bytes`` from memory (at most 64 copies), as a decode step does."""
    copies = max(1, min(64, stream_bytes // (N * K * 4)))
    g = torch.Generator().manual_seed(0)
    plain = [torch.randn(N, K, generator=g) for _ in range(copies)]  # host: a CPU measurement
    packed = [pack(w) for w in plain]
    x = torch.randn(rows, K, generator=g)  # host: (as plain)

    def ours():
        return [linear(x, p, N) for p in packed]

    def mkl():
        return [F.linear(x, w) for w in plain]

    # the two in turn, five rounds, each its fastest: a neighbour's load (a test suite, a
    # build) slows the rounds it falls on for both alike, not one whole side (the choice is
    # cached for good)
    ours(), mkl()
    times = {ours: [], mkl: []}
    for _ in range(5):
        for fn in times:
            t0 = time.perf_counter()
            fn()
            times[fn].append(time.perf_counter() - t0)
    return min(times[ours]) <= min(times[mkl])
