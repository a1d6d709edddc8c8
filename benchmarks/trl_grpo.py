"""TRL's GRPO on SmolLM2-135M-Instruct with the task of apps/configs/rlhf-smollm2.yaml (sorting
digits, phrased as a chat turn, the programmatic gold reward as the reward function), fp32 on
the CPU: the peer whose memory troupe's RLHF is compared with.

    pip install trl==1.16.0      # not a troupe dependency: this benchmark only
    python benchmarks/process_memory.py -- python benchmarks/trl_grpo.py --steps 5

GRPO holds the policy (trained: weights, gradients, Adam state) and, with beta > 0, a frozen
reference in one process; it has no critic and no reward model (the reward is a function).
troupe's PPO recipe holds four models: policy and critic trained, reference and reward frozen.
"""

from __future__ import annotations

import argparse
import os
import random
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from troupe.rlhf.data import SortTask  # noqa: E402

TEMPLATE = "Sort these digits from smallest to largest. Reply with the digits only: {digits}"


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--model", default="~/.cache/troupe/smollm2-135m-instruct")
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--batch", type=int, default=12, help="completions per step")
    p.add_argument("--generations", type=int, default=4, help="completions per prompt")
    a = p.parse_args()
    import torch
    from datasets import Dataset
    from trl import GRPOConfig, GRPOTrainer

    torch.set_num_threads(2)
    task = SortTask(3, 5, 0.5, TEMPLATE)
    rng = random.Random(0)
    prompts = [task.prompt(rng) for _ in range(256)]
    data = Dataset.from_list([{"prompt": [{"role": "user", "content": q}]} for q in prompts])

    def gold(prompts, completions, **_):
        return [task.gold(q[-1]["content"], c[0]["content"].strip())
                for q, c in zip(prompts, completions)]

    out = tempfile.mkdtemp(prefix="trl-grpo-")
    cfg = GRPOConfig(output_dir=out, use_cpu=True, max_steps=a.steps,
                     per_device_train_batch_size=a.batch, num_generations=a.generations,
                     max_completion_length=8, beta=0.05, learning_rate=1e-5, logging_steps=1,
                     save_strategy="no", report_to="none", bf16=False)
    trainer = GRPOTrainer(model=os.path.expanduser(a.model), reward_funcs=gold, args=cfg,
                          train_dataset=data)
    trainer.train()
    return 0


if __name__ == "__main__":
    sys.exit(main())
