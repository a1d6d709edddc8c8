"""XTC's distillation loss: the KL at a temperature, exactly, and its gradient."""

import torch
import torch.nn.functional as F

from troupe.compression.distill import kd_loss


def test_kd_loss_is_the_kl_at_a_temperature():
    g = torch.Generator().manual_seed(0)
    s, t = torch.randn(2, 3, 11, generator=g), torch.randn(2, 3, 11, generator=g)
    for T in (1.0, 2.0):
        s1, s2 = s.clone().requires_grad_(), s.clone().requires_grad_()
        p = F.softmax(t / T, -1)
        want = (p * (p.log() - F.log_softmax(s1 / T, -1))).sum(-1).mean() * T * T
        got = kd_loss(s2, t, T)
        torch.testing.assert_close(got, want)
        want.backward(), got.backward()
        torch.testing.assert_close(s2.grad, s1.grad)  # the teacher's entropy: a constant
    assert kd_loss(t, t, 2.0).abs() < 1e-6
