"""fp16's dynamic loss scaling: an overflowed step is skipped on every rank and the scale backs
off; clean steps grow it back; a pretraining run in fp16 tracks fp32."""

import pytest
import torch

from tests.collectives.helpers import GroupRank, gloo_ranks
from troupe.optim import FlatParams, LossScaler
from troupe.pretrain.config import PretrainConfig
from troupe.pretrain.rank import Trainer


def _flat(values):
    p = torch.nn.Parameter(torch.zeros(len(values)))
    flat = FlatParams([p])
    flat.grad[: len(values)] = torch.tensor(values)
    return flat


def test_scale_backs_off_on_overflow_and_grows_after_clean_steps():
    s = LossScaler(init_scale=8.0, growth_interval=2)
    assert s.scale(torch.tensor(1.5)).item() == 12.0
    flat = _flat([8.0, -16.0])
    assert s.unscale_([flat], None) and flat.grad[:2].tolist() == [1.0, -2.0]  # divided
    assert not s.unscale_([_flat([1.0, float("inf")])], None)
    assert (s.scale_value, s.skipped, s.good_steps) == (4.0, 1, 0)
    assert not s.unscale_([_flat([float("nan")])], None) and s.scale_value == 2.0
    assert s.unscale_([_flat([1.0])], None) and s.unscale_([_flat([1.0])], None)
    assert s.scale_value == 4.0 and s.good_steps == 0  # two clean steps: doubled
    restored = LossScaler()
    restored.load_state_dict(s.state_dict())
    assert restored.state_dict() == s.state_dict()


def _one_rank_overflows(group):
    s = LossScaler(init_scale=4.0)
    bad = float("inf") if group.rank == 1 else 1.0
    return s.unscale_([_flat([2.0, bad])], group), s.scale_value


@pytest.fixture(scope="module")
def ranks(cluster):
    yield from gloo_ranks("scaler", 3)


def test_every_rank_skips_when_one_overflows(ranks):
    assert ranks.invoke(GroupRank.run, "g", _one_rank_overflows) == [(False, 2.0)] * 3


def test_fp16_pretraining_tracks_fp32_and_skips_overflowed_steps():
    """Ten steps in fp16 (autocast, fp32 master weights) within 1% of fp32's losses (fp16
    keeps 10 bits of mantissa); started at a scale of 2^40 the first steps overflow, are
    skipped (the weights do not move) and the scale halves until the gradients fit."""
    def worker(precision):
        cfg = PretrainConfig(model={"d_model": 64, "n_layer": 2, "n_head": 2, "seq_len": 32},
                             precision=precision, workers=1,
                             train={"batch_size": 8, "steps": 10})
        return Trainer(cfg, 0, 1, None)

    fp32, fp16 = worker("fp32"), worker("fp16")
    a = [fp32.train_step(s).loss for s in range(1, 11)]
    b = [fp16.train_step(s).loss for s in range(1, 11)]
    assert a != b and all(abs(x - y) <= 0.01 * x for x, y in zip(a, b)), (a, b)
    hot = worker("fp16")
    hot.scaler.scale_value = 2.0 ** 40
    before = hot.buckets[0].flat.data.clone()
    first = hot.train_step(1)
    assert first.skipped_steps == 1 and first.loss_scale == 2.0 ** 39
    assert torch.equal(hot.buckets[0].flat.data, before)  # a skipped step changes nothing
    stats = [hot.train_step(s) for s in range(2, 41)]
    assert stats[-1].skipped_steps < 40 and stats[-1].loss_scale < 2.0 ** 39
    assert not torch.equal(hot.buckets[0].flat.data, before)


def test_fp16_with_offload_is_refused_by_name():
    with pytest.raises(ValueError, match="precision=fp16 with train.offload"):
        PretrainConfig(precision="fp16", workers=2, train={"offload": True, "batch_size": 4})
