"""A role that runs test functions against its collective groups."""

from troupe import collectives


class GroupRank:
    """Runs ``fn(group, *args)`` on this worker for the group named ``group``."""

    def run(self, group: str, fn, *args):
        return fn(collectives.get_group(group), *args)

    def sleep(self, seconds: float) -> None:
        import time
        time.sleep(seconds)
