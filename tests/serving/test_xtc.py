"""A ternary model directory behind the OpenAI API: a two-block ternary student of
SmolLM2-135M-Instruct (the blocks apps/compress.py would start from, quantized as its export
quantizes them: troupe.compression.artifact), held by the server as written (1.6-bit blocks,
INT4 embedding), answers the official client, streamed as not. (The README's XTC section runs
apps/compress.py itself and serves what it exported.)"""

import openai
import pytest

from troupe.compression import quantize_model
from troupe.compression.artifact import save_quantized
from troupe.compression.student import reduce_layers
from troupe.config import load_app_config
from troupe.models import from_pretrained
from troupe.serving import deploy as serve
from troupe.serving.protocol import ServeConfig

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def distilled(smollm2, tmp_path_factory):
    student = reduce_layers(from_pretrained(smollm2), [0, 29]).eval().requires_grad_(False)
    quantize_model(student, {"blocks.*": "ternary"}, embedding="int4")
    return save_quantized(student, tmp_path_factory.mktemp("xtc") / "quantized", smollm2)


@pytest.fixture(scope="module")
def client(distilled, serve_port):
    cfg = load_app_config(ServeConfig, "apps/configs/serve-smollm2.yaml", [
        f"model.pretrained={distilled}", "quantize={}", "model.name=xtc", f"port={serve_port}",
        "api_key_env=TROUPE_TEST_NO_KEY", "threads=1"])
    url = serve.deploy(cfg)
    yield openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=300)
    serve.shutdown()


def test_a_ternary_model_answers_streamed_as_not(client):
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
