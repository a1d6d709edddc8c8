"""The OpenAI-compatible API's answers as typed models: whole completions, streamed chunks, usage,
log-probabilities and the model list, for the completions and the chat routes.

A field given when a model is built is written, None included (``"finish_reason": null`` in a
chunk, as OpenAI writes it); a field left out is not written at all (a completion's choice has
no ``prompt_token_ids`` unless the request asked for token ids): ``Body.body()`` dumps with
``exclude_unset``. ``Choice`` is what the server gathers of one choice while it decodes."""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass
from typing import Any, Literal

from pydantic import BaseModel

from troupe.generation.tools import ToolCall

# one token's log-probability as the server gathers it: (text, log-probability, the likeliest
# tokens' [(text, log-probability)])
TokenLogprobItem = tuple[str, float, list[tuple[str, float]]]


class Body(BaseModel):
    """A response body (or a part of one): what was given is written, nothing else."""

    def body(self) -> dict[str, Any]:
        return self.model_dump(exclude_unset=True)


class Usage(Body):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int

    @classmethod
    def of(cls, prompt_tokens: int, completion_tokens: int) -> "Usage":
        return cls(prompt_tokens=prompt_tokens, completion_tokens=completion_tokens,
                   total_tokens=prompt_tokens + completion_tokens)


class TopLogprob(Body):
    token: str
    logprob: float
    bytes: list[int]


class TokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob]


class ChatLogprobs(Body):
    """The chat route's log-probabilities: one entry per token."""

    content: list[TokenLogprob]

    @classmethod
    def of(cls, items: list[TokenLogprobItem]) -> "ChatLogprobs":
        return cls(content=[
            TokenLogprob(token=t, logprob=lp, bytes=list(t.encode()), top_logprobs=[
                TopLogprob(token=u, logprob=v, bytes=list(u.encode())) for u, v in top])
            for t, lp, top in items])


class TextLogprobs(Body):
    """The completions route's log-probabilities: parallel lists, each token's offset in the
    choice's text."""

    tokens: list[str]
    token_logprobs: list[float]
    top_logprobs: list[dict[str, float]]
    text_offset: list[int]

    @classmethod
    def of(cls, items: list[TokenLogprobItem], offset: int = 0) -> "TextLogprobs":
        offsets, at = [], offset
        for t, _, _ in items:
            offsets.append(at)
            at += len(t)
        return cls(tokens=[t for t, _, _ in items], token_logprobs=[lp for _, lp, _ in items],
                   top_logprobs=[dict(top) for _, _, top in items], text_offset=offsets)


class AssistantMessage(Body):
    role: Literal["assistant"]
    content: str | None
    tool_calls: list[dict[str, Any]] | None = None


class ChatChoice(Body):
    index: int
    finish_reason: str | None
    logprobs: ChatLogprobs | None
    message: AssistantMessage
    token_ids: list[int] | None = None


class TextChoice(Body):
    """A completion's choice, whole or as a chunk's."""

    index: int
    finish_reason: str | None
    logprobs: TextLogprobs | None
    text: str | None
    prompt_token_ids: list[int] | None = None
    token_ids: list[int] | None = None


class ChatCompletion(Body):
    id: str
    object: Literal["chat.completion"]
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage
    prompt_token_ids: list[int] | None = None  # its one prompt's, at the top as vLLM has them


class TextCompletion(Body):
    id: str
    object: Literal["text_completion"]
    created: int
    model: str
    choices: list[TextChoice]
    usage: Usage


class Delta(Body):
    role: Literal["assistant"] | None = None
    content: str | None = None
    tool_calls: list[dict[str, Any]] | None = None


class ChatChunkChoice(Body):
    index: int
    finish_reason: str | None
    logprobs: ChatLogprobs | None
    delta: Delta
    token_ids: list[int] | None = None


class ChatChunk(Body):
    id: str
    object: Literal["chat.completion.chunk"]
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: Usage | None = None
    prompt_token_ids: list[int] | None = None


class TextChunk(Body):
    id: str
    object: Literal["text_completion"]
    created: int
    model: str
    choices: list[TextChoice]
    usage: Usage | None = None


class ModelCard(Body):
    id: str
    object: Literal["model"]
    created: int
    owned_by: str
    parent: str | None = None  # an adapter's base model


class ModelList(Body):
    object: Literal["list"]
    data: list[ModelCard]

    @classmethod
    def of(cls, name: str, created: int, adapters: list[str] = ()) -> "ModelList":
        """The base model and the LoRA adapters over it (each with ``parent``: the base)."""
        return cls(object="list", data=[
            ModelCard(id=name, object="model", created=created, owned_by="troupe"),
            *(ModelCard(id=a, object="model", created=created, owned_by="troupe", parent=name)
              for a in adapters)])


@dataclass
class Choice:
    """One choice's text, finish reason, token count and (when asked) log-probabilities: per
    token (text, log-probability, [(text, log-probability)] of the likeliest)."""

    text: str | None = ""
    finish: str | None = None
    tokens: int = 0
    logprobs: list[TokenLogprobItem] | None = None
    tool_calls: list[ToolCall] | None = None
    token_ids: list[int] | None = None  # with return_token_ids


def response_id(prefix: str) -> str:
    return prefix + uuid.uuid4().hex[:24]


def now() -> int:
    return int(time.time())
