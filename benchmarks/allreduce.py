"""1-bit compressed allreduce against fp32 allreduce (gloo), 4 ranks, side by side in one run.

    python benchmarks/allreduce.py                       # loopback, 1 and 10 Gbit/s (root)
    python benchmarks/allreduce.py --nets loopback --sizes 1M,4M

Each rank is a process using troupe.collectives directly. Networks:
- loopback: all ranks on 127.0.0.1;
- 1gbit / 10gbit: each rank in its own network namespace, joined to a bridge by a veth link
  rate-limited with tc (tbf) in both directions. The namespaces use addresses of 198.18.0.0/15
  (reserved for benchmarking) and are created and removed by this script; needs root.

Per (network, size, method) one JSON line: seconds per call (slowest rank), bytes each rank
sent per call as the kernel counted them (TCP bytes_sent of the rank's sockets from `ss -ti`;
in namespaces also the interface's tx_bytes), and for compressed, the relative L2 error of one
call and of the running mean after k calls. Inputs are data-parallel-like: one gradient shared by
all ranks plus each rank's own noise of the same size.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

WORLD = 4
NETS = {"loopback": None, "1gbit": "1gbit", "10gbit": "10gbit"}
SUBNET = "198.18.0"
HUB = "trp-hub"


def parse_size(text: str) -> int:
    m = re.fullmatch(r"(\d+)([KM]?)", text.strip().upper())
    if not m:
        raise ValueError(f"size {text!r} is not like 1M, 512K or 1000")
    return int(m.group(1)) * {"": 1, "K": 1 << 10, "M": 1 << 20}[m.group(2)]


# ----------------------------------------------------------------------------- worker side

def tcp_bytes_sent(*pids: int) -> int:
    """Bytes these processes' TCP sockets have sent, as the kernel counts them (ss -ti)."""
    out = subprocess.run(["ss", "-tinpH"], capture_output=True, text=True).stdout
    total, mine = 0, False
    for line in out.splitlines():
        if "users:" in line:
            mine = any(f"pid={pid}," in line for pid in pids)
        m = re.search(r"bytes_sent:(\d+)", line)
        if m and mine:
            total += int(m.group(1))
            mine = False
    return total


def iface_tx_bytes(iface: str | None) -> int:
    if iface is None:
        return 0
    return int(Path(f"/sys/class/net/{iface}/statistics/tx_bytes").read_text())


def worker(args: argparse.Namespace) -> None:
    import torch

    from troupe import collectives
    from troupe.collectives.rendezvous import StoreAddress

    torch.set_num_threads(1)
    store = StoreAddress(args.store_host, args.store_port)
    if args.rank == 0:
        collectives.create_store(args.store_host, port=args.store_port)
    g = collectives.init_group("bench", "gloo", args.rank, WORLD, store, timeout_s=600)
    pid = os.getpid()
    for n in [parse_size(s) for s in args.sizes.split(",")]:
        # data-parallel-like input: a gradient shared by all ranks plus each rank's own noise
        x = torch.randn(n, generator=torch.Generator().manual_seed(1234))
        x += torch.randn(n, generator=torch.Generator().manual_seed(args.rank))
        true_mean = g.all_reduce(x.clone(), "mean")
        for method in ("fp32", "compressed"):
            # Both reuse their output buffer between calls, as an optimizer does.
            state = collectives.OneBitState()
            running = torch.zeros(n)
            buf = torch.empty(n if method == "fp32" else collectives.padded_numel(n, WORLD))

            def once() -> torch.Tensor:
                if method == "fp32":
                    return g.all_reduce(buf.copy_(x), "mean")
                return collectives.compressed_allreduce(x, state, g, out=buf)

            first = once().clone()  # warm-up; also the single-call error (buf is reused)
            g.barrier()
            b0, i0, t0 = tcp_bytes_sent(pid), iface_tx_bytes(args.iface), time.perf_counter()
            for _ in range(args.iters):
                running += once()
            seconds = (time.perf_counter() - t0) / args.iters
            b1, i1 = tcp_bytes_sent(pid), iface_tx_bytes(args.iface)
            running = (running + first) / (args.iters + 1)
            norm = float(true_mean.norm())
            print(json.dumps({
                "rank": args.rank, "numel": n, "method": method, "seconds": seconds,
                "tcp_bytes": (b1 - b0) / args.iters,
                "iface_bytes": (i1 - i0) / args.iters if args.iface else None,
                "err_one": float((first - true_mean).norm()) / norm,
                "err_running": float((running - true_mean).norm()) / norm,
            }), flush=True)
            g.barrier()
    collectives.destroy_group("bench")


# ----------------------------------------------------------------------------- driver side

def sh(*cmd: str) -> None:
    subprocess.run(cmd, check=True, capture_output=True)


