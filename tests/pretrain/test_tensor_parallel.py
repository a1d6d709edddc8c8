"""Pretraining with tensor_parallel: T trainers that split each dense layer take the steps one
trainer takes (losses within 1e-5; benchmarks/tensor_parallel.py runs 30 steps), composed
with expert parallelism, ZeRO-1 and ZeRO-3 and activation checkpointing; a checkpoint written
with T=2 resumes with T=1 and T=4; the export is the one model."""

import shutil

import pytest
import torch

from troupe.config import ConfigError
from troupe.models import from_pretrained
from troupe.pretrain.config import PretrainConfig
from troupe.pretrain.plan import plan

MOE = dict(num_experts=4, expert_interval=1, capacity_factor=1.0, min_capacity=2)


def _cfg(tmp_path, name, steps=12, **over) -> PretrainConfig:
    base = dict(model=dict(seq_len=32, n_layer=2, n_head=4, d_model=32),
                optimizer=dict(name="adamw", lr=3e-3, warmup_steps=2),
                data=dict(max_chars=200_000),
                train=dict(steps=steps, batch_size=4, eval_every=0, eval_batches=2,
                           checkpoint_every=4),
                workers=1, out_dir=str(tmp_path / name))
    for key, value in over.items():
        base[key] = {**base[key], **value} if isinstance(value, dict) else value
    return PretrainConfig(**base)


def _losses(records) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in records if r["kind"] == "train"}


def _close(a: dict, b: dict, rel: float = 1e-5) -> bool:
    return sorted(a) == sorted(b) and all(abs(a[s] - b[s]) <= rel * b[s] for s in b)


@pytest.mark.parametrize("moe", [False, True], ids=["dense", "moe"])
def test_two_tensor_parallel_ranks_take_the_steps_of_one(pretrain_graphs, tmp_path, moe):
    """The steps of one trainer; and (dense) its checkpoint at step 8, written with T=2,
    resumed with T=1 and with T=4 (the buckets put together and cut again) gives steps 9
    and 10 of the uninterrupted run."""
    over = dict(model=dict(moe=MOE)) if moe else {}
    one = _losses(pretrain_graphs.run(_cfg(tmp_path, "one", **over), resume=None,
                                      progress=False))
    two = pretrain_graphs.run(_cfg(tmp_path, "two", workers=2, tensor_parallel=2, **over),
                              resume=None, progress=False)
    assert _close(_losses(two), one) and one[12] < one[1] - 0.5
    assert all(r["tokens"] == 4 * 32 for r in two if r["kind"] == "train")  # counted once
    if moe:  # troupe's MoE GPT has no Hugging Face form
        return
    a, b = (from_pretrained(tmp_path / n / "hf").state_dict() for n in ("one", "two"))
    assert all(torch.allclose(a[k], b[k], atol=1e-5) for k in a)  # the export: one model
    written = tmp_path / "two" / "checkpoints" / "step-00000008"
    for workers, T in [(1, 1), (4, 4)]:
        name = f"resumed-{T}"
        got = pretrain_graphs.run(_cfg(tmp_path, name, workers=workers, tensor_parallel=T),
                                  resume=str(written), stop_after=10, progress=False)
        assert _close(_losses(got), {s: one[s] for s in (9, 10)}), T
        shutil.rmtree(tmp_path / name)


def test_tp_ep_dp_with_zero3_and_activation_checkpointing(pretrain_graphs, tmp_path):
    """tp=2 x ep=2 x dp=2 over 4 trainers, ZeRO-3 over the data-parallel pairs, blocks
    recomputed in the backward: the steps of 2 data-parallel trainers without tensor
    parallelism (the MoE capacity follows the data-parallel batch: the same here)."""
    moe = dict(model=dict(moe={**MOE, "ep_size": 2}))
    ref = _losses(pretrain_graphs.run(_cfg(tmp_path, "ref", steps=4, workers=2, **moe),
                                      resume=None, progress=False))
    got = pretrain_graphs.run(_cfg(tmp_path, "ted", steps=4, workers=4, tensor_parallel=2,
                                   zero_stage=3, train=dict(activation_checkpointing=True),
                                   **moe), resume=None, progress=False)
    assert _close(_losses(got), ref)


def test_sizes_that_do_not_split_are_refused_before_ray(tmp_path, smollm2):
    with pytest.raises(ValueError, match=r"workers=3 must be a multiple of tensor_parallel=2"):
        _cfg(tmp_path, "x", workers=3, tensor_parallel=2)
    with pytest.raises(ValueError, match=r"optimizer.name='lamb'.*norm of whole tensors"):
        _cfg(tmp_path, "x", workers=2, tensor_parallel=2, optimizer=dict(name="lamb"))
    with pytest.raises(ValueError, match=r"6 query and 6 key/value heads.*\[1, 2, 3, 6\]"):
        _cfg(tmp_path, "x", workers=4, tensor_parallel=4, model=dict(n_head=6, d_model=48))
    cfg = _cfg(tmp_path, "x", workers=2, tensor_parallel=2,
               model=dict(pretrained=str(smollm2), seq_len=32))
    with pytest.raises(ConfigError, match=r"9 query and 3 key/value heads.*\[1, 3\].*"
                                          r"config.json"):
        plan(cfg)


def test_the_memory_plan_is_a_shards_and_names_the_size_that_fits(tmp_path):
    big = dict(n_layer=4, n_head=8, d_model=512)
    one = plan(_cfg(tmp_path, "x", model=big)).total
    half = plan(_cfg(tmp_path, "x", workers=2, tensor_parallel=2, model=big)).total
    assert 0.5 * one < half <= 0.51 * one  # all of it splits but the norms and biases
    budget = (one + half) / 2 / 2**30
    with pytest.raises(ConfigError, match=r"tensor_parallel=2 would plan .* a rank"):
        plan(_cfg(tmp_path, "x", model=big, memory_per_worker=budget))
    plan(_cfg(tmp_path, "x", workers=2, tensor_parallel=2, model=big,
              memory_per_worker=budget))
