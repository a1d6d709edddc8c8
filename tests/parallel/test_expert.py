"""apply_expert_parallel keeps one rank's contiguous slice of every MoE layer's experts."""

from dataclasses import dataclass

import pytest
import torch

from troupe.models import GPT, GPTConfig
from troupe.models.moe import MoE
from troupe.parallel import apply_expert_parallel

CFG = GPTConfig(seq_len=16, n_layer=2, n_head=2, d_model=16,
                moe=dict(num_experts=[2, 4], expert_interval=1))


@dataclass
class Group:  # what apply_expert_parallel reads of a Communicator
    rank: int
    world_size: int


def test_each_rank_keeps_its_slice_and_the_dense_weights():
    whole = GPT(CFG, seed=1)
    for rank in range(2):
        part = apply_expert_parallel(GPT(CFG, seed=1), Group(rank, 2))
        mine = [m for m in part.modules() if isinstance(m, MoE)]
        theirs = [m for m in whole.modules() if isinstance(m, MoE)]
        assert len(mine) == len(theirs) == 2
        for a, b in zip(mine, theirs):
            n = b.num_experts // 2
            assert a.num_local == n and a.experts.first == rank * n and a.group is not None
            assert torch.equal(a.experts.w1, b.experts.w1[rank * n:(rank + 1) * n])
            assert all(p.expert for p in a.experts.parameters())
        dense = {k: v for k, v in part.state_dict().items() if ".experts." not in k}
        assert all(torch.equal(v, whole.state_dict()[k]) for k, v in dense.items())


def test_wrong_splits_are_refused():
    with pytest.raises(ValueError, match="2 experts do not split over expert-parallel size 4"):
        apply_expert_parallel(GPT(CFG), Group(0, 4))
    model = apply_expert_parallel(GPT(CFG), Group(0, 2))
    with pytest.raises(ValueError, match="already expert-parallel"):
        apply_expert_parallel(model, Group(0, 2))
    assert apply_expert_parallel(GPT(CFG), None) is not None


class MixtralRank:
    """One expert-parallel rank of a Mixtral checkpoint loaded into troupe's decoder."""

    def logits(self, path: str, ids: torch.Tensor) -> torch.Tensor:
        from troupe import collectives
        from troupe.models import from_pretrained
        model = apply_expert_parallel(from_pretrained(path), collectives.get_group("ep"))
        assert all(m.num_local == m.num_experts // 2 for m in model.modules()
                   if isinstance(m, MoE))
        with torch.no_grad():
            return model(ids)[0]


def test_mixtral_over_two_expert_parallel_actors_gives_transformers_logits(cluster, tmp_path):
    """A Mixtral checkpoint split over 2 actors (2 of its 4 experts each, tokens exchanged
    over gloo) gives transformers' single-process fp32 logits on each rank's own batch."""
    transformers = pytest.importorskip("transformers")
    from tests.models.test_hf import MIXTRAL
    from troupe.runtime import ActorGraph
    from troupe.actors import PerRank
    torch.manual_seed(0)
    reference = transformers.MixtralForCausalLM(MIXTRAL()).eval()
    reference.save_pretrained(tmp_path / "mixtral")
    g = torch.Generator().manual_seed(5)
    batches = [torch.randint(0, 97, (2, 13), generator=g) for _ in range(2)]
    graph = (ActorGraph("mixtral-ep").role("w", MixtralRank, 2, num_cpus=0.5)
             .collective("ep", ["w"], "gloo").build(timeout_s=120))
    try:
        got = graph["w"].invoke(MixtralRank.logits, str(tmp_path / "mixtral"), PerRank(batches))
    finally:
        graph.shutdown()
    with torch.no_grad():
        for ids, logits in zip(batches, got):
            torch.testing.assert_close(logits, reference(input_ids=ids).logits, atol=1e-4,
                                       rtol=0)


class DispatchRank:
    """One expert-parallel rank of a small MoE GPT: the loss and gradients of its batch, and
    the bytes its token exchanges sent, with the tokens carried as ``dispatch`` says."""

    def run(self, dispatch: str, ids: torch.Tensor) -> dict:
        from troupe import collectives
        cfg = GPTConfig(seq_len=16, n_layer=2, n_head=2, d_model=64,
                        moe=dict(num_experts=4, expert_interval=1, top_k=2, dispatch=dispatch))
        model = apply_expert_parallel(GPT(cfg, seed=3), collectives.get_group("ep"))
        logits, _, aux = model(ids)
        (logits.square().mean() + aux).backward()
        dense = {n: p.grad for n, p in model.named_parameters() if ".experts." not in n}
        return {"logits": logits.detach(), "grads": dense,
                "bytes": sum(m.meter.bytes for m in model.modules() if isinstance(m, MoE))}


