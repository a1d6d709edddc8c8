"""The OpenAI-compatible HTTP API's requests (their answers' shapes: troupe.serving.responses).
Requests are validated here; every rejection says which field is at fault and maps to an HTTP
status in the 4xx range."""

from __future__ import annotations

import json
import re
from typing import Annotated, Any, Literal

from pydantic import (AfterValidator, BaseModel, ConfigDict, Field, ValidationError,
                      field_validator, model_validator)

from troupe.generation import SamplingParams
from troupe.generation.grammar import Constraint
from troupe.generation.tools import NamedChoice, Tool, call_constraint, choice_name
from troupe.serving.config import Limits


MAX_CHOICES = 16  # choices a request may ask for (n, times its prompts)


class RequestError(Exception):
    """A request the server refuses: HTTP ``status``, OpenAI error ``type``, ``param``."""

    def __init__(self, status: int, message: str, param: str | None = None,
                 type: str = "invalid_request_error"):
        super().__init__(message)
        self.status, self.message, self.param, self.type = status, message, param, type

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param,
                          "code": None}}


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="ignore")

    include_usage: bool = False


class JsonSchemaFormat(BaseModel):
    """``response_format.json_schema``: the schema the output must validate against (``strict``
    is accepted either way: the output is held to the schema token by token regardless)."""

    model_config = ConfigDict(extra="ignore")

    name: str = Field(min_length=1, max_length=64)
    schema_: dict[str, Any] | bool = Field(default=True, alias="schema")
    strict: bool | None = None
    description: str | None = None


class ResponseFormat(BaseModel):
    """OpenAI's ``response_format``: ``text`` (no constraint), ``json_object`` (any JSON
    object) or ``json_schema``."""

    model_config = ConfigDict(extra="ignore")

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    @model_validator(mode="after")
    def _schema_given(self) -> "ResponseFormat":
        if self.type == "json_schema" and self.json_schema is None:
            raise ValueError("json_schema: required when type is 'json_schema'")
        return self


