"""The README's command blocks, read and run as a newcomer would run them (tests/test_readme.py).

Every fenced block of README.md and docs/*.md has a language. ``text`` blocks (layouts,
trees) are not commands; ``bash`` and ``python`` blocks are run, section by section (a
``##``/``###`` heading), in order, in one working directory per section: a copy of the
repository's files (those git tracks or would track), so that ``apps/...`` and ``runs/...``
mean what they mean in a checkout and nothing is written into the checkout itself.

How a line of a bash block runs:
- An app command (``python apps/rlhf.py``, ``troupe serve``, ``python -m troupe pretrain``,
  also behind ``&&`` or ``ray job submit ... --``) gets the size overrides of ``SIZE`` for its
  app appended, each unless the line sets that key itself: the same commands, shorter runs.
- A server (the ``serve`` app without ``--check`` or ``--print-config``) is started in the
  background; the section goes on once it says where it serves, and it is stopped (SIGINT, as
  Ctrl-C) when the section ends. ``ray start`` runs with RAY_TMPDIR a directory of the
  section's, whose cluster's processes are killed at the section's end (what ``ray stop``
  does, but to that cluster alone); ``troupe hosts up`` is followed by ``troupe hosts down``
  (and is skipped, with the reason, without root or ``ip``/``tc``).
- A line that makes a virtual environment (``python3 -m venv``) runs as written, in the
  section's copy: installs never touch the suite's own environment.
- Any other ``pip install`` runs as ``pip install --dry-run``: the suite's environment must
  already hold what it names, and nothing is installed over it.

Sections run in the background (``Runner``), since a section's commands leave a core idle for
a third of their time (Ray starting and stopping, pip unpacking, a server waiting): those that
need the machine to themselves (``ray start``, ``troupe hosts``) one after another before the
suite's shared cluster starts; the others one at a time beside the rest of the suite, once the
shared cluster holds the dashboard's port (their apps' embedded clusters take the next free
one), and two at a time once the suite's other tests are done. Sections that would get in each
other's way never overlap: what each holds alone is in ``holds``.

A block preceded by ``<!-- readme-test: not here: REASON -->`` cannot run on this machine
(a cloud account, GPUs); its app commands are checked with ``--print-config`` instead (the
recipe and every key valid), and the files a ``ray up/down/dashboard`` line names must exist.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DOCUMENTS = ["README.md", *sorted(p.relative_to(ROOT).as_posix()
                                  for p in (ROOT / "docs").glob("*.md"))]
COMMANDS = ("bash", "python")
APP = re.compile(r"(?:python3?\s+apps/(rlhf|pretrain|serve|compress)\.py"
                 r"|troupe\s+(rlhf|pretrain|serve|compress)"
                 r"|python3?\s+-m\s+troupe\s+(rlhf|pretrain|serve|compress))\b")
SERVING = re.compile(r"serving \S+ at (http://\S+)/v1")
NOT_HERE = re.compile(r"<!--\s*readme-test:\s*not here:\s*(.+?)\s*-->")

# Size overrides: each app command runs a few steps instead of a full run.
SIZE = {
    "rlhf": ["sft.steps=2", "reward.steps=2", "step3.iterations=1", "step3.eval_every=1",
             "step3.checkpoint_every=1", "dpo.steps=2", "dpo.eval_every=1", "task.eval_examples=8",
             "step3.prompts_per_iter=4", "sft.batch_size=4", "reward.batch_size=4",
             "dpo.batch_size=4", "workers=1"],  # one rank a role (5-6 s less a command); the
    # newcomer's first command keeps the recipe's two (with_sizes' keep), as the driver tests do
    "pretrain": ["train.steps=2", "train.eval_every=2", "train.eval_batches=1",
                 "train.checkpoint_every=2"],
    "serve": [],
    "compress": ["train.steps=2", "train.eval_every=2", "train.eval_batches=1",
                 "train.checkpoint_every=2", "train.batch_size=2", "model.seq_len=32",
                 "workers=1"],
}

# Recipes whose model is SmolLM2 (135M parameters) rather than a tiny one: shorter windows and
# one rank, on top of their app's sizes (a README line that sets a key keeps its value).
SIZE_OF_RECIPE = {
    "pretrain-smollm2.yaml": ["model.seq_len=64", "workers=1"],  # 54 s with the recipe's own
    # no step-3 checkpoint (the RLHF section's tiny runs test them): SmolLM2's policy, critic and
    # their Adam states are 4.1 GB and 9 s to write
    "rlhf-smollm2.yaml": ["step3.checkpoint_every=0"],
    "grpo-smollm2.yaml": ["step3.checkpoint_every=0"],
}

# Files a block names as the user's own (``data.path=pairs.jsonl``), written into the section.
FIXTURES = {
    "pairs.jsonl": "".join(json.dumps({"prompt": f"sort {d}:", "chosen": " " + "".join(sorted(d)),
                                       "rejected": " " + d}) + "\n"
                           for d in ["312", "9071", "55102", "846", "2093", "7315", "60", "4821"]
                           * 8),
}


@dataclass
class Block:
    document: str
    line: int          # of the opening fence, 1-based
    section: str
    language: str
    text: str
    not_here: str | None = None

    @property
    def where(self) -> str:
        return f"{self.document}:{self.line}"


def blocks(document: str) -> list[Block]:
    """The fenced blocks of ``document`` (relative to the repository), in order."""
    found, section, pending = [], "", None
    lines = (ROOT / document).read_text().splitlines()
    i = 0
    while i < len(lines):
        line = lines[i]
        if line.startswith("#"):
            section = line.lstrip("#").strip()
        elif (m := NOT_HERE.search(line)):
            pending = m.group(1)
        elif line.startswith("```"):
            start, body = i, []
            i += 1
            while i < len(lines) and not lines[i].startswith("```"):
                body.append(lines[i])
                i += 1
            found.append(Block(document, start + 1, section, line[3:].strip(), "\n".join(body),
                               pending))
            pending = None
        elif line.strip():
            pending = None if not line.startswith("<!--") else pending
        i += 1
    return found


def all_blocks() -> list[Block]:
    return [b for d in DOCUMENTS for b in blocks(d)]


def sections() -> dict[str, list[Block]]:
    """The command blocks by section (``document: heading``), in document order."""
    out: dict[str, list[Block]] = {}
    for b in all_blocks():
        if b.language in COMMANDS:
            out.setdefault(f"{b.document}: {b.section}", []).append(b)
    return out


def shell_lines(text: str) -> list[str]:
    """The commands of a bash block: continuation lines joined, comments and blanks dropped,
    a trailing comment cut off."""
    joined = re.sub(r"\\\n\s*", "", text)
    out = []
    for line in joined.splitlines():
        line = re.sub(r"\s+#\s.*$", "", line).strip()
        if line and not line.startswith("#"):
            out.append(line)
    return out


def with_sizes(line: str, keep: tuple[str, ...] = ()) -> str:
    """``line`` with its app command's size overrides appended (the keys it sets, and the
    keys ``keep`` names, kept)."""
    m = APP.search(line)
    if not m or "--print-config" in line or "--help" in line:
        return line
    app = next(g for g in m.groups() if g)
    given = set(re.findall(r"(?:^|\s)([\w.]+)=", line[m.end():])) | set(keep)
    recipe = re.search(r"--config\s+\S*?([\w.-]+\.yaml)", line)
    sizes = {o.split("=")[0]: o for o in SIZE[app]}
    sizes.update((o.split("=")[0], o) for o in SIZE_OF_RECIPE.get(recipe.group(1) if recipe
                                                                else "", []))
    extra = [o for key, o in sizes.items() if key not in given]
    return " ".join([line, *extra])


def app_of(line: str) -> str | None:
    m = APP.search(line)
    return next(g for g in m.groups() if g) if m else None


def is_server(line: str) -> bool:
    """Whether ``line`` starts a server (the serve app, not only checking its config)."""
    return app_of(line) == "serve" and not re.search(r"--check|--print-config|--help", line)


def slug(name: str) -> str:
    """A section's name as a test id and a directory name."""
    return re.sub(r"[^A-Za-z0-9]+", "-", name).strip("-")


