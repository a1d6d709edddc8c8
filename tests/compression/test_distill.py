"""XTC's distillation loss: the KL at a temperature, exactly."""

import torch
import torch.nn.functional as F

from troupe.compression.distill import kd_loss


def test_kd_loss_is_the_kl_at_a_temperature():
    g = torch.Generator().manual_seed(0)
    s, t = torch.randn(2, 3, 11, generator=g), torch.randn(2, 3, 11, generator=g)
    for T in (1.0, 2.0):
        p = F.softmax(t / T, -1)
        want = (p * (p.log() - F.log_softmax(s / T, -1))).sum(-1).mean() * T * T
        torch.testing.assert_close(kd_loss(s, t, T), want)
    assert kd_loss(t, t, 2.0).abs() < 1e-6