class _Request(BaseModel):
    """A request's common fields. Structured outputs: ``response_format`` (OpenAI's), or one of
    the extension fields ``guided_regex`` (the whole output matches the regular expression)
    and ``guided_grammar`` (a Lark grammar, its ``start`` rule), as vLLM names them.
    Sampling: OpenAI's ``logit_bias`` (token ids as strings, biases in [-100, 100]),
    ``presence_penalty`` and ``frequency_penalty``, and vLLM's ``repetition_penalty``,
    ``top_k``, ``stop_token_ids``, ``ignore_eos``, ``min_tokens`` and
    ``include_stop_str_in_output`` (troupe.generation.sampling says what each does). Fields OpenAI clients send that
    change nothing here (``user``, ``metadata``, ...) are ignored; ``echo``, ``suffix`` and
    ``best_of`` other than n, which would change the answer, are refused naming the field.
    ``return_token_ids`` (vLLM's): the answer carries the prompt's token ids and each
    choice's generated ones (the end-of-text or stop token that ended it included), so that
    a client that trains on tokens (RL) need not tokenize the text again."""

    model_config = ConfigDict(extra="ignore")  # OpenAI clients send fields we do not use

    model: str
    max_tokens: int | None = Field(default=None, ge=1)
    temperature: float = Field(default=1.0, ge=0, le=2)
    top_p: float = Field(default=1.0, gt=0, le=1)
    n: int = Field(default=1, ge=1, le=MAX_CHOICES)
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    seed: int | None = None
    response_format: ResponseFormat | None = None
    guided_regex: str | None = Field(default=None, min_length=1)
    guided_grammar: str | None = Field(default=None, min_length=1)
    logit_bias: dict[int, Annotated[float, Field(ge=-100, le=100)]] | None = \
        Field(default=None, max_length=1024)
    presence_penalty: float = Field(default=0.0, ge=-2, le=2)
    frequency_penalty: float = Field(default=0.0, ge=-2, le=2)
    repetition_penalty: float = Field(default=1.0, gt=0, le=100)
    top_k: int = Field(default=0, ge=-1)  # 0 or -1 (vLLM's "off"): every token
    stop_token_ids: list[Annotated[int, Field(ge=0)]] | None = Field(default=None, max_length=64)
    ignore_eos: bool = False
    min_tokens: int = Field(default=0, ge=0)
    include_stop_str_in_output: bool = False
    return_token_ids: bool = False
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = None

    @model_validator(mode="after")
    def _refused(self) -> "_Request":
        if self.echo:
            raise ValueError("echo: not supported (the prompt is not returned with the answer)")
        if self.suffix:
            raise ValueError("suffix: not supported (no insertion; send the prompt alone)")
        if self.best_of is not None and self.best_of != self.n:
            raise ValueError("best_of: not supported other than equal to n (every choice "
                             "is returned; none is ranked)")
        return self

    @model_validator(mode="after")
    def _one_constraint(self) -> "_Request":
        given = [name for name, on in (
            ("response_format", self.response_format is not None
             and self.response_format.type != "text"),
            ("guided_regex", self.guided_regex is not None),
            ("guided_grammar", self.guided_grammar is not None)) if on]
        if len(given) > 1:
            raise ValueError(f"give one of {', '.join(given)}: each constrains the whole output")
        return self

    def constraint(self) -> tuple[Constraint, str] | None:
        """The output's constraint and the field that gave it (None: free text)."""
        f = self.response_format
        if f is not None and f.type == "json_object":
            return Constraint("json_object"), "response_format"
        if f is not None and f.type == "json_schema":
            return (Constraint("json_schema", json.dumps(f.json_schema.schema_, sort_keys=True)),
                    "response_format.json_schema.schema")
        if self.guided_regex is not None:
            return Constraint("regex", self.guided_regex), "guided_regex"
        if self.guided_grammar is not None:
            return Constraint("grammar", self.guided_grammar), "guided_grammar"
        return None

    def top_logprobs_wanted(self) -> int | None:
        """How many top log-probabilities each token reports (0: the chosen token's only;
        None: no log-probabilities)."""
        return None

    def include_usage(self) -> bool:
        return bool(self.stream and self.stream_options and self.stream_options.include_usage)

    @field_validator("stop")
    @classmethod
    def _stops(cls, v):
        stops = [v] if isinstance(v, str) else (v or [])
        if len(stops) > 4 or any(not s for s in stops):
            raise ValueError("at most 4 non-empty strings")
        return v

    def sampling(self, default_max: int, limits: Limits) -> SamplingParams:
        """The engine's parameters; without max_tokens, ``default_max`` (completions: 16, as
        OpenAI's; chat: what is left of the context) up to the server's limit."""
        n = self.max_tokens if self.max_tokens is not None else min(default_max, limits.max_tokens)
        if n > limits.max_tokens:
            raise RequestError(400, f"max_tokens={n} exceeds this server's limit of "
                               f"{limits.max_tokens}", "max_tokens")
        if self.min_tokens > n:
            raise RequestError(400, f"min_tokens={self.min_tokens} exceeds max_tokens={n}",
                               "min_tokens")
        stop = (self.stop,) if isinstance(self.stop, str) else tuple(self.stop or ())
        constraint = self.constraint()
        return SamplingParams(max_tokens=n, temperature=self.temperature, top_p=self.top_p,
                              seed=self.seed, stop=stop, logprobs=self.top_logprobs_wanted(),
                              constraint=constraint and constraint[0],
                              logit_bias=tuple(sorted((self.logit_bias or {}).items())),
                              repetition_penalty=self.repetition_penalty,
                              frequency_penalty=self.frequency_penalty,
                              presence_penalty=self.presence_penalty, top_k=max(self.top_k, 0),
                              stop_token_ids=tuple(self.stop_token_ids or ()),
                              ignore_eos=self.ignore_eos, min_tokens=self.min_tokens,
                              include_stop_str_in_output=self.include_stop_str_in_output)


class CompletionRequest(_Request):
    """A completion request. ``prompt`` is a prompt or a list of them, as OpenAI's API spells
    it: a string, a list of token ids (the model's, run as they are: what an RL client that
    keeps its own tokens sends), a list of strings or a list of token-id lists. Prompt i's
    choices come at indices i * n to i * n + n - 1; a request holds at most MAX_CHOICES
    choices in all (prompts x n)."""

    prompt: str | list[int] | list[str] | list[list[int]]
    logprobs: int | None = Field(default=None, ge=0, le=5)

    def top_logprobs_wanted(self) -> int | None:
        return self.logprobs

    def prompts(self) -> list[str | list[int]]:
        v = self.prompt
        return list(v) if isinstance(v, list) and v and isinstance(v[0], (str, list)) else [v]

    @model_validator(mode="after")
    def _prompts(self) -> "CompletionRequest":
        prompts = self.prompts()
        for i, one in enumerate(prompts):
            if isinstance(one, list) and any(t < 0 for t in one):
                where = "prompt" if len(prompts) == 1 else f"prompt.{i}"
                raise ValueError(f"{where}: token ids are whole numbers >= 0")
        if len(prompts) * self.n > MAX_CHOICES:
            raise ValueError(f"prompt: {len(prompts)} prompts x n={self.n} make "
                             f"{len(prompts) * self.n} choices; a request holds at most "
                             f"{MAX_CHOICES}")
        return self


