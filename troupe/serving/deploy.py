"""Driver side of serving: the OpenAI-compatible app on Ray Serve, one ServeReplica per
replica, behind Serve's HTTP proxy. With ``expert_parallel`` > 1 each replica of a MoE model
builds a graph of ServeRank actors that hold its experts between them and decode its
sequences in lockstep, exchanging tokens through all_to_all; with ``tensor_parallel`` > 1 its
ServeRank actors hold a shard of every layer and run every sequence together
(troupe.serving.ranks)."""

from __future__ import annotations

import ipaddress
import logging
import time
import urllib.request
from dataclasses import asdict

from troupe.devices import cluster_device
from troupe.runtime.cluster import init
from troupe.serving.auth import KeyDigest, take_key
from troupe.serving.config import ServeConfig
from troupe.serving.ranks import RankedReplica
from troupe.serving.model import locate
from troupe.serving.replica import ServeReplica

log = logging.getLogger(__name__)

APP = "troupe-openai"


def proxy_location(host: str) -> str:
    """Where Serve runs its HTTP proxies: on every node when ``host`` is a wildcard (0.0.0.0,
    ::; a load balancer may reach any node), else on the head alone, the one machine that has
    the address (a proxy elsewhere could not bind it, and Serve retries it forever)."""
    return "EveryNode" if host in ("0.0.0.0", "::", "") else "HeadOnly"


def _loopback(host: str) -> bool:
    try:
        return host == "localhost" or ipaddress.ip_address(host).is_loopback
    except ValueError:  # a host name
        return False


def deploy(cfg: ServeConfig, name: str = APP, timeout_s: float = 300.0,
           key: KeyDigest | None = None) -> str:
    """Start (or update) the app on the cluster; returns its base URL once it answers.
    The API key reaches the replicas only as a salted digest (troupe.serving.auth): never in a
    runtime environment, which Ray logs. ``key``: its digest, as ``take_key`` took it before
    Ray started (the apps do); else the key is taken from ``cfg.api_key_env`` here."""
    from ray import serve

    locate(cfg.model)  # a missing model fails here, not in a replica's traceback
    info = init()
    ranks = max(cfg.expert_parallel, cfg.tensor_parallel)  # the actors of a replica
    needed = cfg.num_replicas * ranks * cfg.num_gpus
    cfg = cfg.model_copy(update={"device": cluster_device(cfg.device, info.num_gpus, needed,
                                                          info.embedded)})
    serve.start(proxy_location=proxy_location(cfg.host),
                http_options={"host": cfg.host, "port": cfg.port,
                              "request_timeout_s": cfg.limits.request_timeout_s})
    options: dict = {"num_cpus": cfg.num_cpus}
    if cfg.device == "cuda" and ranks == 1:  # else the replica's ranks hold the GPUs
        options["num_gpus"] = cfg.num_gpus
    if key is None:
        key = take_key(cfg.api_key_env)[1]
    if key is None and not _loopback(cfg.host):
        log.warning("serving on %s without an API key: anyone who reaches this address can "
                    "use the model (export %s=... to require one)", cfg.host, cfg.api_key_env)
    digest = asdict(key) if key else None
    cls = RankedReplica if ranks > 1 else ServeReplica
    # a replica whose expert rank died is replaced within seconds
    health = (dict(health_check_period_s=1.0, health_check_timeout_s=30.0,
                   graceful_shutdown_timeout_s=5.0) if cls is RankedReplica else {})
    deployment = serve.deployment(cls, name=cls.__name__).options(
        num_replicas=cfg.num_replicas, **health,
        # a stopping replica looks for requests still in flight every 0.25 s (Serve's default,
        # 2 s, made every stop of an idle server take 3 s); it still waits for them all
        graceful_shutdown_wait_loop_s=0.25,
        # above the replica's own limits (in flight, queued, still sending), so that it answers 429
        # rather than Serve queueing
        max_ongoing_requests=(cfg.limits.max_concurrent + cfg.limits.max_queued
                              + cfg.limits.max_receiving + 16),
        ray_actor_options=options)
    serve.run(deployment.bind(cfg.model_dump(), digest), name=name, route_prefix="/",
              blocking=False)
    url = f"http://{cfg.host}:{cfg.port}"
    _wait_healthy(url, timeout_s)
    log.info("serving %s at %s (%d replica(s))", cfg.model.name, url, cfg.num_replicas)
    return url


def shutdown(name: str = APP) -> None:
    from ray import serve

    serve.delete(name)


def _wait_healthy(url: str, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            with urllib.request.urlopen(f"{url}/health", timeout=10) as r:
                if r.status == 200:
                    return
        except OSError as e:
            if time.monotonic() > deadline:
                raise TimeoutError(f"the app at {url} did not answer /health within "
                                   f"{timeout_s:g}s: {e}") from None
        time.sleep(0.5)
