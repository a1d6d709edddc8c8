"""`troupe compress` (apps/compress.py): XTC's extreme compression, a ternary or binary
(optionally layer-reduced) student distilled from a Hugging Face model in one stage, as a
distributed job on pretraining's trainer actors, exported for apps/serve.py.

    troupe compress --config xtc-smollm2 [key=value ...]
    troupe compress --config xtc-smollm2 model.keep_layers=[0,2,4,...] out_dir=runs/xtc-15
    troupe compress --config xtc-smollm2 'quantize={"blocks.*": binary}'

The student starts from the teacher: the blocks ``model.keep_layers`` names (layer reduction,
troupe.compression.student; all of them by default) with every Linear that a ``quantize`` rule
matches trained through its quantization (troupe.compression.lkd.FakeQuantLinear: ternary or
binary weights and INT8 tokens in the forward, a straight-through backward to the fp32 latent
weights). Each trainer rank holds the frozen teacher in its own process (as RLHF's reference
is held) and the student data-parallel (ZeRO-1 or 3, or the 1-bit optimizers: pretraining's
machinery, with its checkpoints, exact resume and failure policy). The loss on the user's text
(``data.source``: .txt, .jsonl or .parquet files) is troupe.compression.distill's: the logit
KL at ``distill.temperature`` plus ``distill.hidden_mse`` times the blocks' hidden-state MSE.
The held-out loss evaluated every ``train.eval_every`` steps is the student's own next-token
loss (its perplexity is exp of it).

Metrics go to <out_dir>/metrics.jsonl (the distillation loss each step, the student's held-out
loss at each evaluation), the curves to distill.png (and loss.png), checkpoints to
checkpoints/step-N, the compressed model to quantized/ (troupe.compression.artifact; serve it
with ``apps/serve.py model.pretrained=<out_dir>/quantized quantize={}``). Running the same
command again resumes from the newest checkpoint; --no-resume starts over.
"""

from __future__ import annotations

import logging
import math
from pathlib import Path
from typing import Literal

import torch
from pydantic import Field, field_validator, model_validator

from troupe import checkpoint as ckpt
from troupe.compression.artifact import save_quantized
from troupe.compression.distill import Distillation
from troupe.compression.lkd import FakeQuantLinear
from troupe.compression.quantize import (check_patterns, gates_stay_fp32, known_modes,
                                         quantize_model, replace_linears)
from troupe.compression.student import reduce_layers, reduced_config
from troupe.config import Config, ConfigError, app_parser, errors_reported, load_app_config
from troupe.models import GPT, GPTConfig, from_pretrained
from troupe.models.hf_config import check_pretrained
from troupe.pretrain import driver as pretrain
from troupe.pretrain.config import ModelConfig, PretrainConfig
from troupe.pretrain.export import load_full_model
from troupe.pretrain.plan import plan
from troupe.runtime import cluster
from troupe.runtime.metrics import MetricsLog

log = logging.getLogger(__name__)


class StudentModelConfig(ModelConfig):
    """The teacher (``pretrained``, a local Hugging Face directory: the student starts from its
    weights and tokenizer) and ``keep_layers``: the teacher's blocks the student keeps, in
    order (None: all of them). The architecture is the student's."""

    keep_layers: list[int] | None = None

    def architecture(self) -> GPTConfig:
        arch = super().architecture()
        return arch if self.keep_layers is None else reduced_config(arch, self.keep_layers)


class DistillConfig(Config):
    """temperature: of the logit KL (its gradient scaled back by temperature^2);
    hidden_mse: weight of the hidden-state MSE between student block j and teacher block
    keep_layers[j] (0: logits only)."""

    temperature: float = Field(default=1.0, gt=0)
    hidden_mse: float = Field(default=0.0, ge=0)


class CompressConfig(PretrainConfig):
    """apps/compress.py's recipe: pretraining's keys (model, optimizer, data, train, workers,
    device, precision, seed, out_dir, zero_stage, ...) for the student, and:

    quantize: module-name rules -> mode, as apps/serve.py's (first match wins; ternary and
    binary, or w8a8 / w8a16 / w4a16, or fp32), the layers trained through that quantization;
    embedding: how the exported model holds its token embedding (int8, int4 or fp32; a tied
    output projection gets the same integers), quantized after training;
    group_size: of the weight-only layers and the embedding; distill: the loss."""

    model: StudentModelConfig = StudentModelConfig()
    quantize: dict[str, str] = Field(default_factory=lambda: {"blocks.*": "ternary"})
    embedding: Literal["fp32", "int8", "int4"] = "int4"
    group_size: int = Field(default=64, ge=2)
    distill: DistillConfig = DistillConfig()
    out_dir: str = "runs/compress"

    @field_validator("quantize")
    @classmethod
    def _known_modes(cls, rules: dict[str, str]) -> dict[str, str]:
        return known_modes(rules)

    @model_validator(mode="after")
    def _has_teacher(self) -> "CompressConfig":
        if self.model.pretrained is None:
            raise ValueError("model.pretrained: the teacher (a local Hugging Face directory) "
                             "is required: the student starts from it")
        return self

    def prepare_model(self, model: GPT) -> GPT:
        """The student of the teacher ``model``: layer-reduced, then its Linears matched by
        ``quantize`` swapped for FakeQuantLinear (same parameter names)."""
        if self.model.keep_layers is not None:
            model = reduce_layers(model, self.model.keep_layers)
        rules = gates_stay_fp32(model, self.quantize)
        replace_linears(model, rules, lambda lin, mode, _: FakeQuantLinear(
            lin, mode, self.group_size))
        return model.train()

    def objective(self, device: torch.device) -> Distillation:
        teacher = from_pretrained(self.model.pretrained).to(device).eval().requires_grad_(False)
        keep = self.model.keep_layers or list(range(teacher.cfg.n_layer))
        return Distillation(teacher, self.distill.temperature, self.distill.hidden_mse, keep)


