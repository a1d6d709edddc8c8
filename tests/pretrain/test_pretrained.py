"""Continued pretraining from a Hugging Face directory (model.pretrained): the data tokenized by
the model's tokenizer, training starting from its weights (the first loss is transformers'
loss of the same batch), and the result exported as a directory transformers loads."""

import json
import random

import pytest
import torch
import torch.nn.functional as F

transformers = pytest.importorskip("transformers")

from tests.models.tiny import save_tiny_llama  # noqa: E402
from troupe import checkpoint as ckpt  # noqa: E402
from troupe.data import TokenDataset, load_tokenizer  # noqa: E402
from troupe.pretrain import PretrainConfig  # noqa: E402
from troupe.pretrain import driver  # noqa: E402
from troupe.pretrain.export import load_full_model  # noqa: E402


def test_continued_pretraining_and_export(cluster, tmp_path):
    hf = save_tiny_llama(tmp_path / "llama")
    rng = random.Random(0)
    files = []
    for i in range(4):
        digits = ["".join(rng.choice("0123456789") for _ in range(4)) for _ in range(60)]
        files.append(tmp_path / f"doc{i}.jsonl")
        files[-1].write_text("".join(json.dumps({"text": f"sort {d}: {''.join(sorted(d))}"})
                                     + "\n" for d in digits))
    cfg = PretrainConfig(model={"pretrained": str(hf), "seq_len": 24},
                         data={"source": [str(f) for f in files], "val_fraction": 0.25},
                         optimizer={"name": "adamw", "lr": 3e-3, "min_lr": 3e-3},
                         train={"steps": 6, "batch_size": 4, "eval_every": 0},
                         workers=2, out_dir=str(tmp_path / "run"))
    records = driver.run(cfg, resume=None, progress=False)
    train = [r for r in records if r["kind"] == "train"]

    data = TokenDataset(cfg.data, load_tokenizer(str(hf)))
    assert data.train.max() < 19 and (data.train == 0).sum() > 0  # its ids, eos between docs
    x, y = data.train_batch(1, 4, 24)
    reference = transformers.AutoModelForCausalLM.from_pretrained(hf).eval()
    with torch.no_grad():
        loss = F.cross_entropy(reference(input_ids=x).logits.flatten(0, 1), y.flatten())
    assert train[0]["loss"] == pytest.approx(loss.item(), abs=1e-4)
    assert train[-1]["loss"] < train[0]["loss"]

    exported = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "run" / "hf").eval()
    trained = load_full_model(ckpt.latest(tmp_path / "run" / "checkpoints"), cfg)
    with torch.no_grad():
        torch.testing.assert_close(exported(input_ids=x).logits, trained(x)[0], atol=1e-4,
                                   rtol=1e-4)
    assert (tmp_path / "run" / "hf" / "tokenizer.json").is_file()
