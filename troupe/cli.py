"""The ``troupe`` command: one entry point for the applications.

    troupe rlhf [--config RECIPE] [key=value ...]       # RLHF (steps 1-3), PPO / GRPO / DPO ...
    troupe pretrain [--config RECIPE] [key=value ...]   # GPT / PR-MoE pretraining
    troupe serve [--config RECIPE] [key=value ...]      # the OpenAI-compatible server
    troupe compress [--config RECIPE] [key=value ...]   # XTC: ternary/binary students, distilled
    troupe hosts up|down|status|shape|cut|restore|kill|restart|exec
                                                        # hosts as network namespaces, Ray in each
    troupe recipes                                      # the bundled recipes and their files

``python -m troupe ...`` is the same command, and ``python apps/rlhf.py ...`` (likewise
pretrain.py, serve.py) runs its app from a checkout. RECIPE is a YAML file or the name of a
bundled recipe (``--config rlhf-smollm2``); every app takes ``--print-config`` and ``--help``.
"""

from __future__ import annotations

import importlib
import sys

from troupe.config import bundled_recipes

APPS = {"pretrain": "troupe.pretrain.cli", "rlhf": "troupe.rlhf.cli",
        "serve": "troupe.serving.cli", "compress": "troupe.pretrain.compress",
        "hosts": "troupe.runtime.hosts"}


def main(argv: list[str] | None = None) -> int:
    """Run ``troupe APP ...``; returns the exit status (2 for a bad command line)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] in (["-h"], ["--help"]):
        print(__doc__.strip())
        return 0
    if not argv or argv[0] not in (*APPS, "recipes"):
        print(__doc__.strip(), file=sys.stderr)
        return 2
    if argv[0] == "recipes":
        for name, path in bundled_recipes().items():
            print(f"{name:20s} {path}")
        return 0
    return importlib.import_module(APPS[argv[0]]).main(argv[1:])