class CallFunction(BaseModel):
    model_config = ConfigDict(extra="ignore")

    name: str
    arguments: str  # JSON text, as OpenAI sends it


class MessageToolCall(BaseModel):
    """A call an earlier assistant turn made (sent back with the conversation)."""

    model_config = ConfigDict(extra="ignore")

    id: str
    type: Literal["function"] = "function"
    function: CallFunction


class ChatMessage(BaseModel):
    """One message. ``content`` is a string, or OpenAI's array of content parts, of which
    this server takes the text parts (``{"type": "text", "text": ...}``), joined by newlines
    as vLLM joins them; another part type is refused naming it. An assistant turn that
    called tools has ``tool_calls`` (and may have no content); a ``tool`` message carries a
    call's result."""

    model_config = ConfigDict(extra="ignore")

    role: Literal["system", "user", "assistant", "developer", "tool"]
    content: str | None = None
    tool_calls: list[MessageToolCall] | None = None
    tool_call_id: str | None = None
    name: str | None = None

    @field_validator("content", mode="before")
    @classmethod
    def _text_parts(cls, v: Any) -> Any:
        if not isinstance(v, list):
            return v
        texts = []
        for i, part in enumerate(v):
            kind = part.get("type") if isinstance(part, dict) else type(part).__name__
            if kind != "text":
                raise ValueError(f"part {i} has type {kind!r}; this server takes text parts "
                                 "only ({\"type\": \"text\", \"text\": ...})")
            if not isinstance(part.get("text"), str):
                raise ValueError(f"part {i}: 'text' must be a string")
            texts.append(part["text"])
        return "\n".join(texts)

    @model_validator(mode="after")
    def _content_or_calls(self) -> "ChatMessage":
        if self.content is None and not (self.role == "assistant" and self.tool_calls):
            raise ValueError("content: required (only an assistant turn with tool_calls may "
                             "leave it null)")
        if self.tool_calls and self.role != "assistant":
            raise ValueError("tool_calls: only an assistant message has them")
        return self

    def chars(self) -> int:
        calls = sum(len(c.function.name) + len(c.function.arguments)
                    for c in self.tool_calls or [])
        return len(self.content or "") + len(self.role) + 1 + calls


# what the request itself gives a chat template: not to be set through chat_template_kwargs
TEMPLATE_OWN = ("messages", "tools", "add_generation_prompt", "tokenize", "chat_template",
                "return_dict", "continue_final_message")


def template_kwargs(v: dict[str, Any] | None) -> dict[str, Any] | None:
    """``chat_template_kwargs`` (vLLM's field): more variables for the model's chat template
    (Qwen3's ``enable_thinking``, say); a ValueError naming a key the request sets itself."""
    if v is None:
        return None
    if len(v) > 32:
        raise ValueError(f"{len(v)} keys; at most 32")
    own = [k for k in v if k in TEMPLATE_OWN]
    if own:
        raise ValueError(f"{own[0]!r} is set by the request itself, not here")
    return v


TemplateKwargs = Annotated[dict[str, Any] | None, AfterValidator(template_kwargs)]


