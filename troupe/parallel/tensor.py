"""Tensor parallelism applied to a built model, Megatron-style (Shoeybi et al. 2019): the T
ranks of a group each hold 1/T of every dense layer and compute it together.

- Attention: each rank holds H/T query heads and their key/value heads (Hkv/T of them, or,
  when T exceeds the key/value heads and Hkv divides T, the one its query heads read,
  replicated: inference only, as vLLM does). ``qkv`` is column-parallel (its rows of those
  heads), ``proj`` row-parallel (its columns of them).
- MLP: ``fc`` column-parallel (SwiGLU: the same rows of the gate and of the up projection),
  ``proj`` row-parallel.
- The embedding and the output head split by vocabulary rows, the vocabulary padded with
  zero rows to a multiple of T (the byte model's 257 over 2 ranks: 258); the loss is the
  vocabulary-parallel cross-entropy, which never gathers the logits: each rank's max,
  sum of exponentials and target logit are all-reduced, (B, T) numbers instead of (B, T, V).
- MoE layers (TED, Singh et al. 2023): the tensor-parallel ranks hold the same tokens, so
  after the (replicated) gate each dispatches only its 1/T of them to the expert-parallel
  group and the results are all-gathered back: 1/T of the all-to-all bytes of sending every
  duplicate. The experts are not split by the tensor-parallel group: ranks t of every
  tensor-parallel group are data parallel for them (troupe.parallel.layout.ParallelLayout).

Two collectives carry the rest, each the other's transpose: at a column-parallel input the
activations are copied (forward) and the gradients all-reduced (backward); at a
row-parallel output the partial products are all-reduced (forward) and the gradient copied.
So a rank's gradient of a split weight is the whole model's gradient of that slice, and the
replicated weights (norms, biases after the reduce, position embeddings, the gate) get the
same gradient on every rank of the group. The q and k norms' weights, shared by all heads,
are the exception: each rank sees its heads only, so their gradient is all-reduced.

``Layout`` records, per split parameter, which rows or columns of the whole tensor a rank
holds: ``shard`` cuts a whole tensor, ``merge`` puts the ranks' shards back together (for
initialisation from the same seed, checkpoints across sizes and export).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
from torch import nn

from troupe.collectives import Communicator
from troupe.models.attention import Attention
from troupe.models.io import load_state, read_module_file
from troupe.models.layers import MLP
from troupe.models.moe import MoE


# --- which slice of each split parameter a rank holds ------------------------------------------

@dataclass(frozen=True)
class Split:
    """A parameter split along ``dim``: rank t holds the whole tensor's indices ``index[t]``
    along it (-1: a padding row of zeros, the vocabulary's); the whole tensor's size there is
    ``whole``."""

    dim: int
    index: tuple[torch.Tensor, ...]
    whole: int

    def shard(self, full: torch.Tensor, rank: int) -> torch.Tensor:
        """Rank ``rank``'s part of the whole tensor ``full``."""
        idx = self.index[rank]
        out = full.index_select(self.dim, idx.clamp_min(0).to(full.device))
        if bool((idx < 0).any()):
            shape = [1] * full.dim()
            shape[self.dim] = -1
            out = out * (idx >= 0).view(shape).to(out.device, out.dtype)
        return out

    def merge(self, shards: list[torch.Tensor]) -> torch.Tensor:
        """The whole tensor from every rank's part (the replicated key/value heads from the
        first rank holding them)."""
        first = shards[0]
        shape = list(first.shape)
        shape[self.dim] = self.whole
        out = first.new_zeros(shape)
        for idx, part in zip(self.index, shards):
            real = (idx >= 0).nonzero().flatten()
            out.index_copy_(self.dim, idx[real].to(out.device),
                            part.index_select(self.dim, real.to(part.device)))
        return out

    def gather(self, part: torch.Tensor, group: Communicator) -> torch.Tensor:
        """The whole tensor, every rank of ``group`` giving its ``part`` (an all-gather; every
        rank calls and gets it)."""
        return self.merge(list(group.all_gather(part.detach().contiguous()).unbind(0)))


def _arange(lo: int, hi: int) -> torch.Tensor:
    """Indices on the host (also while a model is built under torch.device("meta"))."""
    return torch.arange(lo, hi, device="cpu")


def _heads_index(H: int, Hkv: int, D: int, T: int, rank: int) -> tuple[torch.Tensor, ...]:
    """Rows of a fused qkv projection (H query heads, then Hkv key and Hkv value heads, D rows
    each) that rank ``rank`` holds, and the columns of the output projection (its query
    heads)."""
    q = _arange(rank * H // T, (rank + 1) * H // T)
    kv = (_arange(rank * Hkv // T, (rank + 1) * Hkv // T) if Hkv % T == 0
          else _arange(0, 1) + rank * H // T // (H // Hkv))

    def rows(heads: torch.Tensor, first: int) -> torch.Tensor:
        return ((first + heads) * D)[:, None].add(_arange(0, D)).flatten()
    return torch.cat([rows(q, 0), rows(kv, H), rows(kv, H + Hkv)]), rows(q, 0)


def check_heads(n_head: int, n_kv: int, T: int, training: bool, where: str = "model") -> None:
    """ValueError naming the sizes that work when T does not split the heads: T must divide
    the query heads and either divide the key/value heads or (inference only) be a multiple
    of them, so that each rank's query heads read one key/value head."""
    def fits(t: int) -> bool:
        return n_head % t == 0 and (n_kv % t == 0 or (not training and t % n_kv == 0))
    if fits(T):
        return
    ok = [t for t in range(1, n_head + 1) if fits(t)]
    kv = "" if training else " (or a multiple of them, for inference)"
    raise ValueError(
        f"tensor_parallel={T}: {where} has {n_head} query and {n_kv} key/value heads; a size "
        f"must divide the query heads and the key/value heads{kv}: one of {ok} (zero heads "
        "are not padded in: they would cost their share of compute on every rank)")


def check_split(cfg, T: int, training: bool = True) -> None:
    """ValueError when T does not split a model of config ``cfg`` (a GPTConfig): its heads
    (``check_heads``) and every MLP width (d_ff, the shared expert's), naming the sizes
    that do."""
    check_heads(cfg.n_head, cfg.kv_heads, T, training)
    d_ff = cfg.d_ff or 4 * cfg.d_model
    widths = {"d_ff": d_ff} if len(cfg.moe_layers()) < cfg.n_layer else {}
    if cfg.moe is not None and cfg.moe.shared_expert_d_ff:
        widths["moe.shared_expert_d_ff"] = cfg.moe.shared_expert_d_ff
    for key, width in widths.items():
        if width % T:
            ok = [t for t in range(1, min(width, 64) + 1) if width % t == 0
                  and cfg.n_head % t == 0 and cfg.kv_heads % t == 0]
            raise ValueError(f"tensor_parallel={T}: {key}={width} does not split over {T} "
                             f"ranks; sizes that split it and the heads: {ok}")


def check_optimizer(opt, T: int, key: str) -> None:
    """ValueError naming ``key`` when the optimizer ``opt`` (an OptimizerConfig) takes norms
    of whole tensors, which tensor parallelism's ranks hold in shards: LAMB's trust ratio, 0/1
    Adam's update clipping."""
    if opt.name in ("lamb", "onebit_lamb") or (opt.name == "zero_one_adam" and opt.update_clip):
        what = "LAMB's trust ratio" if "lamb" in opt.name else \
            f"0/1 Adam's update clipping ({key}.update_clip=0 turns it off)"
        raise ValueError(f"tensor_parallel={T} with {key}.name={opt.name!r}: {what} takes "
                         "the norm of whole tensors, which the ranks hold in shards; use adam, "
                         "adamw or onebit_adam")


def splits(cfg, T: int) -> bool:
    """Whether T splits a model of config ``cfg`` for training (``check_split``)."""
    try:
        check_split(cfg, T)
        return True
    except ValueError:
        return False


def larger_fitting(cfg, T: int, total_at: Callable[[int], int], budget_bytes: float
                   ) -> int | None:
    """The smallest power-of-two size above T that splits ``cfg`` and whose rank's planned
    bytes (``total_at(size)``) are within ``budget_bytes``; None if none up to 64: what a
    memory refusal names (troupe.parallel.memory)."""
    return next((t for t in (2, 4, 8, 16, 32, 64) if t > T and splits(cfg, t)
                 and total_at(t) <= budget_bytes), None)


def layout(model: nn.Module, T: int) -> dict[str, Split]:
    """Which parameters of ``model`` (a whole GPT) tensor parallelism of size T splits, and
    how; replicated parameters are not listed."""
    cfg = model.cfg
    out: dict[str, Split] = {}
    vocab = cfg.vocab_size
    per = -(-vocab // T)
    rows = tuple(torch.where(i < vocab, i, -1) for i in
                 (_arange(r * per, (r + 1) * per) for r in range(T)))
    out["tok_emb.weight"] = Split(0, rows, vocab)
    if getattr(model, "lm_head", None) is not None:
        out["lm_head.weight"] = Split(0, rows, vocab)
    for name, m in model.named_modules():
        if isinstance(m, Attention):
            qkv, proj = zip(*(_heads_index(m.n_head, m.n_kv, m.head_dim, T, r)
                              for r in range(T)))
            width = (m.n_head + 2 * m.n_kv) * m.head_dim
            out[f"{name}.qkv.weight"] = Split(0, qkv, width)
            if m.qkv.bias is not None:
                out[f"{name}.qkv.bias"] = Split(0, qkv, width)
            out[f"{name}.proj.weight"] = Split(1, proj, m.n_head * m.head_dim)
        elif isinstance(m, MLP):
            d_ff = m.proj.in_features
            if d_ff % T:
                raise ValueError(f"tensor_parallel={T}: {name} has d_ff={d_ff}, which "
                                 f"{T} ranks do not split evenly")
            own = [_arange(r * d_ff // T, (r + 1) * d_ff // T) for r in range(T)]
            fc = tuple(torch.cat([i, i + d_ff]) if m.kind == "swiglu" else i for i in own)
            width = m.fc.out_features
            out[f"{name}.fc.weight"] = Split(0, fc, width)
            if m.fc.bias is not None:
                out[f"{name}.fc.bias"] = Split(0, fc, width)
            out[f"{name}.proj.weight"] = Split(1, tuple(own), d_ff)
    return out


@dataclass(frozen=True)
class Place:
    """A rank's place in a tensor-parallel group without the group: for a model that is only
    shapes (on the meta device: a driver's memory plan, a checkpoint's layout)."""

    rank: int
    world_size: int


# --- applying it ---------------------------------------------------------------------------------

def apply_tensor_parallel(model: nn.Module, group: Communicator | Place | None,
                          training: bool = True) -> nn.Module:
    """Make ``model`` (a whole GPT, on any device or the meta device) hold group rank r's
    shard of every split layer (see the module's docstring) and compute with the group. In
    place; returns ``model``. A group of one (or None) leaves it as it is. ``training``:
    refuse what only inference supports (key/value heads replicated over ranks).

    The shards keep the whole model's values, so a tensor-parallel model made this way from a
    seeded (or loaded) model is the same model, split; ``model.tp_layout`` records the
    splits (GPT.init_weights draws whole tensors and keeps its shard)."""
    if group is None or group.world_size == 1:
        return model
    if getattr(model, "tp", None) is not None:
        raise ValueError("the model is already tensor-parallel")
    T, r = group.world_size, group.rank
    cfg = model.cfg
    check_heads(cfg.n_head, cfg.kv_heads, T, training)
    splits = layout(model, T)
    params = dict(model.named_parameters())
    with torch.no_grad():
        for name, split in splits.items():
            owner, _, leaf = name.rpartition(".")
            module = model.get_submodule(owner)
            old = params[name]
            new = nn.Parameter(split.shard(old.data, r), requires_grad=old.requires_grad)
            setattr(module, leaf, new)
            if isinstance(module, nn.Linear) and leaf == "weight":  # its shape, as it says
                module.out_features, module.in_features = new.shape
    for name, m in model.named_modules():
        if isinstance(m, Attention):
            m.n_head //= T
            m.n_kv = m.n_kv // T if m.n_kv % T == 0 else 1
            m.tp = group
        elif isinstance(m, (MLP, MoE)):
            m.tp = group
    model.tp, model.tp_layout = group, splits
    return model


def bias_on_first_rank(model: nn.Module) -> None:
    """After quantization (troupe.compression) of a tensor-parallel model: the row-parallel
    layers that are no longer nn.Linear add their bias inside their forward, before the
    partial products are summed; so only rank 0 keeps it (troupe.models.layers.row_parallel)."""
    group = getattr(model, "tp", None)
    if group is None or group.rank == 0:
        return
    for m in model.modules():
        if isinstance(m, (Attention, MLP)) and not isinstance(m.proj, nn.Linear) \
                and getattr(m.proj, "bias", None) is not None:
            m.proj.bias = None


def split_models(module: nn.Module) -> list[tuple[str, nn.Module]]:
    """The tensor-parallel models inside ``module`` (itself included), each with the prefix
    of its names in ``module``'s state dict ("" for ``module`` itself; "lm.gpt." for a value
    model's body)."""
    return [(f"{name}." if name else "", m) for name, m in module.named_modules()
            if getattr(m, "tp", None) is not None and getattr(m, "tp_layout", None)]


def full_state_dict(module: nn.Module) -> dict[str, torch.Tensor]:
    """The whole state dict of ``module`` (a GPT, or a module holding one: a language or
    value model), each tensor-parallel model in it put together from its ranks' shards (every
    rank of its group calls, and gets it: one all-gather a split tensor); a module without
    tensor parallelism gives its own."""
    state = module.state_dict()
    for prefix, model in split_models(module):
        for name, split in model.tp_layout.items():
            state[prefix + name] = split.gather(state[prefix + name], model.tp)
    return state


def splits_of(model: nn.Module) -> dict[str, Split]:
    """Which of ``model``'s parameters are split and how (empty without tensor
    parallelism)."""
    return model.tp_layout if getattr(model, "tp", None) is not None else {}


def gathered_parameters(model: nn.Module):
    """``model``'s named parameters, the split ones put together, one at a time (every rank
    of the tensor-parallel group walks it to the end, in step: each split one is an
    all-gather); those of a model without tensor parallelism as they are."""
    splits = splits_of(model)
    for name, p in model.named_parameters():
        split = splits.get(name)
        yield name, p if split is None else split.gather(p, model.tp)


def whole_shape(model: nn.Module, name: str, shape: torch.Size) -> torch.Size:
    """The whole tensor's shape of ``model``'s parameter ``name`` (of this rank's ``shape``)."""
    split = splits_of(model).get(name)
    if split is None:
        return shape
    whole = list(shape)
    whole[split.dim] = split.whole
    return torch.Size(whole)


def shard_state(module: nn.Module, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A whole state dict (``full_state_dict``'s, or a file's) cut to the shards this rank's
    tensor-parallel models inside ``module`` hold; tensors already of a shard's shape, and
    modules without tensor parallelism, are left as they are. No collective: each rank cuts
    its own."""
    out = dict(state)
    for prefix, model in split_models(module):
        for name, split in model.tp_layout.items():
            key = prefix + name
            if key in out and out[key].dim() > split.dim \
                    and out[key].shape[split.dim] == split.whole:
                out[key] = split.shard(out[key], model.tp.rank)
    return out


def load_shards(path: str, module: nn.Module) -> dict:
    """``troupe.models.io.load_module`` for a module that may hold tensor-parallel models:
    the file's whole tensors cut to this rank's shards (``shard_state``); returns its meta."""
    meta, state = read_module_file(path)
    load_state(module, shard_state(module, state), path)
    return meta
