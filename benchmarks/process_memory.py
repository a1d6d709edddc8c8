"""Peak memory of a command's whole process tree (the command, and for an embedded Ray cluster
its GCS, raylet and every worker, all descendants of the driver), sampled while it runs.

    python benchmarks/process_memory.py -- python apps/rlhf.py --config apps/configs/rlhf-smollm2.yaml

Prints one JSON line: wall seconds, exit code, peak sum of PSS (each shared page counted once,
split among the processes that map it: the fair total), peak sum of RSS (shared pages counted
in every process: an upper bound), in GB, and the biggest processes' PSS at the PSS peak.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

import psutil


def _pss(pid: int) -> int | None:
    """Proportional set size in bytes from /proc/PID/smaps_rollup (Linux), None elsewhere."""
    try:
        for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines():
            if line.startswith("Pss:"):
                return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def tree_memory(root: psutil.Process) -> tuple[int, int, dict[str, int]]:
    """(sum of PSS, sum of RSS, PSS by process "pid name") in bytes over ``root`` and its
    descendants."""
    pss = rss = 0
    each: dict[str, int] = {}
    for p in [root, *root.children(recursive=True)]:
        try:
            r, name = p.memory_info().rss, " ".join(p.cmdline()[:2])[-60:]
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
        rss += r
        each[f"{p.pid} {name}"] = _pss(p.pid) or r
        pss += each[f"{p.pid} {name}"]
    return pss, rss, each


def measure(cmd: list[str], every_s: float = 0.5) -> dict:
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=sys.stderr)  # this script's stdout: JSON lines only
    root = psutil.Process(proc.pid)
    peak_pss = peak_rss = 0
    at_peak: dict[str, int] = {}
    while proc.poll() is None:
        try:
            pss, rss, each = tree_memory(root)
        except psutil.NoSuchProcess:
            break
        if pss > peak_pss:
            peak_pss, at_peak = pss, each
        peak_rss = max(peak_rss, rss)
        time.sleep(every_s)
    biggest = sorted(at_peak.items(), key=lambda kv: -kv[1])[:8]
    return {"cmd": " ".join(cmd), "exit": proc.wait(), "wall_s": round(time.perf_counter() - t0, 1),
            "peak_pss_gb": round(peak_pss / 1e9, 2), "peak_rss_gb": round(peak_rss / 1e9, 2),
            "at_peak_pss_gb": {k: round(v / 1e9, 2) for k, v in biggest}}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--every", type=float, default=0.5, help="seconds between samples")
    p.add_argument("cmd", nargs=argparse.REMAINDER, help="the command, after --")
    args = p.parse_args()
    cmd = args.cmd[1:] if args.cmd[:1] == ["--"] else args.cmd
    if not cmd:
        p.error("give the command after --")
    print(json.dumps(measure(cmd, args.every)), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
