"""XTC extreme compression of a Hugging Face model (SmolLM2-135M-Instruct by default): held-out
perplexity, the served artifact's bytes on disk, and decode tokens/s at batch 1 and 8 through the
engine, for fp32, ternary post-training quantization, the students apps/compress.py distilled
(ternary at two budgets, ternary with 15 of 30 blocks, binary), and W4A16 / W8A8 for reference.

    python benchmarks/xtc.py --run ternary-100=runs/xtc-t100 --run ternary-300=runs/xtc-t300 \
        --run ternary-15of30=runs/xtc-15 --run binary=runs/xtc-bin

Each --run NAME=OUT_DIR reads what apps/compress.py left in OUT_DIR (quantized/, metrics.jsonl,
config.json): no distillation happens here; its budget (steps, tokens, minutes of training on
the machine that ran it) is read from metrics.jsonl. The held-out text is benchmarks/
perplexity.py's (the held-out docstrings of Python's standard library, the split the recipes
train beside). Every model is written as a quantized model directory (troupe.compression.
artifact) and read back before it is measured: bytes are the directory's weights on disk
(fp32: the teacher's model.safetensors). One JSON line a model, then a summary line with the
goals: the share of PTQ-ternary's log-perplexity gap each distilled ternary student recovers,
the 15-block student's size ratio, ternary decode at batch 1 against W4A16's (the median of
alternating rounds: the per-model rates above come minutes apart on a machine whose speed
drifts).
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from troupe.compression import quantize_model  # noqa: E402
from troupe.compression.artifact import TENSORS, load_quantized, save_quantized  # noqa: E402
from troupe.data import DataConfig, TokenDataset, load_tokenizer  # noqa: E402
from troupe.generation import ContinuousBatcher, SamplingParams  # noqa: E402
from troupe.models import from_pretrained  # noqa: E402
from machine import machine  # benchmarks/machine.py, beside this script

BATCH = 8
REFERENCE = {  # name -> (rules, embedding), quantized here from the teacher
    "ternary-ptq": ({"blocks.*": "ternary"}, "int4"),
    "w4a16": ({"blocks.*": "w4a16"}, "int4"),
    "w8a8": ({"blocks.*": "w8a8"}, "int8"),
}


@torch.no_grad()
def perplexity(model, data: TokenDataset, batches: int, seq_len: int) -> float:
    losses = [model(x, y)[1].item() for x, y in data.val_batches(batches, BATCH, seq_len)]
    return math.exp(sum(losses) / len(losses))


@torch.no_grad()
def decode_rate(model, batch: int, new_tokens: int, repeats: int = 3) -> float:
    """Tokens per second of batch-``batch`` greedy generation after the prefill (best of
    ``repeats``: the machine is shared and noisy)."""
    prompts = [[(7 * i + j) % 5000 + 100 for j in range(24 + 4 * i)] for i in range(batch)]
    best = 0.0
    for _ in range(repeats):
        engine = ContinuousBatcher(model, eos_id=None, max_batch=batch)
        for i, prompt in enumerate(prompts):
            engine.add(str(i), prompt, SamplingParams(max_tokens=new_tokens, temperature=0))
        engine.step()
        t0, n = time.perf_counter(), 0
        while engine.has_work():
            n += len(engine.step())
        best = max(best, n / (time.perf_counter() - t0))
    return best


def budget(out_dir: Path) -> dict:
    """What a compress run spent (its metrics.jsonl and config.json)."""
    records = [json.loads(line) for line in (out_dir / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in records if r["kind"] == "train"]
    cfg = json.loads((out_dir / "config.json").read_text())
    evals = [r for r in records if r["kind"] == "eval"]
    return {"steps": len(train), "tokens": sum(r["tokens"] for r in train),
            "train_minutes": round(sum(r["seconds"] for r in train) / 60, 1),
            "workers": cfg["workers"], "keep_layers": cfg["model"].get("keep_layers"),
            "quantize": cfg["quantize"], "embedding": cfg["embedding"],
            "lr": cfg["optimizer"]["lr"], "seq_len": cfg["model"]["seq_len"],
            "hidden_mse": cfg["distill"]["hidden_mse"],
            "last_val_ppl_in_run": round(math.exp(evals[-1]["val_loss"]), 3) if evals else None}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--teacher", default="~/.cache/troupe/smollm2-135m-instruct")
    p.add_argument("--run", action="append", default=[], metavar="NAME=OUT_DIR",
                   help="an apps/compress.py output directory to measure")
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--batches", type=int, default=4, help="held-out batches of 8 windows")
    p.add_argument("--new-tokens", type=int, default=32)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--rounds", type=int, default=7,
                   help="alternating batch-1 decode rounds of ternary and W4A16 for the goal")
    a = p.parse_args()
    torch.set_num_threads(a.threads)
    teacher_dir = Path(a.teacher).expanduser()
    teacher = from_pretrained(teacher_dir).eval().requires_grad_(False)
    data = TokenDataset(DataConfig(), load_tokenizer(teacher_dir))
    T = min(a.seq_len, teacher.cfg.seq_len)
    fp32_bytes = sum(f.stat().st_size for f in teacher_dir.glob("*.safetensors"))
    head = {"bench": "xtc", "machine": machine(), "threads": a.threads, "teacher": str(a.teacher),
            "heldout_tokens": a.batches * BATCH * T}
    models: dict[str, tuple] = {"fp32": (teacher, fp32_bytes, None)}
    scratch = Path(tempfile.mkdtemp(prefix="xtc-"))
    for name, (rules, embedding) in REFERENCE.items():
        q = copy.deepcopy(teacher)
        quantize_model(q, rules, embedding=embedding)
        save_quantized(q, scratch / name, teacher_dir)
        del q
        loaded, _ = load_quantized(scratch / name)
        models[name] = (loaded, (scratch / name / TENSORS).stat().st_size,
                        {"quantize": rules, "embedding": embedding, "training": "none (PTQ)"})
    for spec in a.run:
        name, _, out = spec.partition("=")
        out = Path(out)
        loaded, _ = load_quantized(out / "quantized")
        models[name] = (loaded, (out / "quantized" / TENSORS).stat().st_size, budget(out))
    results = {}
    for name, (model, size, how) in models.items():
        ppl = perplexity(model, data, a.batches, T)
        rates = {b: decode_rate(model, b, a.new_tokens) for b in (1, 8)}
        results[name] = {"ppl": ppl, "bytes": size, "rates": rates}
        print(json.dumps({**head, "model": name, "n_layer": model.cfg.n_layer,
                          "ppl": round(ppl, 3), "bytes_on_disk": size,
                          "fp32_over_bytes": round(fp32_bytes / size, 2),
                          "decode_tokens_per_s_batch1": round(rates[1], 1),
                          "decode_tokens_per_s_batch8": round(rates[8], 1),
                          "how": how}), flush=True)
    base, ptq = math.log(results["fp32"]["ppl"]), math.log(results["ternary-ptq"]["ppl"])
    summary = {**head, "model": "summary", "goals": {
        "gap_recovered (goal >= 0.8)": {
            n: round((ptq - math.log(r["ppl"])) / (ptq - base), 3)
            for n, r in results.items() if n not in ("fp32", *REFERENCE)},
        "fp32_over_bytes (goal >= 20 for 15 of 30 blocks)": {
            n: round(fp32_bytes / r["bytes"], 2) for n, r in results.items() if n != "fp32"},
        "ternary_batch1_over_w4a16 (goal >= 1)": alternating_ratio(
            models["ternary-ptq"][0], models["w4a16"][0], a.new_tokens, a.rounds)}}
    print(json.dumps(summary), flush=True)


def alternating_ratio(a, b, new_tokens: int, rounds: int) -> dict:
    """Batch-1 decode of ``a`` over ``b``, measured in alternating rounds (a, b, a, b, ...):
    on a shared machine whose speed drifts within minutes, each round's ratio compares the
    two under the same conditions; the median of the rounds' ratios, and their range."""
    ratios = sorted(decode_rate(a, 1, new_tokens, repeats=1)
                    / decode_rate(b, 1, new_tokens, repeats=1) for _ in range(rounds))
    return {"median": round(ratios[len(ratios) // 2], 3), "min": round(ratios[0], 3),
            "max": round(ratios[-1], 3), "rounds": rounds}


if __name__ == "__main__":
    main()
