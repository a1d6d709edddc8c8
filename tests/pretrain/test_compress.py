"""apps/compress.py (XTC): the student (layer-reduced, trained through its ternary layers,
exported to what is served) and the distillation job on trainer actors, whose resume
reproduces the uninterrupted run."""

import json
import math

import pytest
import torch

from troupe.compression import quantize_model
from troupe.compression.artifact import load_quantized
from troupe.compression.distill import Distillation
from troupe.compression.lkd import FakeQuantLinear
from troupe.compression.student import reduce_layers
from troupe.models import GPT, from_pretrained
from troupe.pretrain.compress import CompressConfig, run

transformers = pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from tests.models.tiny import save_tiny_llama
    root = tmp_path_factory.mktemp("xtc")
    save_tiny_llama(root / "hf")
    rows = [json.dumps({"text": "sort: " + " ".join(str((i * 7 + j) % 10) for j in range(40))})
            for i in range(40)]
    (root / "docs.jsonl").write_text("\n".join(rows) + "\n")
    return root


def _cfg(tiny, out):
    cfg = {"model": {"pretrained": str(tiny / "hf"), "seq_len": 32, "keep_layers": [1]},
           "data": {"source": [str(tiny / "docs.jsonl")]},
           "train": {"steps": 6, "batch_size": 4, "eval_every": 3, "checkpoint_every": 3},
           "optimizer": {"name": "adamw", "lr": 3e-3, "warmup_steps": 1}, "workers": 2,
           "out_dir": str(out), "device": "cpu", "distill": {"hidden_mse": 0.5},
           "group_size": 16, "embedding": "fp32"}
    return CompressConfig.model_validate(cfg)


def test_the_student_keeps_the_chosen_blocks_and_trains_through_ternary(tiny):
    cfg = _cfg(tiny, "unused")
    teacher = from_pretrained(tiny / "hf")
    student = cfg.prepare_model(from_pretrained(tiny / "hf"))
    assert len(student.blocks) == 1 and student.cfg == cfg.model.architecture()
    assert torch.equal(student.blocks[0].attn.qkv.weight, teacher.blocks[1].attn.qkv.weight)
    assert isinstance(student.blocks[0].ffn.fc, FakeQuantLinear)
    # the same parameter names as the plain student: checkpoints and exports need nothing else
    assert [n for n, _ in student.named_parameters()] == \
        [n for n, _ in GPT(cfg.model.architecture()).named_parameters()]
    ids = torch.randint(0, 19, (2, 16), generator=torch.Generator().manual_seed(0))
    loss, _ = Distillation(teacher, 1.0, 0.5, [1])(student, ids, ids)
    loss.backward()
    assert student.blocks[0].ffn.fc.weight.grad.abs().sum() > 0


def test_the_exported_student_serves_what_was_trained(tiny):
    """The ternary layers' integer product against the fake quantization they were trained
    through: the same function up to fp32 rounding."""
    cfg = _cfg(tiny, "unused")
    student = cfg.prepare_model(from_pretrained(tiny / "hf")).eval()
    plain = reduce_layers(from_pretrained(tiny / "hf"), [1]).eval()
    quantize_model(plain, cfg.quantize, cfg.group_size)
    ids = torch.randint(0, 19, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(plain(ids)[0], student(ids)[0], rtol=1e-4, atol=1e-4)


def test_resume_reproduces_the_uninterrupted_run_and_exports(cluster, tiny, tmp_path):
    full = run(_cfg(tiny, tmp_path / "full"), resume=None, progress=False)
    cfg = _cfg(tiny, tmp_path / "split")
    first = run(cfg, resume=None, stop_after=3, progress=False)
    assert not (tmp_path / "split" / "quantized").exists()  # exported at the end only
    second = run(cfg, resume="auto", progress=False)
    key = lambda r: (r["kind"], r["step"], r.get("loss"), r.get("val_loss"))  # noqa: E731
    assert [key(r) for r in first + second] == [key(r) for r in full]
    train = [r["loss"] for r in full if r["kind"] == "train"]
    assert train[-1] < train[0]
    assert (tmp_path / "split" / "distill.png").stat().st_size > 1000
    model, modes = load_quantized(tmp_path / "split" / "quantized")
    assert set(modes.values()) == {"ternary"} and len(model.blocks) == 1
    val = [r["val_loss"] for r in full if r["kind"] == "eval"][-1]
    ids = torch.tensor([[3, 4, 5]])
    assert math.isfinite(val) and model(ids)[0].shape == (1, 3, model.cfg.vocab_size)


def test_the_student_trains_under_zero3_and_one_bit_adam(cluster, tiny, tmp_path):
    """ZeRO-3 and ZeRO-2 partition the student (its fake-quantized Linears inside the blocks)
    and give ZeRO-1's losses; 1-bit Adam gives Adam's losses through its warm-up, then compressed
    steps (fewer bytes a step) that stay finite."""
    base = _cfg(tiny, tmp_path / "base").model_dump()
    four = {**base["train"], "steps": 4}

    def losses(name, **over):
        cfg = CompressConfig.model_validate({**base, **over, "train": four,
                                             "out_dir": str(tmp_path / name)})
        return [r for r in run(cfg, resume=None, progress=False) if r["kind"] == "train"]

    ref = losses("ref")
    for stage in (2, 3):
        zero = losses(f"zero{stage}", zero_stage=stage)
        assert [r["loss"] for r in zero] == pytest.approx([r["loss"] for r in ref], rel=1e-5)
    onebit = losses("onebit", optimizer={**base["optimizer"], "name": "onebit_adam",
                                         "freeze_step": 3})
    assert [r["loss"] for r in onebit[:3]] == [r["loss"] for r in ref[:3]]
    assert math.isfinite(onebit[3]["loss"])
    sent = [b["bytes_sent"] - a["bytes_sent"] for a, b in zip(onebit, onebit[1:])]
    assert sent[-1] < sent[0] / 4  # step 4 sent signs, step 2 fp32


def test_bad_recipes_name_the_key(tiny):
    from troupe.config import ConfigError
    from troupe.pretrain.compress import check_student

    check_student(_cfg(tiny, "unused"))
    bad = _cfg(tiny, "unused").model_copy(update={"quantize": {"blocks.*.atn.*": "ternary"}})
    with pytest.raises(ConfigError, match="quantize: pattern 'blocks.\\*.atn.\\*'"):
        check_student(bad)
    model = _cfg(tiny, "unused").model.model_copy(update={"keep_layers": [0, 5]})
    with pytest.raises(ConfigError, match="model.keep_layers"):
        check_student(_cfg(tiny, "unused").model_copy(update={"model": model}))
    with pytest.raises(ValueError, match="model.pretrained"):
        CompressConfig.model_validate({"model": {"keep_layers": [0]}})
    with pytest.raises(ValueError, match="'blocks.\\*': mode 'trinary'"):
        CompressConfig.model_validate({"model": {"pretrained": str(tiny / "hf")},
                                       "quantize": {"blocks.*": "trinary"}})
