"""Speculative decoding stats from the worker's stats message reach /metrics."""

from deepwell.engine.stats import EngineStats, SpecStats
from deepwell.serve.messages import decode_message, encode_message
from deepwell.serve.metrics import ServeMetrics


def test_speculative_stats_are_exported_and_survive_the_wire():
    spec = SpecStats(
        decode_steps=10,
        verified_tokens=8,
        accepted_tokens=6,
        position_accept_rates=(1.0, 0.5),
        confidence_error=0.25,
    )
    stats = EngineStats(1, 0, 2, 10, spec=spec)
    assert decode_message(encode_message(stats)) == stats
    text = ServeMetrics(lambda: stats).render().decode()
    assert "deepwell_spec_verified_tokens_total 8.0" in text
    assert "deepwell_spec_accepted_tokens_total 6.0" in text
    assert "deepwell_spec_accept_ratio 0.75" in text
    assert 'deepwell_spec_position_accept_ratio{position="2"} 0.5' in text
    assert "deepwell_spec_tokens_per_decode_step 1.6" in text
    assert "deepwell_spec_confidence_error 0.25" in text
