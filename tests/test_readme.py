"""The README is executable: every command block of README.md and docs/*.md runs here as
written (size overrides aside; tests/readme.py says how each line runs), section by section:
those that need the machine to themselves before the suite's shared Ray cluster starts, the
others in the background beside the rest of the suite, waited for at its end. A block the
harness cannot classify fails."""

from __future__ import annotations

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


def _param(name: str):
    """A section that needs the machine to itself (``ray start``, ``troupe hosts``) runs
    before the suite's shared cluster starts (own_cluster); any other in the background
    beside the suite (beside; tests/conftest.py: ``readme_beside``), its test at the end."""
    alone = "machine" in readme.holds(SECTIONS[name])
    return pytest.param(name, id=readme.slug(name),
                        marks=pytest.mark.own_cluster if alone else pytest.mark.beside)


@pytest.fixture(scope="session")
def readme_alone(request, tmp_path_factory):
    """The sections that hold the machine, one after another, before the shared cluster."""
    names = readme.selected(request.session, own_cluster=True)
    readme.build_smollm2(names, SECTIONS)
    return readme.Runner(names, SECTIONS, tmp_path_factory.mktemp("readme-alone"), lanes=1)


@pytest.mark.slow
@pytest.mark.timeout(3600)  # waits for the sections ahead of it too (each line has its own limit)
@pytest.mark.parametrize("name", [_param(n) for n in SECTIONS])
def test_section_runs_as_written(name, request):
    """Each section's blocks in order (the recipes that name SmolLM2 find it built)."""
    alone = request.node.get_closest_marker("own_cluster") is not None
    runner = request.getfixturevalue("readme_alone" if alone else "readme_beside")
    if not alone:  # the suite's other tests are done: the sections left get both cores
        runner.widen(2)
    try:
        runner.result(name, timeout=3500)
    finally:
        TIMINGS.extend(runner.timings.get(name, []))


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
