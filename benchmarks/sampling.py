"""What sampling costs a decode step: tokens per second of troupe's engine on
SmolLM2-135M-Instruct at batch 8, temperature 1, for
- plain: the whole distribution; top_p: 0.9; adjusted: every sequence with logit_bias (64
  tokens), the repetition, frequency and presence penalties and top-k 50;
- each with troupe's draw (one uniform number through the cumulative sum) and with the
  draw as it was before (torch.multinomial over the vocabulary, top-p by sorting all of it),
  put in its place for the run.

    python benchmarks/sampling.py [--model DIR] [--batch 8] [--tokens 64] [--rounds 5]

Prints one JSON line per setting: the median rate over alternating rounds (the steps where
the whole batch decodes; ignore_eos keeps every sequence to --tokens), for both draws, and
their ratio; and the adjusted rate over the plain one.
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

import troupe.generation.engine as engine_module  # noqa: E402
from troupe.data import load_tokenizer  # noqa: E402
from troupe.generation import ContinuousBatcher, SamplingParams  # noqa: E402
from troupe.kernels.small_gemm import DecodeWeights  # noqa: E402
from troupe.models import from_pretrained  # noqa: E402


SETTINGS = {
    "plain": {},
    "top_p": dict(top_p=0.9),
    "adjusted": dict(logit_bias={t: 1.5 for t in range(1000, 1064)}, repetition_penalty=1.1,
                     frequency_penalty=0.5, presence_penalty=0.3, top_k=50),
}


def multinomial_draw(logits_V, p, gen) -> int:
    """The draw before this benchmark's change: softmax over the vocabulary, top-k and top-p
    by scattering into it (top-p sorting all of it), torch.multinomial."""
    probs = torch.softmax(logits_V.float().cpu() / p.temperature, -1)
    if 0 < p.top_k < probs.numel():
        top = probs.topk(p.top_k)
        probs = torch.zeros_like(probs).scatter(0, top.indices, top.values)
        probs /= probs.sum()
    if p.top_p < 1.0:
        sorted_p, order = probs.sort(descending=True)
        keep = sorted_p.cumsum(0) - sorted_p < p.top_p
        probs = torch.zeros_like(probs).scatter(0, order[keep], sorted_p[keep])
    return int(torch.multinomial(probs, 1, generator=gen))


def decode_rate(model, tok, packed, batch: int, tokens: int, extra: dict, seed: int) -> float:
    engine = ContinuousBatcher(model, tok.eos_id, max_batch=batch, tokenizer=tok.hf,
                               packed_decode=packed)
    prompt = tok.chat([{"role": "user", "content": "Write a short story about a robot."}])
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
    draws = {"troupe": engine_module.draw, "multinomial": multinomial_draw}
    rates = {(s, d): [] for s in SETTINGS for d in draws}
    for r in range(a.rounds):  # alternating, so that a noisy neighbour hits all alike
        for (setting, name), out in rates.items():
            engine_module.draw = draws[name]
            out.append(decode_rate(model, tok, packed, a.batch, a.tokens, SETTINGS[setting],
                                   100 * r))
    engine_module.draw = draws["troupe"]
    median = {key: statistics.median(v) for key, v in rates.items()}
    head = {"bench": "sampling", "machine": machine(), "threads": a.threads,
            "batch": a.batch, "max_tokens": a.tokens}
    with open(a.out, "a") as f:
        for setting in SETTINGS:
            line = {**head, "setting": setting,
                    "tokens_per_s": median[setting, "troupe"],
                    "tokens_per_s_multinomial": median[setting, "multinomial"],
                    "ratio": median[setting, "troupe"] / median[setting, "multinomial"],
                    "vs_plain": median[setting, "troupe"] / median["plain", "troupe"],
                    "rounds": rates[setting, "troupe"],
                    "rounds_multinomial": rates[setting, "multinomial"]}
            print(json.dumps(line), flush=True)
            f.write(json.dumps(line) + "\n")


if __name__ == "__main__":
    main()