@dataclass
class Section:
    """One section's working directory, its environment and what it left running."""

    workdir: Path
    timings: list[dict] = field(default_factory=list)
    servers: list[subprocess.Popen] = field(default_factory=list)
    hosts_up: bool = False  # `troupe hosts up` ran: `troupe hosts down` at the end, whatever
    ray_tmp: Path | None = None  # RAY_TMPDIR of a section that runs `ray start`

    @classmethod
    def make(cls, tmp: Path) -> "Section":
        files = subprocess.run(["git", "ls-files", "-co", "--exclude-standard", "-z"], cwd=ROOT,
                               capture_output=True, text=True, check=True).stdout.split("\0")
        for name in filter(None, files):
            src = ROOT / name
            if src.is_file():
                (tmp / name).parent.mkdir(parents=True, exist_ok=True)
                shutil.copy2(src, tmp / name)
        for name, text in FIXTURES.items():
            (tmp / name).write_text(text)
        return cls(tmp)

    def env(self) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items()
               if k not in ("RAY_ADDRESS", "TROUPE_API_KEY", "VIRTUAL_ENV")}
        env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
        env["PYTHONUNBUFFERED"] = "1"
        if self.ray_tmp is not None:
            env["RAY_TMPDIR"] = str(self.ray_tmp)
        return env

    def run(self, command: str, what: str, timeout: float = 900) -> str:
        """Run one command line with bash in the working directory; AssertionError naming
        the line and showing the end of its output unless it exits 0."""
        start = time.monotonic()
        out = subprocess.run(["bash", "-c", command], cwd=self.workdir, env=self.env(),
                             capture_output=True, text=True, timeout=timeout)
        self.timings.append({"block": what, "command": command,
                             "seconds": round(time.monotonic() - start, 1)})
        text = out.stdout + out.stderr
        assert out.returncode == 0, f"{what}: `{command}` exited {out.returncode}:\n{text[-4000:]}"
        return text

    def serve(self, command: str, what: str, timeout: float = 600) -> str:
        """Start a server in the background; returns its URL once it says where it serves."""
        # SIGINT as a terminal has it: a suite started in the background (CI, `cmd &`) ignores
        # it, the server would inherit that, and the Ctrl-C at the section's end would not stop
        # it (60 s, then a kill, in each section with a server)
        proc = subprocess.Popen(["bash", "-c", f"exec {command}"], cwd=self.workdir,
                                env=self.env(), stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, text=True, start_new_session=True,
                                preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
        self.servers.append(proc)
        seen: list[str] = []
        url: list[str] = []
        ready = threading.Event()

        def read():
            for line in proc.stdout:
                seen.append(line)
                if not url and (m := SERVING.search(line)):
                    url.append(m.group(1))
                    ready.set()
            ready.set()

        threading.Thread(target=read, daemon=True).start()
        start = time.monotonic()
        ready.wait(timeout)
        self.timings.append({"block": what, "command": command + "  (until it serves)",
                             "seconds": round(time.monotonic() - start, 1)})
        assert url, f"{what}: `{command}` never said where it serves:\n{''.join(seen)[-4000:]}"
        return url[0]

    def close(self) -> None:
        for proc in self.servers:
            if proc.poll() is None:
                start = time.monotonic()
                os.killpg(proc.pid, signal.SIGINT)
                try:
                    proc.wait(60)
                    how = "stopped by Ctrl-C"
                except subprocess.TimeoutExpired:
                    os.killpg(proc.pid, signal.SIGKILL)
                    proc.wait()
                    how = "still running 60 s after Ctrl-C: killed"
                self.timings.append({"block": "(end of section)", "command": f"server {how}",
                                     "seconds": round(time.monotonic() - start, 1)})
        if self.ray_tmp is not None:
            stop_ray_under(self.ray_tmp)
        if self.hosts_up:
            subprocess.run([sys.executable, "-m", "troupe", "hosts", "down"], env=self.env(),
                           cwd=self.workdir, capture_output=True)


def stop_ray_under(tmp: Path) -> None:
    """Kill the processes of the Ray cluster whose files are under ``tmp`` (RAY_TMPDIR of
    its ``ray start``; each of its processes names that directory in its command line), as
    ``ray stop --force`` would but for that cluster alone; then remove ``tmp``."""
    import psutil

    mine = []
    for proc in psutil.process_iter(["cmdline"]):
        if any(str(tmp) in arg for arg in proc.info["cmdline"] or ()):
            mine.append(proc)
    for proc in mine:
        try:
            proc.kill()
        except psutil.NoSuchProcess:
            pass
    psutil.wait_procs(mine, timeout=30)
    shutil.rmtree(tmp, ignore_errors=True)


def run_block(section: Section, block: Block) -> None:
    """Run one block per the rules of this module's docstring."""
    what = f"{block.where} ({block.section})"
    if block.language == "python":
        script = section.workdir / f"block_{block.line}.py"
        script.write_text(block.text + "\n")
        section.run(f"python {script.name}", what)
        return
    for line in shell_lines(block.text):
        if block.not_here is not None:
            check_not_here(section, line, what)
        elif "-m venv" in line:  # a newcomer's first run: the recipe's data-parallel ranks
            section.run(with_sizes(line, keep=("workers",)), what, timeout=1800)
        elif re.search(r"\bpip install\b", line):
            text = section.run(re.sub(r"\bpip install\b", "pip install --dry-run", line), what)
            assert "Would install" not in text, f"{what}: the suite's environment lacks " \
                                                f"what `{line}` installs:\n{text[-2000:]}"
        elif is_server(line):
            section.serve(with_sizes(line), what)
        else:
            if re.search(r"\bray start\b", line) and section.ray_tmp is None:
                # its cluster's files under a directory of the section's own, so that the
                # section's end stops that cluster alone (``ray stop`` ends every Ray process
                # of the machine: the emulated hosts' of tests/runtime/test_hosts.py too)
                section.ray_tmp = Path(tempfile.mkdtemp(prefix="trs-", dir="/tmp"))
            if re.search(r"\btroupe hosts up\b", line):
                from troupe.runtime.hosts import HostsError, check_tools
                try:
                    check_tools()
                except HostsError as e:  # no root, no `ip`: the section cannot run here
                    import pytest
                    pytest.skip(f"{what}: {e}")
                section.hosts_up = True
            section.run(with_sizes(line), what)


def check_not_here(section: Section, line: str, what: str) -> None:
    """A line of a block that cannot run here, checked as far as this machine allows."""
    for part in re.split(r"&&|;|(?<!\|)\|(?!\|)|&", line):
        m = APP.search(part)
        if m:
            command = part[m.start():].strip()
            if "--print-config" not in command:
                command += " --print-config"
            section.run(command, what)
        elif (r := re.search(r"\bray (?:up|down|dashboard)\s+(\S+)", part)):
            assert (section.workdir / r.group(1)).is_file(), f"{what}: {r.group(1)} is missing"


def test_command(block: Block) -> str:
    """The one line of the README's test block."""
    lines = shell_lines(block.text)
    assert len(lines) == 1, block.where
    return lines[0]


def holds(blocks: list[Block]) -> set[str]:
    """What a section holds while it runs, so that sections running at once never share it:

    - "machine": ``ray start`` takes the machine's default ports (6379, and 8265, where a
      job submitted to 127.0.0.1:8265 needs the dashboard of its own cluster); ``troupe
      hosts`` sections run the same way, no other section and no cluster of the suite's
      beside them (tests/runtime/test_hosts.py's emulated hosts excepted: their own names,
      namespaces and Ray directories);
    - "port": a server binds the recipes' port;
    - "smollm2": the 135M model's runs, 3-7 GB each at their peak (the Hugging Face section's
      RLHF run 7.0 GB, the RLHF section's GRPO run 4.4); held alone only on a machine with
      less than ``ROOMY`` available (``Runner``).
    """
    text = "\n".join(b.text for b in blocks if b.not_here is None)
    held = set()
    if re.search(r"\bray (?:start|stop)\b|\btroupe hosts\b", text):
        held.add("machine")
    lines = [line for b in blocks if b.language == "bash" and b.not_here is None
             for line in shell_lines(b.text)]
    if any(is_server(line) for line in lines):
        held.add("port")
    if "smollm2" in text.lower():
        held.add("smollm2")
    return held


def may_start(mine: set[str], running: list[set[str]], lanes: int) -> bool:
    """Whether a section holding ``mine`` may start beside sections holding ``running``."""
    if "machine" in mine:
        return not running
    held = set().union(*running)
    return len(running) < lanes and "machine" not in held and not mine & held


def selected(session, own_cluster: bool) -> list[str]:
    """The sections whose tests (tests/test_readme.py) the pytest ``session`` selected: those
    that run before the suite's shared cluster (``own_cluster``), or those beside the suite."""
    return [item.callspec.params["name"] for item in session.items
            if item.originalname == "test_section_runs_as_written"
            and (item.get_closest_marker("own_cluster") is not None) == own_cluster]


def build_smollm2(names: list[str], blocks: dict[str, list[Block]]) -> None:
    """SmolLM2's directory (troupe.models.smollm2), built before any of the sections ``names``
    that name it runs: its recipes read ~/.cache/troupe/smollm2-135m-instruct, which the
    Hugging Face section builds but another section may run first. Nothing where it cannot be
    built (those sections then fail naming the directory)."""
    from troupe.models import smollm2
    if any("smollm2" in holds(blocks[n]) for n in names) and smollm2.missing() is None:
        smollm2.build()


ROOMY = 16 << 30  # bytes available at the start for two SmolLM2 sections at once


def available_memory() -> int:
    """MemAvailable of /proc/meminfo in bytes (0 where there is none)."""
    try:
        text = Path("/proc/meminfo").read_text()
    except OSError:
        return 0
    m = re.search(r"^MemAvailable:\s+(\d+) kB", text, re.M)
    return int(m.group(1)) << 10 if m else 0


class Runner:
    """Runs sections in background threads, ``lanes`` at a time, each alone with what it
    holds (``holds``); ``result(name)`` waits for a section and re-raises its failure.
    Sections that hold something start first (they form chains that cannot overlap), sections
    holding "machine" last and alone."""

    def __init__(self, names: list[str], blocks: dict[str, list[Block]], workdir: Path,
                 lanes: int = 2):
        self.blocks, self.workdir = blocks, workdir
        self.holds = {n: holds(blocks[n]) for n in names}
        if available_memory() >= ROOMY:
            self.holds = {n: h - {"smollm2"} for n, h in self.holds.items()}
        self.pending = sorted(names, key=lambda n: ("machine" in self.holds[n],
                                                    not self.holds[n]))
        self.running: set[str] = set()
        self.done: dict[str, tuple[BaseException | None, str]] = {}
        self.timings: dict[str, list[dict]] = {}  # each section's commands, as they finish
        self.lanes = max(1, lanes)
        self.cond = threading.Condition()
        threading.Thread(target=self._schedule, name="readme-sections", daemon=True).start()

    def widen(self, lanes: int) -> None:
        """Let ``lanes`` sections run at once from now on."""
        with self.cond:
            self.lanes = max(self.lanes, lanes)
            self.cond.notify_all()

    def _schedule(self) -> None:
        with self.cond:
            while self.pending:
                held = [self.holds[r] for r in self.running]
                ready = next((n for n in self.pending
                              if may_start(self.holds[n], held, self.lanes)), None)
                if ready is None:
                    self.cond.wait()
                    continue
                self.pending.remove(ready)
                self.running.add(ready)
                threading.Thread(target=self._run, args=(ready,), daemon=True).start()

    def _run(self, name: str) -> None:
        workdir = self.workdir / slug(name)
        workdir.mkdir(parents=True)
        error, trace = None, ""
        try:
            section = Section.make(workdir)
            self.timings[name] = section.timings
            try:
                for block in self.blocks[name]:
                    run_block(section, block)
            finally:
                section.close()
        except BaseException as e:  # noqa: BLE001 - handed to the section's test
            error, trace = e, traceback.format_exc()
        with self.cond:
            self.running.discard(name)
            self.done[name] = (error, trace)
            self.cond.notify_all()

    def result(self, name: str, timeout: float) -> None:
        """Wait for the section to have run; its failure is raised here, with its trace (its
        commands' seconds are in ``timings`` either way)."""
        with self.cond:
            if not self.cond.wait_for(lambda: name in self.done, timeout):
                raise TimeoutError(f"{name}: not finished within {timeout:.0f} s "
                                   f"(running: {sorted(self.running)})")
            error, trace = self.done[name]
        if isinstance(error, AssertionError):
            raise AssertionError(f"{error}\n(in the section's thread)\n{trace}")
        if error is not None:
            raise RuntimeError(f"{name} failed:\n{trace}") from error
