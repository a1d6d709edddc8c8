"""Prefix caching on SmolLM2-135M-Instruct: requests that share a long system prompt, answered by
the server's engine with the prefix cache and without, in one run.

    python benchmarks/prefix_cache.py [--model DIR] [--requests 32] [--system-tokens 512]
                                      [--max-tokens 32] [--batch 8] [--arrive-every 0]
                                      [--quantize w8a8]

Each request is the chat template over one shared system prompt (``--system-tokens`` tokens of
the standard library's docstrings) and a question of its own, greedy, ``--max-tokens`` each.
They are all queued at once and the server's continuous batcher takes them (``--batch`` at a
time, a new one as soon as one finishes), or one arrives every ``--arrive-every`` engine steps
(few arrive together, as on a server under steady traffic). Three settings: ``no_reuse`` (every
prompt run whole: no cache, and the engine's in-batch sharing of a common opening turned off),
``shared_opening`` (no cache; what the engine does by itself: prompts admitted together run
their common opening once) and ``prefix_cache``. Prints one JSON line per setting (requests per
second, generated tokens per second, prompt tokens the model ran, the cache's hit ratio) and
one with the speed-ups of the cache over the other two; the tokens must be the same in all
three.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))

from machine import machine  # noqa: E402  benchmarks/machine.py, beside this script

from troupe.compression import quantize_model  # noqa: E402
from troupe.data import load_tokenizer  # noqa: E402
from troupe.data.corpus import stdlib_documents  # noqa: E402
from troupe.generation import ContinuousBatcher, SamplingParams, admission  # noqa: E402
from troupe.generation.prefix_cache import PrefixCache  # noqa: E402
from troupe.models import from_pretrained  # noqa: E402


def requests(tok, n: int, system_tokens: int) -> list[list[int]]:
    text = "\n\n".join(stdlib_documents()[:200])
    ids = tok.encode(text[:20 * system_tokens])[:system_tokens]
    system = tok.decode(ids)
    return [tok.chat([{"role": "system", "content": system},
                      {"role": "user", "content": f"Question {i}: what does the text above say "
                                                  f"about item number {i * 7 % 97}?"}])
            for i in range(n)]


def serve(model, tok, prompts, batch: int, max_tokens: int, cache: PrefixCache | None,
          every: int = 0):
    """Request i arrives before the engine's step i x ``every`` (0: all at once)."""
    engine = ContinuousBatcher(model, tok.eos_id, max_batch=batch, tokenizer=tok.hf,
                               prefix_cache=cache)
    out: dict[str, list[int]] = {}
    t0 = time.perf_counter()
    waiting, step = list(enumerate(prompts)), 0
    while waiting or engine.has_work():
        while waiting and waiting[0][0] * every <= step:
            i, p = waiting.pop(0)
            engine.add(str(i), p, SamplingParams(max_tokens=max_tokens))
        for ev in engine.step():
            out.setdefault(ev.seq_id, []).append(ev.token)
        step += 1
    seconds = time.perf_counter() - t0
    return seconds, out, engine.prefill_tokens


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--model", default=str(Path("~/.cache/troupe/smollm2-135m-instruct")
                                          .expanduser()))
    p.add_argument("--requests", type=int, default=32)
    p.add_argument("--system-tokens", type=int, default=512)
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--arrive-every", type=int, default=0,
                   help="a request arrives every this many engine steps (0: all at once)")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--quantize", default="none", choices=["none", "w8a8"])
    p.add_argument("--out", default=str(ROOT / "benchmarks" / "results-prefix_cache.jsonl"))
    a = p.parse_args()
    torch.set_num_threads(a.threads)
    tok = load_tokenizer(a.model)
    model = from_pretrained(a.model).eval()
    if a.quantize != "none":
        quantize_model(model, {"*": a.quantize})
    prompts = requests(tok, a.requests, a.system_tokens)
    head = {"bench": "prefix_cache", "machine": machine(), "requests": a.requests,
            "prompt_tokens": sum(map(len, prompts)), "system_tokens": a.system_tokens,
            "max_tokens": a.max_tokens, "batch": a.batch, "threads": a.threads,
            "quantize": a.quantize, "arrive_every_steps": a.arrive_every}
    serve(model, tok, prompts[:2], a.batch, 4, None)  # warm-up: kernels, allocator
    results = {}
    shared = admission.SHARED_OPENING
    for name, cache in (("no_reuse", None), ("shared_opening", None),
                        ("prefix_cache", PrefixCache(1 << 30))):
        admission.SHARED_OPENING = 1 << 30 if name == "no_reuse" else shared
        seconds, out, ran = serve(model, tok, prompts, a.batch, a.max_tokens, cache,
                                  a.arrive_every)
        generated = sum(map(len, out.values()))
        results[name] = (seconds, out)
        line = {**head, "setting": name, "seconds": seconds,
                "requests_per_s": a.requests / seconds, "tokens_per_s": generated / seconds,
                "prefill_tokens": ran,
                "hit_ratio": cache.hit_rate if cache is not None else 0.0}
        print(json.dumps(line), flush=True)
        with open(a.out, "a") as f:
            f.write(json.dumps(line) + "\n")
    admission.SHARED_OPENING = shared
    (t0, plain), (t1, opening), (t2, cached) = results.values()
    line = {**head, "setting": "ratio", "speedup": t0 / t2, "speedup_over_shared_opening":
            t1 / t2, "same_tokens": plain == opening == cached}
    print(json.dumps(line), flush=True)
    with open(a.out, "a") as f:
        f.write(json.dumps(line) + "\n")


if __name__ == "__main__":
    main()
