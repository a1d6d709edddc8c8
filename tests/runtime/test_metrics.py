"""The peak-memory figure the roles and ranks report in their metrics."""

import json
import subprocess
import sys

PROBE = """
import json, torch
from troupe.runtime.metrics import peak_memory_mb
before = peak_memory_mb()
big = torch.ones(256 * 2**20 // 4)  # 256 MiB, written (so resident)
after = peak_memory_mb()
del big
print(json.dumps([before, after, peak_memory_mb()]))
"""


def test_peak_memory_follows_what_the_process_touched():
    """In a fresh process (the figure is a high-water mark): 256 MiB written raise it by about
    that much, and freeing them does not lower it."""
    out = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True,
                         check=True).stdout
    before, after, later = json.loads(out.strip().splitlines()[-1])
    assert before > 50  # the interpreter and torch alone
    assert 240 < after - before < 300
    assert later > after - 2  # 256 MiB freed, the mark stays (the kernel batches its counts)