def check_student(cfg: CompressConfig, local: bool = False) -> None:
    """What the driver checks before anything starts: the teacher directory, ``keep_layers``
    against its blocks, and that every ``quantize`` pattern matches some layer of the student
    (a typo would quietly leave it unquantized); ConfigError naming the key otherwise."""
    check_pretrained(cfg.model.pretrained)
    try:
        arch = cfg.model.architecture()
    except ValueError as e:
        raise ConfigError(f"model.keep_layers: {e}") from None
    with torch.device("meta"):
        check_patterns(GPT(arch), cfg.quantize, "the student")
    plan(cfg, local)  # the distillation window against the teacher's context; memory; CPUs


def export_quantized(cfg: CompressConfig, out: Path) -> Path:
    """The newest checkpoint's student, quantized as it was trained (``quantize`` rules, the
    ``embedding``), as a quantized model directory out/quantized; returns it."""
    newest = ckpt.latest(pretrain.checkpoint_root(cfg))
    model = load_full_model(newest, cfg).eval().requires_grad_(False)
    quantize_model(model, cfg.quantize, cfg.group_size, embedding=cfg.embedding)
    directory = save_quantized(model, out / "quantized", cfg.model.pretrained, cfg.group_size)
    log.info("exported %s as a quantized model directory: %s", newest, directory)
    return directory


def run(cfg: CompressConfig, resume: str | None = "auto", stop_after: int | None = None,
        progress: bool = True) -> list[dict]:
    """Distil per ``cfg`` (pretraining's driver with the student and the distillation loss),
    plot, and export; returns the metric records of this run."""
    records = pretrain.run(cfg, resume, stop_after, progress, export=export_quantized,
                           name="compress")
    plot_distillation(MetricsLog(Path(cfg.out_dir) / "metrics.jsonl").records(),
                      Path(cfg.out_dir) / "distill.png", Path(cfg.out_dir).name)
    return records


def plot_distillation(records: list[dict], path: Path, title: str) -> Path:
    """The distillation loss per step and the student's held-out perplexity per evaluation."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    train = [(r["step"], r["loss"]) for r in records if r.get("kind") == "train"]
    val = [(r["step"], math.exp(min(r["val_loss"], 50.0))) for r in records
           if r.get("kind") == "eval"]
    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 4))
    if train:
        a.plot(*zip(*train), linewidth=0.8)
    a.set(xlabel="step", ylabel="distillation loss", title=f"{title}: KD loss")
    if val:
        b.plot(*zip(*val), "o-")
        b.set_yscale("log")
    b.set(xlabel="step", ylabel="held-out perplexity", title=f"{title}: student perplexity")
    for ax in (a, b):
        ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def main(argv: list[str] | None = None) -> int:
    p = app_parser("compress", __doc__, "xtc-smollm2")
    p.add_argument("--resume", default="auto", help="'auto', a checkpoint directory")
    p.add_argument("--no-resume", action="store_true", help="ignore existing checkpoints")
    p.add_argument("--stop-after", type=int, default=None, help="stop after this step")
    args = p.parse_intermixed_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    cfg = load_app_config(CompressConfig, args.config, args.overrides,
                          lambda c: check_student(c, local=not args.print_config),
                          print_config=args.print_config)
    with errors_reported(cfg.out_dir, "compress", args.traceback):
        cluster.init()
        records = run(cfg, None if args.no_resume else args.resume, args.stop_after)
    evals = [r for r in records if r["kind"] == "eval"]
    if evals:
        first, last = evals[0], evals[-1]
        print(f"held-out perplexity of the student: {math.exp(first['val_loss']):.2f} (step "
              f"{first['step']}) -> {math.exp(last['val_loss']):.2f} (step {last['step']}); "
              f"outputs in {cfg.out_dir}")
    return 0
