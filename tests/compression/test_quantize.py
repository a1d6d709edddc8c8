"""Quantized Linear layers and model quantization by name patterns."""

import copy

import pytest
import torch
import torch.nn.functional as F

from troupe.compression import QuantizedLinear, quantize_model
from troupe.compression.quantize import QuantizedExperts
from troupe.models import GPT, GPTConfig
from troupe.models.moe.experts import Experts
from troupe.serving.model import weight_bytes


@pytest.mark.parametrize("mode,tol", [("w8a8", 0.02), ("w8a16", 0.01), ("w4a16", 0.15)])
def test_quantized_linear_close_to_fp32(mode, tol):
    torch.manual_seed(0)
    lin = torch.nn.Linear(128, 64)
    q = QuantizedLinear(lin, mode)
    x = torch.randn(3, 10, 128)
    want = lin(x)
    rel = ((q(x) - want).norm() / want.norm()).item()
    assert rel < tol
    assert q.weight_nbytes < lin.weight.numel() * 4 * (0.3 if "8" in mode else 0.17)


def test_lorc_compensates_the_weight_error():
    """Rank r removes the r largest singular values of the weight error; full rank restores
    the fp32 weight exactly (weight-only modes)."""
    torch.manual_seed(0)
    lin = torch.nn.Linear(96, 64)
    x = torch.randn(20, 96)
    want = lin(x)
    errors = []
    for r in (0, 4, 16):
        q = QuantizedLinear(lin, "w4a16", group_size=32, lorc_rank=r)
        errors.append(((q(x) - want).norm() / want.norm()).item())
        E = lin.weight - q.dequantized_weight()
        s = torch.linalg.svdvals(E)
        if r:
            left = E - q.lorc_up @ q.lorc_down
            assert torch.allclose(torch.linalg.matrix_norm(left), s[r:].norm(), rtol=1e-4)
            assert q.weight_nbytes == q.qw.nbytes + 4 * r * (96 + 64)
    assert errors[0] > errors[1] > errors[2]
    full = QuantizedLinear(lin, "w4a16", group_size=32, lorc_rank=64)
    # the weight is whole again; what is left is the 16-bit tokens' rounding (half an INT16
    # step of max|x_t| times sum |w| at most)
    step = x.abs().amax(1, keepdim=True) / 32767
    bound = 0.5 * step * lin.weight.abs().sum(1)[None, :] + 1e-5
    assert ((full(x) - want).abs() <= bound).all()
    with pytest.raises(ValueError, match="lorc_rank must be in 0..64"):
        QuantizedLinear(lin, "w8a8", lorc_rank=65)


def test_to_moves_the_integer_weights_and_lorc_factors():
    lin = torch.nn.Linear(32, 16)
    q = QuantizedLinear(lin, "w4a16", group_size=16, lorc_rank=2)
    q.to(torch.device("meta"))
    assert q.qw.q.is_meta and q.qw.scales.is_meta and q.bias.is_meta
    assert q.lorc_down.is_meta and q.lorc_up.is_meta and q.qw.q.dtype == torch.uint8


def test_w8a8_moves_off_the_cpu_in_rows_and_packs_again_on_it():
    """A W8A8 weight is packed for the CPU kernel only while on the CPU (when it runs here):
    moved elsewhere it travels as (O, I) rows, and a move back packs it again."""
    from troupe.kernels.quant import vnni_available

    lin = torch.nn.Linear(64, 40)
    q = QuantizedLinear(lin, "w8a8")
    x = torch.randn(5, 64)
    y = q(x)
    assert q.qw.layout == ("vnni" if vnni_available() else "rows")
    q.to(torch.float64)  # a cast goes through the same path and keeps the integers
    assert torch.equal(q(x), y)
    q.to(torch.device("meta"))
    assert q.qw.layout == "rows" and q.qw.q.shape == (40, 64) and q.qw.q.is_meta


