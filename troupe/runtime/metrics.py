"""Run metrics: JSON lines on disk and a loss-curve PNG."""

from __future__ import annotations

import json
import resource
import sys
from pathlib import Path
from typing import Any, Collection

import torch


class MetricsLog:
    """Appends one JSON object per line to ``path``. ``truncate_after(step)`` drops records
    past a step, so a resumed run continues the file where its checkpoint left off."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)

    def write(self, record: dict[str, Any]) -> None:
        with self.path.open("a") as f:
            f.write(json.dumps(record) + "\n")

    def records(self) -> list[dict[str, Any]]:
        if not self.path.is_file():
            return []
        return [json.loads(line) for line in self.path.read_text().splitlines() if line.strip()]

    def truncate_after(self, step: int, kinds: Collection[str] | None = None) -> None:
        """Drop the records after ``step`` (of ``kinds`` only, when given)."""
        kept = [r for r in self.records() if r.get("step", 0) <= step
                or (kinds is not None and r.get("kind") not in kinds)]
        self.path.write_text("".join(json.dumps(r) + "\n" for r in kept))


def peak_memory_mb() -> float:
    """This process's peak memory so far, in MiB: the CUDA allocator's high-water mark when
    this process has used CUDA, else the resident set's (the weights, activations and
    everything else the process touched). On Linux that is VmHWM, the peak of this program's
    own address space: ru_maxrss would also carry the peak of the process it was forked from
    (a fork copies it and exec keeps it: a worker started by a 2 GB process would report 2 GB
    before doing anything)."""
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        return torch.cuda.max_memory_allocated() / 2**20
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) / 2**10  # kB
    except OSError:
        pass
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux, bytes on macOS
    return rss / (2**20 if sys.platform == "darwin" else 2**10)


def plot_losses(records: list[dict[str, Any]], path: str | Path, title: str) -> Path:
    """Training loss (per step) and validation loss (per evaluation) against step."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    train = [(r["step"], r["loss"]) for r in records if r.get("kind") == "train"]
    val = [(r["step"], r["val_loss"]) for r in records if r.get("kind") == "eval"]
    fig, ax = plt.subplots(figsize=(7, 4))
    if train:
        ax.plot(*zip(*train), label="train", linewidth=0.8)
    if val:
        ax.plot(*zip(*val), "o-", label="validation")
    ax.set_xlabel("step")
    ax.set_ylabel("loss (nats/token)")
    ax.set_title(title)
    ax.legend()
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return Path(path)
