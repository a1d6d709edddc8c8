"""Speculative decoding by prompt lookup (troupe.generation.speculative) against the same engine
without it, on SmolLM2-135M-Instruct, in one run.

    python benchmarks/speculative.py [--model DIR] [--batches 1 8] [--k 4 8] [--new 128]
                                     [--draft-k 4]

Two workloads, chat-templated, greedy: "copy" (rewrite a given passage of the standard
library's documentation with one change: the answer repeats its prompt) and "chat" (open
questions: little to look up). Proposers: prompt lookup with each k, and a draft model (a W8A8
copy of the target: a quarter of its weight bytes, near its predictions; no smaller SmolLM2 is
at hand offline) with ``--draft-k``. For each: decode tokens per second with and without
speculation (the prefill step left out), whether the tokens are the same, the acceptance rate
(accepted over proposed), the tokens a verify pass yields per row, a speculative step's time
(draft and verify) over a plain decode step's, and the speed-up those imply (tokens a pass
over its cost, were every step speculative) beside the one measured. One JSON line each.
Speculation is forced at every batch (``speculate_batch`` = the batch); above the engine's
default ``speculate_batch`` one more lookup line runs with the default, where the engine
decodes without speculation while more than that many sequences run: the cost of having it
configured (``--rounds`` alternating runs of it and of the plain engine, the median ratio).
"""

from __future__ import annotations

import argparse
import inspect
import json
import statistics
import time
from pathlib import Path

import torch

from troupe.compression import quantize_model
from troupe.data import load_tokenizer
from troupe.data.corpus import stdlib_documents
from troupe.generation import ContinuousBatcher, SamplingParams
from troupe.generation.draft import DraftModel
from troupe.models import from_pretrained
from machine import machine  # benchmarks/machine.py, beside this script

#: the engine's own ``speculate_batch``: above it a step decodes without speculation
DEFAULT_SPECULATE_BATCH = inspect.signature(ContinuousBatcher).parameters["speculate_batch"].default

QUESTIONS = ["What makes a good night's sleep?", "Explain how a bicycle stays upright.",
             "Why do leaves change colour in autumn?", "Give advice to a new programmer.",
             "What is the difference between weather and climate?", "How do bees make honey?",
             "Describe a walk through a city at dawn.", "Why is the sky blue?"]


def workloads(tok, n: int) -> dict[str, list[list[int]]]:
    """n prompts of each workload, as token ids."""
    docs = [d for d in stdlib_documents() if 400 < len(d) < 900][:n]
    copy = [tok.prompt("Rewrite the following text exactly as it is, except that every "
                       "occurrence of the word 'the' becomes 'THE':\n\n" + d) for d in docs]
    chat = [tok.prompt(QUESTIONS[i % len(QUESTIONS)]) for i in range(n)]
    return {"copy": copy, "chat": chat}


def run(model, tok, prompts: list[list[int]], new: int, k: int, draft=None,
        policy: bool = False) -> dict:
    """Decode ``prompts`` at once; tokens/s after the prefill and each kind of step's time.
    Speculation at any batch, or with ``policy`` where the engine's default allows it."""
    batch = {} if policy else {"speculate_batch": len(prompts)}
    engine = ContinuousBatcher(model, tok.eos_id, max_batch=len(prompts), speculate=k,
                               draft=None if draft is None else DraftModel(draft, len(prompts)),
                               **batch)
    for i, p in enumerate(prompts):
        engine.add(str(i), p, SamplingParams(max_tokens=new))
    out: dict[str, list[int]] = {}
    verify, plain, tokens = [], [], 0
    for i in range(10 ** 6):
        if not engine.has_work():
            break
        passes = engine.speculation["passes"]
        t = time.perf_counter()
        events = engine.step()
        dt = time.perf_counter() - t
        for ev in events:
            if ev.token is not None:
                out.setdefault(ev.seq_id, []).append(ev.token)
        if i == 0:
            continue  # the prefill
        tokens += sum(ev.token is not None for ev in events)
        (verify if engine.speculation["passes"] > passes else plain).append(dt)
    seconds = sum(verify) + sum(plain)
    return {"out": out, "tok_s": tokens / seconds, "verify": verify, "plain": plain,
            "tokens": tokens, **engine.speculation}