def test_quantize_model_by_patterns():
    torch.manual_seed(0)
    model = GPT(GPTConfig(seq_len=16, n_layer=2, n_head=2, d_model=32)).eval()
    x = torch.randint(0, 257, (2, 16))
    ref = model(x)[0]
    done = quantize_model(model, {"*.attn.*": "w8a8", "*.ffn.*": "w4a16"})
    assert set(done.values()) == {"w8a8", "w4a16"} and len(done) == 8
    assert all(isinstance(model.get_submodule(n), QuantizedLinear) for n in done)
    out = model(x)[0]
    assert ((out - ref).norm() / ref.norm()).item() < 0.1
    with pytest.raises(ValueError, match="mode must be one of"):
        quantize_model(model, {"*": "int3"})


@pytest.mark.parametrize("mode", ["w8a8", "w8a16", "w4a16"])
def test_moe_experts_are_quantized_expert_by_expert(mode):
    torch.manual_seed(0)
    moe = dict(num_experts=4, expert_interval=1, top_k=2, capacity_factor=1.0)
    model = GPT(GPTConfig(seq_len=16, n_layer=2, n_head=2, d_model=32, moe=moe), seed=3).eval()
    x = torch.randint(0, 257, (2, 16))
    ref = model(x)[0]
    experts = {n: m for n, m in model.named_modules() if isinstance(m, Experts)}
    originals = {n: copy.deepcopy(m) for n, m in experts.items()}
    done = quantize_model(model, {"*": mode}, group_size=16)
    assert not [n for n in done if ".gate" in n]  # gates stay fp32
    assert set(experts) <= set(done) and len(experts) == 2
    for name, fp32 in originals.items():
        q = model.get_submodule(name)
        assert isinstance(q, QuantizedExperts) and q.num_local == 4
        # expert e is its two projections with integer weights, in the experts' own order
        rows, counts = torch.randn(9, 32), [3, 0, 4, 2]
        want = []
        for e, xe in enumerate(rows.split(counts)):
            up, down = q.up[e], q.down[e]
            assert torch.equal(up.bias, fp32.b1[e]) and torch.equal(down.bias, fp32.b2[e])
            want.append(down(F.gelu(up(xe))))
        assert torch.equal(q(rows, counts), torch.cat(want))
        w_err = (q.up[1].dequantized_weight() - fp32.w1[1].t()).norm() / fp32.w1[1].norm()
        assert w_err < (0.1 if mode == "w4a16" else 0.01)
        # 1 byte (INT8) or half a byte (INT4) per weight, an fp32 scale per group of 16, and
        # the fp32 biases: 0.32x and 0.20x
        ratio = weight_bytes(q) / weight_bytes(fp32)
        assert ratio < (0.21 if mode == "w4a16" else 0.33), ratio
    out = model(x)[0]  # (a few tokens may change experts: routing and capacity see the error)
    assert ((out - ref).norm() / ref.norm()).item() < 0.1


def test_lkd_reduces_the_w4_gap():
    """On a briefly trained GPT, LKD brings each block of a W4/8 copy closer to the
    full-precision block, and the whole model's logits closer than plain quantization."""
    from troupe.compression import layerwise_distill, random_batches
    from troupe.data import DataConfig, TokenDataset

    torch.manual_seed(0)
    cfg = GPTConfig(seq_len=32, n_layer=2, n_head=2, d_model=64)
    model = GPT(cfg)
    data = TokenDataset(DataConfig(max_chars=100_000))
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    for step in range(60):
        x, y = data.train_batch(step, 16, 32)
        loss = model(x, y)[1]
        opt.zero_grad()
        loss.backward()
        opt.step()
    model.eval()
    rules = {"*.attn.*": "w8a8", "*.ffn.*": "w4a16"}
    batches = [data.train_batch(1000 + i, 16, 32)[0] for i in range(8)]
    student, report = layerwise_distill(model, rules, batches, group_size=64)
    assert all(after < before for before, after in report), report
    import copy
    plain = copy.deepcopy(model)
    quantize_model(plain, rules, group_size=64)
    x = next(data.val_batches(1, 16, 32))[0]  # held out: LKD never saw it
    with torch.no_grad():
        ref, p, s = model(x)[0], plain(x)[0], student(x)[0]
    assert ((s - ref) ** 2).mean() < 0.5 * ((p - ref) ** 2).mean()  # at least half the gap
    assert all(not isinstance(m, torch.nn.Linear) or m is student.tok_emb
               for n, m in student.named_modules() if ".attn." in n or ".ffn." in n)
    assert random_batches(257, 2, 4, 8)[0].shape == (4, 8)


