"""The system's side of ``troupe hosts`` (troupe.runtime.hosts): network namespaces, links and
their processes through iproute2 (``ip``, ``tc``) and nftables, each failure a HostsError
naming the command and what it printed."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import time


class HostsError(RuntimeError):
    """The emulator cannot do what was asked (no root, no ``ip``/``tc``/``nft``, a name in
    use, a host that does not exist); the message says which, in one line."""


def check_tools(loss: bool = False, delay: bool = False) -> None:
    """HostsError in one line when the emulator cannot run here (root, ``ip``, ``tc``; ``nft``
    for loss; netem for delay, which this kernel lacks)."""
    if os.geteuid() != 0:
        raise HostsError("troupe hosts makes network namespaces: it needs root")
    for tool in ("ip", "tc") + (("nft",) if loss else ()):
        if shutil.which(tool) is None:
            package = {"ip": "iproute2", "tc": "iproute2", "nft": "nftables"}[tool]
            raise HostsError(f"troupe hosts needs `{tool}` (Debian's {package} package: "
                             f"apt-get install {package})")
    if delay and not netem():
        raise HostsError("delay and jitter need the kernel's netem (sch_netem), which this "
                         "kernel lacks: rate (--rate), loss (--loss), cut and kill are "
                         "what can be emulated here")


def netem() -> bool:
    ns = f"trh-probe-{os.getpid()}"
    try:
        ip("netns", "add", ns)
        return subprocess.run(["ip", "netns", "exec", ns, "tc", "qdisc", "add", "dev", "lo",
                               "root", "netem", "delay", "1ms"], capture_output=True
                              ).returncode == 0
    finally:
        subprocess.run(["ip", "netns", "del", ns], capture_output=True)


def run(*cmd: str, stdin: str | None = None) -> str:
    p = subprocess.run(cmd, capture_output=True, text=True, input=stdin)
    if p.returncode != 0:
        raise HostsError(f"{' '.join(cmd)}: {p.stderr.strip() or p.stdout.strip()}")
    return p.stdout


def ip(*args: str) -> str:
    return run("ip", *args)


def namespaces() -> list[str]:
    out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    return [line.split()[0] for line in out.splitlines() if line.strip()]


def pids(ns: str) -> list[int]:
    out = subprocess.run(["ip", "netns", "pids", ns], capture_output=True, text=True).stdout
    return [int(x) for x in out.split()]


def kill_namespace(ns: str, timeout_s: float = 10.0) -> None:
    """SIGKILL every process in ``ns`` until none is left."""
    deadline = time.monotonic() + timeout_s
    while (left := pids(ns)) and time.monotonic() < deadline:
        for pid in left:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        time.sleep(0.1)


def burst(rate: str) -> str:
    """tbf's bucket: a few milliseconds of the rate, and at least 64 KiB (a GSO segment)."""
    units = {"kbit": 1e3, "mbit": 1e6, "gbit": 1e9, "bit": 1.0}
    text = rate.lower()
    for unit, scale in units.items():
        if text.endswith(unit) and text[:-len(unit)].replace(".", "").isdigit():
            bits = float(text[:-len(unit)]) * scale
            return f"{max(int(bits / 8 / 250), 64 << 10)}b"
    raise HostsError(f"--rate {rate!r}: a rate such as 100mbit, 1gbit or 10gbit")
