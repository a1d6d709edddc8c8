"""Hugging Face checkpoints in and out of troupe's decoder: a local directory with config.json
and *.safetensors (one file or shards with an index) becomes a GPT with the same logits, and a
GPT becomes a directory that transformers loads. No hub access. (config.json's mapping is
troupe.models.hf_config.)

Supported: GPT-2 (GPT2LMHeadModel) and the Llama family (LlamaForCausalLM, MistralForCausalLM,
Qwen2ForCausalLM, Qwen3ForCausalLM with its per-head q and k norms, and MixtralForCausalLM,
Qwen2MoeForCausalLM and Qwen3MoeForCausalLM, whose sparse blocks become troupe MoE layers:
the router is the gate, dropless softmax top-k (renormalised or not), the experts troupe's
stacked SwiGLU experts, Qwen2-MoE's gated shared expert a dense MLP beside them; expert
parallelism and quantization apply to them). Weights are read tensor
by tensor (plain reads, no memory map) into a model built on the meta device, so loading holds
one copy of the model and one tensor. A name
map per family says which Hugging Face tensors make each troupe parameter: q, k and v
concatenate into ``attn.qkv``, gate and up into ``ffn.fc``, a Mixtral layer's per-expert w1
(gate), w3 (up) and w2 (down) stack into ``ffn.experts.w1`` / ``w2``; GPT-2's Conv1D weights are
transposed.
"""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path
from typing import Any, Callable

import torch

from troupe.models.gpt import GPT, GPTConfig
from troupe.models.hf_config import config_from_hf, config_json, config_to_hf

IGNORED = (".attn.bias", ".attn.masked_bias", "rotary_emb.inv_freq")  # buffers, not weights
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                   "vocab.json", "merges.txt", "tokenizer.model", "chat_template.jinja",
                   "generation_config.json")


def _weight_map(cfg: GPTConfig, kind: str) -> dict[str, tuple[list[str], str]]:
    """troupe parameter name -> (Hugging Face tensor names, how to combine them)."""
    out: dict[str, tuple[list[str], str]] = {}
    if kind == "gpt2":
        out["tok_emb.weight"] = (["wte.weight"], "one")
        out["pos_emb.weight"] = (["wpe.weight"], "one")
        out["ln_f.weight"], out["ln_f.bias"] = (["ln_f.weight"], "one"), (["ln_f.bias"], "one")
        for i in range(cfg.n_layer):
            h, b = f"h.{i}.", f"blocks.{i}."
            for mine, theirs in (("ln1", "ln_1"), ("ln2", "ln_2")):
                for p in ("weight", "bias"):
                    out[f"{b}{mine}.{p}"] = ([f"{h}{theirs}.{p}"], "one")
            for mine, theirs in (("attn.qkv", "attn.c_attn"), ("attn.proj", "attn.c_proj"),
                                 ("ffn.fc", "mlp.c_fc"), ("ffn.proj", "mlp.c_proj")):
                out[f"{b}{mine}.weight"] = ([f"{h}{theirs}.weight"], "transpose")
                if mine != "attn.qkv" or cfg.qkv_bias:
                    out[f"{b}{mine}.bias"] = ([f"{h}{theirs}.bias"], "one")
        return out
    out["tok_emb.weight"] = (["model.embed_tokens.weight"], "one")
    out["ln_f.weight"] = (["model.norm.weight"], "one")
    if not cfg.tie_embeddings:
        out["lm_head.weight"] = (["lm_head.weight"], "one")
    moe_layers = cfg.moe_layers()
    for i in range(cfg.n_layer):
        h, b = f"model.layers.{i}.", f"blocks.{i}."
        out[f"{b}ln1.weight"] = ([f"{h}input_layernorm.weight"], "one")
        out[f"{b}ln2.weight"] = ([f"{h}post_attention_layernorm.weight"], "one")
        qkv = [f"{h}self_attn.{x}_proj" for x in "qkv"]
        out[f"{b}attn.qkv.weight"] = ([f"{n}.weight" for n in qkv], "concat")
        if cfg.qkv_bias:
            out[f"{b}attn.qkv.bias"] = ([f"{n}.bias" for n in qkv], "concat")
        if cfg.qk_norm:
            out[f"{b}attn.q_norm.weight"] = ([f"{h}self_attn.q_norm.weight"], "one")
            out[f"{b}attn.k_norm.weight"] = ([f"{h}self_attn.k_norm.weight"], "one")
        out[f"{b}attn.proj.weight"] = ([f"{h}self_attn.o_proj.weight"], "one")
        if cfg.out_bias:
            out[f"{b}attn.proj.bias"] = ([f"{h}self_attn.o_proj.bias"], "one")
        if i in moe_layers:
            out.update(_moe_weights(cfg, kind, h, b))
            continue
        mlp = [f"{h}mlp.gate_proj", f"{h}mlp.up_proj"]
        out[f"{b}ffn.fc.weight"] = ([f"{n}.weight" for n in mlp], "concat")
        out[f"{b}ffn.proj.weight"] = ([f"{h}mlp.down_proj.weight"], "one")
        if cfg.mlp_bias:
            out[f"{b}ffn.fc.bias"] = ([f"{n}.bias" for n in mlp], "concat")
            out[f"{b}ffn.proj.bias"] = ([f"{h}mlp.down_proj.bias"], "one")
    return out


