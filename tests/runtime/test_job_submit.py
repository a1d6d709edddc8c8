"""`ray start --head` with token auth, then `ray job submit` of a script that uses troupe.init()."""

import secrets
import subprocess
import textwrap
import time

import pytest

from tests.runtime.helpers import RAY, ray_head

pytestmark = pytest.mark.own_cluster

JOB = textwrap.dedent("""
    import troupe
    from troupe.runtime import ActorGraph, get_context

    class Hello:
        def hi(self):
            return f"{get_context().role}-{get_context().rank}"

    info = troupe.init()
    print("embedded:", info.embedded, "auth:", info.auth_mode)
    graph = ActorGraph("job").role("greeter", Hello, 2, num_cpus=0.5).build(timeout_s=60)
    print("results:", graph["greeter"].invoke(Hello.hi))
    graph.shutdown()
""")


@pytest.fixture(scope="module")
def head(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("head")
    with ray_head(tmp) as head:
        (tmp / "job").mkdir()
        (tmp / "job" / "job.py").write_text(JOB)
        yield {**head, "tmp": tmp}


def submit(head, **env_overrides):
    env = {**head["env"], **env_overrides}
    env = {k: v for k, v in env.items() if v is not None}
    for _ in range(30):  # a fresh head's job agent may not be up yet: Ray says to try again
        out = subprocess.run(
            [RAY, "job", "submit", "--address", head["url"], "--working-dir",
             str(head["tmp"] / "job"), "--", "python", "job.py"],
            env=env, capture_output=True, text=True, timeout=180)
        if "No available agent" not in out.stdout + out.stderr:
            return out
        time.sleep(2)
    return out


@pytest.mark.slow
def test_job_with_token_succeeds(head):
    out = submit(head)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "embedded: False auth: token" in out.stdout
    assert "results: ['greeter-0', 'greeter-1']" in out.stdout


@pytest.mark.slow
def test_job_without_the_token_is_refused(head):
    missing = submit(head, RAY_AUTH_MODE=None, RAY_AUTH_TOKEN_PATH=None)
    assert "Missing authentication token" in missing.stdout + missing.stderr
    wrong = head["tmp"] / "wrong"
    wrong.write_text(secrets.token_hex(32))
    refused = submit(head, RAY_AUTH_TOKEN_PATH=str(wrong))
    assert refused.returncode != 0
    assert "Invalid authentication token" in refused.stdout + refused.stderr
    assert "results:" not in missing.stdout + refused.stdout
