"""precision=bf16: the forward and backward under bf16 autocast (the MoE experts too),
the fp32 master weights and optimizer state untouched."""

import pytest
import torch

from troupe.pretrain.config import PretrainConfig
from troupe.pretrain.rank import Trainer


@pytest.mark.parametrize("moe", [None, {"num_experts": 4, "expert_interval": 1, "top_k": 2}])
def test_bf16_steps_track_fp32(moe):
    """Ten steps of a small GPT (dense, and MoE with top-2 experts): bf16's losses within 2% of
    fp32's (bf16 rounds each product to 8 bits of mantissa, ~0.4%; losses average thousands of
    them), different from them (bf16 really ran), and the weights still fp32."""
    def run(precision):
        cfg = PretrainConfig(model={"d_model": 64, "n_layer": 2, "n_head": 2, "seq_len": 32,
                                    "moe": moe},
                             precision=precision, workers=1,
                             train={"batch_size": 8, "steps": 10})
        worker = Trainer(cfg, 0, 1, None)
        losses = [worker.train_step(step).loss for step in range(1, 11)]
        return losses, worker

    (fp32, _), (bf16, worker) = run("fp32"), run("bf16")
    assert fp32 != bf16
    assert all(abs(a - b) <= 0.02 * a for a, b in zip(fp32, bf16)), (fp32, bf16)
    assert fp32[-1] < fp32[0] and bf16[-1] < bf16[0]
    assert all(b.flat.data.dtype == torch.float32 for b in worker.buckets)
    assert all(p.dtype == torch.float32 for p in worker.model.parameters())


@pytest.mark.gpu
@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_pretraining_steps_on_cuda_match_cpu(precision):
    """device=cuda: three steps of a dense GPT (no dropout; random-LTD's positions come
    from a CPU generator, so both devices drop the same tokens) give the CPU's losses within
    1e-4 relative in fp32 (the same math, another summation order) and 2% in bf16 (CPU and GPU
    bf16 kernels round differently), the final weights likewise; weights and batches live on
    the GPU, the master weights stay fp32."""
    def run(device):
        cfg = PretrainConfig(model={"d_model": 64, "n_layer": 2, "n_head": 2, "seq_len": 32,
                                    "dropout": 0.0},
                             random_ltd={"enabled": True, "min_tokens": 16, "total_steps": 6},
                             precision=precision, workers=1, device=device,
                             train={"batch_size": 8, "steps": 3})
        worker = Trainer(cfg, 0, 1, None)
        losses = [worker.train_step(step).loss for step in range(1, 4)]
        assert worker.buckets[0].flat.data.device.type == device
        return torch.tensor(losses), worker.buckets[0].flat.data.cpu(), worker.evaluate()

    tol = 1e-4 if precision == "fp32" else 2e-2
    (l_cpu, w_cpu, v_cpu), (l_gpu, w_gpu, v_gpu) = run("cpu"), run("cuda")
    assert torch.allclose(l_cpu, l_gpu, rtol=tol), (l_cpu, l_gpu)
    assert abs(v_cpu - v_gpu) <= tol * v_cpu
    assert w_gpu.dtype == torch.float32
    assert (w_cpu - w_gpu).abs().max() <= (1e-4 if precision == "fp32" else 1e-2)