_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16,
           "BF16": torch.bfloat16, "I64": torch.int64, "I32": torch.int32, "I16": torch.int16,
           "I8": torch.int8, "U8": torch.uint8, "BOOL": torch.bool}


def _moe_weights(cfg: GPTConfig, kind: str, h: str, b: str) -> dict[str, tuple[list[str], str]]:
    """A sparse block's tensors: Mixtral's block_sparse_moe (experts' w1 = gate, w3 = up,
    w2 = down), or Qwen2-MoE's mlp (experts' gate/up/down_proj, the shared expert and its
    gate)."""
    E = cfg.moe.experts_per_layer(len(cfg.moe_layers()))[0]
    if kind == "mixtral":
        moe, (gate, up, down) = f"{h}block_sparse_moe.", ("w1", "w3", "w2")
    else:
        moe, (gate, up, down) = f"{h}mlp.", ("gate_proj", "up_proj", "down_proj")
    out = {f"{b}ffn.gate.wg.weight": ([f"{moe}gate.weight"], "one"),
           f"{b}ffn.experts.w1": ([f"{moe}experts.{e}.{w}.weight" for e in range(E)
                                   for w in (gate, up)], "experts_up"),
           f"{b}ffn.experts.w2": ([f"{moe}experts.{e}.{down}.weight" for e in range(E)],
                                  "experts_down")}
    if cfg.moe.shared_expert_d_ff:
        shared = f"{moe}shared_expert."
        out[f"{b}ffn.shared.fc.weight"] = ([f"{shared}gate_proj.weight",
                                            f"{shared}up_proj.weight"], "concat")
        out[f"{b}ffn.shared.proj.weight"] = ([f"{shared}down_proj.weight"], "one")
        out[f"{b}ffn.shared_gate.weight"] = ([f"{moe}shared_expert_gate.weight"], "one")
    return out


MAX_HEADER = 100 << 20  # bytes of a safetensors header


def _check_entry(path: Path, name: str, info: Any, data_bytes: int) -> None:
    """A safetensors header entry is {"dtype": str, "shape": [ints >= 0], "data_offsets":
    [start, end]} within the file's data; ValueError naming the file and tensor otherwise."""
    ok = (isinstance(info, dict) and isinstance(info.get("dtype"), str)
          and isinstance(info.get("shape"), list) and len(info["shape"]) <= 8
          and all(type(d) is int and d >= 0 for d in info["shape"])
          and isinstance(info.get("data_offsets"), list) and len(info["data_offsets"]) == 2
          and all(type(o) is int for o in info["data_offsets"]))
    if not ok:
        raise ValueError(f"{path}: tensor {name!r} has a malformed header entry "
                         f"{str(info)[:120]}")
    start, end = info["data_offsets"]
    if not 0 <= start <= end <= data_bytes:
        raise ValueError(f"{path}: tensor {name!r} claims bytes [{start}, {end}) of "
                         f"{data_bytes} (damaged file)")


class _SafetensorsFile:
    """One .safetensors file read with plain file reads, a tensor at a time: unlike a memory
    map, nothing of the file stays resident in the process once a tensor is copied where it
    belongs, so loading holds the model plus one tensor, not the model twice."""

    def __init__(self, path: Path):
        self.path = path
        total = path.stat().st_size
        with open(path, "rb") as f:
            size = int.from_bytes(f.read(8), "little")
            if not 2 <= size <= min(total - 8, MAX_HEADER):
                raise ValueError(f"{path}: not a safetensors file (a header of {size} bytes in "
                                 f"a file of {total})")
            try:
                header = json.loads(f.read(size))
            except (ValueError, UnicodeDecodeError) as e:
                raise ValueError(f"{path}: not a safetensors file ({e})") from None
        if not isinstance(header, dict):
            raise ValueError(f"{path}: not a safetensors file (its header is not an object)")
        self.base = 8 + size
        self.meta = {k: v for k, v in header.items() if k != "__metadata__"}
        for name, info in self.meta.items():
            _check_entry(path, name, info, total - self.base)

    def keys(self):
        return self.meta.keys()

    def get(self, name: str) -> torch.Tensor:
        info = self.meta[name]
        dtype = _DTYPES.get(info.get("dtype"))
        if dtype is None:
            raise ValueError(f"{self.path}: tensor {name!r} has dtype {info.get('dtype')!r}, "
                             f"which troupe does not read")
        start, end = info["data_offsets"]
        nbytes = math.prod(info["shape"]) * dtype.itemsize
        if end - start != nbytes:  # checked before anything of that size is allocated
            raise ValueError(f"{self.path}: tensor {name!r} of shape {info['shape']} needs "
                             f"{nbytes} bytes, the header gives {end - start}")
        out = torch.empty(info["shape"], dtype=dtype)  # host: read from the file
        with open(self.path, "rb", buffering=0) as f:
            f.seek(self.base + start)
            if nbytes and f.readinto(memoryview(out.view(-1).view(torch.uint8).numpy())) != nbytes:
                raise ValueError(f"{self.path}: tensor {name!r} is cut short (damaged file)")
        return out


