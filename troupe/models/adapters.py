"""Many LoRA adapters over one base model, applied per row: Hugging Face PEFT directories
(``adapter_config.json``, ``adapter_model.safetensors``) loaded onto troupe's decoder, and a
batch whose rows each use their own adapter (or none), as S-LoRA and Punica serve them: the
base weights are shared and never changed, each adapted layer adds ``B (A x)`` for the rows of
each adapter.

PEFT names the Hugging Face layers (``q_proj``, ``k_proj``, ``v_proj``, ``o_proj``,
``gate_proj``, ``up_proj``, ``down_proj``); troupe's decoder concatenates q, k, v into
``attn.qkv`` and gate, up into ``ffn.fc`` (troupe.models.hf). An adapter on such a part becomes
a block of one low-rank pair on the concatenated layer: A stacks the parts' A matrices, B puts
each part's B (times the adapter's scale, alpha / r) in the part's rows, zeros elsewhere; so
one adapted layer is one pair per adapter, and the product equals the parts' products.
"""

from __future__ import annotations

import contextlib
import json
import re
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from troupe.kernels import small_gemm
from troupe.models.gpt import GPT, GPTConfig

_KEY = re.compile(r"(?:^|\.)layers\.(\d+)\.(self_attn|mlp)\.(q_proj|k_proj|v_proj|o_proj|"
                  r"gate_proj|up_proj|down_proj)\.lora_([AB])(?:\.[^.]+)?\.weight$")


@dataclass
class Adapter:
    """One adapter in troupe's layout: for each adapted layer (by module name) its A (r, in)
    and B (out, r), the scale folded into B."""

    name: str
    pairs: dict[str, tuple[torch.Tensor, torch.Tensor]]


def _parts(cfg: GPTConfig, proj: str) -> tuple[str, int, int]:
    """The troupe layer a Hugging Face projection is part of, and its rows there."""
    D = cfg.head_size
    q, kv = cfg.n_head * D, cfg.kv_heads * D
    ff = cfg.d_ff or 4 * cfg.d_model
    return {"q_proj": ("attn.qkv", 0, q), "k_proj": ("attn.qkv", q, q + kv),
            "v_proj": ("attn.qkv", q + kv, q + 2 * kv), "o_proj": ("attn.proj", 0, cfg.d_model),
            "gate_proj": ("ffn.fc", 0, ff), "up_proj": ("ffn.fc", ff, 2 * ff),
            "down_proj": ("ffn.proj", 0, cfg.d_model)}[proj]


