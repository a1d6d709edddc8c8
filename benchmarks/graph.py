"""ActorGraph build time and the overhead of one `call` round trip, beside plain Ray.

    python benchmarks/graph.py [--workers 8] [--calls 200] [--builds 5]

Baselines measured in the same run: building = starting the same number of plain Ray actors
in one placement group and waiting until each answers; a call = `ray.get` of one plain actor
method (and of one per actor for the all-worker call). One JSON line per figure.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import ray
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

import troupe
from troupe.actors import Dispatch, dispatch
from troupe.runtime import ActorGraph


class Noop:
    def noop(self, x=None):
        return x

    @dispatch(Dispatch.RANK0)
    def noop_on_rank0(self, x=None):
        return x


@ray.remote(num_cpus=0.25)
class PlainNoop(Noop):
    pass


def build_troupe(workers: int, collective: bool) -> tuple[float, object]:
    g = ActorGraph("bench").role("w", Noop, workers, num_cpus=0.25)
    if collective:
        g.collective("dp", ["w"], backend="gloo")
    t0 = time.perf_counter()
    graph = g.build(timeout_s=300)
    return time.perf_counter() - t0, graph


def build_plain(workers: int) -> tuple[float, list]:
    t0 = time.perf_counter()
    pg = ray.util.placement_group([{"CPU": 0.25}] * workers)
    ray.get(pg.ready())
    actors = [PlainNoop.options(scheduling_strategy=PlacementGroupSchedulingStrategy(
        pg, placement_group_bundle_index=i)).remote() for i in range(workers)]
    ray.get([a.noop.remote() for a in actors])
    seconds = time.perf_counter() - t0
    for a in actors:
        ray.kill(a)
    ray.util.remove_placement_group(pg)
    return seconds, actors


def timed(fn, calls: int) -> float:
    fn()
    samples = []
    for _ in range(calls):
        t0 = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - t0)
    return statistics.median(samples)


def emit(**row) -> None:
    print(json.dumps({"bench": "graph", **row}), flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workers", type=int, default=8)
    ap.add_argument("--calls", type=int, default=200)
    ap.add_argument("--builds", type=int, default=5)
    args = ap.parse_args()
    # the graph and the plain baseline actors (0.25 CPU each) are alive together
    info = troupe.init(num_cpus=args.workers * 0.25 * 2 + 1)
    w = args.workers

    for collective in (False, True):
        ours, plain = [], []
        for _ in range(args.builds):
            seconds, graph = build_troupe(w, collective)
            ours.append(seconds)
            graph.shutdown()
            plain.append(build_plain(w)[0])
        emit(figure="build_seconds", workers=w, with_gloo_group=collective,
             troupe=round(statistics.median(ours), 3), plain_ray=round(statistics.median(plain), 3),
             ratio=round(statistics.median(ours) / statistics.median(plain), 2), cpus=info.num_cpus)

    _, graph = build_troupe(w, False)
    group = graph["w"]
    plain_actors = [PlainNoop.remote() for _ in range(w)]
    ray.get([a.noop.remote() for a in plain_actors])
    one_troupe = timed(lambda: group.invoke(Noop.noop_on_rank0), args.calls)
    one_plain = timed(lambda: ray.get(plain_actors[0].noop.remote()), args.calls)
    all_troupe = timed(lambda: group.invoke(Noop.noop), args.calls)
    all_plain = timed(lambda: ray.get([a.noop.remote() for a in plain_actors]), args.calls)
    emit(figure="call_round_trip_ms", workers=1, troupe=round(one_troupe * 1e3, 3),
         plain_ray=round(one_plain * 1e3, 3), overhead_ms=round((one_troupe - one_plain) * 1e3, 3))
    emit(figure="call_round_trip_ms", workers=w, troupe=round(all_troupe * 1e3, 3),
         plain_ray=round(all_plain * 1e3, 3), overhead_ms=round((all_troupe - all_plain) * 1e3, 3))
    graph.shutdown()


if __name__ == "__main__":
    main()
