"""The replica's /metrics in Prometheus' text format (version 0.0.4): requests running and
waiting, prompt and generated tokens, time to first token and time per output token as
histograms, how full the KV cache is, and what the prefix cache served. Written by hand (a
few counters need no client library); tests parse it with prometheus_client's parser."""

from __future__ import annotations

import bisect
import math

TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
TPOT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)


class Histogram:
    def __init__(self, name: str, help: str, buckets: tuple[float, ...]):
        self.name, self.help, self.buckets = name, help, buckets
        self.counts = [0] * (len(buckets) + 1)  # the last: above every bucket (+Inf only)
        self.sum, self.count = 0.0, 0

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.buckets, value)] += 1
        self.sum += value
        self.count += 1

    def lines(self) -> list[str]:
        out = [f"# HELP {self.name} {self.help}", f"# TYPE {self.name} histogram"]
        running = 0
        for le, n in zip((*self.buckets, math.inf), self.counts):
            running += n
            out.append(f'{self.name}_bucket{{le="{"+Inf" if le == math.inf else le}"}} {running}')
        out += [f"{self.name}_sum {self.sum}", f"{self.name}_count {self.count}"]
        return out


class ServerMetrics:
    """What /metrics reports; the replica counts into it as requests come and go."""

    def __init__(self) -> None:
        self.requests = {}  # (route, outcome) -> count
        self.prompt_tokens = 0
        self.generated_tokens = 0
        self.ttft = Histogram("troupe_time_to_first_token_seconds",
                              "Seconds from a request's arrival to its first token.", TTFT_BUCKETS)
        self.tpot = Histogram("troupe_time_per_output_token_seconds",
                              "Seconds between a sequence's consecutive tokens.", TPOT_BUCKETS)

    def finished(self, route: str, outcome: str) -> None:
        key = (route, outcome)
        self.requests[key] = self.requests.get(key, 0) + 1

    def render(self, running: int, waiting: int, kv_used: int, kv_capacity: int,
               prefix: tuple[int, int, int] = (0, 0, 0),
               speculation: dict[str, int] | None = None) -> str:
        """``prefix``: the prefix cache's (prompt tokens looked up, tokens it served, prompt
        tokens the model ran); ``speculation``: the engine's speculative decoding counts
        (passes, proposed, accepted)."""
        spec = speculation or {"passes": 0, "proposed": 0, "accepted": 0}
        lines = ["# HELP troupe_requests_total Requests answered, by route and outcome.",
                 "# TYPE troupe_requests_total counter"]
        lines += [f'troupe_requests_total{{route="{r}",outcome="{o}"}} {n}'
                  for (r, o), n in sorted(self.requests.items())]
        for name, kind, help, value in (
                ("troupe_requests_running", "gauge", "Requests being answered.", running),
                ("troupe_requests_waiting", "gauge",
                 "Sequences queued for a free slot of the decode batch.", waiting),
                ("troupe_prompt_tokens_total", "counter", "Prompt tokens of the requests.",
                 self.prompt_tokens),
                ("troupe_generation_tokens_total", "counter", "Tokens generated.",
                 self.generated_tokens),
                ("troupe_kv_cache_usage_ratio", "gauge",
                 "Positions of the KV cache in use over the batch's capacity.",
                 kv_used / kv_capacity if kv_capacity else 0.0),
                ("troupe_prefix_cache_queries_total", "counter",
                 "Prompt tokens looked up in the prefix cache.", prefix[0]),
                ("troupe_prefix_cache_hits_total", "counter",
                 "Prompt tokens whose keys and values came from the prefix cache.", prefix[1]),
                ("troupe_prefix_cache_hit_ratio", "gauge",
                 "Prompt tokens served from the prefix cache over those looked up.",
                 prefix[1] / prefix[0] if prefix[0] else 0.0),
                ("troupe_prefill_tokens_total", "counter",
                 "Prompt tokens the model ran (the others came from the prefix cache).",
                 prefix[2]),
                ("troupe_spec_decode_passes_total", "counter",
                 "Verify passes of speculative decoding.", spec["passes"]),
                ("troupe_spec_decode_proposed_tokens_total", "counter",
                 "Tokens proposed by prompt lookup.", spec["proposed"]),
                ("troupe_spec_decode_accepted_tokens_total", "counter",
                 "Proposed tokens the model's own choice confirmed.", spec["accepted"]),
                ("troupe_spec_decode_acceptance_ratio", "gauge",
                 "Accepted over proposed tokens.",
                 spec["accepted"] / spec["proposed"] if spec["proposed"] else 0.0)):
            lines += [f"# HELP {name} {help}", f"# TYPE {name} {kind}", f"{name} {value}"]
        return "\n".join(lines + self.ttft.lines() + self.tpot.lines()) + "\n"