def load_peft(directory: str | Path, model: GPT, name: str | None = None) -> Adapter:
    """A PEFT LoRA directory as an Adapter for ``model``; ValueError naming the file and what
    does not fit (another model's shapes, an adapter type or target this loader does not
    take)."""
    from safetensors.torch import load_file

    d = Path(directory).expanduser()
    cfg_path, w_path = d / "adapter_config.json", d / "adapter_model.safetensors"
    for p in (cfg_path, w_path):
        if not p.is_file():
            raise FileNotFoundError(f"{d}: no {p.name} (a PEFT LoRA directory has "
                                    "adapter_config.json and adapter_model.safetensors)")
    conf = json.loads(cfg_path.read_text())
    if conf.get("peft_type", "LORA") != "LORA":
        raise ValueError(f"{cfg_path}: peft_type {conf.get('peft_type')!r}; only LORA adapters")
    if conf.get("fan_in_fan_out"):
        raise ValueError(f"{cfg_path}: fan_in_fan_out adapters (GPT-2's Conv1D) are not taken")
    r, alpha = int(conf["r"]), float(conf.get("lora_alpha", conf["r"]))
    scale = alpha / (r ** 0.5 if conf.get("use_rslora") else r)
    found: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    for key, t in load_file(str(w_path)).items():
        m = _KEY.search(key)
        if m is None:
            raise ValueError(f"{w_path}: tensor {key!r} is not a LoRA A/B of a decoder layer's "
                             "projection")
        layer, _, proj, ab = m.groups()
        found.setdefault((int(layer), proj), {})[ab] = t.float()
    cfg = model.cfg
    modules = dict(model.named_modules())
    blocks: dict[str, list[tuple[int, int, torch.Tensor, torch.Tensor]]] = {}
    for (layer, proj), ab in sorted(found.items()):
        if set(ab) != {"A", "B"}:
            raise ValueError(f"{w_path}: layer {layer} {proj} has lora_{''.join(ab)} only")
        if layer >= cfg.n_layer:
            raise ValueError(f"{w_path}: layer {layer}; the model has {cfg.n_layer}")
        target, lo, hi = _parts(cfg, proj)
        where = f"blocks.{layer}.{target}"
        base = modules.get(where)
        base = getattr(base, "base", base)  # already wrapped by another adapter
        A, B = ab["A"], ab["B"]
        if base is None or A.shape[1] != base.in_features or B.shape[0] != hi - lo:
            raise ValueError(f"{w_path}: layer {layer} {proj}: A {tuple(A.shape)}, B "
                             f"{tuple(B.shape)} do not fit this model")
        blocks.setdefault(where, []).append((lo, hi, A, B * scale))
    pairs = {}
    for where, parts in blocks.items():
        out = getattr(modules[where], "base", modules[where]).out_features
        A = torch.cat([a for _, _, a, _ in parts])
        B = A.new_zeros(out, A.shape[0])
        at = 0
        for lo, hi, a, b in parts:
            B[lo:hi, at:at + a.shape[0]] = b
            at += a.shape[0]
        pairs[where] = (A.to(model.device), B.to(model.device))
    return Adapter(name or d.name, pairs)


