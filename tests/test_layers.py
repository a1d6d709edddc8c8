"""Imports point downward (docs/architecture.md, "The layers"), and an application never
imports another:

    leaves (context, devices, errors, config, wire) <- kernels <- collectives
    <- models, optim, compression, data, checkpoint <- parallel, generation
    <- actors <- runtime <- pretrain, rlhf, serving (serving may use pretrain.export; rlhf's
       agent mode speaks the server's OpenAI formats, serving.protocol)
    <- cli, __main__ (the `troupe` command over the applications)
"""

import ast
from pathlib import Path

import pytest

import troupe

ROOT = Path(troupe.__file__).parent
LEAVES = {"troupe.context", "troupe.devices", "troupe.errors", "troupe.wire", "troupe.config",
          "troupe.cache"}
LAYERS = {"kernels": 1, "collectives": 2, "models": 3, "optim": 3, "compression": 3, "data": 3,
          "checkpoint": 3, "parallel": 4, "generation": 4, "actors": 5, "runtime": 6,
          "pretrain": 7, "rlhf": 7, "serving": 7, "cli": 8, "__main__": 8}
APPS = {"pretrain", "rlhf", "serving"}
ALLOWED_ACROSS = {("serving", "troupe.pretrain.export"), ("rlhf", "troupe.serving.protocol")}


def layer(module: str) -> int:
    if module in LEAVES or module == "troupe":
        return 0
    parts = module.split(".")
    if len(parts) > 1 and parts[1] not in LAYERS:
        raise AssertionError(f"{module}: package troupe.{parts[1]} has no layer in "
                             "tests/test_layers.py; give it one (see docs/architecture.md)")
    return LAYERS[parts[1]] if len(parts) > 1 else 0


def troupe_imports(source: str) -> list[str]:
    names = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            names += [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module == "troupe":
            names += [f"troupe.{a.name}" for a in node.names]  # from troupe import collectives
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.append(node.module)
    return [n for n in names if n == "troupe" or n.startswith("troupe.")]


def violations(module: str, source: str) -> list[str]:
    """What is wrong with the imports of ``module`` (whose text is ``source``)."""
    bad = []
    for imported in troupe_imports(source):
        mine, theirs = module.split(".")[1:2], imported.split(".")[1:2]
        if imported == "troupe" and module not in LEAVES:
            bad.append(f"{module} imports the top-level troupe package")
        elif module in LEAVES and imported not in LEAVES:
            bad.append(f"leaf {module} imports {imported}")
        elif module in LEAVES:
            continue
        elif layer(imported) > layer(module):
            bad.append(f"{module} (layer {layer(module)}) imports {imported} "
                       f"(layer {layer(imported)})")
        elif (mine and theirs and mine != theirs and {mine[0], theirs[0]} <= APPS
              and not any(mine[0] == a and imported.startswith(b) for a, b in ALLOWED_ACROSS)):
            bad.append(f"application {module} imports another application: {imported}")
    return bad


def modules():
    for path in sorted(ROOT.rglob("*.py")):
        rel = path.relative_to(ROOT.parent).with_suffix("")
        module = ".".join(p for p in rel.parts if p != "__init__")
        if module != "troupe":
            yield module, path


def test_imports_point_down():
    bad = [v for module, path in modules() for v in violations(module, path.read_text())]
    assert not bad, "\n".join(bad)


@pytest.mark.parametrize("module,source", [
    ("troupe.models.gpt", "from troupe.runtime import ActorGraph"),          # upward
    ("troupe.actors.worker", "from troupe.runtime.graph import rewire"),     # upward
    ("troupe.rlhf.step3", "from troupe.serving.model import load_source"),     # across apps
    ("troupe.pretrain.driver", "import troupe.rlhf.data"),                   # across apps
    ("troupe.context", "from troupe.collectives import get_group"),          # leaf
])
def test_a_wrong_import_is_caught(module, source):
    assert violations(module, source)


def test_serving_may_use_pretrainings_export():
    assert not violations("troupe.serving.model", "from troupe.pretrain.export import x")
