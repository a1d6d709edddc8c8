"""GPT pretraining, dense or (PR-)MoE with expert parallelism, on troupe actors.

    python apps/pretrain.py --config apps/configs/moe-tiny.yaml [key=value ...]
    python apps/pretrain.py --config apps/configs/moe-tiny.yaml optimizer.name=onebit_adam

Continued pretraining of a Hugging Face model (its tokenizer tokenizes the data):

    python -m troupe.models.smollm2                                     # SmolLM2, offline
    python apps/pretrain.py --config apps/configs/pretrain-smollm2.yaml  # or model.pretrained=DIR

Metrics go to <out_dir>/metrics.jsonl, the loss curve to loss.png, checkpoints to
checkpoints/step-N (one file per rank and a manifest), the trained model to hf/ as a Hugging
Face directory (when it has that form). Running the same command again resumes
from the newest checkpoint; --no-resume starts over.
"""

from __future__ import annotations

import argparse
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
from troupe.pretrain import PretrainConfig  # noqa: E402
from troupe.pretrain import driver as pretrain  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--config", default="apps/configs/moe-tiny.yaml", help="YAML recipe")
    p.add_argument("--resume", default="auto", help="'auto', a checkpoint directory")
    p.add_argument("--no-resume", action="store_true", help="ignore existing checkpoints")
    p.add_argument("--stop-after", type=int, default=None, help="stop after this step")
    p.add_argument("--print-config", action="store_true",
                   help="print the validated configuration (overrides applied) and exit")
    p.add_argument("overrides", nargs="*", help="dotted overrides, e.g. train.steps=50")
    args = p.parse_intermixed_args(argv)  # overrides before and after options
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    cfg = load_app_config(PretrainConfig, args.config, args.overrides,
                          lambda c: check_pretrained(c.model.pretrained),
                          print_config=args.print_config)
    troupe.init()
    try:
        records = pretrain.run(cfg, None if args.no_resume else args.resume, args.stop_after)
    except CheckpointError as e:  # a damaged or lying checkpoint: one line, exit 2
        print(f"error: {e}", file=sys.stderr)
        return 2
    evals = [r for r in records if r["kind"] == "eval"]
    if evals:
        print(f"validation loss: {evals[0]['val_loss']:.4f} (step {evals[0]['step']}) -> "
              f"{evals[-1]['val_loss']:.4f} (step {evals[-1]['step']}); "
              f"outputs in {cfg.out_dir}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
