"""The two generating routes, /v1/completions and /v1/chat/completions, as one ``Endpoint`` each:
what differs between them (the request's type, how its prompts become ids, a default length,
tool calls, the shapes of the answer and of its chunks) is here, and the replica
(troupe.serving.replica) runs either the same way: admission, decoding, streaming."""

from __future__ import annotations

import json
from typing import Any, ClassVar

from troupe.generation import tools
from troupe.serving.prompts import Prompts
from troupe.serving.protocol import ChatRequest, CompletionRequest
from troupe.serving.responses import (AssistantMessage, Body, ChatChoice, ChatChunk,
                                      ChatChunkChoice, ChatCompletion, ChatLogprobs, Choice,
                                      Delta, TextChoice, TextChunk, TextCompletion,
                                      TextLogprobs, TokenLogprobItem, Usage, now, response_id)


class Endpoint:
    """One generating route. ``prompts`` gives a request's prompts as ids (each checked),
    ``answer`` the whole answer, ``opening``/``chunk``/``usage_chunk`` a stream's events."""

    route: ClassVar[str]
    request: ClassVar[type]
    id_prefix: ClassVar[str]

    def new_id(self) -> str:
        return response_id(self.id_prefix)

    def prompts(self, req, prompts: Prompts) -> list[list[int]]:
        raise NotImplementedError

    def prompt_field(self, i: int, n: int) -> str:
        """The field that holds prompt ``i`` of ``n``, for errors."""
        raise NotImplementedError

    def default_max_tokens(self, context: int, prompts: list[list[int]]) -> int:
        raise NotImplementedError

    def parses_tools(self, req) -> bool:
        """Whether the model's <tool_call> blocks become ``tool_calls``."""
        return False

    def finish(self, req, choices: list[Choice]) -> None:
        """The choices as the answer gives them, once decoded."""
        if self.parses_tools(req):
            for c in choices:
                c.text, c.tool_calls = tools.parse(c.text)
                c.finish = "tool_calls" if c.tool_calls else c.finish

    def answer(self, rid: str, model: str, choices: list[Choice], prompt_tokens: int,
               prompt_ids: list[list[int]] | None = None) -> Body:
        """The whole answer. ``prompt_ids`` (return_token_ids): each choice's prompt, as the
        tokens ran."""
        raise NotImplementedError

    def opening(self, rid: str, model: str, index: int,
                prompt_ids: list[int] | None) -> Body | None:
        """The chunk a choice's stream opens with before any token (None: none)."""
        return None

    def chunk(self, rid: str, model: str, index: int, text: str, finish: str | None,
              logprobs: list[TokenLogprobItem] | None = None, offset: int = 0,
              tool_calls: list[dict] | None = None, token_ids: list[int] | None = None,
              prompt_ids: list[int] | None = None) -> Body:
        """One streamed chunk of choice ``index``. With return_token_ids, ``token_ids``: the
        tokens this chunk adds; ``prompt_ids``: the prompt's, in a choice's first chunk."""
        raise NotImplementedError

    def usage_chunk(self, rid: str, model: str, prompt_tokens: int,
                    completion_tokens: int) -> Body:
        """The last chunk of a stream with ``stream_options.include_usage``: no choices."""
        raise NotImplementedError


class Completions(Endpoint):
    """/v1/completions: one or more prompts (text or token ids), n choices each; 16 tokens
    unless asked, as OpenAI's."""

    route, request, id_prefix = "/v1/completions", CompletionRequest, "cmpl-"

    def prompts(self, req: CompletionRequest, prompts: Prompts) -> list[list[int]]:
        given = req.prompts()
        return [prompts.completion(one, self.prompt_field(i, len(given)))
                for i, one in enumerate(given)]

    def prompt_field(self, i: int, n: int) -> str:
        return "prompt" if n == 1 else f"prompt.{i}"

    def default_max_tokens(self, context: int, prompts: list[list[int]]) -> int:
        return 16

    def answer(self, rid, model, choices, prompt_tokens, prompt_ids=None) -> TextCompletion:
        out = []
        for i, c in enumerate(choices):
            choice = TextChoice(index=i, finish_reason=c.finish, text=c.text,
                                logprobs=_text_logprobs(c.logprobs))
            if prompt_ids is not None:
                choice.prompt_token_ids = prompt_ids[i]
            if c.token_ids is not None:
                choice.token_ids = c.token_ids
            out.append(choice)
        return TextCompletion(id=rid, object="text_completion", created=now(), model=model,
                              choices=out,
                              usage=Usage.of(prompt_tokens, sum(c.tokens for c in choices)))

    def chunk(self, rid, model, index, text, finish, logprobs=None, offset=0, tool_calls=None,
              token_ids=None, prompt_ids=None) -> TextChunk:
        choice = TextChoice(index=index, finish_reason=finish, text=text,
                            logprobs=_text_logprobs(logprobs, offset))
        if prompt_ids is not None:
            choice.prompt_token_ids = prompt_ids
        if token_ids is not None:
            choice.token_ids = token_ids
        return TextChunk(id=rid, object="text_completion", created=now(), model=model,
                         choices=[choice])

    def usage_chunk(self, rid, model, prompt_tokens, completion_tokens) -> TextChunk:
        return TextChunk(id=rid, object="text_completion", created=now(), model=model,
                         choices=[], usage=Usage.of(prompt_tokens, completion_tokens))


