"""Goodput of the OpenAI-compatible server under clients that retry a 429 at once.

    python benchmarks/serve_goodput.py [--clients 32 64] [--seconds 20]

One replica of a small model (4 layers, d=128, W8A8, limits.max_concurrent 16) on the
embedded Ray; each client thread keeps one HTTP connection and sends completions (prompt of 24
bytes, 16 tokens, greedy) back to back, and on a 429 sends the same request again at once
(ignoring Retry-After: the eager client the limit must survive). One JSON line per client
count: completions per second, 429s per second, and the ratio of each count's goodput to the
first count's, all in one run (so on one machine state).
"""

from __future__ import annotations

import argparse
import http.client
import json
import tempfile
import threading
import time
from pathlib import Path

import troupe
from troupe.models import GPT, GPTConfig
from troupe.serving import deploy as serve
from troupe.serving.model import save_model
from troupe.serving.protocol import ServeConfig
from machine import machine  # benchmarks/machine.py, beside this script


def client(port: int, stop: float, counts: dict, lock: threading.Lock, i: int) -> None:
    body = json.dumps({"model": "m", "prompt": f"client {i:03d} asks for text", "max_tokens": 16,
                       "temperature": 0}).encode()
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    ok = refused = failed = 0
    while time.monotonic() < stop:
        try:
            conn.request("POST", "/v1/completions", body, {"Content-Type": "application/json"})
            r = conn.getresponse()
            r.read()
            if r.status == 200:
                ok += 1
            elif r.status == 429:
                refused += 1
            else:
                failed += 1
        except (OSError, http.client.HTTPException):
            failed += 1
            conn.close()
            conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    with lock:
        counts["ok"] += ok
        counts["refused"] += refused
        counts["failed"] += failed


def run(port: int, clients: int, seconds: float) -> dict:
    counts, lock = {"ok": 0, "refused": 0, "failed": 0}, threading.Lock()
    stop = time.monotonic() + seconds
    threads = [threading.Thread(target=client, args=(port, stop, counts, lock, i))
               for i in range(clients)]
    t0 = time.monotonic()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.monotonic() - t0
    return {"clients": clients, "seconds": round(wall, 1),
            "goodput_rps": round(counts["ok"] / wall, 2),
            "refused_rps": round(counts["refused"] / wall, 2), "failed": counts["failed"]}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--clients", type=int, nargs="+", default=[32, 64])
    p.add_argument("--seconds", type=float, default=20)
    p.add_argument("--port", type=int, default=8197)
    a = p.parse_args()
    troupe.init(num_cpus=2)
    path = Path(tempfile.mkdtemp()) / "model.trp"
    save_model(GPT(GPTConfig(seq_len=128, n_layer=4, n_head=4, d_model=128), seed=0), path)
    cfg = ServeConfig(model={"file": str(path), "name": "m"}, port=a.port, group_size=32,
                      limits={"max_concurrent": 16, "max_batch": 16})
    serve.deploy(cfg)
    try:
        run(a.port, 4, 3)  # warm-up
        first = None
        for n in a.clients:
            r = run(a.port, n, a.seconds)
            first = first or r["goodput_rps"]
            print(json.dumps({"bench": "serve_goodput", "machine": machine(), **r,
                              "max_concurrent": cfg.limits.max_concurrent,
                              "goodput_vs_first": round(r["goodput_rps"] / first, 3)}),
                  flush=True)
    finally:
        serve.shutdown()


if __name__ == "__main__":
    main()