def test_int8_and_int9_dispatch_send_their_bytes_within_their_rounding(cluster):
    """moe.dispatch=int8 and int9 over two expert-parallel actors: each token row (and its
    gradient going back) as 8- or 9-bit integers with a scale per row. Against the model's
    own dtype on the same batches: 68 and 76 of 256 bytes per 64-wide row (at most 0.3x),
    logits and gradients within a few steps of the rounding, int9's closer than int8's."""
    from troupe.actors import PerRank
    from troupe.runtime import ActorGraph
    g = torch.Generator().manual_seed(5)
    batches = [torch.randint(0, 97, (4, 16), generator=g) for _ in range(2)]
    graph = (ActorGraph("dispatch").role("w", DispatchRank, 2, num_cpus=0.5)
             .collective("ep", ["w"], "gloo").build(timeout_s=120))
    try:
        runs = {d: graph["w"].invoke(DispatchRank.run, d, PerRank(batches))
                for d in ("model", "int8", "int9")}
    finally:
        graph.shutdown()
    errors = {}
    for dispatch, row in (("int8", 68), ("int9", 76)):
        for a, b in zip(runs["model"], runs[dispatch]):
            assert 0 < b["bytes"] <= 0.3 * a["bytes"]
            assert b["bytes"] == a["bytes"] * row // 256  # M (+ M/8) + 4 bytes a row, not 4M
            err = (a["logits"] - b["logits"]).abs().max() / a["logits"].abs().max()
            assert 1e-6 < err < 2e-2, (dispatch, err)  # changed, by the rounding alone
            errors.setdefault(dispatch, []).append(err)
            for name, grad in a["grads"].items():
                torch.testing.assert_close(b["grads"][name], grad, rtol=0.05,
                                           atol=0.05 * grad.abs().max().item())
    assert all(e9 < e8 for e8, e9 in zip(errors["int8"], errors["int9"])), errors


@pytest.mark.parametrize("bits, row", [(8, 68), (9, 76)])
def test_rows_round_trip_within_half_a_step_and_carry_no_rows(bits, row):
    from troupe.collectives.autograd import pack_rows, row_bytes, unpack_rows
    x = torch.randn(5, 64) * torch.tensor([1e-3, 1.0, 30.0, 0.0, 5.0])[:, None]
    packed = pack_rows(x, bits)
    assert packed.shape == (5, row) == (5, row_bytes(64, bits)) and packed.dtype == torch.uint8
    back = unpack_rows(packed, 64, bits)
    n = 2 ** (bits - 1) - 1  # steps each side of zero
    step = x.abs().amax(1, keepdim=True) / n
    assert torch.all((back - x).abs() <= step / 2 + 1e-12) and torch.equal(back[3], x[3])
    assert unpack_rows(pack_rows(torch.empty(0, 64), bits), 64, bits).shape == (0, 64)
    odd = torch.tensor([[1.0, -2.0, n]])  # a row of 7 or 8 bytes: the scale unaligned
    assert torch.equal(unpack_rows(pack_rows(odd, bits), 3, bits), odd)


def test_nine_bit_rows_take_every_value_of_their_range():
    """Every one of the 511 steps from -255 to 255 survives the 9th bit's packing (the
    values 256 apart share their low byte), and 8 or 9 are the only widths."""
    from troupe.collectives.autograd import pack_rows, unpack_rows
    steps = torch.arange(-255, 256, dtype=torch.float32)
    x = torch.stack([steps, steps.flip(0)])  # 511 wide: the last byte of bits half full
    assert torch.equal(unpack_rows(pack_rows(x, 9), 511, 9), x)
    with pytest.raises(ValueError, match="8 or 9 bits, not 7"):
        pack_rows(x, 7)


@pytest.mark.parametrize("bits, row", [(8, 68), (9, 76)])
def test_int_all_to_all_keeps_a_ranks_rows_to_itself_exact_and_meters_the_others(bits, row):
    from troupe.collectives.autograd import Meter, all_to_all
    from troupe.collectives.threads import run_ranks

    def rank(group):
        r = group.rank
        x = torch.randn(3, 64, generator=torch.Generator().manual_seed(r)) * (1 + r)
        meter = Meter()
        out = all_to_all(x, group, [1, 2] if r == 0 else [2, 1], [1, 2] if r == 0 else [2, 1],
                         bits=bits, meter=meter)
        return x, out, meter.bytes

    (x0, out0, bytes0), (x1, out1, bytes1) = run_ranks(2, rank)
    assert torch.equal(out0[:1], x0[:1]) and torch.equal(out1[2:], x1[2:])  # own rows exact
    assert not torch.equal(out0[1:], x1[:2]) and torch.allclose(out0[1:], x1[:2], atol=0.05)
    assert (bytes0, bytes1) == (2 * row, 2 * row)  # rows to the other rank, values + scale
