"""Perplexity of a pretrained model (apps/pretrain.py checkpoint) in FP32 and quantized modes,
with ZeroQuant's LKD beside plain post-training quantization, on held-out text.

    python benchmarks/perplexity.py runs/dense-tiny/checkpoints/step-00001000

Modes: W8A8 everywhere; W4/8A16 (INT4 weights in the MLPs, INT8 in attention, fp activations);
W4/8A8 (INT4 MLP weights, W8A8 attention), for each --group-sizes; each plain (PTQ), with LoRC
(rank --lorc-rank) and after LKD, which distills each block on training batches (the original
data) and is evaluated on the held-out ones. torch.ao's dynamic INT8 quantization beside them.
One JSON line per mode and group size.
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import platform
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from troupe.compression import layerwise_distill, quantize_model  # noqa: E402
from troupe.data import TokenDataset  # noqa: E402
from troupe.pretrain import PretrainConfig  # noqa: E402
from troupe.pretrain.export import load_full_model  # noqa: E402

MODES = {"w8a8": {"*": "w8a8"},
         "w4/8a16": {"*.attn.*": "w8a16", "*.ffn.*": "w4a16"},
         "w4/8a8": {"*.attn.*": "w8a8", "*.ffn.*": "w4a16"}}


@torch.no_grad()
def perplexity(model, data: TokenDataset, batches: int, seq_len: int) -> float:
    losses = [model(x, y)[1].item() for x, y in data.val_batches(batches, 16, seq_len)]
    return math.exp(sum(losses) / len(losses))


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("checkpoint")
    p.add_argument("--batches", type=int, default=8)
    p.add_argument("--lkd-batches", type=int, default=8)
    p.add_argument("--group-sizes", type=int, nargs="+", default=[64, 128])
    p.add_argument("--lorc-rank", type=int, default=8)
    a = p.parse_args()
    directory = Path(a.checkpoint)
    cfg = PretrainConfig(**json.loads((directory.parent.parent / "config.json").read_text()))
    model = load_full_model(directory, cfg)
    data = TokenDataset(cfg.data)
    T = cfg.model.seq_len
    base = perplexity(model, data, a.batches, T)
    head = {"bench": "perplexity", "machine": platform.node(), "checkpoint": str(directory)}
    print(json.dumps({**head, "mode": "fp32", "ppl": round(base, 4)}), flush=True)
    ao = torch.ao.quantization.quantize_dynamic(copy.deepcopy(model), {torch.nn.Linear},
                                                dtype=torch.qint8)
    ppl = perplexity(ao, data, a.batches, T)
    print(json.dumps({**head, "mode": "torch_dynamic_int8", "ppl": round(ppl, 4),
                      "vs_fp32": round(ppl / base - 1, 5)}), flush=True)
    train = [data.train_batch(10_000 + i, 16, T)[0] for i in range(a.lkd_batches)]
    for group in a.group_sizes:
        for mode, rules in MODES.items():
            plain = copy.deepcopy(model)
            quantize_model(plain, rules, group)
            ptq = perplexity(plain, data, a.batches, T)
            lorc = copy.deepcopy(model)
            quantize_model(lorc, rules, group, lorc_rank=a.lorc_rank)
            with_lorc = perplexity(lorc, data, a.batches, T)
            student, _ = layerwise_distill(model, rules, train, group_size=group)
            lkd = perplexity(student, data, a.batches, T)
            gap = ptq - base
            print(json.dumps({
                **head, "mode": mode, "group_size": group, "ppl": round(ptq, 4),
                "vs_fp32": round(ptq / base - 1, 5), "lorc_rank": a.lorc_rank,
                "lorc_ppl": round(with_lorc, 4), "lorc_vs_fp32": round(with_lorc / base - 1, 5),
                "lkd_ppl": round(lkd, 4), "lkd_vs_fp32": round(lkd / base - 1, 5),
                "lkd_gap_recovered": round((ptq - lkd) / gap, 3) if gap > 0 else None,
                "lorc_gap_recovered": round((ptq - with_lorc) / gap, 3) if gap > 0 else None}),
                flush=True)


if __name__ == "__main__":
    main()