class Chat(Endpoint):
    """/v1/chat/completions: one conversation through the model's chat template, n choices;
    the rest of the context unless asked, as OpenAI's; tool calls parsed when the request
    has tools."""

    route, request, id_prefix = "/v1/chat/completions", ChatRequest, "chatcmpl-"

    def prompts(self, req: ChatRequest, prompts: Prompts) -> list[list[int]]:
        ids = prompts.chat(req)
        prompts.check_length(ids, "messages")
        return [ids]

    def prompt_field(self, i: int, n: int) -> str:
        return "messages"

    def default_max_tokens(self, context: int, prompts: list[list[int]]) -> int:
        return context - len(prompts[0])

    def parses_tools(self, req: ChatRequest) -> bool:
        return req.uses_tools()

    def answer(self, rid, model, choices, prompt_tokens, prompt_ids=None) -> ChatCompletion:
        out = []
        for i, c in enumerate(choices):
            message = AssistantMessage(role="assistant", content=c.text)
            if c.tool_calls:
                message.tool_calls = [call.body() for call in c.tool_calls]
            choice = ChatChoice(index=i, finish_reason=c.finish, message=message,
                                logprobs=_chat_logprobs(c.logprobs))
            if c.token_ids is not None:
                choice.token_ids = c.token_ids
            out.append(choice)
        answer = ChatCompletion(id=rid, object="chat.completion", created=now(), model=model,
                                choices=out,
                                usage=Usage.of(prompt_tokens, sum(c.tokens for c in choices)))
        if prompt_ids is not None:  # its one prompt's, at the top, as vLLM gives them
            answer.prompt_token_ids = prompt_ids[0]
        return answer

    def opening(self, rid, model, index, prompt_ids) -> ChatChunk:
        return self._chunk(rid, model, ChatChunkChoice(
            index=index, finish_reason=None, logprobs=None,
            delta=Delta(role="assistant", content="")), prompt_ids)

    def chunk(self, rid, model, index, text, finish, logprobs=None, offset=0, tool_calls=None,
              token_ids=None, prompt_ids=None) -> ChatChunk:
        delta = Delta()
        if text:
            delta.content = text
        if tool_calls:
            delta.tool_calls = tool_calls
        choice = ChatChunkChoice(index=index, finish_reason=finish, delta=delta,
                                 logprobs=_chat_logprobs(logprobs))
        if token_ids is not None:
            choice.token_ids = token_ids
        return self._chunk(rid, model, choice, prompt_ids)

    def usage_chunk(self, rid, model, prompt_tokens, completion_tokens) -> ChatChunk:
        return ChatChunk(id=rid, object="chat.completion.chunk", created=now(), model=model,
                         choices=[], usage=Usage.of(prompt_tokens, completion_tokens))

    @staticmethod
    def _chunk(rid: str, model: str, choice: ChatChunkChoice,
               prompt_ids: list[int] | None) -> ChatChunk:
        chunk = ChatChunk(id=rid, object="chat.completion.chunk", created=now(), model=model,
                          choices=[choice])
        if prompt_ids is not None:
            chunk.prompt_token_ids = prompt_ids
        return chunk


ENDPOINTS = {e.route: e for e in (Completions(), Chat())}


def _text_logprobs(items: list[TokenLogprobItem] | None, offset: int = 0):
    return None if items is None else TextLogprobs.of(items, offset)


def _chat_logprobs(items: list[TokenLogprobItem] | None):
    return None if items is None else ChatLogprobs.of(items)


class StreamedChoices:
    """A stream's choices as their tokens arrive: each event of choice ``index`` becomes its
    chunks (``chunks``). It keeps what a choice's next chunk depends on: the text offset of its
    log-probabilities, its prompt's ids until the first chunk has carried them
    (``token_ids``, return_token_ids), and with ``parse_tools`` its
    troupe.generation.tools.ToolStream: content as it comes, each call as one ``tool_calls``
    delta once its block closes."""

    def __init__(self, endpoint: Endpoint, rid: str, model: str, prompts: list[list[int]],
                 parse_tools: bool, token_ids: bool):
        self.endpoint, self.rid, self.model = endpoint, rid, model
        self.parse_tools, self.token_ids = parse_tools, token_ids
        self.offsets = [0] * len(prompts)
        self.splitters = [tools.ToolStream() for _ in prompts]
        self.unsent = [ids if token_ids else None for ids in prompts]  # until first sent
        self.generated = 0

    def opening(self, index: int) -> Body | None:
        body = self.endpoint.opening(self.rid, self.model, index, self.unsent[index])
        if body is not None:
            self.unsent[index] = None
        return body

    def chunks(self, index: int, token: int, delta: str, finish: str | None,
               logprob: TokenLogprobItem | None) -> list[Body]:
        """The chunks one generated token of choice ``index`` gives (none while it is inside
        a tool call's block)."""
        self.generated += 1
        text, calls, splitter = delta, [], self.splitters[index]
        if self.parse_tools:
            text, calls = splitter.feed(text)
            if finish is not None:
                text += splitter.end()
                finish = "tool_calls" if splitter.calls else finish
        sent = splitter.calls - len(calls)  # the choice's calls before these
        out = [self.endpoint.chunk(self.rid, self.model, index, "", None,
                                   tool_calls=[call.body(index=sent + k)])
               for k, call in enumerate(calls)]
        if text or finish or logprob or self.token_ids:
            out.append(self.endpoint.chunk(
                self.rid, self.model, index, text, finish,
                logprobs=[logprob] if logprob else None, offset=self.offsets[index],
                token_ids=[token] if self.token_ids else None, prompt_ids=self.unsent[index]))
            self.offsets[index] += len(text)
            self.unsent[index] = None
        return out


def sse(obj: dict[str, Any]) -> str:
    """One server-sent event carrying ``obj`` as JSON."""
    return f"data: {json.dumps(obj)}\n\n"
