"""Run metrics: JSON lines on disk (and, as a recipe's ``logging.backends`` asks, the same
records in TensorBoard, Weights & Biases or MLflow) and a loss-curve PNG."""

from __future__ import annotations

import importlib.util
import json
import math
import resource
import sys
from pathlib import Path
from typing import Any, Collection, Literal

import torch
from pydantic import field_validator

from troupe.config import Config


class LoggingConfig(Config):
    """Where a run's metric records go. ``backends``: any of
    - jsonl: <out_dir>/metrics.jsonl, always written (resume, the plots and summaries read it);
    - tensorboard: event files in <out_dir>/tensorboard (``tensorboard --logdir``);
    - wandb: a Weights & Biases run in <out_dir>/wandb, offline unless ``wandb_mode`` is
      online (``wandb sync <out_dir>/wandb/offline-run-*`` uploads an offline one);
    - mlflow: an MLflow run under ``mlflow_tracking_uri`` (default the SQLite store
      <out_dir>/mlflow.db, its artifacts in <out_dir>/mlartifacts:
      ``mlflow ui --backend-store-uri sqlite:///<out_dir>/mlflow.db``).
    Each record is logged as ``<kind>/<key>`` = value at its ``step`` (numbers only; a
    record's kind is its own x axis in W&B). ``project``: W&B's project, MLflow's experiment;
    ``run_name``: default the out_dir's name. The optional packages are extras:
    ``pip install 'troupe[tensorboard]'`` (or wandb, mlflow)."""

    backends: list[Literal["jsonl", "tensorboard", "wandb", "mlflow"]] = ["jsonl"]
    project: str = "troupe"
    run_name: str | None = None
    wandb_mode: Literal["offline", "online"] = "offline"
    mlflow_tracking_uri: str | None = None

    @field_validator("backends")
    @classmethod
    def _installed(cls, backends: list[str]) -> list[str]:
        for b in backends:  # each optional backend is the package of its name
            if b != "jsonl" and importlib.util.find_spec(b) is None:
                raise ValueError(f"{b} needs the {b} package: pip install 'troupe[{b}]'")
        return list(dict.fromkeys(["jsonl", *backends]))


class MetricsLog:
    """Appends one JSON object per line to ``path``. ``truncate_after(step)`` drops records
    past a step, so a resumed run continues the file where its checkpoint left off. With
    ``logging`` (a recipe's LoggingConfig) each record also goes to its other backends, which
    start here (``run_config``: the recipe, as the run's parameters) and end at ``close``."""

    def __init__(self, path: str | Path, logging: LoggingConfig | None = None,
                 run_config: dict | None = None):
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.backends = []
        for name in (logging.backends if logging is not None else []):
            if name != "jsonl":
                self.backends.append(_OPEN[name](self.path.parent, logging, run_config or {}))

    def write(self, record: dict[str, Any]) -> None:
        with self.path.open("a") as f:
            f.write(json.dumps(record) + "\n")
        if self.backends:
            kind, step = str(record.get("kind", "metrics")), int(record.get("step", 0))
            values = {f"{kind}/{k}": float(v) for k, v in record.items()
                      if k not in ("kind", "step") and isinstance(v, (int, float))
                      and not isinstance(v, bool) and math.isfinite(v)}
            for b in self.backends:
                b.write(kind, step, values)

    def close(self) -> None:
        """Flush and end the other backends' runs (metrics.jsonl needs no closing)."""
        for b in self.backends:
            b.close()
        self.backends = []

    def records(self) -> list[dict[str, Any]]:
        if not self.path.is_file():
            return []
        return [json.loads(line) for line in self.path.read_text().splitlines() if line.strip()]

    def truncate_after(self, step: int, kinds: Collection[str] | None = None) -> None:
        """Drop the records after ``step`` (of ``kinds`` only, when given)."""
        kept = [r for r in self.records() if r.get("step", 0) <= step
                or (kinds is not None and r.get("kind") not in kinds)]
        self.path.write_text("".join(json.dumps(r) + "\n" for r in kept))


class _TensorBoard:
    def __init__(self, out: Path, cfg: LoggingConfig, run_config: dict):
        from torch.utils.tensorboard import SummaryWriter
        self.writer = SummaryWriter(str(out / "tensorboard"))
        self.writer.add_text("config", "```\n" + json.dumps(run_config, indent=1) + "\n```")

    def write(self, kind: str, step: int, values: dict[str, float]) -> None:
        for key, v in values.items():
            self.writer.add_scalar(key, v, step)
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()


class _WandB:
    def __init__(self, out: Path, cfg: LoggingConfig, run_config: dict):
        import wandb
        self.run = wandb.init(project=cfg.project, name=cfg.run_name or out.resolve().name,
                              dir=str(out), mode=cfg.wandb_mode, config=run_config)
        self.kinds: set[str] = set()

    def write(self, kind: str, step: int, values: dict[str, float]) -> None:
        if kind not in self.kinds:  # each kind of record on its own step axis
            self.run.define_metric(f"{kind}/step")
            self.run.define_metric(f"{kind}/*", step_metric=f"{kind}/step")
            self.kinds.add(kind)
        self.run.log({**values, f"{kind}/step": step})

    def close(self) -> None:
        self.run.finish()


class _MLflow:
    def __init__(self, out: Path, cfg: LoggingConfig, run_config: dict):
        import mlflow
        self.mlflow = mlflow
        mlflow.set_tracking_uri(cfg.mlflow_tracking_uri
                                or f"sqlite:///{(out / 'mlflow.db').resolve()}")
        if cfg.mlflow_tracking_uri is None and mlflow.get_experiment_by_name(cfg.project) is None:
            # MLflow's default artifact root is ./mlruns of the working directory
            mlflow.create_experiment(cfg.project,
                                     artifact_location=(out / "mlartifacts").resolve().as_uri())
        mlflow.set_experiment(cfg.project)
        self.run = mlflow.start_run(run_name=cfg.run_name or out.resolve().name)
        mlflow.log_dict(run_config, "config.json")

    def write(self, kind: str, step: int, values: dict[str, float]) -> None:
        self.mlflow.log_metrics(values, step=step)

    def close(self) -> None:
        self.mlflow.end_run()


_OPEN = {"tensorboard": _TensorBoard, "wandb": _WandB, "mlflow": _MLflow}


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
