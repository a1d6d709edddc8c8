"""Where the suite's time goes: a pytest plugin that writes, per test, its wall seconds and the
machine's CPU seconds over them (all processes: the test's Ray actors and the README's
background sections count where they ran), then one line per file, biggest first.

    PYTHONPATH=benchmarks python -m pytest -q -p suite_cpu

JSON lines go to results-suite_cpu.jsonl in the working directory (``SUITE_CPU_OUT`` to
change it). On a 2-core machine a file whose CPU seconds are near twice its wall is bound by
the cores; one far below waits (timeouts, node deaths, a single-threaded step). Run it alone:
the CPU is the whole machine's. Each row also counts the actors the shared cluster started
during the test, by class (from its actor table, read as each file ends)."""

from __future__ import annotations

import collections
import json
import os
import time

import pytest

_OUT = os.environ.get("SUITE_CPU_OUT", "results-suite_cpu.jsonl")
_started: dict[str, tuple[float, float, float]] = {}
_rows: list[dict] = []


def _cpu_seconds() -> float:
    """Busy seconds of every core since boot (user, nice, system, irq, softirq)."""
    with open("/proc/stat") as f:
        fields = f.readline().split()[1:]
    return sum(int(fields[i]) for i in (0, 1, 2, 5, 6)) / os.sysconf("SC_CLK_TCK")


def pytest_runtest_logstart(nodeid, location):
    _started[nodeid] = (time.monotonic(), _cpu_seconds(), time.time())


def pytest_runtest_logfinish(nodeid, location):
    wall, cpu, epoch = _started.pop(nodeid)
    _rows.append({"test": nodeid, "wall_s": round(time.monotonic() - wall, 2),
                  "cpu_s": round(_cpu_seconds() - cpu, 2), "_span": (epoch, time.time())})


_actors: dict[str, tuple[float, str]] = {}


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_teardown(item, nextitem):
    """Read the cluster's actor table as each file ends (before its fixtures go, the session's
    with the last file)."""
    if nextitem is not None and nextitem.path == item.path:
        return
    try:
        import ray
        if ray.is_initialized():
            for a in ray._private.state.actors().values():
                _actors[a["ActorID"]] = (a["StartTime"] / 1000, a["ActorClassName"])
    except Exception:  # noqa: BLE001 - a count is a nicety; the times stand without it
        pass


def _count_actors() -> None:
    """Give each row the actors whose start time falls in its span."""
    starts = sorted(v for v in _actors.values() if v[0])
    for r in _rows:
        lo, hi = r["_span"]
        classes = collections.Counter(c for t, c in starts if lo <= t < hi)
        if classes:
            r["actors"] = sum(classes.values())
            r["classes"] = dict(classes)


def pytest_sessionfinish(session):
    _count_actors()
    files: dict[str, list[float]] = collections.defaultdict(lambda: [0.0, 0.0, 0, 0])
    for r in _rows:
        r.pop("_span")
        f = files[r["test"].split("::")[0]]
        f[0] += r["wall_s"]
        f[1] += r["cpu_s"]
        f[2] += 1
        f[3] += r.get("actors", 0)
    with open(_OUT, "w") as out:
        for r in _rows:
            out.write(json.dumps(r) + "\n")
        for name, (wall, cpu, n, actors) in sorted(files.items(), key=lambda kv: -kv[1][1]):
            out.write(json.dumps({"file": name, "tests": n, "wall_s": round(wall, 1),
                                  "cpu_s": round(cpu, 1), "actors": actors}) + "\n")
        wall, cpu = sum(r["wall_s"] for r in _rows), sum(r["cpu_s"] for r in _rows)
        out.write(json.dumps({"total_wall_s": round(wall), "total_cpu_s": round(cpu),
                              "cores_busy": round(cpu / wall, 2) if wall else None}) + "\n")
