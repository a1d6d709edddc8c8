"""grouped_mlp against the per-expert autograd loop it replaced: the same forward and gradients,
gradients added into an existing .grad in place only where backward() would add them anyway."""

import pytest
import torch
import torch.nn.functional as F

from troupe.kernels.grouped_mlp import grouped_mlp

M, H = 12, 20


def loop_mlp(x_AM, counts, w1, b1, w2, b2):
    """The former Experts.forward: index each stacked weight per expert under autograd."""
    outs = []
    for e, x in enumerate(x_AM.split(counts)):
        h = F.gelu(torch.addmm(b1[e], x, w1[e]))
        outs.append(torch.addmm(b2[e], h, w2[e]))
    return torch.cat(outs)


def make(counts, device="cpu", seed=0):
    g = torch.Generator().manual_seed(seed)
    E, A = len(counts), sum(counts)
    x = torch.randn(A, M, generator=g)
    ws = [torch.randn(E, M, H, generator=g) * 0.3, torch.randn(E, H, generator=g),
          torch.randn(E, H, M, generator=g) * 0.3, torch.randn(E, M, generator=g)]
    return [t.to(device).requires_grad_() for t in [x] + ws], torch.randn(A, M, generator=g).to(device)


def run(fn, counts, device="cpu"):
    tensors, target = make(counts, device)
    y = fn(tensors[0], counts, *tensors[1:])
    (y * target).sum().backward()
    return y.detach(), [t.grad for t in tensors]


@pytest.mark.parametrize("counts", [[5, 0, 7, 1], [3], [0, 0, 4], [9, 2, 0, 0, 6, 1, 3, 3]])
def test_equals_the_per_expert_loop(counts):
    y, grads = run(grouped_mlp, counts)
    y_ref, grads_ref = run(loop_mlp, counts)
    torch.testing.assert_close(y, y_ref, atol=1e-6, rtol=0)
    for g, g_ref in zip(grads, grads_ref):
        torch.testing.assert_close(g, g_ref, atol=1e-6, rtol=0)
    for e, n in enumerate(counts):
        if n == 0:  # an expert without rows gets an exact zero gradient
            assert all((g[e] == 0).all() for g in grads[1:])


def test_adds_into_an_existing_grad_in_place():
    counts = [4, 0, 6]
    (x, *ws), target = make(counts)
    before = [torch.randn_like(w) for w in ws]
    for w, b in zip(ws, before):
        w.grad = b.clone()
    buffers = [w.grad for w in ws]
    (grouped_mlp(x, counts, *ws) * target).sum().backward()
    _, grads_ref = run(loop_mlp, counts)
    for w, buf, b, g_ref in zip(ws, buffers, before, grads_ref[1:]):
        assert w.grad is buf, "the existing gradient is added to, not replaced"
        torch.testing.assert_close(w.grad, b + g_ref, atol=1e-5, rtol=0)


def test_autograd_grad_and_partial_backward_leave_dot_grad_alone():
    counts = [3, 5]
    (x, *ws), target = make(counts)
    for w in ws:
        w.grad = torch.full_like(w, 7.0)
    grads = torch.autograd.grad((grouped_mlp(x, counts, *ws) * target).sum(), ws)
    _, grads_ref = run(loop_mlp, counts)
    for g, g_ref in zip(grads, grads_ref[1:]):
        torch.testing.assert_close(g, g_ref, atol=1e-6, rtol=0)
    (grouped_mlp(x, counts, *ws) * target).sum().backward(inputs=[x])
    torch.testing.assert_close(x.grad, grads_ref[0], atol=1e-6, rtol=0)
    assert all((w.grad == 7.0).all() for w in ws)


def test_frozen_and_non_leaf_weights():
    counts = [2, 3]
    (x, w1, b1, w2, b2), target = make(counts)
    w1.requires_grad_(False)
    scale = torch.tensor(2.0, requires_grad=True)
    (grouped_mlp(x, counts, w1, b1, w2 * scale, b2) * target).sum().backward()
    (x2, w1r, b1r, w2r, b2r), _ = make(counts)
    w1r.requires_grad_(False)
    scale_r = torch.tensor(2.0, requires_grad=True)
    (loop_mlp(x2, counts, w1r, b1r, w2r * scale_r, b2r) * target).sum().backward()
    assert w1.grad is None
    torch.testing.assert_close(scale.grad, scale_r.grad, atol=1e-5, rtol=1e-6)
    torch.testing.assert_close(b1.grad, b1r.grad, atol=1e-6, rtol=0)


def test_counts_must_fit():
    (x, *ws), _ = make([2, 2])
    with pytest.raises(ValueError, match="do not fit"):
        grouped_mlp(x, [2, 1], *ws)


@pytest.mark.gpu
def test_cuda_equals_cpu():
    counts = [5, 0, 7, 1]
    y, grads = run(grouped_mlp, counts)
    y_gpu, grads_gpu = run(grouped_mlp, counts, "cuda")
    torch.testing.assert_close(y_gpu.cpu(), y, atol=1e-4, rtol=1e-4)
    for g, g_gpu in zip(grads, grads_gpu):
        torch.testing.assert_close(g_gpu.cpu(), g, atol=1e-4, rtol=1e-4)


def test_a_second_backward_is_refused():
    (x, *ws), target = make([3, 4])
    loss = (grouped_mlp(x, [3, 4], *ws) * target).sum()
    loss.backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="retain_graph"):
        loss.backward()


def loop_swiglu(x_AM, counts, w1, w2):
    """Mixtral's experts, one at a time under autograd: silu(x @ gate) * (x @ up) @ down."""
    outs = []
    for e, x in enumerate(x_AM.split(counts)):
        gate, up = (x @ w1[e]).chunk(2, dim=-1)
        outs.append((F.silu(gate) * up) @ w2[e])
    return torch.cat(outs)


@pytest.mark.parametrize("counts", [[5, 0, 7, 1], [0, 0, 4]])
def test_swiglu_without_biases_equals_the_per_expert_loop(counts):
    g = torch.Generator().manual_seed(2)
    E, A = len(counts), sum(counts)
    x = torch.randn(A, M, generator=g)
    w1, w2 = torch.randn(E, M, 2 * H, generator=g) * 0.3, torch.randn(E, H, M, generator=g) * 0.3
    target = torch.randn(A, M, generator=g)
    results = []
    for fn in (lambda x, a, b: grouped_mlp(x, counts, a, None, b, None, swiglu=True),
               lambda x, a, b: loop_swiglu(x, counts, a, b)):
        ts = [t.clone().requires_grad_() for t in (x, w1, w2)]
        y = fn(*ts)
        (y * target).sum().backward()
        results.append((y.detach(), [t.grad for t in ts]))
    (y, grads), (y_ref, grads_ref) = results
    torch.testing.assert_close(y, y_ref, atol=1e-5, rtol=1e-5)
    for got, want in zip(grads, grads_ref):
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
