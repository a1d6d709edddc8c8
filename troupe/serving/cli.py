"""Quantized serving with an OpenAI-compatible API on Ray Serve.

    troupe pretrain --config dense-tiny              # a model to serve
    troupe serve --config serve-tiny [key=value ...]
    curl http://127.0.0.1:8000/v1/completions -H 'Content-Type: application/json' \\
         -d '{"model": "dense-tiny-w8a8", "prompt": "def main(", "max_tokens": 32}'
    troupe serve --config serve-smollm2              # a Hugging Face directory (model.pretrained)

Serves /v1/completions and /v1/chat/completions (with "stream": true too), /v1/models,
/health and /metrics until interrupted; --check sends one completion, prints it and exits.
"""

from __future__ import annotations

import json
import logging
import signal
import time
import urllib.request

from troupe.config import app_parser, errors_reported, load_app_config
from troupe.runtime import cluster
from troupe.serving import deploy as serve
from troupe.serving.auth import take_key
from troupe.serving.config import ServeConfig
from troupe.serving.model import check_source


def check(url: str, cfg: ServeConfig, prompt: str, key: str | None) -> dict:
    """One completion through the HTTP API, as a client would send it."""
    headers = {"Content-Type": "application/json"}
    if key:
        headers["Authorization"] = f"Bearer {key}"
    body = json.dumps({"model": cfg.model.name, "prompt": prompt, "max_tokens": 32,
                       "temperature": 0}).encode()
    req = urllib.request.Request(f"{url}/v1/completions", data=body, headers=headers)
    with urllib.request.urlopen(req, timeout=120) as r:
        return json.loads(r.read())


def main(argv: list[str] | None = None) -> int:
    p = app_parser("serve", __doc__, "serve-tiny")
    p.add_argument("--check", metavar="PROMPT", default=None,
                   help="send one completion of PROMPT, print it and exit")
    args = p.parse_intermixed_args(argv)  # overrides before and after options
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    cfg = load_app_config(ServeConfig, args.config, args.overrides, check_source,
                          print_config=args.print_config)
    key, digest = take_key(cfg.api_key_env)  # before Ray starts: no process inherits the key
    with errors_reported(None, "serve", args.traceback):
        cluster.init()
        url = serve.deploy(cfg, key=digest)
        print(f"serving {cfg.model.name} at {url}/v1 (OpenAI API); Ctrl-C stops", flush=True)
        if args.check is not None:
            out = check(url, cfg, args.check, key)
            print(json.dumps(out["choices"][0]), flush=True)
            serve.shutdown()
            return 0
    signal.signal(signal.SIGTERM, _interrupt)  # `kill`, `docker stop`: as Ctrl-C
    try:
        while True:
            time.sleep(3600)
    except KeyboardInterrupt:
        serve.shutdown()
    return 0


def _interrupt(signum, frame):
    raise KeyboardInterrupt(signal.Signals(signum).name)
