"""Students for distillation. ``reduce_layers`` builds XTC's layer-reduced student: the
teacher's embeddings, final norm and output head, and a chosen list of its blocks, in the order
given (XTC found that which layers matter less than distilling long enough afterwards; keeping
every other layer is the usual start). Works for every decoder troupe loads (its own GPT,
GPT-2, Llama, Qwen2, Mistral, Mixtral): they are all ``troupe.models.GPT``."""

from __future__ import annotations

from typing import Sequence

import torch

from troupe.models import GPT, GPTConfig


def reduced_config(cfg: GPTConfig, keep: Sequence[int]) -> GPTConfig:
    """The configuration of ``cfg``'s student keeping blocks ``keep`` (in that order)."""
    keep = list(keep)
    bad = [i for i in keep if not isinstance(i, int) or not 0 <= i < cfg.n_layer]
    if not keep or bad or len(set(keep)) != len(keep):
        raise ValueError(f"keep_layers: {keep} must be distinct block indices in "
                         f"0..{cfg.n_layer - 1}" + (f" ({bad} are not)" if bad else ""))
    moe = None
    if cfg.moe is not None:
        moe_layers = cfg.moe_layers()
        counts = dict(zip(moe_layers, cfg.moe.experts_per_layer(len(moe_layers))))
        kept = [i for i in keep if i in counts]
        if kept:
            moe = cfg.moe.model_copy(update={
                "expert_interval": 1,
                "dense_layers": [j for j, i in enumerate(keep) if i not in counts],
                "num_experts": [counts[i] for i in kept]})
    return cfg.model_copy(update={"n_layer": len(keep), "moe": moe})


def reduce_layers(teacher: GPT, keep: Sequence[int]) -> GPT:
    """A new GPT whose block j is a copy of the teacher's block ``keep[j]``; every other weight
    copied too. An MoE block stays MoE with its expert count (the student's config lists them);
    the teacher is left untouched."""
    keep = list(keep)
    student = GPT(reduced_config(teacher.cfg, keep))
    state = {k: v for k, v in teacher.state_dict().items() if not k.startswith("blocks.")}
    for j, i in enumerate(keep):
        prefix = f"blocks.{i}."
        state.update({f"blocks.{j}.{k[len(prefix):]}": v for k, v in teacher.state_dict().items()
                      if k.startswith(prefix)})
    with torch.no_grad():
        student.load_state_dict({k: v.detach().clone() for k, v in state.items()}, strict=True)
    return student.to(teacher.tok_emb.weight.device)
