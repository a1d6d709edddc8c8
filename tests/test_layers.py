"""Imports point downward (docs/architecture.md, "The layers"), and an application never
imports another:

    leaves (context, devices, errors, config, wire) <- kernels <- collectives
    <- models, optim, compression, data, checkpoint <- parallel, generation
    <- actors <- runtime <- pretrain, rlhf, serving (serving may use pretrain.export; rlhf's
       agent mode speaks the server's OpenAI formats and checks its key: ALLOWED_ACROSS)
    <- cli, __main__ (the `troupe` command over the applications)

Inside troupe.rlhf, its rooms (troupe/rlhf/__init__.py) in the same way: a module imports from
its own level or from the levels below it, never from above:

    config, algorithms <- data <- sandbox <- models <- agents <- rollout <- roles <- pipeline
    <- driver, plan, plots <- cli and the package itself
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
# what one application may take from another: serving, pretraining's export; rlhf's agent mode,
# the server's OpenAI formats and its key check (not its replicas or deployment)
ALLOWED_ACROSS = {("serving", "troupe.pretrain.export"), ("rlhf", "troupe.serving.protocol"),
                  ("rlhf", "troupe.serving.config"), ("rlhf", "troupe.serving.responses"),
                  ("rlhf", "troupe.serving.endpoints"), ("rlhf", "troupe.serving.auth")}


ROOMS = {"config": 0, "sections": 0, "algorithms": 0, "data": 1, "sandbox": 2, "models": 3,
         "agents": 4, "rollout": 5, "roles": 6, "pipeline": 7, "driver": 8, "plan": 8,
         "plots": 8, "cli": 9}


def room(module: str) -> tuple[str, int]:
    """The room of a module of troupe.rlhf and its level (the package itself on top)."""
    parts = module.split(".")
    if len(parts) == 2:
        return "", max(ROOMS.values()) + 1
    if parts[2] not in ROOMS:
        raise AssertionError(f"{module}: troupe.rlhf.{parts[2]} has no room in "
                             "tests/test_layers.py; give it one (see docs/architecture.md)")
    return parts[2], ROOMS[parts[2]]


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
              and not any(mine[0] == a and (imported == b or imported.startswith(b + "."))
                          for a, b in ALLOWED_ACROSS)):
            bad.append(f"application {module} imports another application: {imported}")
        elif mine == theirs == ["rlhf"] and imported != "troupe.rlhf":
            (here, mine_level), (there, theirs_level) = room(module), room(imported)
            if theirs_level > mine_level:
                bad.append(f"{module} (room {here or 'troupe.rlhf'}, level {mine_level}) "
                           f"imports {imported} (room {there}, level {theirs_level})")
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
    ("troupe.rlhf.pipeline.step3", "from troupe.serving.model import load_source"),  # across apps
    ("troupe.pretrain.driver", "import troupe.rlhf.data.datasets"),          # across apps
    ("troupe.context", "from troupe.collectives import get_group"),          # leaf
    ("troupe.rlhf.rollout.engine", "from troupe.rlhf.roles.policy import Policy"),  # up a room
    ("troupe.rlhf.sandbox.pool", "from troupe.rlhf.models.lm import GPTLM"),  # up a room
    ("troupe.rlhf.data.batch", "import troupe.rlhf.pipeline.step3"),          # up a room
])
def test_a_wrong_import_is_caught(module, source):
    assert violations(module, source)


def test_a_room_of_rlhf_may_import_its_own_and_the_rooms_below():
    assert not violations("troupe.rlhf.roles.value", "from troupe.rlhf.roles.reference import x")
    assert not violations("troupe.rlhf.pipeline.step3", "from troupe.rlhf.data.batch import x")
    assert not violations("troupe.rlhf.cli", "from troupe.rlhf import driver")


def test_serving_may_use_pretrainings_export():
    assert not violations("troupe.serving.model", "from troupe.pretrain.export import x")
