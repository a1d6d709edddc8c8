"""What the sampler's logit adjustments cost: decode tokens per second of troupe's engine on
SmolLM2-135M-Instruct at batch 8, every sequence with logit_bias (64 tokens), the repetition,
frequency and presence penalties and top-k, against the same sampling without them.

    python benchmarks/sampling.py [--model DIR] [--batch 8] [--tokens 64] [--rounds 5]

Prints one JSON line: the median rate of each over alternating rounds (the steps where the
whole batch decodes; ignore_eos keeps every sequence to --tokens) and their ratio.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))

from engine_rate import full_batch_rate  # noqa: E402  beside this script
from machine import machine  # noqa: E402  benchmarks/machine.py, beside this script

from troupe.data import load_tokenizer  # noqa: E402
from troupe.generation import ContinuousBatcher, SamplingParams  # noqa: E402
from troupe.kernels.small_gemm import DecodeWeights  # noqa: E402
from troupe.models import from_pretrained  # noqa: E402


def decode_rate(model, tok, packed, batch: int, tokens: int, adjusted: bool, seed: int) -> float:
    engine = ContinuousBatcher(model, tok.eos_id, max_batch=batch, tokenizer=tok.hf,
                               packed_decode=packed)
    prompt = tok.chat([{"role": "user", "content": "Write a short story about a robot."}])
    extra = dict(logit_bias={t: 1.5 for t in range(1000, 1064)}, repetition_penalty=1.1,
                 frequency_penalty=0.5, presence_penalty=0.3, top_k=50) if adjusted else {}
    for i in range(batch):
        engine.add(str(i), prompt, SamplingParams(max_tokens=tokens, temperature=1.0,
                                                  seed=seed + i, ignore_eos=True, **extra))
    return full_batch_rate(engine, batch)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--model", default=str(Path("~/.cache/troupe/smollm2-135m-instruct")
                                          .expanduser()))
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--tokens", type=int, default=64)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--out", default=str(ROOT / "benchmarks" / "results-sampling.jsonl"))
    a = p.parse_args()
    torch.set_num_threads(a.threads)
    tok = load_tokenizer(a.model)
    model = from_pretrained(a.model).eval()
    packed = DecodeWeights(model)
    plain, adjusted = [], []
    for r in range(a.rounds):  # alternating, so that a noisy neighbour hits both alike
        plain.append(decode_rate(model, tok, packed, a.batch, a.tokens, False, 100 * r))
        adjusted.append(decode_rate(model, tok, packed, a.batch, a.tokens, True, 100 * r))
    line = {"bench": "sampling", "machine": machine(), "threads": a.threads,
            "batch": a.batch, "max_tokens": a.tokens,
            "tokens_per_s_plain": statistics.median(plain),
            "tokens_per_s_adjusted": statistics.median(adjusted),
            "ratio": statistics.median(adjusted) / statistics.median(plain),
            "rounds_plain": plain, "rounds_adjusted": adjusted}
    text = json.dumps(line)
    print(text, flush=True)
    with open(a.out, "a") as f:
        f.write(text + "\n")


if __name__ == "__main__":
    main()
