"""GPT pretraining, dense or (PR-)MoE with expert parallelism, on troupe actors.

    troupe pretrain --config moe-tiny [key=value ...]
    troupe pretrain --config moe-tiny optimizer.name=onebit_adam optimizer.freeze_step=150
    troupe pretrain --config pretrain-smollm2      # continued pretraining of a Hugging Face model

Metrics go to <out_dir>/metrics.jsonl, the loss curve to loss.png, checkpoints to
checkpoints/step-N (one file per rank and a manifest), the trained model to hf/ as a Hugging
Face directory (when it has that form). Running the same command again resumes from the
newest checkpoint; --no-resume starts over.
"""

from __future__ import annotations

import logging

from troupe.config import app_parser, errors_reported, load_app_config
from troupe.models.hf_config import check_pretrained
from troupe.pretrain import PretrainConfig
from troupe.pretrain import driver as pretrain
from troupe.pretrain.plan import plan
from troupe.runtime import cluster


def main(argv: list[str] | None = None) -> int:
    p = app_parser("pretrain", __doc__, "moe-tiny")
    p.add_argument("--resume", default="auto", help="'auto', a checkpoint directory")
    p.add_argument("--no-resume", action="store_true", help="ignore existing checkpoints")
    p.add_argument("--stop-after", type=int, default=None, help="stop after this step")
    args = p.parse_intermixed_args(argv)  # overrides before and after options
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    cfg = load_app_config(PretrainConfig, args.config, args.overrides,
                          lambda c: (check_pretrained(c.model.pretrained),
                                     plan(c, local=not args.print_config)),
                          print_config=args.print_config)
    with errors_reported(cfg.out_dir, "pretrain", args.traceback):
        cluster.init()
        records = pretrain.run(cfg, None if args.no_resume else args.resume, args.stop_after)
    evals = [r for r in records if r["kind"] == "eval"]
    if evals:
        print(f"validation loss: {evals[0]['val_loss']:.4f} (step {evals[0]['step']}) -> "
              f"{evals[-1]['val_loss']:.4f} (step {evals[-1]['step']}); "
              f"outputs in {cfg.out_dir}")
    return 0
