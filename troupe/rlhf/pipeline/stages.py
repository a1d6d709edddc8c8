"""Steps 1 and 2 of the pipeline on the graph (supervised fine-tuning of the policy, the
pairwise reward model) and the evaluation of the policy on held-out prompts."""

from __future__ import annotations

import random
from pathlib import Path

import torch
from tqdm import tqdm

from troupe.rlhf.config import RLHFConfig
from troupe.rlhf.data.datasets import Data
from troupe.rlhf.data.experience import RolloutRequest, merged_agent
from troupe.rlhf.roles.actors import PolicyActor, RewardCalls, reward_of
from troupe.runtime.handle import Graph
from troupe.runtime.metrics import MetricsLog


def batches(items: list, batch: int, steps: int, seed: int):
    """(step, batch) for steps 1..steps, each batch sampled from ``items`` without repeats."""
    rng = random.Random(seed)
    for step in range(1, steps + 1):
        yield step, rng.sample(items, batch)


def seeds(rng: random.Random, n: int) -> list[int]:
    """One sampling seed per prompt, drawn from the driver's RNG (checkpointed with it)."""
    return [rng.getrandbits(63) for _ in range(n)]


def run_sft(graph: Graph, cfg: RLHFConfig, data: Data, log: MetricsLog, out: Path) -> Path:
    """Step 1: the policy learns the demonstrations; its weights go to out/sft/policy.trp."""
    policy, c = graph["policy"], cfg.sft
    policy.invoke(PolicyActor.start_sft, c.steps)
    for step, batch in tqdm(batches(data.sft, c.batch_size, c.steps, cfg.seed + 10),
                            total=c.steps, desc="step 1: SFT"):
        stats = policy.invoke(PolicyActor.sft_step, batch, step)
        log.write({"kind": "sft", "step": step, "loss": _mean(s.loss for s in stats)})
    path = out / "sft" / "policy.trp"
    policy.invoke(PolicyActor.save, str(path))
    policy.invoke(PolicyActor.end_sft)
    return path


def run_reward(graph: Graph, cfg: RLHFConfig, data: Data, log: MetricsLog, out: Path) -> Path:
    """Step 2: the reward model learns the preference pairs (started from the SFT policy
    when reward.init_from_sft); its weights go to out/reward/reward.trp."""
    reward, c = reward_of(graph, cfg), cfg.reward
    sft = out / "sft" / "policy.trp"
    if c.init_from_sft and not sft.is_file():
        raise FileNotFoundError(f"reward.init_from_sft: {sft} does not exist; run step 1 first "
                                "or set reward.init_from_sft=false")
    reward.invoke(RewardCalls.start_reward_training, c.steps,
                  str(sft) if c.init_from_sft else None)
    for step, batch in tqdm(batches(data.pairs, c.batch_size, c.steps, cfg.seed + 20),
                            total=c.steps, desc="step 2: reward model"):
        stats = reward.invoke(RewardCalls.rm_step, batch, step)
        log.write({"kind": "reward", "step": step, "loss": _mean(s.loss for s in stats),
                   "accuracy": _mean(s.accuracy for s in stats)})
    ev = reward.invoke(RewardCalls.rm_evaluate, data.eval_pairs)
    acc = sum(e.correct for e in ev) / sum(e.count for e in ev)
    log.write({"kind": "reward_eval", "step": c.steps, "accuracy": acc,
               "loss": _mean(e.loss for e in ev)})
    path = out / "reward" / "reward.trp"
    reward.invoke(RewardCalls.save_reward, str(path))
    return path


def evaluate_policy(graph: Graph, data: Data, seed: int, temperature: float | None = None,
                    use_ema: bool = False) -> dict:
    """Gold reward (if the task has one) of the policy's responses to the held-out prompts;
    with an environment (env.function), the mean reward of its trajectories and the share of
    their turns that called a tool."""
    request = RolloutRequest(data.eval_prompts, seeds(random.Random(seed), len(data.eval_prompts)),
                             temperature, use_ema, fields=data.eval_fields)
    rollouts = graph["policy"].invoke(PolicyActor.generate, request)
    responses = [r for ro in rollouts for r in ro.responses]
    out = {"samples": list(zip(data.eval_prompts[:4], responses[:4]))}
    env = [ro.env_reward for ro in rollouts if ro.env_reward is not None]
    if env:
        out["env_reward"] = torch.cat(env).mean().item()
        agent = merged_agent([ro.agent for ro in rollouts])
        out["tool_call_fraction"] = agent["tool_turns"] / max(agent["turns"], 1)
    if data.gold is not None:
        gold = [data.gold(p, r) for p, r in zip(data.eval_prompts, responses)]
        out["gold"] = sum(gold) / len(gold)
        out["exact"] = sum(g == 1.0 for g in gold) / len(gold)
    return out


def _mean(values) -> float:
    values = list(values)
    return sum(values) / len(values)
