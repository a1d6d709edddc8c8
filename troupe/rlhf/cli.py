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

import logging
import sys
from pathlib import Path

from troupe.config import app_parser, errors_reported, load_app_config
from troupe.models.hf_config import check_pretrained
from troupe.rlhf import driver as rlhf
from troupe.rlhf.config import STEP3, RLHFConfig
from troupe.rlhf.plan import Plan, plan
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

    def steps_of(cfg: RLHFConfig) -> tuple[str, ...]:
        asked = [STEP3 if s == "ppo" else s for s in (args.step or cfg.steps)]  # older name
        return tuple(s for s in rlhf.STEPS if s in asked)

    planned: list[Plan] = []  # lengths, data and memory, refused before Ray starts
    cfg = load_app_config(RLHFConfig, args.config, args.overrides,
                          lambda c: (check_pretrained(c.model.pretrained),
                                     planned.append(plan(c, steps_of(c),
                                                         local=not args.print_config))),
                          print_config=args.print_config)
    steps = steps_of(cfg)
    if args.resume and steps != (STEP3,):
        print("--resume continues step 3 from its checkpoint: use it with --step step3 alone",
              file=sys.stderr)
        return 2
    with errors_reported(cfg.out_dir, "rlhf", args.traceback):
        cluster.init()
        summary = rlhf.run(cfg, steps, resume=args.resume, planned=planned[0])
    print(glance(summary, cfg), flush=True)
    return 0


def glance(summary: dict, cfg: RLHFConfig) -> str:
    """The run's ending as a person reads it: the gold reward (or the environment's) after
    SFT and before and after step 3, the reward model's accuracy, the time, and where the
    plots and the exported model are; the whole summary is <out_dir>/summary.json."""
    out = Path(cfg.out_dir)
    lines = [f"rlhf ({cfg.algorithm}): {', '.join(summary.get('steps', []))} in "
             f"{summary.get('seconds', 0.0):.0f} s"]
    s3 = summary.get(STEP3) or {}
    for name, ev in (("after SFT", summary.get("sft")), (f"before {cfg.algorithm}",
                                                         s3.get("before")),
                     (f"after {cfg.algorithm}", s3.get("after"))):
        figures = [f"{k} {ev[k]:.3f}" for k in ("gold", "exact", "env_reward")
                   if isinstance(ev, dict) and isinstance(ev.get(k), (int, float))]
        if figures and not (name.startswith("before") and "sft" in summary):
            lines.append(f"  {name + ':':20s} {', '.join(figures)}")
    if "reward_accuracy" in summary:
        lines.append(f"  {'reward model:':20s} accuracy {summary['reward_accuracy']:.3f} on "
                     "held-out pairs")
    lines.append(f"  {'plots:':20s} {out / 'rlhf.png'}")
    if summary.get("exported"):
        lines.append(f"  {'exported model:':20s} {summary['exported']}")
    lines.append(f"  {'everything else:':20s} {out / 'summary.json'}, {out / 'metrics.jsonl'}")
    return "\n".join(lines)