def test_outlier_channels_stay_fp32_and_save_the_other_channels():
    """A channel 300x the others sets every token's INT8 scale; kept in fp32 (found by
    calibration), the rest quantize finely and the layer's error falls by far."""
    from troupe.compression.quantize import outlier_channels
    torch.manual_seed(0)
    lin = torch.nn.Linear(64, 32)
    x = torch.randn(40, 64)
    x[:, 5] *= 300
    model = torch.nn.Sequential(lin)
    found = outlier_channels(model, [x], 1)
    assert found["0"].tolist() == [5]
    with torch.no_grad():
        want = lin(x)
        plain = QuantizedLinear(lin, "w8a8")(x)
        kept = QuantizedLinear(lin, "w8a8", outliers=found["0"])(x)
    err = lambda y: (y - want).abs().max().item()  # noqa: E731
    assert err(kept) < err(plain) / 20
    assert QuantizedLinear(lin, "w8a8", outliers=found["0"]).weight_nbytes > \
        QuantizedLinear(lin, "w8a8").weight_nbytes


@pytest.mark.slow
def test_smollm2_w8a8_perplexity_within_one_percent(smollm2):
    """ZeroQuant W8A8 on a real model, held-out real text: per-output-channel INT8 weights,
    token-wise INT8 activations, 16 calibrated outlier channels per layer in fp32 (as served)."""
    import math
    from troupe.compression.quantize import outlier_channels
    from troupe.data import DataConfig, TokenDataset, load_tokenizer
    from troupe.models import from_pretrained
    model = from_pretrained(smollm2)
    data = TokenDataset(DataConfig(), load_tokenizer(smollm2))

    def perplexity(m):
        with torch.no_grad():
            # 4096 held-out tokens: the ratio is 0.66% on them, 0.65% on twice as many
            losses = [m(x, y)[1].item() for x, y in data.val_batches(2, 8, 256)]
        return math.exp(sum(losses) / len(losses))

    base = perplexity(model)
    calibration = [data.train_batch(10_000 + i, 4, 256)[0] for i in range(2)]
    quantize_model(model, {"*": "w8a8"}, outliers=outlier_channels(model, calibration, 16))
    assert perplexity(model) / base - 1 < 0.01


def test_requantize_equals_a_fresh_quantized_copy_after_an_update():
    """RLHF's INT8 rollouts re-quantize their copy in place after each policy update: the
    result is exactly a fresh copy quantized from the updated weights, and a model that does
    not match is refused by name."""
    import copy

    from troupe.compression import requantize
    from troupe.models import GPT, GPTConfig

    model = GPT(GPTConfig(seq_len=16, n_layer=2, n_head=2, d_model=32), seed=0).eval()
    engine = copy.deepcopy(model)
    quantize_model(engine, {"*": "w8a8"})
    with torch.no_grad():  # an "update": every weight moves
        for p in model.parameters():
            p.add_(0.05 * torch.randn_like(p))
    requantize(engine, model)
    fresh = copy.deepcopy(model)
    quantize_model(fresh, {"*": "w8a8"})
    ids = torch.randint(0, 256, (3, 12))
    with torch.no_grad():
        assert torch.equal(engine(ids)[0], fresh(ids)[0])
    other = GPT(GPTConfig(seq_len=16, n_layer=2, n_head=2, d_model=64), seed=0)
    with pytest.raises(ValueError, match="blocks.0"):
        requantize(engine, other)


