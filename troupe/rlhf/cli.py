"""RLHF, InstructGPT-style, with the policy, reference, reward and critic as Ray actors.

    troupe rlhf                                         # steps 1-3 on the bundled sorting task
    troupe rlhf --step ppo                              # one step, using earlier outputs
    troupe rlhf --step ppo --resume                     # PPO from its latest checkpoint
    troupe rlhf data.path=my_pairs.jsonl                # your preference pairs
    troupe rlhf --config rlhf-smollm2                   # a Hugging Face model
    troupe rlhf algorithm=grpo ppo.prompts_per_iter=8   # GRPO, 4 samples a prompt
    troupe rlhf --config grpo-smollm2                   # GRPO with a reward function

Step 1 fine-tunes the policy on demonstrations, step 2 trains a pairwise reward model, step 3
runs PPO against it with a KL penalty to the SFT policy; ``algorithm=grpo`` (or rloo,
reinforce_pp, dpo) runs another step 3, and ``reward.function=module:function`` scores with
your own Python function instead of (or beside) the learned reward model. Outputs in
<out_dir>: metrics.jsonl, rlhf.png, summary.json, sft/, reward/, ppo/iter-N/ weights,
ppo/checkpoints/ (full PPO state), policy-hf/ (the final policy as a Hugging Face directory).
"""

from __future__ import annotations

import json
import logging
import sys

from troupe.checkpoint import CheckpointError
from troupe.config import app_parser, load_app_config
from troupe.errors import DataError
from troupe.models.hf_config import check_pretrained
from troupe.rlhf import driver as rlhf
from troupe.rlhf.config import RLHFConfig
from troupe.runtime import cluster


def main(argv: list[str] | None = None) -> int:
    p = app_parser("rlhf", __doc__, "rlhf-sort")
    p.add_argument("--step", choices=rlhf.STEPS, action="append",
                   help="run only this step (repeatable); default: all three in order")
    p.add_argument("--resume", action="store_true",
                   help="continue PPO from the latest checkpoint in <out_dir>/ppo/checkpoints")
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
    try:
        data = rlhf.load_data(cfg, steps)
        cluster.init()
        summary = rlhf.run(cfg, steps, resume=args.resume, data=data)
    except (CheckpointError, DataError) as e:  # a damaged checkpoint, bad data: one line
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(json.dumps(summary, indent=1))
    return 0
