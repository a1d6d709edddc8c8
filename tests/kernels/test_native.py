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
first = _native.load_extension.__wrapped__("small_gemm")
assert first is not None, "the extension does not build here"
build = Path(first.__file__).parent  # the build directory it loaded from
(build / "built").unlink()
(build / "lock").touch()  # what a killed build leaves
again = _native.load_extension.__wrapped__("small_gemm")
assert again is not None and not (build / "lock").exists() and (build / "built").is_file()
def refuse(*args, **kwargs):
    raise AssertionError("a finished build was built again")
cpp_extension.load = refuse
assert _native.load_extension.__wrapped__("small_gemm") is not None
print("loaded")
"""


def test_a_killed_builds_lock_does_not_hang_the_next_load_and_a_build_is_reused():
    # in the cache every other test uses: the build is there already (or made once for all)
    env = {**os.environ, "TROUPE_NATIVE": "1"}
    out = subprocess.run([sys.executable, "-c", SCRIPT], env=env, capture_output=True,
                         text=True, timeout=240)
    assert out.returncode == 0 and "loaded" in out.stdout, out.stderr[-3000:]
