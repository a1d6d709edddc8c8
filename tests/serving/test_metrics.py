"""/metrics' text (troupe.serving.metrics): the engine's speculative decoding counts render as
Prometheus counters and the acceptance ratio as a gauge."""

from troupe.serving.metrics import ServerMetrics


def _values(text: str) -> dict[str, float]:
    return {line.split()[0]: float(line.split()[1]) for line in text.splitlines()
            if line and not line.startswith("#")}


def test_speculation_is_counted_and_its_acceptance_ratio_given():
    m = ServerMetrics()
    off = _values(m.render(0, 0, 0, 1))
    assert off["troupe_spec_decode_passes_total"] == 0
    assert off["troupe_spec_decode_acceptance_ratio"] == 0.0
    on = _values(m.render(1, 0, 10, 100, (0, 0, 5),
                          {"passes": 7, "proposed": 20, "accepted": 15}))
    assert on["troupe_spec_decode_passes_total"] == 7
    assert on["troupe_spec_decode_proposed_tokens_total"] == 20
    assert on["troupe_spec_decode_accepted_tokens_total"] == 15
    assert on["troupe_spec_decode_acceptance_ratio"] == 0.75
