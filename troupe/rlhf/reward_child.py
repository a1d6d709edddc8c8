"""One process of troupe.rlhf.rewards' pool: imports the user's reward function and scores what
the driver sends, one JSON object per line each way. Run by path (``python reward_child.py
module:function``), so it imports the standard library and the user's module only, not
troupe (which would cost every process Ray and torch).

Requests: {"i": index, "prompt": text or chat messages, "response": text, "fields": {...}}.
Replies: {"i": index, "value": number} or {"i": index, "error": "what went wrong"}; first of
all {"ready": true}, or {"fatal": "..."} when the function cannot be imported. The user's
prints go to stderr: stdout is this protocol's.
"""

import importlib
import json
import math
import numbers
import os
import sys
import traceback


def _load(spec: str):
    module, name = spec.split(":")
    fn = getattr(importlib.import_module(module), name, None)
    if fn is None:
        raise AttributeError(f"module {module!r} has no attribute {name!r}")
    if not callable(fn):
        raise TypeError(f"{spec} is a {type(fn).__name__}, not a function")
    return fn


def _score(fn, request: dict) -> dict:
    i = request["i"]
    try:
        value = fn(request["prompt"], request["response"], **request.get("fields", {}))
    except Exception as e:  # the user's code: any failure is this sample's
        where = traceback.extract_tb(e.__traceback__)[-1]
        return {"i": i, "error": f"raised {type(e).__name__}: {e} "
                                 f"({os.path.basename(where.filename)}:{where.lineno})"}
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        return {"i": i, "error": f"returned {value!r:.60} ({type(value).__name__}), not a number"}
    if not math.isfinite(float(value)):
        return {"i": i, "error": f"returned {float(value)}, not a finite number"}
    return {"i": i, "value": float(value)}


def main() -> None:
    sys.path[0] = os.getcwd()  # the user's modules, not this directory's
    proto = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)  # print() in the user's code goes to stderr
    sys.stdout = sys.stderr
    try:
        fn = _load(sys.argv[1])
    except Exception as e:
        proto.write(json.dumps({"fatal": f"{type(e).__name__}: {e}"}) + "\n")
        return
    proto.write(json.dumps({"ready": True}) + "\n")
    for line in sys.stdin:
        proto.write(json.dumps(_score(fn, json.loads(line))) + "\n")


if __name__ == "__main__":
    main()
