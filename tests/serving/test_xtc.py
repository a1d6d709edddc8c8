"""A distilled ternary model behind the OpenAI API: apps/compress.py distils a two-block
ternary student of SmolLM2-135M-Instruct for a few steps, and the server holds the directory
it exported as written (1.6-bit blocks, INT4 embedding) and answers the official client,
streamed as not."""

import openai
import pytest

from troupe.config import load_app_config
from troupe.pretrain.compress import CompressConfig, run
from troupe.serving import deploy as serve
from troupe.serving.config import ServeConfig

pytestmark = [pytest.mark.slow, pytest.mark.waits]  # a server and few clients


@pytest.fixture(scope="module")
def distilled(cluster, smollm2, tmp_path_factory):
    out = tmp_path_factory.mktemp("xtc")
    cfg = load_app_config(CompressConfig, "apps/configs/xtc-smollm2.yaml", [
        f"model.pretrained={smollm2}", "model.seq_len=32", "model.keep_layers=[0,29]",
        "train.steps=2", "train.batch_size=2", "train.eval_every=2", "train.eval_batches=1",
        "train.checkpoint_every=0", "workers=1", "precision=fp32", f"out_dir={out}"])
    records = run(cfg, resume=None, progress=False)
    assert [r["step"] for r in records if r["kind"] == "train"] == [1, 2]
    return out / "quantized"


@pytest.fixture(scope="module")
def client(distilled, serve_port):
    cfg = load_app_config(ServeConfig, "apps/configs/serve-smollm2.yaml", [
        f"model.pretrained={distilled}", "quantize={}", "model.name=xtc", f"port={serve_port}",
        "api_key_env=TROUPE_TEST_NO_KEY", "threads=1"])
    url = serve.deploy(cfg)
    yield openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=300)
    serve.shutdown()


def test_a_distilled_ternary_model_answers_streamed_as_not(client):
    assert [m.id for m in client.models.list().data] == ["xtc"]
    messages = [{"role": "user", "content": "Name the capital of France."}]
    whole = client.chat.completions.create(model="xtc", messages=messages, max_tokens=12,
                                           temperature=0)
    text = whole.choices[0].message.content
    assert whole.usage.completion_tokens >= 1
    parts = client.chat.completions.create(model="xtc", messages=messages, max_tokens=12,
                                           temperature=0, stream=True)
    assert "".join(p.choices[0].delta.content or "" for p in parts) == text


def test_quantize_rules_over_a_quantized_directory_are_refused(distilled):
    from troupe.config import ConfigError
    from troupe.serving.model import check_source
    cfg = ServeConfig.model_validate({"model": {"pretrained": str(distilled)},
                                      "quantize": {"*": "w8a8"}})
    with pytest.raises(ConfigError, match="quantize"):
        check_source(cfg)
    check_source(ServeConfig.model_validate({"model": {"pretrained": str(distilled)}}))
