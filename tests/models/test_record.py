"""The model record a checkpoint carries (troupe.models.record): its hash stays what it was for
architectures written before GPTConfig grew fields, and changes with every field that is set."""

import pytest

from troupe.config import ConfigError
from troupe.models.gpt import GPTConfig
from troupe.models.record import ModelRecord, architecture_hash

LLAMA = dict(positions="rope", norm="rmsnorm", mlp="swiglu", n_kv_head=2)


def test_a_record_written_before_the_later_fields_still_reads():
    """The hash troupe wrote for this architecture before head_dim, the sliding window and
    qk_norm existed (at 41e836d): a checkpoint of that time is read, not refused as edited."""
    old = "49cd77e9b391decd4570e7d8716b44d367a6d5f22d81e12684d89b5e2122de08"
    assert architecture_hash(GPTConfig(**LLAMA)) == old
    record = ModelRecord.read({"architecture": LLAMA, "sha256": old}, "step-00000100")
    assert record.architecture == GPTConfig(**LLAMA)


@pytest.mark.parametrize("field", [dict(head_dim=64), dict(sliding_window=64),
                                   dict(sliding_window=64, sliding_layers=[1]),
                                   dict(qk_norm=True)])
def test_a_later_field_that_is_set_counts(field):
    arch = GPTConfig(**LLAMA, **field)
    assert architecture_hash(arch) != architecture_hash(GPTConfig(**LLAMA))
    with pytest.raises(ConfigError, match="does not match its sha256"):  # dropped by hand
        ModelRecord.read({"architecture": LLAMA, "sha256": architecture_hash(arch)}, "x")
