"""Quantized serving with an OpenAI-compatible API on Ray Serve.

    python apps/pretrain.py --config apps/configs/dense-tiny.yaml     # a model to serve
    python apps/serve.py --config apps/configs/serve-tiny.yaml [key=value ...]
    curl http://127.0.0.1:8000/v1/completions -H 'Content-Type: application/json' \\
         -d '{"model": "dense-tiny-w8a8", "prompt": "def main(", "max_tokens": 32}'

A Hugging Face model directory instead (its tokenizer and chat template come with it):

    python -m troupe.models.smollm2                                   # SmolLM2, offline
    python apps/serve.py --config apps/configs/serve-smollm2.yaml     # or model.pretrained=DIR

Serves /v1/completions and /v1/chat/completions (with "stream": true too), /v1/models and
/health until interrupted; --check sends one completion, prints it and exits.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import time
import urllib.request
from pathlib import Path

# the troupe next to this script comes first (see apps/pretrain.py)
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import troupe  # noqa: E402
from troupe.config import load_app_config  # noqa: E402
from troupe.serving import deploy as serve  # noqa: E402
from troupe.serving.model import check_source  # noqa: E402
from troupe.serving.protocol import ServeConfig  # noqa: E402


def check(url: str, cfg: ServeConfig, prompt: str) -> dict:
    """One completion through the HTTP API, as a client would send it."""
    headers = {"Content-Type": "application/json"}
    key = os.environ.get(cfg.api_key_env)
    if key:
        headers["Authorization"] = f"Bearer {key}"
    body = json.dumps({"model": cfg.model.name, "prompt": prompt, "max_tokens": 32,
                       "temperature": 0}).encode()
    req = urllib.request.Request(f"{url}/v1/completions", data=body, headers=headers)
    with urllib.request.urlopen(req, timeout=120) as r:
        return json.loads(r.read())


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--config", default="apps/configs/serve-tiny.yaml", help="YAML config")
    p.add_argument("--check", metavar="PROMPT", default=None,
                   help="send one completion of PROMPT, print it and exit")
    p.add_argument("--print-config", action="store_true",
                   help="print the validated configuration (overrides applied) and exit")
    p.add_argument("overrides", nargs="*", help="dotted overrides, e.g. port=8001")
    args = p.parse_intermixed_args(argv)  # overrides before and after options
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    cfg = load_app_config(ServeConfig, args.config, args.overrides, check_source,
                          print_config=args.print_config)
    troupe.init()
    url = serve.deploy(cfg)
    print(f"serving {cfg.model.name} at {url}/v1 (OpenAI API); Ctrl-C stops", flush=True)
    if args.check is not None:
        out = check(url, cfg, args.check)
        print(json.dumps(out["choices"][0]), flush=True)
        serve.shutdown()
        return 0
    try:
        while True:
            time.sleep(3600)
    except KeyboardInterrupt:
        serve.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