def make_namespaces(rate: str) -> list[str]:
    """Rank namespaces trp-r{i} with 198.18.0.{i+1}, bridged in trp-hub; tbf on both ends."""
    remove_namespaces()
    sh("ip", "netns", "add", HUB)
    sh("ip", "-n", HUB, "link", "add", "br0", "type", "bridge")
    sh("ip", "-n", HUB, "link", "set", "br0", "up")
    names = []
    for i in range(WORLD):
        ns = f"trp-r{i}"
        sh("ip", "netns", "add", ns)
        sh("ip", "link", "add", f"trp{i}a", "netns", ns, "type", "veth", "peer", "name",
           f"trp{i}b", "netns", HUB)
        sh("ip", "-n", ns, "addr", "add", f"{SUBNET}.{i + 1}/24", "dev", f"trp{i}a")
        for cmd_ns, dev in ((ns, f"trp{i}a"), (HUB, f"trp{i}b")):
            sh("ip", "-n", cmd_ns, "link", "set", dev, "up")
            sh("ip", "netns", "exec", cmd_ns, "tc", "qdisc", "add", "dev", dev, "root", "tbf",
               "rate", rate, "burst", "1mbit" if rate == "1gbit" else "10mbit", "latency", "50ms")
        sh("ip", "-n", HUB, "link", "set", f"trp{i}b", "master", "br0")
        sh("ip", "-n", ns, "link", "set", "lo", "up")
        names.append(ns)
    return names


def remove_namespaces() -> None:
    for ns in [HUB] + [f"trp-r{i}" for i in range(WORLD)]:
        subprocess.run(["ip", "netns", "del", ns], capture_output=True)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_net(net: str, sizes: str, iters: int) -> list[dict]:
    rate = NETS[net]
    base = [sys.executable, __file__, "--worker", "--sizes", sizes, "--iters", str(iters)]
    if rate is None:
        host, port, prefixes, ifaces = "127.0.0.1", free_port(), [[]] * WORLD, [None] * WORLD
    else:
        names = make_namespaces(rate)
        host, port = f"{SUBNET}.1", 29500
        prefixes = [["ip", "netns", "exec", ns] for ns in names]
        ifaces = [f"trp{i}a" for i in range(WORLD)]
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    procs = []
    try:
        for r in range(WORLD):
            cmd = prefixes[r] + base + ["--rank", str(r), "--store-host", host,
                                        "--store-port", str(port)]
            if ifaces[r]:
                cmd += ["--iface", ifaces[r]]
            procs.append(subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True, env=env))
            if r == 0:
                time.sleep(1.0)  # rank 0 serves the store
        lines = []
        for p in procs:
            out, _ = p.communicate(timeout=3600)
            if p.returncode:
                raise RuntimeError(f"{net}: a rank exited with {p.returncode}")
            lines += [json.loads(l) for l in out.splitlines() if l.startswith("{")]
    finally:
        for p in procs:
            p.kill()
        if rate is not None:
            remove_namespaces()
    return summarize(net, lines)


def summarize(net: str, lines: list[dict]) -> list[dict]:
    rows = []
    for n in sorted({l["numel"] for l in lines}):
        by = {m: [l for l in lines if l["numel"] == n and l["method"] == m]
              for m in ("fp32", "compressed")}
        fp32_s = max(l["seconds"] for l in by["fp32"])
        fp32_b = sum(l["tcp_bytes"] for l in by["fp32"]) / WORLD
        for method, ls in by.items():
            seconds = max(l["seconds"] for l in ls)
            tcp = sum(l["tcp_bytes"] for l in ls) / WORLD
            iface = [l["iface_bytes"] for l in ls if l["iface_bytes"] is not None]
            rows.append({
                "bench": "allreduce", "net": net, "world": WORLD, "numel": n, "method": method,
                "seconds_per_call": round(seconds, 5),
                "tcp_bytes_per_rank": int(tcp),
                "iface_bytes_per_rank": int(sum(iface) / len(iface)) if iface else None,
                "speedup_vs_fp32": round(fp32_s / seconds, 2),
                "bytes_ratio_vs_fp32": round(tcp / fp32_b, 4),
                "err_one_call": round(max(l["err_one"] for l in ls), 4),
                "err_running_mean": round(max(l["err_running"] for l in ls), 4),
            })
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--nets", default="loopback,1gbit,10gbit")
    ap.add_argument("--sizes", default="1M,4M,16M,64M")
    ap.add_argument("--iters", type=int, default=3)
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--rank", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--store-host", help=argparse.SUPPRESS)
    ap.add_argument("--store-port", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--iface", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        return worker(args)
    for net in args.nets.split(","):
        if net not in NETS:
            raise SystemExit(f"--nets: {net!r} is not one of {list(NETS)}")
        if NETS[net] is not None and (os.geteuid() != 0 or not shutil.which("tc")):
            print(json.dumps({"bench": "allreduce", "net": net, "skipped":
                              "needs root and tc (iproute2) to build network namespaces"}))
            continue
        for row in run_net(net, args.sizes, args.iters):
            print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
