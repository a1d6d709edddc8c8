"""TRL's GRPO on SmolLM2-135M-Instruct with the task of apps/configs/rlhf-smollm2.yaml (sorting
digits, phrased as a chat turn, the programmatic gold reward as the reward function), fp32 on
the CPU: the peer troupe's RLHF is compared with (benchmarks/grpo_vs_trl.py runs both).

    pip install trl==1.16.0      # not a troupe dependency: this benchmark only
    python benchmarks/process_memory.py -- python benchmarks/trl_grpo.py --steps 5

With --timings FILE: one JSON line per step there (seconds of the whole step, of
transformers' generate within it, completions and their mean length).

GRPO holds the policy (trained: weights, gradients, Adam state) and, with beta > 0, a frozen
reference in one process; it has no critic and no reward model (the reward is a function).
troupe's PPO recipe holds four models: policy and critic trained, reference and reward frozen.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from troupe.rlhf.data.datasets import SortTask  # noqa: E402

TEMPLATE = "Sort these digits from smallest to largest. Reply with the digits only: {digits}"


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--model", default="~/.cache/troupe/smollm2-135m-instruct")
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--batch", type=int, default=12, help="completions per step")
    p.add_argument("--generations", type=int, default=4, help="completions per prompt")
    p.add_argument("--new-tokens", type=int, default=8)
    p.add_argument("--beta", type=float, default=0.05)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--timings", default=None)
    a = p.parse_args()
    import torch
    from datasets import Dataset
    from trl import GRPOConfig, GRPOTrainer

    torch.set_num_threads(a.threads)
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
                     max_completion_length=a.new_tokens, beta=a.beta, learning_rate=1e-5,
                     logging_steps=1,
                     save_strategy="no", report_to="none", bf16=False)
    trainer = GRPOTrainer(model=os.path.expanduser(a.model), reward_funcs=gold, args=cfg,
                          train_dataset=data)
    if a.timings:
        trainer.add_callback(_Timings(a.timings))
    trainer.train()
    return 0


def _Timings(path: str):
    """A callback writing each step's seconds, and generate's seconds within it (TRL's own
    profiling blocks, which otherwise go to wandb/mlflow only), to ``path``."""
    import time

    from transformers import TrainerCallback
    from trl.extras import profiling

    generate: list[float] = []
    log = profiling.ProfilingContext._log_metrics

    def record(self, duration):
        if self.name.endswith("transformers.generate"):
            generate.append(duration)
        return log(self, duration)

    profiling.ProfilingContext._log_metrics = record

    class Timings(TrainerCallback):
        def on_step_begin(self, args, state, control, **kw):
            self.t0, self.gen0 = time.perf_counter(), len(generate)

        def on_log(self, args, state, control, logs=None, **kw):
            if logs and "completions/mean_length" in logs:
                self.length = logs["completions/mean_length"]

        def on_step_end(self, args, state, control, **kw):
            self.step_s = time.perf_counter() - self.t0
            self.gen_s = sum(generate[self.gen0:])

        def on_substep_end(self, *a, **kw):
            pass

    class Writer(Timings):
        def on_log(self, args, state, control, logs=None, **kw):
            super().on_log(args, state, control, logs, **kw)
            if logs and "completions/mean_length" in logs and hasattr(self, "step_s"):
                with open(path, "a") as f:
                    f.write(json.dumps({"step": state.global_step, "step_s": self.step_s,
                                        "generate_s": self.gen_s,
                                        "mean_length": self.length,
                                        "completions": args.per_device_train_batch_size})
                            + "\n")

    return Writer()


if __name__ == "__main__":
    sys.exit(main())
