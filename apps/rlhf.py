"""RLHF, InstructGPT-style, with the policy, reference, reward and critic as Ray actors.

    python apps/rlhf.py                                  # steps 1-3 on the bundled sorting task
    python apps/rlhf.py --step ppo                       # one step, using earlier outputs
    python apps/rlhf.py --step ppo --resume              # PPO from its latest checkpoint
    python apps/rlhf.py --config apps/configs/rlhf-sort.yaml data.path=my_pairs.jsonl
    python apps/rlhf.py --config apps/configs/rlhf-smollm2.yaml       # a Hugging Face model
    python apps/rlhf.py algorithm=grpo ppo.prompts_per_iter=8         # GRPO, 4 samples a prompt
    python apps/rlhf.py --config apps/configs/grpo-smollm2.yaml       # GRPO, a reward function

Step 1 fine-tunes the policy on demonstrations, step 2 trains a pairwise reward model, step 3
runs PPO against it with a KL penalty to the SFT policy; ``algorithm=grpo`` (or rloo,
reinforce_pp, dpo) runs another step 3, and ``reward.function=module:function`` scores with
your own Python function instead of (or beside) the learned reward model. Outputs in <out_dir>: metrics.jsonl,
rlhf.png, summary.json, sft/, reward/, ppo/iter-N/ weights, ppo/checkpoints/ (full PPO state),
policy-hf/ (the final policy as a Hugging Face directory).
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from pathlib import Path

# the troupe next to this script comes first: `ray job submit --working-dir .` runs the code
# you uploaded, whether or not (and whichever) troupe is installed on the cluster
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import troupe  # noqa: E402
from troupe.checkpoint import CheckpointError  # noqa: E402
from troupe.config import load_app_config  # noqa: E402
from troupe.models.hf import check_pretrained  # noqa: E402
from troupe.rlhf import driver as rlhf  # noqa: E402
from troupe.rlhf.config import RLHFConfig  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--config", default="apps/configs/rlhf-sort.yaml", help="YAML recipe")
    p.add_argument("--step", choices=rlhf.STEPS, action="append",
                   help="run only this step (repeatable); default: all three in order")
    p.add_argument("--resume", action="store_true",
                   help="continue PPO from the latest checkpoint in <out_dir>/ppo/checkpoints")
    p.add_argument("--print-config", action="store_true",
                   help="print the validated configuration (overrides applied) and exit")
    p.add_argument("overrides", nargs="*", help="dotted overrides, e.g. ppo.iterations=50")
    args = p.parse_intermixed_args(argv)  # overrides before and after options
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    cfg = load_app_config(RLHFConfig, args.config, args.overrides,
                          lambda c: check_pretrained(c.model.pretrained),
                          print_config=args.print_config)
    steps = tuple(s for s in rlhf.STEPS if s in (args.step or cfg.steps))
    if args.resume and steps != ("ppo",):
        print("--resume continues PPO from its checkpoint: use it with --step ppo alone",
              file=sys.stderr)
        return 2
    troupe.init()
    try:
        summary = rlhf.run(cfg, steps, resume=args.resume)
    except CheckpointError as e:  # a damaged or lying checkpoint: one line, exit 2
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(json.dumps(summary, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
