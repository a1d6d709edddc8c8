"""Extra memory of loading a Hugging Face checkpoint: troupe.models.from_pretrained against
transformers' AutoModelForCausalLM.from_pretrained, each in a fresh process, fp32.

    python benchmarks/load_memory.py [DIR]     # default: ~/.cache/troupe/smollm2-135m-instruct

Extra memory = the process's peak RSS during the load minus its RSS just before (libraries
imported), as a multiple of the model's fp32 weight bytes. One JSON line per loader.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from machine import machine  # benchmarks/machine.py, beside this script

CHILD = r"""
import json, resource, sys, time
import psutil, torch
from machine import machine  # benchmarks/machine.py, beside this script
kind, path = sys.argv[1], sys.argv[2]
if kind == "troupe":
    from troupe.models import from_pretrained as load
else:
    from transformers import AutoModelForCausalLM
    load = lambda p: AutoModelForCausalLM.from_pretrained(p, dtype=torch.float32)
before = psutil.Process().memory_info().rss
t0 = time.perf_counter()
model = load(path)
seconds = time.perf_counter() - t0
peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
weights = sum(p.numel() * 4 for p in model.parameters())
print(json.dumps({"extra_bytes": peak - before, "weight_bytes": weights, "seconds": seconds}))
"""


def main() -> int:
    path = Path(sys.argv[1] if len(sys.argv) > 1 else "~/.cache/troupe/smollm2-135m-instruct")
    path = path.expanduser()
    for kind in ("troupe", "transformers"):
        out = subprocess.run([sys.executable, "-c", CHILD, kind, str(path)], check=True,
                             capture_output=True, text=True).stdout.strip().splitlines()[-1]
        r = json.loads(out)
        print(json.dumps({"bench": "load_memory", "machine": machine(), "model": str(path),
                          "loader": kind, "extra_gb": round(r["extra_bytes"] / 1e9, 3),
                          "weights_gb": round(r["weight_bytes"] / 1e9, 3),
                          "extra_vs_weights": round(r["extra_bytes"] / r["weight_bytes"], 3),
                          "seconds": round(r["seconds"], 2)}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
