"""Building the native kernels: a build that was killed (Ctrl-C during the first compile)
leaves torch's lock file behind; the next load must not wait for it forever."""

import os
import subprocess
import sys


def test_a_killed_builds_lock_does_not_hang_the_next_load(tmp_path):
    script = """
import sys
from troupe.kernels import _native
first = _native.load_extension.__wrapped__("small_gemm")
assert first is not None, "the extension does not build here"
from pathlib import Path
build = Path(first.__file__).parent  # the build directory it loaded from
(build / "lock").touch()  # what a killed build leaves
again = _native.load_extension.__wrapped__("small_gemm")
assert again is not None and not (build / "lock").exists()
print("loaded")
"""
    # in the cache every other test uses: the build is there already (or made once for all)
    env = {**os.environ, "TROUPE_NATIVE": "1"}
    out = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True,
                         text=True, timeout=240)
    assert out.returncode == 0 and "loaded" in out.stdout, out.stderr[-3000:]