def test_a_tied_output_projection_is_quantized_only_when_named():
    """A tied model's output projection is the embedding matrix: the rule "lm_head" makes it a
    separate W8A16 lm_head (the embedding stays fp32 for the lookups), "*" leaves it alone; the
    decode engine then uses the quantized head instead of packing the fp32 embedding, and
    requantize follows the source's embedding."""
    from troupe.compression import requantize
    from troupe.compression.quantize import unmatched_patterns
    from troupe.generation import ContinuousBatcher, SamplingParams

    model = GPT(GPTConfig(seq_len=32, n_layer=2, n_head=2, d_model=32), seed=0).eval()
    ids = torch.randint(0, 256, (2, 12))
    with torch.no_grad():
        ref = model(ids)[0]
    everything = copy.deepcopy(model)
    assert "lm_head" not in quantize_model(everything, {"*": "w8a8"})
    assert getattr(everything, "lm_head", None) is None
    assert unmatched_patterns(model, {"lm_head": "w8a16"}) == []
    head = copy.deepcopy(model)
    assert quantize_model(head, {"lm_head": "w8a16"}) == {"lm_head": "w8a16"}
    assert isinstance(head.lm_head, QuantizedLinear) and head.tok_emb.weight.dtype == torch.float32
    with torch.no_grad():
        out = head(ids)[0]
    assert not torch.equal(out, ref) and ((out - ref).norm() / ref.norm()).item() < 0.01
    engine = ContinuousBatcher(head, eos_id=None, max_batch=2)
    assert engine.packed.logits_weight is None  # the quantized head, not the fp32 embedding
    engine.add("a", ids[0].tolist(), SamplingParams(max_tokens=3))
    want = int(out[0, -1].argmax())
    assert engine.run()["a"][0] == want
    with torch.no_grad():
        model.tok_emb.weight.mul_(1.5)
    requantize(head, model)
    fresh = copy.deepcopy(model)
    quantize_model(fresh, {"lm_head": "w8a16"})
    with torch.no_grad():
        assert torch.equal(head(ids)[0], fresh(ids)[0])


@pytest.mark.parametrize("embedding", ["int8", "int4"])
def test_a_quantized_embedding_looks_up_its_dequantized_rows(embedding):
    """A lookup is the dequantized matrix's row, exactly; the scales are fp16 values (stored
    as fp16 at no loss); a tied head multiplies by the same integers and scales."""
    from troupe.compression.quantize import QuantizedEmbedding
    from troupe.kernels.quant import dequantize_weight, row_layout

    model = GPT(GPTConfig(vocab_size=300, d_model=64, n_layer=1, n_head=4, seq_len=32,
                          tie_embeddings=True), seed=0).eval()
    emb = model.tok_emb.weight.detach().clone()
    modes = quantize_model(model, {}, group_size=32, embedding=embedding)
    assert modes == {"lm_head": "w8a16" if embedding == "int8" else "w4a16",
                     "tok_emb": embedding}
    q = model.tok_emb
    assert isinstance(q, QuantizedEmbedding)
    ids = torch.tensor([[0, 5, 299], [7, 7, 1]])
    table = dequantize_weight(q.qw)
    assert torch.equal(q(ids), table[ids])
    assert torch.equal(q.qw.scales.half().float(), q.qw.scales)
    assert (table - emb).abs().max() <= q.qw.scales.max() / 2 + 1e-6  # half a step at most
    head = row_layout(model.lm_head.qw)
    assert torch.equal(head.q, q.qw.q) and torch.equal(head.scales, q.qw.scales)
    with pytest.raises(ValueError, match="lm_head"):
        quantize_model(GPT(model.cfg, seed=0), {"lm_head": "fp32"}, embedding=embedding)
