"""Shared prompts computed once (troupe.models.PrefixTree) against every row computed whole, on
SmolLM2-135M-Instruct with its chat template (whose system prompt every prompt opens with).

    python benchmarks/prefix_tree.py [--threads 2] [--repeats 8] [--new-tokens 16]

Four batches of the sorting task, each timed both ways in one process, alternating, on the
same rows (prompts left-padded, responses after them, as rollouts are):
- grpo: 2 prompts x 4 sampled responses (a GRPO micro-batch): the policy's training forward +
  backward, and the reference's scoring (no gradients);
- distinct: 8 prompts x 1 response (only the opening is shared): the same two;
- dpo: 8 (prompt, chosen, rejected) pairs, the policy's forward + backward (``pair_logprobs``);
- sft: 8 demonstrations, forward + backward of the loss.

Prints one JSON line per batch and pass: median seconds shared and whole, their ratio, the
positions each computes, and the largest difference between the two log-probabilities.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from machine import machine  # benchmarks/machine.py, beside this script
from troupe.rlhf.config import RLHFConfig
from troupe.rlhf.data.batch import split_completions
from troupe.rlhf.data.datasets import SortTask
from troupe.rlhf.roles.policy import Policy

TEMPLATE = "Sort these digits from smallest to largest. Reply with the digits only: {digits}"


def sampled(tok, prompts: list[str], group: int, new_tokens: int, seed: int):
    """Rows of ``group`` random responses of ``new_tokens`` tokens per prompt (their lengths
    vary as sampled ones do), in the rollouts' layout."""
    g = torch.Generator().manual_seed(seed)
    responses = []
    for _ in prompts:
        for _ in range(group):
            n = int(torch.randint(new_tokens // 2, new_tokens, (), generator=g))
            ids = torch.randint(1000, 20000, (n,), generator=g).tolist()
            responses.append(tok.decode(ids))
    return split_completions(tok, [p for p in prompts for _ in range(group)], responses)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=str(Path("~/.cache/troupe/smollm2-135m-instruct")
                                          .expanduser()))
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--repeats", type=int, default=8)
    p.add_argument("--new-tokens", type=int, default=16)
    a = p.parse_args()
    torch.set_num_threads(a.threads)
    cfg = RLHFConfig(model=dict(pretrained=a.model, chat_template=True),
                     task=dict(template=TEMPLATE))
    policy = Policy(cfg, None, 0)
    lm, tok = policy.lm, policy.tok
    task = SortTask(template=TEMPLATE)
    prompts = [e.prompt for e in task.preferences(8, 7)]
    pairs = [(e.prompt, e.chosen, e.rejected) for e in task.preferences(8, 1)]
    demos = task.demonstrations(8, 0)
    batches = {
        "grpo": sampled(tok, prompts[:2], 4, a.new_tokens, 0),
        "distinct": sampled(tok, prompts, 1, a.new_tokens, 1),
        # each prompt's chosen and rejected side by side, as pair_logprobs lays them out
        "dpo": split_completions(tok, [x for x, _, _ in pairs for _ in range(2)],
                                 [y for _, c, r in pairs for y in (c, r)]),
        "sft": split_completions(tok, [x for x, _ in demos], [y for _, y in demos]),
    }
    passes = {"grpo": ("train", "score"), "distinct": ("train", "score"),
              "dpo": ("train",), "sft": ("train",)}
    for name, (ids, valid, mask, P) in batches.items():
        for kind in passes[name]:
            def run(prompt_len: int):
                lm.padding = [0, 0, 0, 0]
                if kind == "score":
                    lm.eval()
                    with torch.no_grad():
                        return lm.token_logprobs(ids, valid, mask, prompt_len=prompt_len), None
                lm.train()
                lm.zero_grad(set_to_none=True)
                logp = lm.token_logprobs(ids, valid, mask, prompt_len=prompt_len)
                (logp * mask).sum().div(mask.sum()).backward()
                return logp.detach(), list(lm.padding)
            times = {"shared": [], "whole": []}
            out = {}
            for _ in range(a.repeats + 1):  # the first of each, a warm-up, left out
                for side, prompt_len in (("shared", P), ("whole", 0)):
                    t = time.perf_counter()
                    out[side] = run(prompt_len)
                    times[side].append(time.perf_counter() - t)
            shared, whole = (statistics.median(times[s][1:]) for s in ("shared", "whole"))
            diff = float(((out["shared"][0] - out["whole"][0]) * mask).abs().max())
            line = {"bench": "prefix_tree", "machine": machine(), "threads": a.threads,
                    "batch": name, "pass": kind, "rows": len(ids), "prompt_len": P,
                    "shared_s": round(shared, 4), "whole_s": round(whole, 4),
                    "speedup": round(whole / shared, 3), "max_logprob_diff": diff}
            if kind == "train":  # positions computed (the training forwards count them)
                line["positions_shared"] = out["shared"][1][2]
                line["positions_whole"] = out["whole"][1][2]
            print(json.dumps(line), flush=True)


if __name__ == "__main__":
    main()
