"""Quantized model directories: a model as ``quantize_model`` left it (W8A8, W4A16, ternary,
binary layers; INT8 or INT4 embeddings), written as the integers and scales it holds, so what
lies on disk is what is served, and read back without ever holding the fp32 weights.

A directory holds:

- ``config.json``: the Hugging Face config of the architecture (a layer-reduced student's
  own: troupe.compression.student), and the tokenizer files of the model it came from;
- ``quantization.json``: ``{"format": "troupe-quantized/1", "group_size": g, "layers":
  {name: {"mode": m, "shape": [O, I]}}}``, a layer's mode one of troupe.compression's MODES
  ("int8" / "int4" for the embedding ``tok_emb``; a tied output projection stored once, as the
  embedding, is listed with ``"tied": "tok_emb"``);
- ``quantized.safetensors``: each quantized layer's ``NAME.q`` (row-layout integers: INT8, INT4
  two a byte, ternary five a byte, binary eight a byte) and ``NAME.scales`` (fp32; the
  embedding's fp16, which its quantization rounded them to); every other
  parameter (norms, biases, unquantized layers) under its own name, in the type it is held.

``apps/serve.py`` serves such a directory with ``model.pretrained=DIR`` (no ``quantize`` rules:
the directory says how each layer is held). LoRC factors, outlier channels and MoE experts are
not stored (a clear error names the layer)."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from torch import nn

from troupe.compression.fp8 import Fp8Linear
from troupe.compression.quantize import (EMBEDDINGS, LOWBIT, QuantizedEmbedding,
                                         QuantizedExperts, QuantizedLinear)
from troupe.kernels.lowbit import LowbitWeight, row_bytes
from troupe.kernels.quant import QuantizedWeight, group_divisor, row_layout
from troupe.models import GPT
from troupe.models.hf import TOKENIZER_FILES, _SafetensorsFile, _write_safetensors
from troupe.models.hf_config import config_to_hf, read_config

FORMAT = "troupe-quantized/1"
MANIFEST, TENSORS = "quantization.json", "quantized.safetensors"
_BITS = {"w8a8": 8, "w8a16": 8, "w4a16": 4, "int8": 8, "int4": 4}


def is_quantized_dir(directory: str | Path) -> bool:
    return (Path(directory).expanduser() / MANIFEST).is_file()


def save_quantized(model: GPT, directory: str | Path, tokenizer_from: str | Path | None = None,
                   group_size: int = 64) -> Path:
    """Write ``model`` (after ``quantize_model``) as a quantized model directory; returns it.
    ``group_size``: the one the weight-only layers and the embedding were quantized with."""
    directory = Path(directory).expanduser()
    directory.mkdir(parents=True, exist_ok=True)
    layers: dict[str, dict] = {}
    tensors: dict[str, torch.Tensor] = {}
    held: set[str] = set()  # parameter names the quantized modules account for
    for name, m in model.named_modules():
        if isinstance(m, QuantizedExperts):
            raise ValueError(f"save_quantized: {name} holds quantized MoE experts, which "
                             "quantized model directories do not store")
        if isinstance(m, Fp8Linear):
            raise ValueError(f"save_quantized: {name} is fp8, which quantized model "
                             "directories do not store (serve the model with quantize rules "
                             "of fp8 instead: it is quantized as it loads)")
        if isinstance(m, QuantizedLinear):
            if m.lorc_down is not None or m.outliers is not None:
                raise ValueError(f"save_quantized: {name} has LoRC factors or outlier "
                                 "channels, which quantized model directories do not store")
            layers[name] = {"mode": m.mode, "shape": [m.out_features, m.in_features]}
            if isinstance(m.qw, LowbitWeight):
                q, scales = m.qw.rows(), m.qw.scales
            else:
                rows = row_layout(m.qw)
                q, scales = rows.q, rows.scales
            tensors[f"{name}.q"], tensors[f"{name}.scales"] = q, scales
            if m.bias is not None:
                tensors[f"{name}.bias"] = m.bias.detach()
            held.update(f"{name}.{p}" for p, _ in m.named_parameters())
        elif isinstance(m, QuantizedEmbedding):
            layers[name] = {"mode": "int8" if m.qw.bits == 8 else "int4",
                            "shape": list(m.qw.shape)}
            scales = m.qw.scales  # fp16 when that is lossless (QuantizedEmbedding.of's are)
            half = scales.half()
            tensors[f"{name}.q"] = m.qw.q
            tensors[f"{name}.scales"] = half if torch.equal(half.float(), scales) else scales
    if "tok_emb" in layers and "lm_head" in layers and model.cfg.tie_embeddings and \
            layers["lm_head"]["mode"] == EMBEDDINGS[layers["tok_emb"]["mode"]]:
        layers["lm_head"]["tied"] = "tok_emb"  # the same integers: stored once
        del tensors["lm_head.q"], tensors["lm_head.scales"]
    for name, p in model.named_parameters():
        if name not in held:
            tensors[name] = p.detach()
    _write_safetensors(directory / TENSORS, {k: v.contiguous().cpu() for k, v in tensors.items()})
    (directory / "config.json").write_text(json.dumps(config_to_hf(model.cfg), indent=2))
    (directory / MANIFEST).write_text(json.dumps(
        {"format": FORMAT, "group_size": group_size, "layers": layers}, indent=1))
    if tokenizer_from is not None:
        source = Path(tokenizer_from).expanduser()
        for name in TOKENIZER_FILES:
            if (source / name).is_file():
                (directory / name).write_bytes((source / name).read_bytes())
    return directory


def load_quantized(directory: str | Path) -> tuple[GPT, dict[str, str]]:
    """The model of a quantized model directory, on the CPU, and {layer: mode}. Errors name
    the file and the layer or tensor at fault."""
    directory = Path(directory).expanduser()
    where = directory / MANIFEST
    try:
        manifest = json.loads(where.read_text())
    except (OSError, ValueError) as e:
        raise ValueError(f"{where}: {e}") from None
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        raise ValueError(f"{where}: not a {FORMAT} manifest")
    group_size, layers = manifest.get("group_size"), manifest.get("layers")
    if not isinstance(group_size, int) or group_size < 1 or not isinstance(layers, dict):
        raise ValueError(f"{where}: needs an integer group_size and a layers object")
    with torch.device("meta"):
        model = GPT(read_config(directory))
    tensors = _Tensors(directory / TENSORS)
    modes = {name: _load_layer(model, tensors, name, info, group_size, where)
             for name, info in layers.items()}
    for name, p in list(model.named_parameters()):  # what stays unquantized
        if p.device.type != "meta":
            continue
        value = tensors[name]
        if value.shape != p.shape:
            raise ValueError(f"{tensors.path}: {name} has shape {tuple(value.shape)}, "
                             f"the model needs {tuple(p.shape)}")
        parent, _, attr = name.rpartition(".")
        setattr(model.get_submodule(parent), attr, nn.Parameter(value, requires_grad=False))
    for m in model.modules():  # the rotary frequencies
        for key, b in list(m._buffers.items()):
            if b is not None and b.device.type == "meta":
                m._buffers[key] = torch.empty(b.shape, dtype=b.dtype, device="cpu")
    model.reset_buffers()
    return model.eval(), modes


class _Tensors:
    """The directory's safetensors file, read by name; a missing tensor is an error naming
    the file."""

    def __init__(self, path: Path):
        self.path, self.file = path, _SafetensorsFile(path)

    def __contains__(self, name: str) -> bool:
        return name in self.file.keys()

    def __getitem__(self, name: str) -> torch.Tensor:
        if name not in self:
            raise ValueError(f"{self.path}: no tensor {name!r}")
        return self.file.get(name)


def _load_layer(model: GPT, tensors: _Tensors, name: str, info, group_size: int,
                where: Path) -> str:
    """Layer ``name`` of the manifest put in place in ``model`` (the token embedding, or a
    Linear: the output head of a tied model is made here); its mode."""
    cfg = model.cfg
    mode, shape = info.get("mode") if isinstance(info, dict) else None, None
    try:
        shape = tuple(int(v) for v in info["shape"])
        # a tied model has no lm_head module: its quantized head is made here
        module = None if name == "lm_head" and cfg.tie_embeddings else model.get_submodule(name)
    except (KeyError, TypeError, ValueError, AttributeError):
        raise ValueError(f"{where}: layer {name!r}: not a layer of the model with a shape "
                         "[O, I]") from None
    source = info.get("tied", name)
    if name == "tok_emb":
        if mode not in ("int8", "int4") or shape != tuple(module.weight.shape):
            raise ValueError(f"{where}: tok_emb: mode int8 or int4 and shape "
                             f"{list(module.weight.shape)} expected, got {mode}, {shape}")
        model.tok_emb = QuantizedEmbedding(_grouped(
            tensors[f"{source}.q"], tensors[f"{source}.scales"], _BITS[mode], group_size, shape,
            where, name))
        return mode
    expected = (module.out_features, module.in_features) if isinstance(module, nn.Linear) \
        else (cfg.vocab_size, cfg.d_model) if module is None else None
    if mode not in _BITS and mode not in LOWBIT or shape != expected:
        raise ValueError(f"{where}: layer {name!r}: mode {mode!r} with shape {shape}; "
                         f"expected a quantized mode and {expected}")
    if mode in LOWBIT:
        qw = LowbitWeight(tensors[f"{source}.q"], tensors[f"{source}.scales"].float(), mode,
                          shape)
        want = (shape[0], row_bytes(shape[1], mode))
        if tuple(qw.packed.shape) != want or qw.packed.dtype != torch.uint8:
            raise ValueError(f"{tensors.path}: {source}.q must be uint8 {want}")
    else:
        qw = _grouped(tensors[f"{source}.q"], tensors[f"{source}.scales"], _BITS[mode],
                      group_size, shape, where, name, per_row=mode == "w8a8")
    bias = tensors[f"{name}.bias"] if f"{name}.bias" in tensors else None
    parent, _, attr = name.rpartition(".")
    setattr(model.get_submodule(parent) if parent else model, attr,
            QuantizedLinear.from_quantized(qw, mode, bias, group_size))
    return mode


def _grouped(q: torch.Tensor, scales: torch.Tensor, bits: int, group_size: int,
             shape: tuple[int, int], where: Path, name: str,
             per_row: bool = False) -> QuantizedWeight:
    """A row-layout QuantizedWeight as quantize_for makes it: INT8 per output row (w8a8), or
    groups along the input (weight-only modes and embeddings)."""
    O, I = shape
    g = 1 if per_row else group_divisor(I, group_size)
    want_q = (O, I if bits == 8 else I // 2)
    want_s = (O,) if per_row else (O, I // g)
    if tuple(q.shape) != want_q or tuple(scales.shape) != want_s:
        raise ValueError(f"{where}: {name}: integers {tuple(q.shape)} and scales "
                         f"{tuple(scales.shape)}, expected {want_q} and {want_s}")
    return QuantizedWeight(q, scales.float(), bits, g, 0 if per_row else 1, shape)
