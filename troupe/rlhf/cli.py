"""RLHF, InstructGPT-style, with the policy, reference, reward and critic as Ray actors.

    troupe rlhf                                         # steps 1-3 on the bundled sorting task
    troupe rlhf --step step3                            # one step, using earlier outputs
    troupe rlhf --step step3 --resume                   # step 3 from its latest checkpoint
    troupe rlhf data.path=my_pairs.jsonl                # your preference pairs
    troupe rlhf --config rlhf-smollm2                   # a Hugging Face model
    troupe rlhf algorithm=grpo step3.prompts_per_iter=8 # GRPO, 4 samples a prompt
    troupe rlhf --config grpo-smollm2                   # GRPO with a reward function

Step 1 fine-tunes the policy on demonstrations, step 2 trains a pairwise reward model, step 3
runs PPO against it with a KL penalty to the SFT policy; ``algorithm=grpo`` (or rloo,
reinforce_pp, dapo, gspo, dpo, or module:Class for your own) runs another step 3, and ``reward.function=module:function`` scores with
your own Python function instead of (or beside) the learned reward model. Outputs in
<out_dir>: metrics.jsonl, rlhf.png, summary.json, sft/, reward/, step3/iter-N/ weights,
step3/checkpoints/ (full step-3 state), policy-hf/ (the final policy as a Hugging Face
directory). Step 3 used to be called ppo: ``--step ppo``, ``steps: [ppo]``, a ``ppo:`` section
and ``ppo.KEY=VALUE`` are read as step3, and --resume finds an older run's ppo/checkpoints.
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
from troupe.rlhf.config import STEP3, RLHFConfig
from troupe.runtime import cluster


def main(argv: list[str] | None = None) -> int:
    p = app_parser("rlhf", __doc__, "rlhf-sort")
    p.add_argument("--step", choices=(*rlhf.STEPS, "ppo"), action="append",
                   help="run only this step (repeatable); default: all three in order")
    p.add_argument("--resume", action="store_true",
                   help="continue step 3 from the latest checkpoint in "
                        "<out_dir>/step3/checkpoints")
    args = p.parse_intermixed_args(argv)  # overrides before and after options
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    cfg = load_app_config(RLHFConfig, args.config, args.overrides,
                          lambda c: check_pretrained(c.model.pretrained),
                          print_config=args.print_config)
    asked = [STEP3 if s == "ppo" else s for s in (args.step or cfg.steps)]  # its older name
    steps = tuple(s for s in rlhf.STEPS if s in asked)
    if args.resume and steps != (STEP3,):
        print("--resume continues step 3 from its checkpoint: use it with --step step3 alone",
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
