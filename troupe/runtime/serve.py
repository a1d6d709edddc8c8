"""Driver side of serving: the OpenAI-compatible app on Ray Serve, one ServeReplica per
replica, behind Serve's HTTP proxy."""

from __future__ import annotations

import logging
import os
import time
import urllib.request

from troupe.actors.serve import ServeReplica
from troupe.runtime.cluster import init
from troupe.serving.protocol import ServeConfig

log = logging.getLogger(__name__)

APP = "troupe-openai"


def deploy(cfg: ServeConfig, name: str = APP, timeout_s: float = 300.0) -> str:
    """Start (or update) the app on the cluster; returns its base URL once it answers.
    The API key, when ``cfg.api_key_env`` is set in this process, travels to the replicas in
    their runtime environment."""
    from ray import serve

    init()
    serve.start(http_options={"host": cfg.host, "port": cfg.port})
    options: dict = {"num_cpus": cfg.num_cpus}
    key = os.environ.get(cfg.api_key_env)
    if key:
        options["runtime_env"] = {"env_vars": {cfg.api_key_env: key}}
    deployment = serve.deployment(ServeReplica, name="ServeReplica").options(
        num_replicas=cfg.num_replicas,
        # above the replica's own limit, so that it answers 429 rather than Serve queueing
        max_ongoing_requests=cfg.limits.max_concurrent * 2,
        ray_actor_options=options)
    serve.run(deployment.bind(cfg.model_dump()), name=name, route_prefix="/", blocking=False)
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
