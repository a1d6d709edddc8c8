"""troupe.init: join the cluster named by an address or RAY_ADDRESS, or start an embedded one.

The embedded cluster runs with Ray's token authentication on and its dashboard on 127.0.0.1;
Ray's own gRPC servers listen on every interface (Ray resolves 127.0.0.1 to the routable
address on purpose), and the token is what guards them. troupe's own sockets stay on loopback
(see troupe.actors.store). Joining a cluster started with ``ray start`` first asks the cluster whether it
wants a token, and then uses the token that Ray's client finds: ``RAY_AUTH_TOKEN``, the file named
by ``RAY_AUTH_TOKEN_PATH``, or ``~/.ray/auth_token``.

A driver that joined a cluster watches its head: Ray's GCS keeps the cluster's state in the
head's memory (without external storage), and when the head is lost the cluster is gone, while
Ray's own clients retry for a minute and then end the process with their own fatal logs. When
the GCS's port has refused or ignored connections for ``HEAD_TIMEOUT_S``, the driver prints
one line saying so (run again on a new cluster: the last checkpoint resumes) and exits with
status 1.
"""

from __future__ import annotations

import logging
import os
import socket
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import ray

from troupe.config import ConfigError
from troupe.errors import ClusterConnectionError

log = logging.getLogger(__name__)

AUTH_MODE_ENV = "RAY_AUTH_MODE"
HEAD_TIMEOUT_S = 30.0  # the head's GCS unreachable this long: the cluster is gone (Ray: 60 s)


@dataclass(frozen=True)
class ClusterInfo:
    """What troupe.init found: where the cluster is and what it offers."""

    address: str
    embedded: bool
    nodes: int
    num_cpus: float
    num_gpus: float
    resources: dict[str, float] = field(default_factory=dict)
    dashboard_url: str | None = None
    auth_mode: str = "token"


def _token_available() -> bool:
    if os.environ.get("RAY_AUTH_TOKEN"):
        return True
    path = os.environ.get("RAY_AUTH_TOKEN_PATH") or Path.home() / ".ray" / "auth_token"
    return Path(path).is_file()


def _cluster_auth_mode(address: str) -> str | None:
    """"token" or "disabled": whether the cluster at ``address`` asks its callers for a token.

    One unauthenticated call to the GCS tells. None when it cannot be told: a ``ray://`` client
    address, a GCS that does not answer (or speaks TLS), a Ray without these modules.
    """
    if address.startswith("ray://"):
        return None
    try:
        import grpc
        from ray._private.services import canonicalize_bootstrap_address
        from ray.core.generated import gcs_service_pb2, gcs_service_pb2_grpc

        gcs = canonicalize_bootstrap_address(address)
    except Exception:  # an address Ray resolves differently, or no cluster recorded for "auto"
        return None
    if gcs is None:
        return None
    with grpc.insecure_channel(gcs) as channel:
        stub = gcs_service_pb2_grpc.NodeInfoGcsServiceStub(channel)
        try:
            stub.GetClusterId(gcs_service_pb2.GetClusterIdRequest(), timeout=10)
        except grpc.RpcError as e:
            return "token" if e.code() == grpc.StatusCode.UNAUTHENTICATED else None
    return "disabled"


