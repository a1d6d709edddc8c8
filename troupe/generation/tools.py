"""Tool calling in the Hermes style: the tools go to the model through its chat template, the
model answers a call as ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``, and the
server turns each such block into an OpenAI ``tool_calls`` entry (arguments as a JSON string).

``tool_choice``: "none" renders no tools and parses no calls; "auto" renders them and parses
whatever calls the model writes; "required" and a named function constrain the output to one
call whose arguments follow the function's parameter schema (troupe.generation.grammar: a Lark
grammar around the JSON schema), so the call always parses and its arguments always
validate. Streamed, text before a call goes out as content deltas as it comes (holding back
what could be the start of ``<tool_call>``), and each call goes out as one ``tool_calls``
delta once its block is closed.

Templates without tool support (SmolLM2's ignores ``tools``): ``hermes_tools.jinja`` beside
this module renders the tools into the system turn and the calls and their results as Hermes
does; a recipe sets it with ``model.chat_template: hermes_tools``.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from troupe.generation.grammar import JSON_LAYOUT, Constraint

OPEN, CLOSE = "<tool_call>", "</tool_call>"
_BLOCK = re.compile(re.escape(OPEN) + r"\s*(.*?)\s*" + re.escape(CLOSE), re.S)
TEMPLATES = {"hermes_tools": Path(__file__).with_name("hermes_tools.jinja")}


class FunctionSpec(BaseModel):
    model_config = ConfigDict(extra="ignore")

    name: str = Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_.-]+$")
    description: str | None = None
    parameters: dict[str, Any] = Field(default_factory=lambda: {"type": "object",
                                                                "properties": {}})
    strict: bool | None = None


class Tool(BaseModel):
    model_config = ConfigDict(extra="ignore")

    type: Literal["function"]
    function: FunctionSpec


class NamedFunction(BaseModel):
    name: str


class NamedChoice(BaseModel):
    """``tool_choice`` naming one function."""

    type: Literal["function"]
    function: NamedFunction


@dataclass
class ToolCall:
    id: str
    name: str
    arguments: str  # JSON text

    def body(self, index: int | None = None) -> dict[str, Any]:
        out = {"id": self.id, "type": "function",
               "function": {"name": self.name, "arguments": self.arguments}}
        return out if index is None else {"index": index, **out}


def choice_name(choice: str | NamedChoice | None) -> str:
    """"none", "auto", "required" or "function"."""
    return "function" if isinstance(choice, NamedChoice) else (choice or "auto")


def call_constraint(tools: list[Tool], choice: str | NamedChoice | None) -> Constraint | None:
    """The constraint that makes the output one call (``required``: of any tool; a named
    function: of that one), None for ``auto`` and ``none``."""
    if isinstance(choice, NamedChoice):
        picked = [t for t in tools if t.function.name == choice.function.name]
    elif choice == "required":
        picked = tools
    else:
        return None
    one_of = [{"type": "object",
               "properties": {"name": {"const": t.function.name},
                              "arguments": t.function.parameters},
               "required": ["name", "arguments"], "additionalProperties": False}
              for t in picked]
    schema = {"x-guidance": JSON_LAYOUT, **(one_of[0] if len(one_of) == 1
                                             else {"anyOf": one_of})}
    lark = f'start: "{OPEN}\\n" call "\\n{CLOSE}"\ncall: %json {json.dumps(schema)}'
    return Constraint("grammar", lark)


def parse(text: str) -> tuple[str | None, list[ToolCall]]:
    """The text's content (what is not a call; None when nothing else is left) and its
    calls. A block whose body is not a JSON object with a string ``name`` stays content."""
    calls, kept, at = [], [], 0
    for m in _BLOCK.finditer(text):
        call = _call(m.group(1))
        if call is None:
            continue
        kept.append(text[at:m.start()])
        at = m.end()
        calls.append(call)
    kept.append(text[at:])
    content = "".join(kept).strip()
    return (content or None) if calls else text, calls


def _call(body: str) -> ToolCall | None:
    try:
        obj = json.loads(body)
    except json.JSONDecodeError:
        return None
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    args = obj.get("arguments", obj.get("parameters", {}))
    return ToolCall(f"call_{uuid.uuid4().hex[:24]}", obj["name"],
                    args if isinstance(args, str) else json.dumps(args))


class ToolStream:
    """Splits a streamed answer into content deltas and whole calls: ``feed(delta)`` returns
    (content to send now, calls closed by this delta); ``end()`` what is left."""

    def __init__(self):
        self.buffer = ""     # text not sent yet: a call in progress, or a possible "<tool_c"
        self.calls = 0

    def feed(self, delta: str) -> tuple[str, list[ToolCall]]:
        self.buffer += delta
        out, calls = "", []
        while True:
            start = self.buffer.find(OPEN)
            if start < 0:
                keep = _partial_open(self.buffer)
                out += self.buffer[:len(self.buffer) - keep]
                self.buffer = self.buffer[len(self.buffer) - keep:]
                return out, calls
            out += self.buffer[:start]
            self.buffer = self.buffer[start:]
            end = self.buffer.find(CLOSE)
            if end < 0:
                return out, calls
            block = self.buffer[:end + len(CLOSE)]
            self.buffer = self.buffer[end + len(CLOSE):]
            call = _call(block[len(OPEN):-len(CLOSE)].strip())
            if call is None:
                out += block
            else:
                calls.append(call)
                self.calls += 1

    def end(self) -> str:
        """What is still held back (an unclosed block stays text)."""
        rest, self.buffer = self.buffer, ""
        return rest


def _partial_open(text: str) -> int:
    """How many characters at the end of ``text`` could begin ``<tool_call>``."""
    for n in range(min(len(OPEN) - 1, len(text)), 0, -1):
        if OPEN.startswith(text[-n:]):
            return n
    return 0


def template_text(value: str) -> str:
    """A chat template by name (``hermes_tools``) or from a Jinja file."""
    path = TEMPLATES.get(value) or Path(value).expanduser()
    if not path.is_file():
        raise FileNotFoundError(f"model.template: {value!r} is neither a template troupe ships "
                                f"({', '.join(TEMPLATES)}) nor a file")
    return path.read_text()
