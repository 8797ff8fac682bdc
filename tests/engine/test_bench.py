"""`deepwell bench --shared-prefix`: prompts share one prefix, and the prefix cache serves it."""

from deepwell.engine import EngineArgs
from deepwell.engine.bench import BenchConfig, random_requests, run_bench


def test_shared_prefix_prompts_start_alike():
    requests = random_requests(BenchConfig(num_requests=3, shared_prefix=40), vocab_size=300)
    heads = {tuple(prompt[:40]) for prompt, _ in requests}
    assert len(heads) == 1 and all(len(prompt) > 40 for prompt, _ in requests)


def test_the_shared_prefix_workload_hits_the_prefix_cache(tiny_llama):
    args = EngineArgs(model=str(tiny_llama), dtype="float32", block_size=16, memory_gib=0.25)
    config = BenchConfig(
        num_requests=6,
        input_len=(8, 16),
        output_len=(2, 4),
        decode_num_requests=2,
        shared_prefix=96,
    )
    result = run_bench(args, config, progress=False)
    # The first request computes the prefix; the other five take its 6 blocks.
    assert result.prefix_hit_rate > 0.6
    # Model work is counted, and within the wall time. How large a share it is depends on
    # the machine's load, not on the engine: most of it on a quiet machine, 0.23 with the
    # two cores shared by ten other processes (load average 12), so no lower bound holds.
    assert 0.0 < result.busy_fraction <= 1.0