def _match_cluster_auth(address: str) -> str:
    """Set this driver's token authentication to the cluster's and return the mode.

    Both sides must agree: a driver without a token is refused by a cluster that wants one, and a
    driver in token mode on a cluster without it sees its actors die before they start (the
    cluster's calls back to the driver carry no token). Ray turns token mode on by itself only
    for ``address="auto"``; here it follows the cluster, and says clearly when the token is
    missing or RAY_AUTH_MODE contradicts the cluster.
    """
    cluster = _cluster_auth_mode(address)
    here = os.environ.get(AUTH_MODE_ENV)
    if cluster is None:  # cannot tell: use the token if there is one
        if here is None and _token_available():
            _enable_token_auth()
        return os.environ.get(AUTH_MODE_ENV, "disabled")
    if cluster == "token":
        if here is not None and here.lower() != "token":
            raise ClusterConnectionError(
                f"the Ray cluster at {address!r} requires a token, but {AUTH_MODE_ENV}={here} "
                f"here: set {AUTH_MODE_ENV}=token (or unset it).")
        if not _token_available():
            raise ClusterConnectionError(
                f"the Ray cluster at {address!r} requires a token and this machine has none: copy "
                "the head node's ~/.ray/auth_token here, or set RAY_AUTH_TOKEN_PATH to its copy "
                "(or RAY_AUTH_TOKEN to its text).")
        if here is None:
            _enable_token_auth()
        return "token"
    if here is not None and here.lower() == "token":
        raise ClusterConnectionError(
            f"the Ray cluster at {address!r} runs without token authentication, but "
            f"{AUTH_MODE_ENV}=token here: its actors would die before they start. Start the "
            f"cluster with token authentication (`ray start` does so by default), or unset "
            f"{AUTH_MODE_ENV} to join it as it is.")
    log.warning("the Ray cluster at %r runs without token authentication: anyone who reaches "
                "its ports can run code on it", address)
    return "disabled"


def _enable_token_auth() -> None:
    """Turn token auth on in this process; Ray reads RAY_AUTH_MODE once, so it must re-read it."""
    try:
        from ray._private.authentication.authentication_token_setup import _enable_token_auth
    except ImportError:  # a Ray without token authentication
        return
    _enable_token_auth()


def _info(embedded: bool) -> ClusterInfo:
    ctx = ray.get_runtime_context()
    total = ray.cluster_resources()
    alive = [n for n in ray.nodes() if n.get("Alive")]
    return ClusterInfo(
        address=ctx.gcs_address,
        embedded=embedded,
        nodes=len(alive),
        num_cpus=total.get("CPU", 0.0),
        num_gpus=total.get("GPU", 0.0),
        resources=dict(total),
        dashboard_url=_dashboard_url,
        auth_mode=_auth_mode,
    )


_embedded = False
_dashboard_url: str | None = None
_auth_mode = "token"


def init(address: str | None = None, *, num_cpus: float | None = None,
         num_gpus: float | None = None, namespace: str = "troupe", **ray_kwargs: Any) -> ClusterInfo:
    """Connect to Ray (idempotent) and return what the cluster offers.

    Args:
        address: a cluster address ("auto", "host:port", "ray://..."); defaults to RAY_ADDRESS,
            which ``ray job submit`` sets for its jobs. Without either, an embedded local cluster
            starts, bound to 127.0.0.1, with token authentication.
        num_cpus, num_gpus: logical resources of the embedded cluster (default: the machine's).
        namespace: Ray namespace for named actors.
        ray_kwargs: passed to ``ray.init`` as they are.
    """
    if ray.is_initialized():
        return _info(_embedded)
    address = address or os.environ.get("RAY_ADDRESS") or None
    if address:
        return _join(address, namespace, ray_kwargs)
    return _start_embedded(num_cpus, num_gpus, namespace, ray_kwargs)


def check_local_capacity(cpus: float, what: str) -> None:
    """Before Ray starts: ConfigError when the embedded cluster ``init()`` would start (the
    machine's cores; it cannot grow) has fewer CPUs than a run asks for in all (``what``
    says for what). Nothing is checked when the run joins a cluster (RAY_ADDRESS), which may
    grow, or when Ray is already connected (a graph then names what the cluster lacks)."""
    if ray.is_initialized() or os.environ.get("RAY_ADDRESS"):
        return
    have = os.cpu_count() or 1
    if cpus > have + 1e-9:
        raise ConfigError(f"{what} ask for {cpus:g} CPUs in all, and the local cluster this "
                          f"machine starts has {have} (it cannot grow): lower them, or join a "
                          "cluster with RAY_ADDRESS")


