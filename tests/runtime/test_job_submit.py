"""`ray start --head` with token auth, then `ray job submit` of a script that uses troupe.init()."""

import os
import secrets
import signal
import socket
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.own_cluster

RAY = str(Path(sys.executable).parent / "ray")

JOB = textwrap.dedent("""
    import troupe
    from troupe.runtime import ActorGraph, get_context

    class Hello:
        def hi(self):
            return f"{get_context().role}-{get_context().rank}"

    info = troupe.init()
    print("embedded:", info.embedded)
    graph = ActorGraph("job").role("greeter", Hello, 2, num_cpus=0.5).build(timeout_s=60)
    print("results:", graph["greeter"].call("hi"))
    graph.shutdown()
""")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def head(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("head")
    token = tmp / "token"
    token.write_text(secrets.token_hex(32))
    (tmp / "home").mkdir()
    port, dash = free_port(), free_port()
    env = {**os.environ, "RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN_PATH": str(token),
           "HOME": str(tmp / "home")}
    env.pop("RAY_ADDRESS", None)
    proc = subprocess.Popen(
        [RAY, "start", "--head", f"--port={port}", f"--dashboard-port={dash}",
         "--dashboard-host=127.0.0.1", "--node-ip-address=127.0.0.1", "--num-cpus=2", "--block"],
        env=env, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT, start_new_session=True)
    url = f"http://127.0.0.1:{dash}"
    deadline = time.monotonic() + 90
    while subprocess.run([RAY, "job", "list", "--address", url], env=env,
                         capture_output=True).returncode != 0:
        assert proc.poll() is None and time.monotonic() < deadline, "ray start --head failed"
        time.sleep(1)
    (tmp / "job").mkdir()
    (tmp / "job" / "job.py").write_text(JOB)
    yield {"url": url, "token": token, "tmp": tmp, "env": env}
    os.killpg(proc.pid, signal.SIGTERM)
    proc.wait(timeout=60)


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
    assert "embedded: False" in out.stdout
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