class _Tensors:
    """The tensors of a checkpoint directory, read one at a time (safetensors, sharded or not)."""

    def __init__(self, directory: Path):
        index = directory / "model.safetensors.index.json"
        if index.is_file():
            weight_map = json.loads(index.read_text())["weight_map"]
            files = sorted(set(weight_map.values()))
        else:
            files = sorted(p.name for p in directory.glob("*.safetensors"))
            if not files:
                raise FileNotFoundError(f"{directory}: no *.safetensors file (troupe reads "
                                        "safetensors checkpoints only)")
        self.handles = {f: _SafetensorsFile(directory / f) for f in files}
        self.where = {name: f for f, h in self.handles.items() for name in h.keys()}
        self.prefix = ""
        if "transformer.wte.weight" in self.where:  # GPT2LMHeadModel saves under transformer.
            self.prefix = "transformer."
        self.used: set[str] = set()

    def get(self, name: str) -> torch.Tensor:
        full = name if name in self.where else self.prefix + name
        if full not in self.where:
            raise KeyError(name)
        self.used.add(full)
        return self.handles[self.where[full]].get(full)

    def unused(self) -> list[str]:
        return sorted(n for n in self.where if n not in self.used and not n.endswith(IGNORED)
                      and not (n == "lm_head.weight" and "transformer.wte.weight" in self.where))


_COMBINE: dict[str, Callable[[list[torch.Tensor]], torch.Tensor]] = {
    "one": lambda ts: ts[0],
    "concat": lambda ts: torch.cat(ts, 0),
    "transpose": lambda ts: ts[0].t(),  # GPT-2's Conv1D stores (in, out)
    # Mixtral: per expert, w1 (gate) and w3 (up) as (H, M) Linears -> (E, M, 2H), gate first
    "experts_up": lambda ts: torch.stack([torch.cat([g.t(), u.t()], 1)
                                          for g, u in zip(ts[0::2], ts[1::2])]),
    "experts_down": lambda ts: torch.stack([t.t() for t in ts]),  # w2 (M, H) -> (E, H, M)
}


def _split_for_export(value: torch.Tensor, targets: list[str], how: str,
                      cfg: GPTConfig) -> list[torch.Tensor]:
    """The inverse of _COMBINE: troupe's tensor as the Hugging Face tensors ``targets``."""
    if how == "transpose":
        return [value.t()]
    if how == "concat":
        return list(value.split([_rows(cfg, t) for t in targets]))
    if how == "experts_up":
        return [half.t() for e in range(value.shape[0]) for half in value[e].chunk(2, dim=1)]
    if how == "experts_down":
        return [value[e].t() for e in range(value.shape[0])]
    return [value]


def from_pretrained(directory: str | Path, dtype: torch.dtype = torch.float32,
                    device: str | torch.device = "cpu") -> GPT:
    """troupe's GPT with the weights of the Hugging Face checkpoint in ``directory`` (local).
    Errors name the file and tensor at fault, or the unsupported architecture."""
    directory = Path(directory).expanduser()
    hf, where = config_json(directory)
    cfg = config_from_hf(hf, where)
    with torch.device("meta"):
        model = GPT(cfg)
    check_fits(model, dtype, device, where)
    model = model.to(dtype).materialize(device)  # allocated once, in the dtype asked for
    tensors = _Tensors(directory)
    params = dict(model.named_parameters())
    for name, (sources, how) in _weight_map(cfg, hf["model_type"]).items():
        try:
            value = _COMBINE[how]([tensors.get(s) for s in sources])
        except KeyError as e:
            raise ValueError(f"{directory}: tensor {e.args[0]!r} (for {name}) is in no "
                             "safetensors file") from None
        if value.shape != params[name].shape:
            raise ValueError(f"{directory}: {', '.join(sources)} make a tensor of shape "
                             f"{tuple(value.shape)}, {name} needs {tuple(params[name].shape)}")
        with torch.no_grad():
            params[name].copy_(value)
        del params[name]
    if params:
        raise ValueError(f"{directory}: no weights for {sorted(params)[:3]}")
    if tensors.unused():
        raise ValueError(f"{directory}: tensors troupe does not know what to do with: "
                         f"{tensors.unused()[:3]}")
    return model.eval()