def alternated(spec_run, base_run, rounds: int) -> tuple[dict, dict]:
    """``rounds`` runs of each, alternating (this machine's clock drifts between runs of the
    same code); the pair of the median ratio."""
    pairs = [(spec_run(), base_run()) for _ in range(rounds)]
    pairs.sort(key=lambda p: p[0]["tok_s"] / p[1]["tok_s"])
    return pairs[len(pairs) // 2]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=str(Path("~/.cache/troupe/smollm2-135m-instruct")
                                          .expanduser()))
    p.add_argument("--batches", nargs="+", type=int, default=[1, 8])
    p.add_argument("--k", nargs="+", type=int, default=[4, 8])
    p.add_argument("--new", type=int, default=128)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--draft-k", type=int, default=4, help="0: no draft-model runs")
    p.add_argument("--rounds", type=int, default=5,
                   help="alternating rounds of the default policy's lines and the plain engine")
    a = p.parse_args()
    torch.set_num_threads(a.threads)
    model, tok = from_pretrained(a.model).eval(), load_tokenizer(a.model)
    draft = from_pretrained(a.model).eval()
    quantize_model(draft, {"*": "w8a8"})
    loads = workloads(tok, max(a.batches))
    run(model, tok, loads["chat"][:1], 8, 0)  # warm-up: kernels, allocator
    for name, prompts in loads.items():
        for B in a.batches:
            base = run(model, tok, prompts[:B], a.new, 0)
            runs = [(k, "lookup", False) for k in a.k] + (
                [(a.draft_k, "draft_w8a8", False)] if a.draft_k else [])
            if B > DEFAULT_SPECULATE_BATCH:  # where the default policy turns speculation off
                runs += [(k, "lookup", True) for k in a.k[:1]]
            for k, proposer, policy in runs:
                def speculating():
                    return run(model, tok, prompts[:B], a.new, k,
                               draft if proposer != "lookup" else None, policy)
                if policy:  # a ratio near 1: alternate rounds with the plain engine, median
                    spec, ref = alternated(speculating,
                                           lambda: run(model, tok, prompts[:B], a.new, 0),
                                           a.rounds)
                else:
                    spec, ref = speculating(), base
                step_s = statistics.median(ref["plain"])
                verify_s = statistics.median(spec["verify"]) if spec["verify"] else float("nan")
                in_passes = spec["tokens"] - len(spec["plain"]) * B  # what verify steps made
                per_pass = in_passes / max(spec["passes"], 1) / B
                bound = per_pass / (verify_s / step_s) if spec["verify"] else float("nan")
                print(json.dumps({
                    "bench": "speculative", "machine": machine(), "workload": name,
                    "batch": B, "proposer": proposer, "k": k, "new": a.new,
                    "speculate_batch": DEFAULT_SPECULATE_BATCH if policy else B,
                    "threads": a.threads,
                    "tok_s": spec["tok_s"], "tok_s_without": ref["tok_s"],
                    "speedup": spec["tok_s"] / ref["tok_s"],
                    "same_tokens": spec["out"] == ref["out"],
                    "acceptance": spec["accepted"] / max(spec["proposed"], 1),
                    "tokens_per_pass_per_row": per_pass, "verify_over_step": verify_s / step_s,
                    "bound": bound, "of_bound": (spec["tok_s"] / ref["tok_s"]) / bound,
                    "verify_steps": len(spec["verify"]), "plain_steps": len(spec["plain"])}),
                    flush=True)


if __name__ == "__main__":
    main()