class AdaptedLinear(nn.Module):
    """A base linear layer (fp32 or quantized) and the adapters on it. The adapters' pairs are
    laid side by side, each zero-padded to the largest rank R: A as (slots x R, in), B as
    (out, slots x R). A forward runs every row through every adapter's A (one product of
    slots x R columns: a few percent of the base layer's work), keeps each row's own adapter's
    R columns (``mask``: one 0/1 row per batch row, shared by the layers of the same R) and
    runs them through B (one product); rows without an adapter keep none."""

    def __init__(self, base: nn.Module):
        super().__init__()
        self.base = base
        self.pairs: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self.A: torch.Tensor | None = None   # (in, slots x R)
        self.B: torch.Tensor | None = None   # (slots x R, out)
        self.R = 0
        self.mask: torch.Tensor | None = None   # (B, slots x R) set per forward
        self.packed: tuple[torch.Tensor, torch.Tensor] | None = None  # A, B for small_gemm

    @property
    def weight(self):  # what code that reads a linear layer's weight expects
        return self.base.weight

    @property
    def in_features(self) -> int:
        return self.base.in_features

    @property
    def out_features(self) -> int:
        return self.base.out_features

    def stack(self, slots: int) -> None:
        """Lay the pairs out for ``slots`` adapters."""
        R = max(A.shape[0] for A, _ in self.pairs.values())
        A0, B0 = next(iter(self.pairs.values()))
        A_all = A0.new_zeros(slots, R, A0.shape[1])
        B_all = B0.new_zeros(B0.shape[0], slots, R)
        for slot, (A, B) in self.pairs.items():
            A_all[slot, :A.shape[0]] = A
            B_all[:, slot, :B.shape[1]] = B
        A_rows, B_rows = A_all.view(slots * R, -1), B_all.view(B0.shape[0], -1)
        # transposed once here: a prefill's products are then plain (rows, k) x (k, n)
        self.A, self.B, self.R = A_rows.t().contiguous(), B_rows.t().contiguous(), R
        # and packed for the few-row kernel a decode step's base layers use (2-3x faster than
        # torch's product at 8 rows: troupe.kernels.small_gemm)
        self.packed = ((small_gemm.pack(A_rows), small_gemm.pack(B_rows))
                       if small_gemm.available() and A_rows.device.type == "cpu"
                       and A_rows.dtype == torch.float32 else None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.base(x)
        if self.mask is None or self.A is None:
            return y
        rows = x.reshape(-1, x.shape[-1]).to(self.A.dtype)            # (B x T, in)
        T = rows.shape[0] // self.mask.shape[0]
        mask = self.mask if T == 1 else self.mask.repeat_interleave(T, 0)
        if self.packed is not None and rows.shape[0] <= small_gemm.MAX_ROWS:
            # at least two rows: the kernel sums one row in another order, and a row's delta
            # must not depend on how many rows share the step (the native step pads alike)
            M = rows.shape[0]
            if M == 1:
                rows, mask = F.pad(rows, (0, 0, 0, 1)), F.pad(mask, (0, 0, 0, 1))
            low = small_gemm.linear(rows, self.packed[0], self.A.shape[1]).mul_(mask)
            delta = small_gemm.linear(low, self.packed[1], self.B.shape[1])[:M]
        else:
            delta = torch.mm(torch.mm(rows, self.A).mul_(mask), self.B)
        if delta.dtype == y.dtype:
            return y.add_(delta.reshape(y.shape))  # y is this call's own output
        return y + delta.reshape(y.shape).to(y.dtype)


class Adapters:
    """The adapters served over ``model``: ``add`` loads one into a slot of its own (every
    adapted layer wrapped once, the base weights untouched), ``routed(names)`` sets each row's
    adapter for the forward passes it encloses. Call ``add`` between forward passes (the
    server runs it on the decode thread); ``version`` counts the adds, so that what holds the
    layers' tensors (a native decode step) knows to rebuild."""

    def __init__(self, model: GPT):
        self.model = model
        self.slots: dict[str, int] = {}
        self.layers: dict[str, AdaptedLinear] = {}
        self.version = 0

    def add(self, adapter: Adapter) -> None:
        if adapter.name in self.slots:
            raise ValueError(f"adapter {adapter.name!r} is loaded already")
        slot = len(self.slots)
        for name, (A, B) in adapter.pairs.items():
            self._wrapped(name).pairs[slot] = (A, B)
        self.slots[adapter.name] = slot
        for layer in self.layers.values():  # every layer knows every slot (zeros if absent)
            layer.stack(len(self.slots))
        self.version += 1

    def slot_ids(self, names: list[str | None]) -> torch.Tensor:
        """Each row's slot (-1: the base alone), as a native decode step takes them."""
        return torch.tensor([-1 if n is None else self.slots[n] for n in names],  # host: the
                            dtype=torch.long)  # native CPU step reads it

    def _wrapped(self, name: str) -> AdaptedLinear:
        if name not in self.layers:
            parent_name, _, attr = name.rpartition(".")
            parent = self.model.get_submodule(parent_name)
            layer = AdaptedLinear(getattr(parent, attr))
            setattr(parent, attr, layer)
            self.layers[name] = layer
        return self.layers[name]

    @contextlib.contextmanager
    def routed(self, names: list[str | None]):
        """Rows i of the enclosed forwards use adapter ``names[i]`` (None: the base)."""
        if not self.layers or all(n is None for n in names):
            yield
            return
        slots = len(self.slots)
        masks: dict[int, torch.Tensor] = {}
        for layer in self.layers.values():
            if layer.R not in masks:  # row b keeps the R columns of its adapter
                m = torch.zeros(len(names), slots, layer.R, device=self.model.device)
                for b, n in enumerate(names):
                    if n is not None:
                        m[b, self.slots[n]] = 1.0
                masks[layer.R] = m.view(len(names), -1)
            layer.mask = masks[layer.R]
        try:
            yield
        finally:
            for layer in self.layers.values():
                layer.mask = None
