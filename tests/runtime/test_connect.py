"""troupe.init(address) against clusters started with `ray start`, with token authentication and
without: the driver follows the cluster's mode, and a missing token or a RAY_AUTH_MODE that
contradicts the cluster is a clear error before any actor starts."""

import subprocess
import sys
import textwrap

import pytest

from tests.runtime.helpers import ray_head

pytestmark = pytest.mark.own_cluster

DRIVER = textwrap.dedent("""
    import sys
    import troupe
    from troupe.runtime import ActorGraph, get_context

    class Hello:
        def hi(self):
            return get_context().rank

    info = troupe.init(sys.argv[1])
    graph = ActorGraph("hello").role("greeter", Hello, 2, num_cpus=0.5).build(timeout_s=60)
    print("auth:", info.auth_mode, "results:", graph["greeter"].invoke(Hello.hi))
    graph.shutdown()
""")


@pytest.fixture(scope="module", params=["disabled", "token"])
def head(request, tmp_path_factory):
    tmp = tmp_path_factory.mktemp(f"head-{request.param}")
    with ray_head(tmp, auth_mode=request.param, num_cpus=1) as head:
        yield {**head, "mode": request.param, "tmp": tmp}


def drive(head, name: str, token: bool, auth_mode: str | None = None):
    """Run DRIVER against the head from a machine-like environment of its own: a fresh home,
    holding a copy of the token file when ``token``."""
    home = head["tmp"] / name
    home.mkdir()
    if token:
        (home / ".ray").mkdir()
        (home / ".ray" / "auth_token").write_text(head["token"].read_text())
    env = {k: v for k, v in head["env"].items()
           if k not in ("RAY_AUTH_MODE", "RAY_AUTH_TOKEN_PATH", "RAY_AUTH_TOKEN", "RAY_ADDRESS")}
    env["HOME"] = str(home)
    if auth_mode:
        env["RAY_AUTH_MODE"] = auth_mode
    return subprocess.run([sys.executable, "-c", DRIVER, head["address"]], env=env,
                          capture_output=True, text=True, timeout=180)


@pytest.mark.slow
def test_driver_with_a_token_file_follows_the_cluster(head):
    # Before: a token file alone turned token mode on, and on a cluster without token auth the
    # driver's actors died unstarted ("cancelled before it started running").
    out = drive(head, "has-token", token=True)
    assert out.returncode == 0, out.stdout + out.stderr
    assert f"auth: {head['mode']} results: [0, 1]" in out.stdout


@pytest.mark.slow
def test_auth_mismatches_are_named(head):
    if head["mode"] == "token":
        out = drive(head, "no-token", token=False)
        assert "requires a token and this machine has none" in out.stderr
        assert "RAY_AUTH_TOKEN_PATH" in out.stderr
        off = drive(head, "mode-off", token=True, auth_mode="disabled")
        assert "requires a token, but RAY_AUTH_MODE=disabled here" in off.stderr
        outs = [out, off]
    else:
        out = drive(head, "mode-token", token=True, auth_mode="token")
        assert "runs without token authentication, but RAY_AUTH_MODE=token here" in out.stderr
        outs = [out]
    for o in outs:
        assert o.returncode != 0 and "ClusterConnectionError" in o.stderr
        assert "results:" not in o.stdout
