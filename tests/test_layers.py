"""Imports point downward: base <- kernels <- collectives <- models/optim <- actors <- runtime."""

import ast
from pathlib import Path

import troupe

ROOT = Path(troupe.__file__).parent
LEAVES = {"troupe.errors", "troupe.wire", "troupe.config", "troupe.runtime.context"}
LAYERS = {"kernels": 1, "collectives": 2, "models": 3, "optim": 3, "compression": 3,
          "data": 3, "training": 3, "rlhf": 3, "serving": 3, "actors": 4, "runtime": 5}


def layer(module: str) -> int:
    if module in LEAVES or module == "troupe":
        return 0
    parts = module.split(".")
    return LAYERS.get(parts[1], 0) if len(parts) > 1 else 0


def troupe_imports(path: Path) -> list[str]:
    names = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names += [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module == "troupe":
            names += [f"troupe.{a.name}" for a in node.names]  # from troupe import collectives
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.append(node.module)
    return [n for n in names if n == "troupe" or n.startswith("troupe.")]


def test_imports_point_down():
    bad = []
    for path in ROOT.rglob("*.py"):
        rel = path.relative_to(ROOT.parent).with_suffix("")
        module = ".".join(p for p in rel.parts if p != "__init__")
        if module == "troupe":
            continue
        for imported in troupe_imports(path):
            if imported == "troupe" and module not in LEAVES:
                bad.append(f"{module} imports the top-level troupe package")
            elif module in LEAVES and imported not in LEAVES:
                bad.append(f"leaf {module} imports {imported}")
            elif layer(imported) > layer(module) and module not in LEAVES:
                bad.append(f"{module} (layer {layer(module)}) imports {imported} "
                           f"(layer {layer(imported)})")
    assert not bad, "\n".join(bad)
