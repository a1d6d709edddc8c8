"""A real model behind the OpenAI API: SmolLM2-135M-Instruct from its Hugging Face directory,
quantized W8A8, answering the official client through its own chat template."""

import openai
import pytest

from troupe.config import load_app_config
from troupe.serving import deploy as serve
from troupe.serving.config import ServeConfig

pytestmark = [pytest.mark.slow, pytest.mark.waits]  # a server and few clients


@pytest.fixture(scope="module")
def client(cluster, serve_port, smollm2):
    cfg = load_app_config(ServeConfig, "apps/configs/serve-smollm2.yaml",
                          [f"model.pretrained={smollm2}", f"port={serve_port}",
                           "api_key_env=TROUPE_TEST_NO_KEY", "threads=1"])
    url = serve.deploy(cfg)
    yield openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=300), cfg
    serve.shutdown()


def test_the_capital_of_france_is_paris_streamed_or_not(client):
    client, cfg = client
    name = cfg.model.name
    # "What is the capital of France?" puts SmolLM2's first token on a near-tie even in fp32
    # ("The" 25.33 against "L" 25.24): W8A8's greedy answer then turns on fp32 rounding order.
    # This wording leaves a margin of 1.44 logits.
    messages = [{"role": "user", "content": "Name the capital of France."}]
    whole = client.chat.completions.create(model=name, messages=messages, max_tokens=40,
                                           temperature=0)
    text = whole.choices[0].message.content
    assert "Paris" in text, text
    assert whole.choices[0].finish_reason == "stop"  # ended on <|im_end|>, not the limit
    parts = client.chat.completions.create(model=name, messages=messages, max_tokens=40,
                                           temperature=0, stream=True)
    assert "".join(p.choices[0].delta.content or "" for p in parts) == text
    plain = client.completions.create(model=name, prompt="The capital of France is",
                                      max_tokens=8, temperature=0)
    assert plain.usage.prompt_tokens == 5 and plain.choices[0].text.strip()


def test_chat_without_max_tokens_answers_to_the_end(client):
    """The openai client's chat call without max_tokens: the answer is longer than the
    completions API's 16 tokens and ends because the model ended it (finish_reason stop)."""
    client, cfg = client
    out = client.chat.completions.create(
        model=cfg.model.name, temperature=0,
        messages=[{"role": "user", "content": "Name the seven days of the week."}])
    assert out.choices[0].finish_reason == "stop", out.choices[0].message.content
    assert out.usage.completion_tokens > 16, out.choices[0].message.content