def _join(address: str, namespace: str, ray_kwargs: dict[str, Any]) -> ClusterInfo:
    """Join the cluster at ``address`` with its authentication mode."""
    global _embedded, _dashboard_url, _auth_mode
    _auth_mode = _match_cluster_auth(address)
    try:
        ctx = ray.init(address=address, namespace=namespace, **ray_kwargs)
    except Exception as e:
        hint = ""
        if os.environ.get(AUTH_MODE_ENV) == "token":
            hint = (" Token authentication is on: check that this machine's token (RAY_AUTH_TOKEN,"
                    " RAY_AUTH_TOKEN_PATH or ~/.ray/auth_token) is the head node's.")
        elif "auth" in str(e).lower() or "token" in str(e).lower():
            hint = (" The cluster requires a token: copy the head node's ~/.ray/auth_token "
                    "to this machine (or set RAY_AUTH_TOKEN_PATH / RAY_AUTH_TOKEN) and set "
                    f"{AUTH_MODE_ENV}=token.")
        raise ClusterConnectionError(f"cannot join Ray cluster at {address!r}: {e}.{hint}") from e
    _embedded, _dashboard_url = False, ctx.dashboard_url or None
    info = _info(False)
    _watch_head(info.address)
    return info


_watching: threading.Event | None = None


def _watch_head(gcs_address: str, timeout_s: float = HEAD_TIMEOUT_S) -> None:
    """A daemon thread that connects to the GCS's port every second and, once it has failed
    for ``timeout_s`` in a row, prints one line and ends the process (status 1). The line
    starts on a line of its own (a progress bar may be drawing on stderr)."""
    global _watching
    host, _, port = gcs_address.rpartition(":")
    stop = _watching = threading.Event()

    def watch() -> None:
        since = None
        while not stop.wait(1.0):
            try:
                socket.create_connection((host, int(port)), timeout=2.0).close()
                since = None
                continue
            except OSError:
                since = since or time.monotonic()
            if time.monotonic() - since >= timeout_s and not stop.is_set():
                print(f"\nerror: the Ray cluster's head at {gcs_address} has not answered for "
                      f"{timeout_s:g}s: its GCS, and with it the cluster, is gone (Ray keeps "
                      "the cluster's state there); the run stopped. Run it again on a new "
                      "cluster to continue from its last checkpoint (pretraining resumes by "
                      "itself, RLHF with --resume)",
                      file=sys.stderr, flush=True)
                os._exit(1)

    threading.Thread(target=watch, name="troupe-head-watch", daemon=True).start()


def _start_embedded(num_cpus: float | None, num_gpus: float | None, namespace: str,
                    ray_kwargs: dict[str, Any]) -> ClusterInfo:
    """A new local cluster on 127.0.0.1 with token authentication (unless RAY_AUTH_MODE
    says otherwise)."""
    global _embedded, _dashboard_url, _auth_mode
    if os.environ.get(AUTH_MODE_ENV, "token").lower() != "token":
        log.warning("%s=%s: the embedded cluster runs without token authentication",
                    AUTH_MODE_ENV, os.environ[AUTH_MODE_ENV])
    # With RAY_AUTH_MODE unset, Ray (>= 2.5x) turns token auth on for a new local cluster and
    # creates ~/.ray/auth_token if needed; the setting is inherited by every worker it starts.
    _auth_mode = os.environ.get(AUTH_MODE_ENV, "token").lower()
    ctx = ray.init(
        address="local",  # a new cluster, never one that `ray start` left on this machine
        num_cpus=num_cpus if num_cpus is not None else os.cpu_count(),
        num_gpus=num_gpus,
        namespace=namespace,
        include_dashboard=ray_kwargs.pop("include_dashboard", True),
        dashboard_host="127.0.0.1",
        _node_ip_address="127.0.0.1",
        **ray_kwargs,
    )
    _embedded, _dashboard_url = True, ctx.dashboard_url or None
    return _info(True)


def shutdown() -> None:
    """Disconnect from Ray, stopping the embedded cluster if troupe started it."""
    global _embedded, _watching
    if _watching is not None:
        _watching.set()
        _watching = None
    ray.shutdown()
    _embedded = False
