"""One process of troupe.rlhf's sandboxed pools: imports the user's reward function
(troupe.rlhf.pipeline.rewards) or environment class (troupe.rlhf.agents.environments) and serves
what the driver sends, one JSON object per line each way. Run by path (``python child.py
module:name MEMORY_MB KIND``), so it imports the standard library and the user's module only,
not troupe (which would cost every process Ray and torch).

KIND "function" (the default): requests {"i": index, "id": random id, "prompt": text or chat
messages, "response": text, "fields": {...}}, replies {"id": id, "value": number}.

KIND "environment": the process holds one instance of the class per trajectory, from its reset
to its close, so an environment keeps state between turns. Requests carry "op":
  {"op": "reset", "traj": key, "row": {...}}                 -> {"messages": [...]}
  {"op": "step", "traj": key, "messages": [...], "assistant": {...}}
                                     -> {"messages": [...], "reward": number or null, "done": bool}
  {"op": "close", "traj": key}                               -> {"closed": true}
each reply with the request's "id". ``reset(row)`` and ``step(messages, assistant)`` are the
class's methods (constructed with no arguments, or the "kwargs" of the start line); messages
are chat messages: objects with a string "role" and "content" a string (an assistant's may be
null, with "tool_calls").

Either kind answers {"id": id, "error": "what went wrong"} (cut to MAX_ERROR characters) when
the user's code raises or returns something malformed; first of all {"ready": true}, or
{"fatal": "..."} when the name cannot be imported. The user's prints go to stderr: stdout is
this protocol's. The process's address space is limited to MEMORY_MB (0: no limit), so code
that allocates without bound fails with MemoryError. Code that forks returns twice; the copy
that is not this process exits at once instead of answering requests meant for this one.
"""

import importlib
import json
import math
import numbers
import os
import resource
import sys
import traceback

MAX_ERROR = 1000


def _load(spec: str, kind: str):
    module, name = spec.split(":")
    obj = getattr(importlib.import_module(module), name, None)
    if obj is None:
        raise AttributeError(f"module {module!r} has no attribute {name!r}")
    if kind == "environment":
        if not isinstance(obj, type) or not all(callable(getattr(obj, m, None))
                                                for m in ("reset", "step")):
            raise TypeError(f"{spec} is not a class with reset(row) and step(messages, "
                            "assistant) methods")
    elif not callable(obj):
        raise TypeError(f"{spec} is a {type(obj).__name__}, not a function")
    return obj


def _raised(e: Exception) -> str:
    where = traceback.extract_tb(e.__traceback__)[-1]
    text = str(e)
    if len(text) > MAX_ERROR // 2:
        text = text[:MAX_ERROR // 2] + f"... ({len(text)} characters)"
    return f"raised {type(e).__name__}: {text} ({os.path.basename(where.filename)}:{where.lineno})"


def _number(value, what: str):
    """``value`` as a float, or the reason it is not a finite number."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        return None, f"{what} {value!r:.60} ({type(value).__name__}), not a number"
    if not math.isfinite(float(value)):
        return None, f"{what} {float(value)}, not a finite number"
    return float(value), None


def _score(fn, request: dict) -> dict:
    i = request["id"]
    try:
        value = fn(request["prompt"], request["response"], **request.get("fields", {}))
    except Exception as e:  # the user's code: any failure is this sample's
        return {"id": i, "error": _raised(e)}
    value, why = _number(value, "returned")
    return {"id": i, "error": why} if why else {"id": i, "value": value}


def _messages(value, what: str):
    """``value`` checked as a list of chat messages (the reason it is not, or None)."""
    if not isinstance(value, list):
        return f"{what} is a {type(value).__name__}, not a list of messages"
    for j, m in enumerate(value):
        if not (isinstance(m, dict) and isinstance(m.get("role"), str)
                and (isinstance(m.get("content"), str) or m.get("content") is None
                     and m.get("tool_calls"))):
            return (f"{what}[{j}] is not a message (an object with a string role and string "
                    f"content): {json.dumps(m, default=repr)[:80]}")
    return None


class _Environments:
    """The instances of one environment class, by trajectory."""

    def __init__(self, cls, kwargs: dict):
        self.cls, self.kwargs, self.live = cls, kwargs, {}

    def __call__(self, request: dict) -> dict:
        i, op, traj = request["id"], request.get("op"), request.get("traj")
        try:
            if op == "reset":
                env = self.live[traj] = self.cls(**self.kwargs)
                messages = env.reset(request.get("row", {}))
                why = _messages(messages, "reset's messages")
                return {"id": i, "error": why} if why else {"id": i, "messages": messages}
            if op == "close":
                self.live.pop(traj, None)
                return {"id": i, "closed": True}
            if op != "step":
                return {"id": i, "error": f"unknown op {op!r}"}
            if traj not in self.live:
                return {"id": i, "error": f"trajectory {traj!r} was not reset in this process"}
            out = self.live[traj].step(request["messages"], request["assistant"])
        except Exception as e:  # the user's code: any failure is this trajectory's
            return {"id": i, "error": _raised(e)}
        if not (isinstance(out, (tuple, list)) and len(out) == 3):
            return {"id": i, "error": f"step returned {out!r:.60}, not (messages, reward, done)"}
        messages, reward, done = out
        why = _messages(messages, "step's messages")
        if why is None and reward is not None:
            reward, why = _number(reward, "step's reward")
        if why is None and not isinstance(done, bool):
            why = f"step's done is {done!r:.40}, not True or False"
        if why:
            return {"id": i, "error": why}
        return {"id": i, "messages": messages, "reward": reward, "done": done}


def main() -> None:
    sys.path[0] = os.getcwd()  # the user's modules, not this directory's
    memory_mb = int(sys.argv[2]) if len(sys.argv) > 2 else 0
    kind = sys.argv[3] if len(sys.argv) > 3 else "function"
    if memory_mb > 0:
        limit = memory_mb << 20
        resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
    me = os.getpid()
    proto = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)  # print() in the user's code goes to stderr
    sys.stdout = sys.stderr
    try:
        obj = _load(sys.argv[1], kind)
        kwargs = json.loads(sys.argv[4]) if len(sys.argv) > 4 else {}
    except Exception as e:
        proto.write(json.dumps({"fatal": f"{type(e).__name__}: {e}"}) + "\n")
        return
    serve = _Environments(obj, kwargs) if kind == "environment" else (lambda r: _score(obj, r))
    proto.write(json.dumps({"ready": True}) + "\n")
    for line in sys.stdin:
        reply = serve(json.loads(line))
        if os.getpid() != me:  # the user's code forked and this is the copy: no answer
            os._exit(0)
        try:
            text = json.dumps(reply)
        except (TypeError, ValueError) as e:  # the user's objects in messages, NaN content
            text = json.dumps({"id": reply["id"], "error": f"the reply is not JSON: {e}"})
        proto.write(text + "\n")


if __name__ == "__main__":
    main()
