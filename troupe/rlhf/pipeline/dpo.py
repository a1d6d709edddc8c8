"""Step 3 when the recipe's algorithm is dpo: the policy learns the preference pairs directly
(Rafailov et al. 2023; IPO as a loss option), against the frozen SFT policy.

The reference scores each pair once: its summed response log-probabilities are kept on the
driver, keyed by the pair, so a pair drawn again (batches are sampled with replacement across
steps) is not scored twice. No reward model, critic or rollouts; the policy is evaluated by
sampling before and after, as for the online algorithms, so the summary has the same shape.
"""

from __future__ import annotations

from pathlib import Path

import torch
from tqdm import tqdm

from troupe.rlhf.config import RLHFConfig
from troupe.rlhf.data.datasets import Data
from troupe.rlhf.data.experience import PreferenceBatch
from troupe.rlhf.pipeline.stages import batches, evaluate_policy
from troupe.rlhf.roles.actors import PolicyActor, ReferenceCalls, reference_of
from troupe.runtime.handle import Graph
from troupe.runtime.metrics import MetricsLog


class ReferenceCache:
    """The reference's (chosen, rejected) log-probabilities of every pair it has scored."""

    def __init__(self, graph: Graph, cfg: RLHFConfig):
        self.where, self.known, self.scored = reference_of(graph, cfg), {}, 0

    def __call__(self, pairs: list) -> tuple[torch.Tensor, torch.Tensor]:
        keys = [_key(p) for p in pairs]
        new = list({k: p for k, p in zip(keys, pairs) if k not in self.known}.items())
        if new:
            got = torch.cat(self.where.invoke(ReferenceCalls.reference_pair_logprobs,
                                              [p for _, p in new]))
            self.known.update({k: row for (k, _), row in zip(new, got)})
            self.scored += len(new)
        both = torch.stack([self.known[k] for k in keys])
        return both[:, 0], both[:, 1]


def _key(pair) -> str:
    return repr(pair)  # prompts may be chat messages (lists): not hashable as they are


def run_dpo(graph: Graph, cfg: RLHFConfig, data: Data, log: MetricsLog, out: Path,
            sft_path: Path | None) -> dict:
    """``dpo.steps`` steps of ``dpo.batch_size`` pairs; the policy's weights then go to
    out/dpo/policy.trp. Returns the summary's step-3 entry (before, after)."""
    d = cfg.dpo
    if not data.pairs:
        raise ValueError("algorithm=dpo needs preference pairs: rows with chosen and rejected")
    sft = str(sft_path) if sft_path is not None else None
    if sft is not None:
        reference_of(graph, cfg).invoke(ReferenceCalls.load_reference, sft)
    graph["policy"].invoke(PolicyActor.begin_step3, sft)
    before = evaluate_policy(graph, data, cfg.seed + 99)
    log.write({"kind": "step3_eval", "step": 0, **before})
    reference = ReferenceCache(graph, cfg)
    for step, pairs in tqdm(batches(data.pairs, d.batch_size, d.steps, cfg.seed + 40),
                            total=d.steps, desc="step 3: DPO"):
        batch = PreferenceBatch(pairs, *reference(pairs))
        stats = graph["policy"].invoke(PolicyActor.dpo_step, batch, step)
        n = [len(part.pairs) for part in batch.split(cfg.workers)]  # the ranks' shares
        log.write({"kind": "dpo", "step": step, "algorithm": "dpo",
                   "loss": sum(s.loss * k for s, k in zip(stats, n)) / len(pairs),
                   "margin": sum(s.margin * k for s, k in zip(stats, n)) / len(pairs),
                   "accuracy": sum(s.accuracy * k for s, k in zip(stats, n)) / len(pairs),
                   "lr": stats[0].lr, "reference_scored": reference.scored})
        if step % d.eval_every == 0 and step < d.steps:
            log.write({"kind": "step3_eval", "step": step,
                       **evaluate_policy(graph, data, cfg.seed + 99)})
    graph["policy"].invoke(PolicyActor.save, str(out / "dpo" / "policy.trp"))
    after = evaluate_policy(graph, data, cfg.seed + 99)
    log.write({"kind": "step3_eval", "step": d.steps, **after})
    return {"before": before, "after": after, "reference_scored": reference.scored}
