"""Requests are validated before any model sees them: every refusal names the field at fault
(OpenAI's ``param``), and what a request asks of the sampler reaches it."""

import json

import pytest

from troupe.serving.config import Limits
from troupe.serving.protocol import ChatRequest, CompletionRequest, RequestError, parse

HI = [{"role": "user", "content": "hi"}]
TOOL = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}


@pytest.mark.parametrize("kind, fields, param, words", [
    (ChatRequest, dict(tools=[TOOL], tool_choice={"type": "function", "function": {"name": "g"}}),
     "tool_choice", "tool_choice: no tool named 'g'"),
    (ChatRequest, dict(top_logprobs=2), "top_logprobs", "top_logprobs: needs logprobs=true"),
    (CompletionRequest, dict(stop=["a", "b", "c", "d", "e"]), "stop", "stop: at most 4"),
    (CompletionRequest, dict(logit_bias={"x": 1}), "logit_bias.x.[key]", "valid integer"),
    (CompletionRequest, dict(logit_bias={"3": -100.5}), "logit_bias.3", "greater than or equal"),
    (CompletionRequest, dict(frequency_penalty=-3), "frequency_penalty", "frequency_penalty"),
    (CompletionRequest, dict(repetition_penalty=0), "repetition_penalty", "greater than 0"),
    (CompletionRequest, dict(echo=True), "echo", "echo: not supported"),
    (CompletionRequest, dict(suffix="end"), "suffix", "suffix: not supported"),
    (CompletionRequest, dict(n=2, best_of=3), "best_of", "best_of: not supported"),
    (ChatRequest, dict(chat_template_kwargs={"add_generation_prompt": False}),
     "chat_template_kwargs", "'add_generation_prompt' is set by the request itself"),
    (ChatRequest, dict(chat_template_kwargs=["enable_thinking"]), "chat_template_kwargs",
     "Input should be an object"),
])
def test_a_refusal_names_its_field(kind, fields, param, words):
    body = {"model": "m", **({"messages": HI} if kind is ChatRequest else {"prompt": "hi"}),
            **fields}
    with pytest.raises(RequestError) as e:
        parse(kind, json.dumps(body).encode())
    assert e.value.status == 400 and e.value.param == param
    assert words in e.value.message and e.value.message.count(f"{param}:") <= 1


def test_sampling_fields_reach_the_engines_parameters():
    req = parse(CompletionRequest, json.dumps({
        "model": "m", "prompt": "hi", "logit_bias": {"50": 2, "7": -100}, "top_k": -1,
        "presence_penalty": 0.5, "frequency_penalty": -0.25, "repetition_penalty": 1.2,
        "best_of": 1, "user": "someone", "metadata": {"a": "b"}}).encode())
    p = req.sampling(16, Limits())
    assert p.logit_bias == ((7, -100.0), (50, 2.0)) and p.top_k == 0
    assert (p.presence_penalty, p.frequency_penalty, p.repetition_penalty) == (0.5, -0.25, 1.2)
