"""Where tensors live: the ``device`` setting every app config has (auto | cpu | cuda), the
torch device a worker computes on, and moving the tensors of a message to a device.

One code path serves both: a role builds its model on ``worker_device(cfg.device)`` and moves
each batch it is handed there (``move``); what it returns goes back to host memory (the
driver may have no GPU, and troupe.wire writes host bytes). Ray gives an actor that asked for
GPUs its own ``CUDA_VISIBLE_DEVICES``, so "cuda" in a worker is the first GPU Ray assigned it;
colocated roles asking for fractions of one GPU share it. ``cpu_info`` says what the CPU
offers (the native kernels check its flags before compiling for instructions it lacks).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Literal

import torch

from troupe import context as _context

Device = Literal["auto", "cpu", "cuda"]
Precision = Literal["fp32", "bf16", "fp16"]


def check_decode_graphs(decode_graphs: bool, device: Device) -> None:
    """The apps' ``decode_graphs`` (the engine's decode step captured as CUDA graphs,
    troupe.generation.static_step) against their ``device``: ValueError naming both on the
    CPU, whose own decode step (one native call) is the faster one there. With auto, a run
    that lands on the CPU decodes as the CPU does."""
    if decode_graphs and device == "cpu":
        raise ValueError("decode_graphs=true captures CUDA graphs: it needs device=cuda (or "
                         "auto on GPUs), not device=cpu")


@functools.lru_cache(maxsize=None)
def cpu_info() -> tuple[str | None, frozenset[str] | None]:
    """The CPU's model name and feature flags as Linux's /proc/cpuinfo lists them; None for
    what it does not say (and for both off Linux)."""
    model = flags = None
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                key, _, value = line.partition(":")
                if key.strip() == "model name" and model is None:
                    model = value.strip()
                elif key.strip() == "flags" and flags is None:
                    flags = frozenset(value.split())
    except OSError:
        pass
    return model, flags


def cluster_device(setting: Device, cluster_gpus: float, needed_gpus: float,
                   embedded: bool = False) -> Literal["cpu", "cuda"]:
    """The driver's choice for the workers, who would ask Ray for ``needed_gpus`` GPUs in
    all on cuda: ``auto`` is cuda when the cluster has that many (``troupe.init().num_gpus``),
    else cpu (a laptop, or two ranks and one GPU: NCCL wants a GPU per rank). cuda on a
    cluster without them is taken as it is (an autoscaling cluster starts GPU nodes when a
    role asks for GPUs: set device=cuda there, not auto), except on the embedded local
    cluster, which cannot grow: ValueError naming ``device`` rather than a placement that
    waits for nothing."""
    if setting not in ("auto", "cpu", "cuda"):
        raise ValueError(f"device={setting!r}: expected auto, cpu or cuda")
    if setting == "auto":
        return "cuda" if 0 < needed_gpus <= cluster_gpus else "cpu"
    if setting == "cuda" and needed_gpus > cluster_gpus and embedded:
        raise ValueError(f"device=cuda: the workers need {needed_gpus:g} GPUs and the local "
                         f"Ray cluster has {cluster_gpus:g}; use device=cpu or auto")
    return setting


def worker_device(setting: Device) -> torch.device:
    """The torch device of this process for ``setting``: cpu, or the first CUDA device it
    sees (its Ray GPU). ``auto`` takes CUDA only in a troupe worker that Ray gave GPUs (the
    drivers resolve ``auto`` for their workers with ``cluster_device``; in a script or a test,
    auto is the CPU). RuntimeError naming the setting when cuda is asked for and this process
    sees none."""
    if setting == "cpu":
        return torch.device("cpu")
    if setting == "auto":
        ctx = _context._current
        if ctx is None or not ctx.gpu_ids or not torch.cuda.is_available():
            return torch.device("cpu")
    if not torch.cuda.is_available():
        raise RuntimeError("device=cuda, but this process sees no CUDA device (a role asks Ray "
                           "for GPUs with num_gpus > 0; is torch a CUDA build?)")
    return torch.device("cuda", torch.cuda.current_device())


def rng_state(device: torch.device) -> dict:
    """The random streams a checkpoint keeps for exact resume: the host's, and the GPU's on
    cuda (dropout and MoE gate noise there draw from it)."""
    cuda = torch.cuda.get_rng_state(device) if device.type == "cuda" else None
    return {"torch_rng": torch.get_rng_state(), "cuda_rng": cuda}


def set_rng_state(state: dict, device: torch.device) -> None:
    """Restore what ``rng_state`` saved (a checkpoint without the GPU's stream leaves it)."""
    torch.set_rng_state(state["torch_rng"])
    if device.type == "cuda" and state.get("cuda_rng") is not None:
        torch.cuda.set_rng_state(state["cuda_rng"], device)


def move(obj: Any, device: torch.device | str) -> Any:
    """``obj`` with every tensor in it on ``device``: tensors, and those inside lists,
    tuples, dicts and dataclasses. A container none of whose tensors had to move is returned
    as it is (tensors already there are never copied); one that changed is a new container.
    Other values pass through."""
    if isinstance(obj, torch.Tensor):
        return obj.to(device)
    if isinstance(obj, (list, tuple)):
        items = [move(v, device) for v in obj]
        if all(a is b for a, b in zip(items, obj)):
            return obj
        return type(obj)(*items) if hasattr(obj, "_fields") else type(obj)(items)
    if isinstance(obj, dict):
        moved = {k: move(v, device) for k, v in obj.items()}
        return obj if all(moved[k] is v for k, v in obj.items()) else moved
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        changed = {f.name: m for f in dataclasses.fields(obj) if f.init
                   for v in [getattr(obj, f.name)] for m in [move(v, device)] if m is not v}
        return dataclasses.replace(obj, **changed) if changed else obj
    return obj


def to_host(obj: Any) -> Any:
    """``obj`` with its CUDA tensors copied to host memory (what leaves a worker; ``obj``
    itself when it holds none)."""
    return move(obj, "cpu")


def precision_dtype(precision: str) -> torch.dtype:
    """The torch type of a ``precision`` setting (fp32, bf16, fp16)."""
    return {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[precision]
