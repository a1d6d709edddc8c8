"""Structured outputs on SmolLM2-135M-Instruct: what the grammar mask costs, and the two
maintained libraries side by side.

    pip install --no-deps xgrammar apache-tvm-ffi   # for the comparison only (not a dependency)
    python benchmarks/structured.py [--model DIR] [--batch 8] [--tokens 64] [--rounds 3]

Prints JSON lines:
- per library (llguidance, xgrammar): the tokenizer's set-up, the schema's compile time, and
  the median and 90th-percentile time of one token's mask over random walks through a nested,
  bounded JSON schema (the mask, then a token it allows: what the engine does each step);
- the engine (troupe.generation.ContinuousBatcher, fp32, packed decode, ``--batch``
  sequences, temperature 1): decode tokens per second with the schema enforced and without,
  over the steps where the whole batch decodes (constrained answers end sooner), alternating
  rounds, the median of each and their ratio (the goal: at most 15% fewer).
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))

from engine_rate import full_batch_rate  # noqa: E402  beside this script
from machine import machine  # noqa: E402  benchmarks/machine.py, beside this script

from troupe.data import load_tokenizer  # noqa: E402
from troupe.generation import ContinuousBatcher, SamplingParams  # noqa: E402
from troupe.generation.grammar import Constraint, Grammars  # noqa: E402
from troupe.models import from_pretrained  # noqa: E402

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 24},
        "category": {"enum": ["fruit", "tool", "book", "toy"]},
        "price": {"type": "integer", "minimum": 0, "maximum": 999},
        "in_stock": {"type": "boolean"},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 10}, "maxItems": 3},
        "size": {"type": "object",
                 "properties": {"w": {"type": "integer", "minimum": 0, "maximum": 99},
                                "h": {"type": "integer", "minimum": 0, "maximum": 99}},
                 "required": ["w", "h"], "additionalProperties": False},
    },
    "required": ["name", "category", "price", "in_stock", "tags", "size"],
    "additionalProperties": False,
}


def walk(new, allowed, accept, done, eos: int, walks: int = 20, seed: int = 0) -> list[float]:
    """Seconds of each mask over random walks through the grammar."""
    rng, times = random.Random(seed), []
    for _ in range(walks):
        state = new()
        for _ in range(200):
            t0 = time.perf_counter()
            mask = allowed(state)
            times.append(time.perf_counter() - t0)
            ids = mask.nonzero().flatten().tolist()
            token = rng.choice(ids)
            if token == eos or done(state, token):
                break
            accept(state, token)
    return times


def llguidance_line(tok, vocab: int) -> dict:
    t0 = time.perf_counter()
    g = Grammars(tok.hf, vocab, tok.eos_id)
    setup = time.perf_counter() - t0
    c = Constraint("json_schema", json.dumps(SCHEMA))
    t0 = time.perf_counter()
    g.check(c)
    compile_s = time.perf_counter() - t0
    times = walk(lambda: g.matcher(c), lambda m: m.allowed(), lambda m, t: m.accept(t),
                 lambda m, t: m.done, tok.eos_id)
    return {"library": "llguidance", "setup_s": setup, "compile_s": compile_s,
            "mask_ms_median": 1e3 * statistics.median(times),
            "mask_ms_p90": 1e3 * statistics.quantiles(times, n=10)[-1], "masks": len(times)}


def xgrammar_line(tok, vocab: int) -> dict:
    try:
        import xgrammar as xgr
    except ImportError as e:
        return {"library": "xgrammar", "error": f"not installed: {e}"}
    t0 = time.perf_counter()
    info = xgr.TokenizerInfo.from_huggingface(tok.hf, vocab_size=vocab)
    compiler = xgr.GrammarCompiler(info)
    setup = time.perf_counter() - t0
    t0 = time.perf_counter()
    compiled = compiler.compile_json_schema(json.dumps(SCHEMA), any_whitespace=False,
                                            separators=(", ", ": "))
    compile_s = time.perf_counter() - t0
    bitmask = xgr.allocate_token_bitmask(1, vocab)

    def allowed(m):
        m.fill_next_token_bitmask(bitmask)
        words = bitmask[0].view(torch.uint8).numpy()
        import numpy as np
        return torch.from_numpy(np.unpackbits(words, bitorder="little")[:vocab].view(np.bool_))

    times = walk(lambda: xgr.GrammarMatcher(compiled), allowed,
                 lambda m, t: m.accept_token(t), lambda m, t: m.is_terminated(), tok.eos_id)
    return {"library": "xgrammar", "setup_s": setup, "compile_s": compile_s,
            "mask_ms_median": 1e3 * statistics.median(times),
            "mask_ms_p90": 1e3 * statistics.quantiles(times, n=10)[-1], "masks": len(times)}


def decode_rate(model, tok, grammars, batch: int, tokens: int, constrained: bool,
                seed: int) -> float:
    engine = ContinuousBatcher(model, tok.eos_id, max_batch=batch, tokenizer=tok.hf,
                               grammars=grammars)
    prompt = tok.chat([{"role": "user", "content": "Describe a product for our shop as JSON."}])
    c = Constraint("json_schema", json.dumps(SCHEMA)) if constrained else None
    for i in range(batch):
        engine.add(str(i), prompt, SamplingParams(max_tokens=tokens, temperature=1.0,
                                                  seed=seed + i, constraint=c))
    return full_batch_rate(engine, batch)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--model", default=str(Path("~/.cache/troupe/smollm2-135m-instruct")
                                          .expanduser()))
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--tokens", type=int, default=64)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--out", default=str(ROOT / "benchmarks" / "results-structured.jsonl"))
    a = p.parse_args()
    torch.set_num_threads(a.threads)
    tok = load_tokenizer(a.model)
    model = from_pretrained(a.model).eval()
    vocab = model.cfg.vocab_size
    head = {"bench": "structured", "machine": machine(), "threads": a.threads}
    lines = [llguidance_line(tok, vocab), xgrammar_line(tok, vocab)]
    grammars = Grammars(tok.hf, vocab, tok.eos_id)
    free, held = [], []
    for r in range(a.rounds):  # alternating, so that a noisy neighbour hits both alike
        free.append(decode_rate(model, tok, grammars, a.batch, a.tokens, False, 100 * r))
        held.append(decode_rate(model, tok, grammars, a.batch, a.tokens, True, 100 * r))
    lines.append({"engine": "ContinuousBatcher", "batch": a.batch, "max_tokens": a.tokens,
                  "tokens_per_s_free": statistics.median(free),
                  "tokens_per_s_json_schema": statistics.median(held),
                  "ratio": statistics.median(held) / statistics.median(free),
                  "rounds_free": free, "rounds_json_schema": held})
    with open(a.out, "a") as f:
        for line in lines:
            text = json.dumps({**head, **line})
            print(text, flush=True)
            f.write(text + "\n")


if __name__ == "__main__":
    main()
