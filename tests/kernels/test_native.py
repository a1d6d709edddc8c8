"""Building the native kernels: a build that was killed (Ctrl-C during the first compile)
leaves torch's lock file behind, and the next load must not wait for it forever; a finished
build is imported as it is, without torch's build step."""

import os
import subprocess
import sys

SCRIPT = """
from pathlib import Path
from torch.utils import cpp_extension
from troupe.kernels import _native
first = _native.extension.__wrapped__()
assert first is not None, "the extension does not build here"
build = Path(first.__file__).parent  # the build directory it loaded from
(build / "built").unlink()
(build / "lock").touch()  # what a killed build leaves
again = _native.extension.__wrapped__()
assert again is not None and not (build / "lock").exists() and (build / "built").is_file()
def refuse(*args, **kwargs):
    raise AssertionError("a finished build was built again")
cpp_extension.load = refuse
assert _native.extension.__wrapped__().small_gemm.linear is not None
print("loaded")
"""


def test_a_killed_builds_lock_does_not_hang_the_next_load_and_a_build_is_reused():
    # in the cache every other test uses: the build is there already (or made once for all)
    env = {**os.environ, "TROUPE_NATIVE": "1"}
    out = subprocess.run([sys.executable, "-c", SCRIPT], env=env, capture_output=True,
                         text=True, timeout=240)
    assert out.returncode == 0 and "loaded" in out.stdout, out.stderr[-3000:]


def test_every_kernel_builds_where_a_compiler_is():
    """The kernels' tests skip where nothing can be compiled; where a compiler is, a source
    that does not compile must fail here instead of skipping them all."""
    import shutil

    import pytest

    from troupe.kernels import _native

    if os.environ.get("TROUPE_NATIVE", "1") == "0" or not (shutil.which("c++")
                                                            and shutil.which("cc")):
        pytest.skip("no C and C++ compilers here")
    sources = sorted(_native._CSRC.iterdir())
    broken = [f.name for f in sources if f.suffix == ".cpp" and f.stem != "native"
              and _native.load_extension(f.stem) is None] + [
        f.name for f in sources if f.suffix == ".c" and _native.load(f.stem) is None]
    assert sources and not broken, f"these kernels do not build here: {broken}"


def test_native_cpp_includes_every_part_after_every_header_the_parts_include():
    """A part (csrc/*.cpp) is included inside a namespace of its own: a header it includes
    that native.cpp did not include first would be declared inside that namespace, and a part
    left out of native.cpp would never be built."""
    import re

    from troupe.kernels import _native

    native = (_native._CSRC / "native.cpp").read_text()
    head = native[:native.index("namespace part_")]
    parts = sorted(f for f in _native._CSRC.glob("*.cpp") if f.stem != "native")
    assert len(parts) >= 6
    for part in parts:
        assert f'namespace part_{part.stem} {{\n#include "{part.name}"\n}}' in native, part.name
        assert f'part_{part.stem}::bind(m.def_submodule("{part.stem}"));' in native, part.name
        assert "PYBIND11_MODULE" not in part.read_text(), part.name
    for source in [*parts, *_native._CSRC.glob("*.h")]:
        for line in re.findall(r"^#include .+$", source.read_text(), re.M):
            assert line in head, f"{source.name}: {line} is not in native.cpp's headers"