class ChatRequest(_Request):
    """A chat request. ``tools`` and ``tool_choice`` (troupe.generation.tools): "auto" (the
    default with tools) lets the model call any of them or answer, "none" renders none,
    "required" or a named function makes the answer one call whose arguments follow the
    function's parameters. ``chat_template_kwargs``: more variables for the chat template."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=20)
    tools: list[Tool] | None = Field(default=None, max_length=64)
    tool_choice: Literal["none", "auto", "required"] | NamedChoice | None = None
    parallel_tool_calls: bool | None = None  # accepted; a forced call is one call
    chat_template_kwargs: TemplateKwargs = None

    @model_validator(mode="after")
    def _top_needs_logprobs(self) -> "ChatRequest":
        if self.top_logprobs is not None and not self.logprobs:
            raise ValueError("top_logprobs: needs logprobs=true")
        return self

    @model_validator(mode="after")
    def _tools_agree(self) -> "ChatRequest":
        mode = choice_name(self.tool_choice)
        names = [t.function.name for t in self.tools or []]
        if len(set(names)) < len(names):
            raise ValueError("tools: two functions have the same name")
        if mode in ("required", "function") and not names:
            raise ValueError("tool_choice: needs tools")
        if mode == "function" and self.tool_choice.function.name not in names:
            raise ValueError(f"tool_choice: no tool named {self.tool_choice.function.name!r} "
                             f"(tools: {names})")
        if mode in ("required", "function") and (
                self.guided_regex or self.guided_grammar or (
                    self.response_format is not None and self.response_format.type != "text")):
            raise ValueError("tool_choice: a forced call and a response format both constrain "
                             "the whole output; give one")
        return self

    def top_logprobs_wanted(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None

    def uses_tools(self) -> bool:
        """Tools rendered and calls parsed (there are tools, and tool_choice is not none)."""
        return bool(self.tools) and choice_name(self.tool_choice) != "none"

    def tool_specs(self) -> list[dict] | None:
        return [t.model_dump(exclude_none=True) for t in self.tools] if self.uses_tools() else None

    def constraint(self) -> tuple[Constraint, str] | None:
        if self.uses_tools():
            forced = call_constraint(self.tools, self.tool_choice)
            if forced is not None:
                return forced, "tool_choice"
        return super().constraint()

    def conversation(self) -> list[dict[str, Any]]:
        """The messages as the tokenizer's chat template takes them."""
        out = []
        for m in self.messages:
            d: dict[str, Any] = {"role": m.role, "content": m.content}
            if m.tool_calls:
                d["tool_calls"] = [c.model_dump() for c in m.tool_calls]
            if m.tool_call_id is not None:
                d["tool_call_id"] = m.tool_call_id
            if m.name is not None:
                d["name"] = m.name
            out.append(d)
        return out

    def sampling(self, default_max: int, limits: Limits) -> SamplingParams:
        if self.max_completion_tokens is not None and self.max_tokens is None:
            self.max_tokens = self.max_completion_tokens
        return super().sampling(default_max, limits)


class TokenizeRequest(BaseModel):
    """POST /tokenize (vLLM's route): a ``prompt``'s token ids, or those of chat ``messages``
    through the model's chat template (with ``tools`` and ``chat_template_kwargs``, and the
    assistant's turn begun unless ``add_generation_prompt`` is false), exactly as a completion
    or chat request runs them."""

    model_config = ConfigDict(extra="ignore")

    model: str
    prompt: str | None = None
    messages: list[ChatMessage] | None = Field(default=None, min_length=1)
    tools: list[Tool] | None = Field(default=None, max_length=64)
    add_generation_prompt: bool = True
    chat_template_kwargs: TemplateKwargs = None

    @model_validator(mode="after")
    def _one_input(self) -> "TokenizeRequest":
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("prompt: give a prompt or messages (one of them)")
        return self


class DetokenizeRequest(BaseModel):
    """POST /detokenize (vLLM's route): the text of ``tokens``."""

    model_config = ConfigDict(extra="ignore")

    model: str
    tokens: list[Annotated[int, Field(ge=0)]] = Field(max_length=1 << 16)


def named_field(message: str) -> str | None:
    """The field a check's message names first, as troupe's checks word them ("field: what
    is wrong"), or None."""
    m = re.match(r"([a-z_][\w.]*): ", message)
    return m.group(1) if m else None


def parse(kind: type[BaseModel], body: bytes) -> BaseModel:
    """Validate a JSON body; malformed JSON or fields raise RequestError(400) naming them."""
    try:
        return kind.model_validate_json(body)
    except ValidationError as e:
        first = e.errors()[0]
        if first["type"].startswith("json"):
            raise RequestError(400, f"the request body is not valid JSON: {first['msg']}")
        where = ".".join(str(x) for x in first["loc"]) or None
        msg = first["msg"].removeprefix("Value error, ")
        named = named_field(msg)
        if where is None and named:  # a check across fields names the one at fault first
            raise RequestError(400, msg, named) from None
        raise RequestError(400, f"{where or 'the request body'}: {msg}", where) from None
