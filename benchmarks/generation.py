"""Generation through troupe's engine (troupe.generation: continuous batching, KV cache), as the
RLHF rollouts and the server run it, against recomputing the whole sequence for every new token,
on the default RLHF policy model (apps/configs/rlhf-sort.yaml), in one run.

    python benchmarks/generation.py [--batch 32] [--new-tokens 8 24] [--repeats 5]

Both paths sample greedily from the same weights and must produce the same tokens. One JSON
line per number of new tokens: median seconds of each path and the speedup.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from troupe.config import load_config
from troupe.generation import ContinuousBatcher, SamplingParams
from troupe.rlhf.config import RLHFConfig
from troupe.rlhf.data.batch import prompts
from troupe.rlhf.data.datasets import SortTask
from troupe.rlhf.models.lm import GPTLM, ByteTokens
from machine import machine  # benchmarks/machine.py, beside this script

RECIPE = Path(__file__).resolve().parent.parent / "apps" / "configs" / "rlhf-sort.yaml"


@torch.inference_mode()
def recompute(lm: GPTLM, ids: torch.Tensor, valid: torch.Tensor, n: int) -> torch.Tensor:
    """Greedy tokens (B, n), running the whole left-padded batch again for each one."""
    for _ in range(n):
        nxt = lm.logits(ids, valid)[:, -1].argmax(-1)
        ids = torch.cat([ids, nxt[:, None]], 1)
        valid = torch.cat([valid, torch.ones_like(valid[:, :1])], 1)
    return ids[:, -n:]


@torch.inference_mode()
def engine(lm: GPTLM, ids: torch.Tensor, valid: torch.Tensor, n: int) -> torch.Tensor:
    """Greedy tokens (B, n) from the engine, every sequence queued at once, no eos."""
    batcher = ContinuousBatcher(lm.gpt, None, max_batch=len(ids))
    for i, (row, mask) in enumerate(zip(ids, valid)):
        batcher.add(str(i), row[mask].tolist(), SamplingParams(max_tokens=n))
    out = batcher.run()
    return torch.tensor([out[str(i)] for i in range(len(ids))])


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--new-tokens", type=int, nargs="+", default=[8, 16, 22])
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--threads", type=int, default=1, help="torch threads (an actor gets 1)")
    a = p.parse_args()
    torch.set_num_threads(a.threads)
    cfg = load_config(RLHFConfig, RECIPE)
    lm, tok = GPTLM(cfg.model.gpt).eval(), ByteTokens()
    ids, valid = prompts(tok, SortTask(cfg.task.min_digits, cfg.task.max_digits).prompts(
        a.batch, 0))
    for n in a.new_tokens:
        n = min(n, cfg.model.gpt.seq_len - ids.shape[1])
        times, outs = {}, {}
        for name, fn in (("recompute", recompute), ("kv_cache", engine)):
            runs = []
            for _ in range(a.repeats):
                t0 = time.perf_counter()
                outs[name] = fn(lm, ids, valid, n)
                runs.append(time.perf_counter() - t0)
            times[name] = statistics.median(runs)
        print(json.dumps({"bench": "generation", "machine": machine(),
                          "model": cfg.model.gpt.model_dump(exclude={"moe"}),
                          "batch": a.batch, "prompt_len": ids.shape[1], "new_tokens": n,
                          "threads": a.threads,
                          "recompute_s": round(times["recompute"], 5),
                          "kv_cache_s": round(times["kv_cache"], 5),
                          "speedup": round(times["recompute"] / times["kv_cache"], 2),
                          "same_tokens": bool(torch.equal(outs["recompute"], outs["kv_cache"]))}),
              flush=True)


if __name__ == "__main__":
    main()
