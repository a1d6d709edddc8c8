"""Serving on a GPU (ServeConfig.device=cuda): the replica asks Ray for a GPU, holds its
model there, and answers what the CPU engine answers."""

import json
import urllib.request

import pytest
import torch

from tests.serving.test_app import alone, post
from troupe.models import GPT, GPTConfig
from troupe.serving import deploy as serve
from troupe.serving.config import ServeConfig
from troupe.serving.model import load_served_model, save_model

pytestmark = pytest.mark.gpu


def test_a_served_completion_on_cuda(cluster, serve_port, tmp_path):
    """fp32 on cuda: the greedy completion is the CPU engine's text (the same fp32 math);
    W8A8 on cuda (torch._int_mm): its logits within 1e-3 of the CPU W8A8 model's (both exact
    INT32 products, the fp32 epilogues in another order)."""
    path = tmp_path / "tiny.trp"
    save_model(GPT(GPTConfig(seq_len=96, n_layer=2, n_head=2, d_model=64), seed=3), path)
    base = dict(model={"file": str(path), "name": "tiny"}, group_size=16, port=serve_port,
                api_key_env="TROUPE_NO_KEY", limits={"max_tokens": 40})
    cfg = ServeConfig(**base, quantize={}, device="cuda")
    url = serve.deploy(cfg)
    try:
        status, body = post(url, b'{"model": "tiny", "prompt": "Hello, troupe", '
                                 b'"max_tokens": 12, "temperature": 0}', key="")
        assert status == 200, body
        cpu, _ = load_served_model(cfg.model_copy(update={"device": "cpu"}))
        assert body["choices"][0]["text"] == alone(cpu, "Hello, troupe", 12)
        with urllib.request.urlopen(url + "/health", timeout=30) as r:
            assert json.loads(r.read())["device"].startswith("cuda")
    finally:
        serve.shutdown()
    on_gpu, _ = load_served_model(ServeConfig(**base, device="cuda"))
    on_cpu, _ = load_served_model(ServeConfig(**base, device="cpu"))
    assert on_gpu.tok_emb.weight.is_cuda
    ids = torch.randint(0, 257, (2, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        want, got = on_cpu(ids)[0], on_gpu(ids.cuda())[0].cpu()
    assert (got - want).abs().max() <= 1e-3 * want.abs().max()
