"""One process of troupe.rlhf.rewards' pool: imports the user's reward function and scores what
the driver sends, one JSON object per line each way. Run by path (``python reward_child.py
module:function``), so it imports the standard library and the user's module only, not
troupe (which would cost every process Ray and torch).

Requests: {"i": index, "id": random id, "prompt": text or chat messages, "response": text,
"fields": {...}}. Replies: {"id": id, "value": number} or {"id": id, "error": "what went
wrong"} (cut to MAX_ERROR characters); first of all {"ready": true}, or {"fatal": "..."} when
the function cannot be imported. The user's prints go to stderr: stdout is this protocol's.

``python reward_child.py module:function MEMORY_MB``: the process's address space is limited to
MEMORY_MB (0: no limit), so a function that allocates without bound fails with MemoryError. A
function that forks returns twice; the copy that is not this process exits at once instead of
answering requests meant for this one.
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


def _load(spec: str):
    module, name = spec.split(":")
    fn = getattr(importlib.import_module(module), name, None)
    if fn is None:
        raise AttributeError(f"module {module!r} has no attribute {name!r}")
    if not callable(fn):
        raise TypeError(f"{spec} is a {type(fn).__name__}, not a function")
    return fn


def _score(fn, request: dict) -> dict:
    i = request["id"]
    try:
        value = fn(request["prompt"], request["response"], **request.get("fields", {}))
    except Exception as e:  # the user's code: any failure is this sample's
        where = traceback.extract_tb(e.__traceback__)[-1]
        text = str(e)
        if len(text) > MAX_ERROR // 2:
            text = text[:MAX_ERROR // 2] + f"... ({len(text)} characters)"
        return {"id": i, "error": f"raised {type(e).__name__}: {text} "
                                  f"({os.path.basename(where.filename)}:{where.lineno})"}
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        return {"id": i, "error": f"returned {value!r:.60} ({type(value).__name__}), "
                                  "not a number"}
    if not math.isfinite(float(value)):
        return {"id": i, "error": f"returned {float(value)}, not a finite number"}
    return {"id": i, "value": float(value)}


def main() -> None:
    sys.path[0] = os.getcwd()  # the user's modules, not this directory's
    memory_mb = int(sys.argv[2]) if len(sys.argv) > 2 else 0
    if memory_mb > 0:
        limit = memory_mb << 20
        resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
    me = os.getpid()
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
        reply = _score(fn, json.loads(line))
        if os.getpid() != me:  # the function forked and this is the copy: it must not answer
            os._exit(0)
        proto.write(json.dumps(reply) + "\n")


if __name__ == "__main__":
    main()
