"""Layer reduction: the student computes exactly the teacher's chosen blocks, in order, dense
and MoE, and bad lists are refused naming the field."""

import pytest
import torch

from troupe.compression.student import reduce_layers
from troupe.models import GPT, GPTConfig


def through(teacher: GPT, keep: list[int], idx: torch.Tensor) -> torch.Tensor:
    """The teacher's logits with only blocks ``keep`` run, in that order (by hand)."""
    T = idx.shape[1]
    pos = torch.arange(T)
    x = teacher.embed(idx, pos)
    for i in keep:
        x, _ = teacher.blocks[i](x, None, None, 0, pos)
    return teacher.logits(teacher.ln_f(x))


@pytest.mark.parametrize("extra", [
    {},  # troupe's GPT: learned positions, LayerNorm, GELU
    {"positions": "rope", "norm": "rmsnorm", "mlp": "swiglu", "n_kv_head": 1,
     "tie_embeddings": False},  # the Llama family
    {"moe": {"num_experts": [2, 4], "expert_interval": 2, "top_k": 1}},  # MoE every 2nd block
])
def test_student_runs_the_kept_blocks_of_the_teacher(extra):
    teacher = GPT(GPTConfig(seq_len=16, n_layer=4, n_head=2, d_model=16, vocab_size=64, **extra),
                  seed=3).eval()
    idx = torch.randint(0, 64, (2, 10), generator=torch.Generator().manual_seed(0))
    for keep in ([0, 2], [3, 1], [1, 3], [2]):
        student = reduce_layers(teacher, keep).eval()
        assert student.cfg.n_layer == len(keep)
        with torch.no_grad():
            torch.testing.assert_close(student(idx)[0], through(teacher, keep, idx),
                                       rtol=0, atol=0)
    assert teacher.cfg.n_layer == 4 and len(teacher.blocks) == 4  # untouched


def test_bad_layer_lists_are_refused():
    teacher = GPT(GPTConfig(seq_len=16, n_layer=4, n_head=2, d_model=16, vocab_size=64))
    for keep in ([], [0, 0], [4], [-1]):
        with pytest.raises(ValueError, match="keep_layers"):
            reduce_layers(teacher, keep)
