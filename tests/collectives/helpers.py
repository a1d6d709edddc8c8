"""A role that runs test functions against its collective groups."""

from troupe import collectives
from troupe.runtime import ActorGraph


class GroupRank:
    """Runs ``fn(group, *args)`` on this worker for the group named ``group``."""

    def run(self, group: str, fn, *args):
        return fn(collectives.get_group(group), *args)

    def sleep(self, seconds: float) -> None:
        import time
        time.sleep(seconds)


def gloo_ranks(name: str, world_size: int):
    """Yield the role group of ``world_size`` GroupRank workers sharing gloo group "g"."""
    graph = (ActorGraph(name).role("w", GroupRank, world_size, num_cpus=1)
             .collective("g", ["w"], backend="gloo").build(timeout_s=120, call_timeout_s=300))
    try:
        yield graph["w"]
    finally:
        graph.shutdown()