def check_fits(model: torch.nn.Module, dtype: torch.dtype, device: str | torch.device,
               where: str) -> None:
    """ValueError naming the figures when ``model`` (built on the meta device) would not fit in
    ``device``'s memory in ``dtype``, before anything is allocated."""
    device = torch.device(device)
    need = sum(p.numel() for p in model.parameters()) * dtype.itemsize
    if device.type == "cuda":
        have = torch.cuda.get_device_properties(device.index or 0).total_memory
    else:
        import psutil
        have = psutil.virtual_memory().total
    if need > have:
        raise ValueError(f"{where}: the model's weights need {need / 2**30:.1f} GiB in {dtype}, "
                         f"more than the {have / 2**30:.1f} GiB of {device.type} memory here")


def save_pretrained(model: GPT, directory: str | Path, tokenizer_from: str | Path | None = None,
                    state: dict[str, torch.Tensor] | None = None) -> Path:
    """Write ``model`` as a Hugging Face directory (config.json, model.safetensors) that
    transformers loads; the tokenizer files of ``tokenizer_from`` are copied beside it.
    ``state``: the weights to write instead of ``model.state_dict()`` (e.g. LoRA adapters
    folded in by troupe.models.lora.merged_state_dict)."""
    directory = Path(directory).expanduser()
    directory.mkdir(parents=True, exist_ok=True)
    hf = config_to_hf(model.cfg)
    kind = hf["model_type"]
    state = model.state_dict() if state is None else state
    prefix = "transformer." if kind == "gpt2" else ""
    tensors: dict[str, torch.Tensor] = {}
    for name, (targets, how) in _weight_map(model.cfg, kind).items():
        parts = _split_for_export(state[name].detach(), targets, how, model.cfg)
        for target, part in zip(targets, parts):
            tensors[prefix + target] = part.contiguous()  # views of the weights where it can
    if kind == "gpt2" and not model.cfg.qkv_bias:  # troupe's GPT has none; GPT-2 a zero one
        for i in range(model.cfg.n_layer):
            tensors[f"transformer.h.{i}.attn.c_attn.bias"] = torch.zeros(
                3 * model.cfg.d_model, device=model.tok_emb.weight.device)
    _write_safetensors(directory / "model.safetensors", tensors)
    (directory / "config.json").write_text(json.dumps(hf, indent=2))
    if tokenizer_from is not None:
        source = Path(tokenizer_from).expanduser()
        for name in TOKENIZER_FILES:
            if (source / name).is_file():
                shutil.copy(source / name, directory / name)
    return directory


def _write_safetensors(path: Path, tensors: dict[str, torch.Tensor]) -> None:
    """A .safetensors file written tensor by tensor from the tensors' own memory (the q, k and
    v parts of one weight may share it: no copies are made), atomically."""
    names = sorted(tensors)
    dtypes = {v: k for k, v in _DTYPES.items()}
    header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
    offset = 0
    for name in names:
        t = tensors[name]
        n = t.numel() * t.element_size()
        header[name] = {"dtype": dtypes[t.dtype], "shape": list(t.shape),
                        "data_offsets": [offset, offset + n]}
        offset += n
    head = json.dumps(header, separators=(",", ":")).encode()
    head += b" " * (-len(head) % 8)  # the data starts 8-byte aligned
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "wb") as f:
        f.write(len(head).to_bytes(8, "little"))
        f.write(head)
        for name in names:
            t = tensors[name].detach().cpu().contiguous()
            if t.numel():
                f.write(memoryview(t.reshape(-1).view(torch.uint8).numpy()))
    tmp.replace(path)


def _rows(cfg: GPTConfig, hf_name: str) -> int:
    """Rows of one part of a concatenated tensor (q / k / v, gate / up)."""
    D = cfg.head_size
    if ".q_proj" in hf_name:
        return cfg.n_head * D
    if ".k_proj" in hf_name or ".v_proj" in hf_name:
        return cfg.kv_heads * D
    if ".shared_expert." in hf_name:  # Qwen2-MoE's shared expert
        return cfg.moe.shared_expert_d_ff
    return cfg.d_ff or 4 * cfg.d_model  # gate_proj / up_proj
