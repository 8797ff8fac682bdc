"""Attention DP + MoE EP on gloo: per-step all-to-all time against compute, throughput on
1, 2 and 4 ranks, and EPLB's max/mean rank load before and after on a skewed workload.

A tiny DeepSeek-V4.1 (spec §1.3 schedule) with 64 routed experts, 4 per token, float32,
batch-invariant (so every rank count gives the same tokens, which is checked). The skewed
workload draws prompts from 8 token ids, so few experts take most pairs; EPLB runs with a
short window and redundant slots, re-placing at every window (min gain 0) and with the
default hysteresis (0.05). On a 2-core machine the absolute figures mean little
(4 ranks share 2 cores); the comm/compute split and the imbalance are the point.

    .venv/bin/python benchmarks/parallel.py [--requests 32] [--max-tokens 16]
"""

import argparse
import random
import socket
import tempfile

from deepwell.engine import EngineArgs, SamplingParams
from deepwell.engine.models.deepseek_v41.writer import TINY_TEXT_CONFIG, write_tiny_checkpoint
from deepwell.engine.parallel import ParallelConfig
from deepwell.engine.parallel.launch import generate_data_parallel

ENGINE = dict(
    dtype="float32",
    batch_invariant=True,
    block_size=16,
    memory_gib=0.5,
    max_model_len=256,
    num_threads=1,
    num_speculative_tokens=0,
)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def run(path: str, prompts, params, ranks: int, **eplb):
    parallel = ParallelConfig(
        data_parallel_size=ranks, expert_parallel=ranks > 1, master_port=free_port(), **eplb
    )
    return generate_data_parallel(EngineArgs(path, **ENGINE, parallel=parallel), prompts, params)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--requests", type=int, default=32)
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--experts", type=int, default=64)
    args = parser.parse_args()
    rng = random.Random(0)
    hot = [rng.randrange(3, 250) for _ in range(8)]
    prompts = [[rng.choice(hot) for _ in range(rng.randrange(8, 32))] for _ in range(args.requests)]
    params = [SamplingParams(max_tokens=args.max_tokens, temperature=0, ignore_eos=True)] * len(
        prompts
    )
    config = TINY_TEXT_CONFIG | dict(n_routed_experts=args.experts, num_experts_per_tok=4)
    with tempfile.TemporaryDirectory() as directory:
        path = str(write_tiny_checkpoint(directory, seed=0, text_config=config).path)
        reference = None
        print(f"{args.requests} requests x {args.max_tokens} tokens, {args.experts} experts top-4")
        print("ranks  tok/s  steps  per-step ms  all-to-all ms/step  all-to-all share")
        for ranks in (1, 2, 4):
            result = run(path, prompts, params, ranks)
            tokens = [c.token_ids for c in result.completions]
            reference = reference or tokens
            assert tokens == reference, f"{ranks} ranks changed the tokens"
            wall = max(s.generate_s for s in result.stats)
            steps = max(s.steps for s in result.stats)
            exchange = sum(s.exchange_s for s in result.stats) / ranks
            print(
                f"{ranks:5d}  {sum(map(len, tokens)) / wall:5.0f}  {steps:5d}  "
                f"{1000 * wall / steps:11.1f}  {1000 * exchange / steps:18.1f}  "
                f"{exchange / wall:16.0%}"
            )
        # 0: a re-placement at every window (no hysteresis); 0.05: the default.
        for min_gain in (0.0, 0.05):
            result = run(
                path,
                prompts,
                params,
                4,
                enable_eplb=True,
                eplb_window_steps=4,
                eplb_redundant_experts=16,
                eplb_min_gain=min_gain,
            )
            assert [c.token_ids for c in result.completions] == reference, "EPLB changed tokens"
            print(
                f"EPLB, 4 ranks, 16 redundant slots, window 4 steps, min gain {min_gain}"
                " (max/mean rank load):"
            )
            print("  step  before  after(same tokens)  transfers")
            for r in result.stats[0].rebalances:
                print(
                    f"  {r.step:4d}  {r.imbalance_before:6.2f}  {r.imbalance_after:18.2f}  "
                    f"{r.moved_experts:9d}"
                )


if __name__ == "__main__":
    main()
