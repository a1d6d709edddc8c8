"""Ternary and binary weights: hand-computed rows, the least-squares scale, and gradients
that pass straight through."""

import torch

from troupe.compression.lowbit import binarize, dequantize, fake_lowbit, ternarize


def test_ternary_row_by_hand():
    # mean |w| = (0.9 + 0.1 + 0.5 + 0.25 + 1.25) / 5 = 0.6; w / 0.6 rounds to 1, 0, -1, 0, 1
    w = torch.tensor([[0.9, 0.1, -0.5, 0.25, 1.25]])
    t, s = ternarize(w)
    assert t.tolist() == [[1, 0, -1, 0, 1]]
    # least-squares scale for that pattern: mean of the kept magnitudes (0.9 + 0.5 + 1.2) / 3
    torch.testing.assert_close(s, torch.tensor([2.65 / 3]))
    t_twn, _ = ternarize(w, method="twn")  # threshold 0.7 * 0.6 = 0.42
    assert t_twn.tolist() == [[1, 0, -1, 0, 1]]


def test_the_scale_minimises_the_error_for_its_pattern():
    w = torch.randn(16, 64, generator=torch.Generator().manual_seed(0))
    for q, s in (ternarize(w), binarize(w)):
        err = (w - dequantize(q, s)).pow(2).sum(1)
        for f in (0.9, 1.1):
            assert torch.all(err <= (w - dequantize(q, s * f)).pow(2).sum(1) + 1e-6)


def test_binary_row_by_hand_and_zero_is_positive():
    w = torch.tensor([[0.5, -1.5, 0.0, 2.0]])
    q, s = binarize(w)
    assert q.tolist() == [[1, -1, 1, 1]]
    torch.testing.assert_close(s, torch.tensor([1.0]))


def test_fake_quantization_passes_gradients_straight_through():
    w = torch.randn(4, 8, generator=torch.Generator().manual_seed(1), requires_grad=True)
    for kind in ("ternary", "binary"):
        w.grad = None
        q = fake_lowbit(w, kind)
        want = dequantize(*(ternarize(w) if kind == "ternary" else binarize(w)))
        torch.testing.assert_close(q.detach(), want, rtol=0, atol=1e-6)
        (q * torch.arange(32.0).view(4, 8)).sum().backward()
        assert torch.equal(w.grad, torch.arange(32.0).view(4, 8))


def test_a_lowbit_layer_is_its_packed_weights_product():
    """QuantizedLinear in ternary / binary mode: the packed product of its quantized weight,
    exactly; and close to the layer it came from only as far as the rounding goes."""
    from troupe.compression import QuantizedLinear
    from troupe.kernels.lowbit import lowbit_linear_reference, pack

    torch.manual_seed(0)
    lin = torch.nn.Linear(203, 37)
    x = torch.randn(11, 203)
    for kind, quantize in (("ternary", ternarize), ("binary", binarize)):
        layer = QuantizedLinear(lin, kind)
        q, s = quantize(lin.weight)
        want = lowbit_linear_reference(x, pack(q, kind), s, kind, lin.bias.detach())
        assert torch.equal(layer(x), want)
        assert layer.qw.rows().shape == (37, -(-203 // (5 if kind == "ternary" else 8)))
        assert torch.equal(layer.dequantized_weight(), dequantize(q, s))
        assert layer.qw.rows().numel() + 4 * 37 < 37 * 203 // 4  # < 2 bits a weight, scales too
