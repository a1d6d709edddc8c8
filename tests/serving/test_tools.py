"""Hermes tool calls taken apart (troupe.generation.tools): whole answers and streams cut at every
place give the same content and calls; blocks that are not calls stay text; a forced call's
grammar names the functions it allows."""

import json

from troupe.generation.tools import (NamedChoice, Tool, ToolStream, call_constraint, parse,
                                  template_text)

ANSWER = ('Let me check. <tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n'
          '</tool_call>\n<tool_call>{"name": "get_time", "arguments": {}}</tool_call>')


def test_calls_and_content_of_a_whole_answer():
    content, calls = parse(ANSWER)
    assert content == "Let me check."
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [
        ("get_weather", {"city": "Paris"}), ("get_time", {})]
    assert len({c.id for c in calls}) == 2
    assert parse("no calls here") == ("no calls here", [])
    text = "<tool_call>not json</tool_call> and <tool_call>[1]</tool_call>"
    assert parse(text) == (text, [])  # not calls: the text as it was
    assert parse('<tool_call>{"name": "f", "arguments": {}}</tool_call>')[0] is None


def test_a_stream_cut_anywhere_gives_the_same_content_and_calls():
    want_content, want_calls = parse(ANSWER)
    for size in (1, 2, 3, 5, 7, 11, len(ANSWER)):
        s, content, calls = ToolStream(), "", []
        for i in range(0, len(ANSWER), size):
            text, closed = s.feed(ANSWER[i:i + size])
            content += text
            calls += closed
        content += s.end()
        assert content.strip() == want_content, size
        assert [(c.name, c.arguments) for c in calls] == [(c.name, c.arguments)
                                                          for c in want_calls]
        assert "<tool" not in content
    s = ToolStream()
    assert s.feed("a <tool") == ("a ", []) and s.feed("s> b") == ("<tools> b", [])
    assert s.feed("<tool_call>{unclosed") == ("", []) and s.end() == "<tool_call>{unclosed"


def test_forced_call_grammars():
    tools = [Tool.model_validate({"type": "function", "function": {
        "name": n, "parameters": {"type": "object", "properties": {"x": {"type": "integer"}}}}})
        for n in ("f", "g")]
    assert call_constraint(tools, "auto") is None and call_constraint(tools, "none") is None
    both = call_constraint(tools, "required").spec
    assert '"const": "f"' in both and '"const": "g"' in both and "<tool_call>" in both
    one = call_constraint(tools, NamedChoice.model_validate(
        {"type": "function", "function": {"name": "g"}})).spec
    assert '"const": "g"' in one and '"const": "f"' not in one
    assert "<tool_call>" in template_text("hermes_tools")
