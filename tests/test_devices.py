"""Every tensor troupe creates takes its device from its inputs or its worker (issue 15): a
static check over troupe/. A call to a torch factory (torch.zeros, torch.tensor, torch.arange,
...) must pass ``device=``, be wrapped in ``nn.Parameter(...)`` (a module's parameter, placed
by the module's ``.to()`` or the default-device context, as torch's own layers are), or say on
its line why it lives in host memory: a ``# host: <reason>`` comment (wire deserialization,
CPU-only kernels, batches that cross actors, CPU generators). ``*_like`` and ``new_*``
factories derive the device by construction and are not flagged. Then troupe.devices itself:
the device setting the apps resolve, a worker's device, and moving a message's tensors."""

from __future__ import annotations

import ast
import dataclasses
from pathlib import Path

import pytest
import torch

from troupe.devices import cluster_device, move, to_host, worker_device

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


# ---- troupe.devices: the setting, a worker's device, moving messages ------------------------


@pytest.mark.parametrize("setting, gpus, needed, embedded, expected", [
    ("auto", 0, 2, True, "cpu"),      # a laptop
    ("auto", 1, 2, False, "cpu"),     # two ranks, one GPU: NCCL wants a GPU per rank
    ("auto", 8, 2, False, "cuda"),
    ("auto", 8, 0, False, "cpu"),     # nothing asks for a GPU
    ("cpu", 8, 2, False, "cpu"),
    ("cuda", 0, 2, False, "cuda"),    # an autoscaler starts the GPU nodes
    ("cuda", 2, 2, True, "cuda"),
])
def test_cluster_device(setting, gpus, needed, embedded, expected):
    assert cluster_device(setting, gpus, needed, embedded) == expected


def test_cuda_on_a_local_cluster_without_gpus_is_refused_by_name():
    with pytest.raises(ValueError, match="device=cuda: the workers need 2 GPUs"):
        cluster_device("cuda", 0, 2, embedded=True)
    with pytest.raises(ValueError, match="device='tpu'"):
        cluster_device("tpu", 0, 0)


def test_worker_device():
    assert worker_device("cpu") == worker_device("auto") == torch.device("cpu")  # not a worker
    if torch.cuda.is_available():
        assert worker_device("cuda").type == "cuda"
    else:
        with pytest.raises(RuntimeError, match="device=cuda"):
            worker_device("cuda")


@dataclasses.dataclass(frozen=True)
class Message:
    ids: torch.Tensor
    parts: list
    note: str = "kept"


def test_move_reaches_every_tensor_of_a_message_and_keeps_the_rest():
    a, b, c = torch.ones(2), torch.zeros(3, dtype=torch.long), torch.arange(4)
    msg = Message(a, [b, {"c": c, "n": 1}, (c, "x")])
    out = move(msg, "meta")  # a device other than the host's
    assert out.ids.device.type == "meta" and out.note == "kept"
    assert out.parts[0].device.type == out.parts[1]["c"].device.type == "meta"
    assert out.parts[1]["n"] == 1 and isinstance(out.parts[2], tuple)
    assert out.parts[2][0].device.type == "meta" and out.parts[2][1] == "x"
    assert msg.ids is a and a.device.type == "cpu"  # the original is left as it was
    same = move(msg, "cpu")
    assert same.ids is a and same.parts[1]["c"] is c  # already there: no copies
    assert to_host(msg) is msg  # nothing on a GPU: the message itself


@pytest.mark.gpu
def test_to_host_brings_cuda_tensors_back():
    msg = Message(torch.ones(2, device="cuda"), [torch.zeros(1, device="cuda"), 3])
    out = to_host(msg)
    assert out.ids.device.type == "cpu" and out.parts[0].device.type == "cpu"
    assert out.parts[1] == 3
