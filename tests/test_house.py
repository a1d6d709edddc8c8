"""The house's sizes: no module of troupe/ over 450 lines and no function over 60, so that a
reader finds one idea per file and one step per function (a file that grows past it is split
where its seams are: see how troupe/serving, troupe/parallel and troupe/rlhf are cut)."""

import ast
from pathlib import Path

import troupe

ROOT = Path(troupe.__file__).parent
MAX_FILE_LINES, MAX_FUNCTION_LINES = 450, 60


def oversized(path: Path) -> list[str]:
    """What of ``path`` is over the limits, as "file:line what (n lines)"."""
    source = path.read_text()
    rel = path.relative_to(ROOT.parent)
    out = []
    lines = len(source.splitlines())
    if lines > MAX_FILE_LINES:
        out.append(f"{rel}: {lines} lines (at most {MAX_FILE_LINES})")
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            n = node.end_lineno - node.lineno + 1
            if n > MAX_FUNCTION_LINES:
                out.append(f"{rel}:{node.lineno} {node.name}: {n} lines "
                           f"(at most {MAX_FUNCTION_LINES})")
    return out


def test_no_module_or_function_is_over_its_size():
    found = [o for path in sorted(ROOT.rglob("*.py")) for o in oversized(path)]
    assert not found, "\n".join(found)


def test_the_check_sees_a_long_function_and_a_long_file(tmp_path, monkeypatch):
    monkeypatch.setattr("tests.test_house.ROOT", tmp_path)
    body = "\n".join(f"    x{i} = {i}" for i in range(MAX_FUNCTION_LINES))
    (tmp_path / "long.py").write_text(f"def f():\n{body}\n" + "\n" * MAX_FILE_LINES)
    found = oversized(tmp_path / "long.py")
    assert len(found) == 2 and "f: 61 lines" in found[1], found
