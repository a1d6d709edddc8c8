"""Test modules that run in a pytest process of their own, beside the rest of the suite (a lane).

tests/runtime/test_hosts.py spends its four minutes mostly waiting (cuts, Ray declaring a node
lost, a server's deadlines) with about one core busy; so do the tests with clusters of their
own that open the suite. Run one after the other, a core idles through both. When the session
selects other tests too, the module's selected tests run in a child pytest (``python -m
pytest MODULE::TEST ...``) started with the first test, and each is replaced in this process
by a stand-in of the same name that waits for the child and reports the test's outcome there:
its failure's text, or its skip's reason. A session that selects the module alone runs it
here, as any other.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

#: the modules run in lanes when the session selects more than them
MODULES = ("tests/runtime/test_hosts.py",)
#: set in a lane's own process: its module runs there as usual
IN_LANE = "TROUPE_TEST_LANE"
ROOT = Path(__file__).resolve().parent.parent


class Lane:
    """One module's child pytest; ``check(name)`` waits for it and gives the test's outcome."""

    def __init__(self, module: str):
        self.module = module
        self.names: list[str] = []  # the tests the session selected, in its order
        self.proc: subprocess.Popen | None = None
        self.outcomes: dict[str, tuple[str, str]] | None = None

    def start(self, workdir: Path) -> None:
        if self.proc is not None:
            return
        self.workdir = workdir
        self.log = workdir / "output.txt"
        with open(self.log, "w") as log:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                 *(f"{self.module}::{name}" for name in self.names),
                 f"--junitxml={workdir / 'report.xml'}", f"--basetemp={workdir / 'tmp'}"],
                cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                env={**os.environ, IN_LANE: self.module})

    def check(self, name: str) -> None:
        """Wait for the lane; fail, skip or pass as ``name`` did there."""
        if self.proc is None:
            pytest.fail(f"the lane of {self.module} never started")
        if self.outcomes is None:
            self.proc.wait()
            self.outcomes = self._read()
        if name not in self.outcomes:
            tail = self.log.read_text(errors="replace")[-4000:]
            pytest.fail(f"{self.module}::{name} has no outcome in its lane (exit "
                        f"{self.proc.returncode}); its output ends:\n{tail}")
        outcome, text = self.outcomes[name]
        if outcome == "skipped":
            pytest.skip(text)
        if outcome != "passed":
            pytest.fail(f"{outcome} in its lane (output in {self.log}):\n{text}", pytrace=False)

    def _read(self) -> dict[str, tuple[str, str]]:
        report = self.workdir / "report.xml"
        if not report.exists():
            return {}
        outcomes = {}
        for case in ET.parse(report).iter("testcase"):
            outcome, text = "passed", ""
            for child in case:
                if child.tag in ("failure", "error", "skipped"):
                    outcome = {"failure": "failed"}.get(child.tag, child.tag)
                    text = (child.get("message") or "") + "\n" + (child.text or "")
                    break
            outcomes.setdefault(case.get("name"), (outcome, text.strip()))
        return outcomes

    def stop(self) -> None:
        """End a lane still running (an interrupted session): SIGINT first, so that its
        fixtures tear down what they made (the hosts' namespaces), then SIGKILL."""
        if self.proc is None or self.proc.poll() is not None:
            return
        os.killpg(self.proc.pid, signal.SIGINT)
        try:
            self.proc.wait(timeout=120)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()


LANES: dict[str, Lane] = {}


def divert(items: list) -> None:
    """Replace the tests of each of ``MODULES`` with stand-ins, when the session selected
    other tests too (and this process is not a lane itself). The stand-ins carry the
    ``beside`` mark: they are waited for after the suite's other tests."""
    if os.environ.get(IN_LANE):
        return
    for module in MODULES:
        mine = [i for i, item in enumerate(items) if item.nodeid.startswith(module + "::")]
        if not mine or len(mine) == len(items):
            continue
        lane = LANES.setdefault(module, Lane(module))
        for i in mine:
            lane.names.append(items[i].name)
            items[i] = stand_in(items[i], lane)


def stand_in(item, lane: Lane):
    name = item.name

    def waits_for_its_lane():
        lane.check(name)

    waits_for_its_lane.__doc__ = f"{name}, run in the lane of {lane.module} (tests/lanes.py)."
    twin = pytest.Function.from_parent(item.parent, name=name, callobj=waits_for_its_lane)
    twin.add_marker(pytest.mark.beside)
    return twin
