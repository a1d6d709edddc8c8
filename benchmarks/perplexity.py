"""Perplexity of a pretrained model (an apps/pretrain.py checkpoint, or a Hugging Face directory
with --pretrained) in FP32 and quantized modes, with ZeroQuant's LKD beside plain post-training
quantization, on held-out text (the held-out docstrings of Python's standard library, tokenized
by the model's tokenizer).

    python benchmarks/perplexity.py runs/dense-tiny/checkpoints/step-00001000
    python benchmarks/perplexity.py --pretrained ~/.cache/troupe/smollm2-135m-instruct --seq-len 256

Modes: W8A8 everywhere; W4/8A16 (INT4 weights in the MLPs, INT8 in attention, 16-bit
activations), also with the output projection in INT8 ("+head", as benchmarks/quant.py decodes);
W4/8A8 (INT4 MLP weights, W8A8 attention), for each --group-sizes; each plain (PTQ), with LoRC
(rank --lorc-rank) and after LKD, which distills each block on training batches (the original
data) and is evaluated on the held-out ones. torch.ao's dynamic INT8 quantization beside them.
W8A8 also with --outliers k calibrated fp32 input channels per layer (troupe.compression.quantize;
calibrated on 4 training batches). One JSON line per mode and group size.
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from troupe.compression import layerwise_distill, quantize_model  # noqa: E402
from troupe.compression.quantize import outlier_channels  # noqa: E402
from troupe.data import DataConfig, TokenDataset, load_tokenizer  # noqa: E402
from troupe.models import from_pretrained  # noqa: E402
from troupe.pretrain import PretrainConfig  # noqa: E402
from troupe.pretrain.export import load_full_model  # noqa: E402
from machine import machine  # benchmarks/machine.py, beside this script

MODES = {"w8a8": {"*": "w8a8"},
         "w4/8a16": {"*.attn.*": "w8a16", "*.ffn.*": "w4a16"},
         "w4/8a16+head": {"*.attn.*": "w8a16", "*.ffn.*": "w4a16", "lm_head": "w8a16"},
         "w4/8a8": {"*.attn.*": "w8a8", "*.ffn.*": "w4a16"}}


BATCH = 8


@torch.no_grad()
def perplexity(model, data: TokenDataset, batches: int, seq_len: int) -> float:
    losses = [model(x, y)[1].item() for x, y in data.val_batches(batches, BATCH, seq_len)]
    return math.exp(sum(losses) / len(losses))


def load(a):
    """(model, data, seq_len, name) for a checkpoint or a Hugging Face directory."""
    if a.pretrained:
        model = from_pretrained(a.pretrained)
        return (model, TokenDataset(DataConfig(), load_tokenizer(a.pretrained)),
                min(a.seq_len, model.cfg.seq_len), a.pretrained)
    directory = Path(a.checkpoint)
    cfg = PretrainConfig(**json.loads((directory.parent.parent / "config.json").read_text()))
    return load_full_model(directory, cfg), TokenDataset(cfg.data), cfg.model.seq_len, str(directory)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("checkpoint", nargs="?")
    p.add_argument("--pretrained", help="a Hugging Face model directory instead")
    p.add_argument("--seq-len", type=int, default=256, help="window for --pretrained")
    p.add_argument("--outliers", type=int, default=16, help="fp32 channels for W8A8 (0: none)")
    p.add_argument("--no-lkd", action="store_true", help="skip LKD (slow on larger models)")
    p.add_argument("--batches", type=int, default=8)
    p.add_argument("--lkd-batches", type=int, default=8)
    p.add_argument("--group-sizes", type=int, nargs="+", default=[64, 128])
    p.add_argument("--lorc-rank", type=int, default=8)
    p.add_argument("--modes", nargs="+", default=list(MODES), choices=list(MODES),
                   help="the group-wise modes to run (each with PTQ, LoRC and LKD)")
    p.add_argument("--lkd-steps", type=int, default=80, help="LKD steps per block")
    a = p.parse_args()
    if (a.checkpoint is None) == (a.pretrained is None):
        p.error("give a checkpoint or --pretrained DIR")
    model, data, T, name = load(a)
    base = perplexity(model, data, a.batches, T)
    head = {"bench": "perplexity", "machine": machine(), "model": name,
            "tokens": a.batches * BATCH * T, "threads": torch.get_num_threads()}
    print(json.dumps({**head, "mode": "fp32", "ppl": round(base, 4)}), flush=True)
    ao = torch.ao.quantization.quantize_dynamic(copy.deepcopy(model), {torch.nn.Linear},
                                                dtype=torch.qint8)
    ppl = perplexity(ao, data, a.batches, T)
    print(json.dumps({**head, "mode": "torch_dynamic_int8", "ppl": round(ppl, 4),
                      "vs_fp32": round(ppl / base - 1, 5)}), flush=True)
    train = [data.train_batch(10_000 + i, BATCH, T)[0] for i in range(a.lkd_batches)]
    if a.outliers:
        channels = outlier_channels(model, train[:4], a.outliers)
        q = copy.deepcopy(model)
        quantize_model(q, MODES["w8a8"], outliers=channels)
        ppl = perplexity(q, data, a.batches, T)
        print(json.dumps({**head, "mode": "w8a8", "outliers": a.outliers, "ppl": round(ppl, 4),
                          "vs_fp32": round(ppl / base - 1, 5)}), flush=True)
    for group in a.group_sizes:
        for mode, rules in ((m, MODES[m]) for m in a.modes):
            plain = copy.deepcopy(model)
            quantize_model(plain, rules, group)
            ptq = perplexity(plain, data, a.batches, T)
            lorc = copy.deepcopy(model)
            quantize_model(lorc, rules, group, lorc_rank=a.lorc_rank)
            with_lorc = perplexity(lorc, data, a.batches, T)
            lkd = None
            if not a.no_lkd:
                student, _ = layerwise_distill(model, rules, train, a.lkd_steps,
                                               group_size=group)
                lkd = perplexity(student, data, a.batches, T)
            gap = ptq - base
            print(json.dumps({
                **head, "mode": mode, "group_size": group, "ppl": round(ptq, 4),
                "vs_fp32": round(ptq / base - 1, 5), "lorc_rank": a.lorc_rank,
                "lorc_ppl": round(with_lorc, 4), "lorc_vs_fp32": round(with_lorc / base - 1, 5),
                "lkd_steps_per_block": None if a.no_lkd else a.lkd_steps,
                "lkd_ppl": lkd and round(lkd, 4), "lkd_vs_fp32": lkd and round(lkd / base - 1, 5),
                "lkd_gap_recovered": round((ptq - lkd) / gap, 3) if lkd and gap > 0 else None,
                "lorc_gap_recovered": round((ptq - with_lorc) / gap, 3) if gap > 0 else None}),
                flush=True)


if __name__ == "__main__":
    main()
