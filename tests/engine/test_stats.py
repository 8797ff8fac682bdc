"""EngineStats of several engines combine into one: counters summed, rates weighted."""

from deepwell.engine.stats import EngineStats, SpecStats, combine_stats


def test_pool_stats_sum_counters_and_weight_speculative_rates_by_steps():
    busy = EngineStats(
        running=2,
        waiting=1,
        kv_blocks_used=5,
        kv_blocks_total=10,
        num_preemptions=1,
        store_hits=3,
        spec=SpecStats(
            decode_steps=3,
            verified_tokens=4,
            position_accept_rates=(1.0, 0.5),
            confidence_error=0.2,
        ),
    )
    idle = EngineStats(
        running=0,
        waiting=0,
        kv_blocks_used=0,
        kv_blocks_total=10,
        store_hits=2,
        spec=SpecStats(
            decode_steps=1, verified_tokens=1, position_accept_rates=(0.0,), confidence_error=0.6
        ),
    )
    pool = combine_stats([busy, idle])
    assert (pool.running, pool.kv_blocks_used, pool.kv_blocks_total) == (2, 5, 20)
    assert (pool.num_preemptions, pool.store_hits) == (1, 5)
    assert (pool.spec.decode_steps, pool.spec.verified_tokens) == (4, 5)
    assert pool.spec.position_accept_rates == (0.75, 0.375)
    assert abs(pool.spec.confidence_error - 0.3) < 1e-12


def test_no_engines_and_no_speculation_combine_to_zeros():
    assert combine_stats([]) == EngineStats(0, 0, 0, 0)
    plain = EngineStats(1, 2, 3, 4)
    assert combine_stats([plain, plain]) == EngineStats(2, 4, 6, 8)
