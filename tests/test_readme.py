"""The README is executable: every command block of README.md and docs/*.md runs here as
written (size overrides aside; tests/readme.py says how each line runs), section by section,
before the suite's shared Ray cluster starts. A block the harness cannot classify fails."""

from __future__ import annotations

import os

import pytest

from tests import readme

SECTIONS = readme.sections()
TIMINGS: list[dict] = []  # printed at the end of the run (tests/conftest.py)


def test_every_block_has_a_known_language_and_is_listed():
    """Every fenced block says what it is: ``bash`` and ``python`` are run, ``text`` is not a
    command; a block without a language (or another one) fails here, so a new command block
    cannot go untested."""
    found = readme.all_blocks()
    print("\n".join(f"{b.where} {b.language} {b.section!r}"
                    f"{' (not here: ' + b.not_here + ')' if b.not_here else ''}" for b in found))
    bad = [b.where for b in found if b.language not in (*readme.COMMANDS, "text")]
    assert not bad, f"blocks without a known language (bash, python or text): {bad}"
    runnable = [b for blocks in SECTIONS.values() for b in blocks]
    assert len(runnable) == sum(b.language in readme.COMMANDS for b in found) >= 15


def test_ci_runs_the_readme_test_command():
    """.ci/run runs exactly the README's set-up-and-test line."""
    block = next(b for b in readme.blocks("README.md") if b.not_here and "test suite" in
                 b.not_here)
    ci = (readme.ROOT / ".ci" / "run").read_text().strip().splitlines()[-1]
    assert ci == readme.test_command(block)


def test_the_size_overrides_keep_what_a_line_sets():
    line = "python apps/rlhf.py algorithm=grpo step3.prompts_per_iter=8"
    sized = readme.with_sizes(line)
    assert sized.startswith(line) and "step3.prompts_per_iter=4" not in sized
    assert "sft.steps=2" in sized and readme.with_sizes("troupe serve --help") == \
        "troupe serve --help"
    assert "workers=1" in sized and "workers" not in readme.with_sizes(line, keep=("workers",))
    smollm2 = readme.with_sizes("python apps/pretrain.py --config apps/configs/pretrain-smollm2.yaml")
    assert "model.seq_len=64" in smollm2 and "model.seq_len" not in readme.with_sizes(
        "python apps/pretrain.py --config apps/configs/dense-tiny.yaml")
    rlhf = readme.with_sizes("python apps/rlhf.py --config apps/configs/rlhf-smollm2.yaml")
    assert "step3.checkpoint_every=0" in rlhf and "step3.checkpoint_every=1" not in rlhf


@pytest.fixture(scope="session")
def sections_run(request, tmp_path_factory, smollm2):
    """The sections this session selected, started together in the background, two at a time
    (tests/readme.py: Runner); each section's test waits for its own."""
    names = [item.callspec.params["name"] for item in request.session.items
             if item.originalname == "test_section_runs_as_written"]
    return readme.Runner(names, SECTIONS, tmp_path_factory.mktemp("readme"),
                         lanes=min(2, os.cpu_count() or 1))


@pytest.mark.slow
@pytest.mark.own_cluster
@pytest.mark.timeout(3600)  # waits for the sections ahead of it too (each line has its own limit)
@pytest.mark.parametrize("name", list(SECTIONS),
                         ids=[readme.slug(n) for n in SECTIONS])
def test_section_runs_as_written(name, sections_run):
    """Each section's blocks in order (the recipes that name SmolLM2 find it built)."""
    try:
        sections_run.result(name, timeout=3500)
    finally:
        TIMINGS.extend(sections_run.timings.get(name, []))


def test_sections_that_would_clash_never_run_together():
    """What each section holds alone: the cluster section the whole machine, servers their
    port, SmolLM2's runs the model's memory and directory."""
    held = {name: readme.holds(blocks) for name, blocks in SECTIONS.items()}
    assert any("machine" in h for h in held.values()), held
    assert sum("port" in h for h in held.values()) >= 2, held
    assert sum("smollm2" in h for h in held.values()) >= 2, held
    for a in held.values():
        assert readme.may_start(a, [], lanes=2) and not readme.may_start(a, [set(), set()], 2)
        for b in held.values():
            clash = "machine" in a | b or a & b
            assert readme.may_start(b, [a], lanes=2) == (not clash), (a, b)


def test_a_failing_section_fails_its_own_test_and_no_other(tmp_path):
    """A section runs in the runner's thread; its failure is raised in its own test, with the
    line at fault, while the section beside it passes."""
    blocks = {"doc: bad": [readme.Block("doc", 1, "bad", "bash", "true\nexit 3")],
              "doc: good": [readme.Block("doc", 5, "good", "bash", "echo fine")]}
    runner = readme.Runner(list(blocks), blocks, tmp_path, lanes=2)
    runner.result("doc: good", 120)
    assert [t["command"] for t in runner.timings["doc: good"]] == ["echo fine"]
    with pytest.raises(AssertionError, match="`exit 3` exited 3"):
        runner.result("doc: bad", 120)
    assert [t["command"] for t in runner.timings["doc: bad"]] == ["true", "exit 3"]
