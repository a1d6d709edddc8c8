"""Every tensor troupe creates takes its device from its inputs or its worker (issue 15): a
static check over troupe/. A call to a torch factory (torch.zeros, torch.tensor, torch.arange,
...) must pass ``device=``, be wrapped in ``nn.Parameter(...)`` (a module's parameter, placed
by the module's ``.to()`` or the default-device context, as torch's own layers are), or say on
its line why it lives in host memory: a ``# host: <reason>`` comment (wire deserialization,
CPU-only kernels, batches that cross actors, CPU generators). ``*_like`` and ``new_*``
factories derive the device by construction and are not flagged."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
FACTORIES = {"zeros", "ones", "empty", "full", "arange", "rand", "randn", "randint", "randperm",
             "tensor", "as_tensor", "eye", "linspace", "logspace", "normal", "empty_strided"}


def unplaced_tensors(source: str, filename: str = "<source>") -> list[str]:
    """``file:line: torch.<factory>`` for each factory call of ``source`` that neither passes
    ``device=`` nor is a parameter nor is marked ``# host:`` on one of its lines."""
    lines = source.splitlines()
    tree = ast.parse(source, filename)
    parameters = {id(node.args[0]) for node in ast.walk(tree)
                  if isinstance(node, ast.Call) and node.args
                  and isinstance(node.func, ast.Attribute) and node.func.attr == "Parameter"}
    found = []
    for node in ast.walk(tree):
        if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                and isinstance(node.func.value, ast.Name) and node.func.value.id == "torch"
                and node.func.attr in FACTORIES):
            continue
        if any(k.arg == "device" for k in node.keywords) or id(node) in parameters:
            continue
        span = lines[node.lineno - 1:(node.end_lineno or node.lineno)]
        if any("# host:" in line for line in span):
            continue
        found.append(f"{filename}:{node.lineno}: torch.{node.func.attr}")
    return sorted(found)


def test_troupe_places_every_tensor_it_creates():
    found = []
    for path in sorted((ROOT / "troupe").rglob("*.py")):
        found += unplaced_tensors(path.read_text(), str(path.relative_to(ROOT)))
    assert not found, "tensors created without a device:\n" + "\n".join(found)


def test_the_check_catches_a_planted_violation():
    planted = '''
import torch
from torch import nn

def scores(x):
    out = torch.zeros(x.shape[0])                 # on the CPU whatever x is: caught
    ok = torch.zeros(x.shape[0], device=x.device)
    ids = torch.tensor([1, 2, 3])  # host: token ids from Python, moved by the caller
    w = nn.Parameter(torch.empty(4, 4))
    return out + ok + torch.arange(
        3)                                        # a call over two lines: caught
'''
    assert unplaced_tensors(planted, "planted.py") == ["planted.py:10: torch.arange",
                                                       "planted.py:6: torch.zeros"]
