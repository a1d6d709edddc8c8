"""Model weights in one wire-format file: {"meta": ..., "state": tensors}, written atomically
(LoRA adapters folded in), read back with errors that name the file and the keys at fault."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch
from torch import nn

from troupe import wire
from troupe.models.lora import merged_state_dict


def save_module(path: str | Path, module: nn.Module, state: dict[str, torch.Tensor] | None = None,
                **meta: Any) -> Path:
    """Weights of ``module`` (LoRA adapters folded in) and ``meta`` to ``path``, atomically.
    ``state``: the weights to write instead (a tensor-parallel module's put together:
    troupe.parallel.tensor.full_state_dict)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    state = merged_state_dict(module) if state is None else state
    state = {k: v.contiguous() for k, v in state.items()}
    with open(tmp, "wb") as f:
        wire.dump({"meta": meta, "state": state}, f)
    os.replace(tmp, path)
    return path


def read_module_file(path: str | Path) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """(meta, state) of a file written by ``save_module``."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"model file {path} does not exist (run the earlier step?)")
    with open(path, "rb") as f:
        try:
            blob = wire.load(f)
        except wire.WireFormatError as e:
            raise ValueError(f"{path}: {e}") from None
    if not isinstance(blob, dict) or not isinstance(blob.get("state"), dict):
        raise ValueError(f"{path}: not a model file (no weights in it)")
    return blob.get("meta") or {}, blob["state"]


def load_module(path: str | Path, module: nn.Module, strict: bool = True) -> dict[str, Any]:
    """Load weights saved by save_module into ``module``; returns the file's meta (a module
    holding tensor-parallel shards: troupe.parallel.tensor.load_shards)."""
    meta, state = read_module_file(path)
    load_state(module, state, path, strict)
    return meta


def load_state(module: nn.Module, state: dict[str, torch.Tensor], path: str | Path,
               strict: bool = True) -> None:
    """Copy ``state`` (read from ``path``, which errors name) into ``module``'s weights."""
    mine = module.state_dict()
    missing = [k for k in mine if k not in state]
    if strict and (missing or set(state) - set(mine)):
        raise ValueError(f"{path}: keys missing {missing[:5]}, unexpected "
                         f"{sorted(set(state) - set(mine))[:5]}")
    with torch.no_grad():
        for k, v in state.items():
            if k in mine:
                if mine[k].shape != v.shape or mine[k].dtype != v.dtype:
                    raise ValueError(f"{path}: {k} is {v.dtype} {tuple(v.shape)}, the model "
                                     f"has {mine[k].dtype} {tuple(mine[k].shape)}")
                mine[k].copy_(v)
