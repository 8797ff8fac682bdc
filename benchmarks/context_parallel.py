"""Mirror context parallelism on DeepSeek-V4.1: long-prefill time on 1, 2 and 4 ranks, and
per layer how rank 0's time splits between collectives (all-gathers, including waiting for
the slowest rank) and its own compute.

A random tiny (or small) V4.1 checkpoint in float32, cache quantisation off, prefix caching
off, one torch thread per rank, synchronous steps: the prefill is the first `step()` of a
request of --tokens prompt tokens (it also samples the first token). Each figure is the
median of --repeats prefills after a warm-up; the ratio is 1-rank time over N-rank time. On
a machine with fewer cores than ranks the ranks share cores, so read the split, not the
speed-up. The last column compares the first token's top-20 log-probabilities with the
first size's (inf if the ranking differs). Note the 1-rank engine scores each prefill row against every key (masked), while
a rank scores its chunks against their own keys plus a window, so some of a speed-up is
less work, not more cores.

    .venv/bin/python benchmarks/context_parallel.py [--preset tiny] [--tokens 2048]
"""

import argparse
import random
import statistics
import tempfile
import time

from deepwell.engine import EngineArgs, EngineCore, SamplingParams
from deepwell.engine.models.deepseek_v41.writer import PRESETS, write_tiny_checkpoint

FIRST_TEXT_ID = 3  # below: BOS, EOS, pad of the byte-level tokenizer


def make_core(path: str, size: int, tokens: int) -> EngineCore:
    return EngineCore(
        EngineArgs(
            model=path,
            dtype="float32",
            quantize_kv_cache=False,
            max_model_len=tokens + 16,
            max_num_batched_tokens=tokens,
            memory_gib=2.0,
            num_threads=1,
            async_scheduling=False,
            enable_prefix_caching=False,
            num_speculative_tokens=0,
            context_parallel_size=size,
        )
    )


def prefill(core: EngineCore, request_id: str, prompt: list[int]) -> tuple[float, float, list]:
    """Seconds of the prefill step and of rank 0's collectives within it, and the first
    token's top log-probabilities."""
    group = core.context_parallel.group if core.context_parallel else None
    params = SamplingParams(max_tokens=1, temperature=0, logprobs=True, top_logprobs=20)
    core.add_request(request_id, prompt, params)
    if group is not None:
        group.collective_s = 0.0
    started = time.perf_counter()
    (output,) = core.step()
    elapsed = time.perf_counter() - started
    while core.has_unfinished():
        core.step()
    return elapsed, group.collective_s if group else 0.0, list(output.new_logprobs[0].top)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--preset", choices=sorted(PRESETS), default="tiny")
    parser.add_argument("--tokens", type=int, default=2048)
    parser.add_argument("--sizes", default="1,2,4", help="comma-separated rank counts")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    rng = random.Random(0)
    with tempfile.TemporaryDirectory() as tmp:
        written = write_tiny_checkpoint(tmp, seed=0, text_config=PRESETS[args.preset])
        config = written.config.get("text_config", written.config)
        layers = config["num_hidden_layers"]
        print(
            f"DeepSeek-V4.1 {args.preset} (hidden {config['hidden_size']}, {layers} layers, "
            f"window {config['sliding_window']}), {args.tokens}-token prefill, float32, "
            "1 thread per rank"
        )
        print(
            f"{'ranks':>5} {'prefill s':>10} {'speed-up':>9} {'ms/layer':>9} "
            f"{'collective ms/layer':>20} {'compute ms/layer':>17} {'max |dlogprob|':>15}"
        )
        prompts = [
            [rng.randrange(FIRST_TEXT_ID, config["vocab_size"]) for _ in range(args.tokens)]
            for _ in range(args.repeats + 1)
        ]
        baseline = reference = None
        for size in (int(s) for s in args.sizes.split(",")):
            core = make_core(str(written.path), size, args.tokens)
            prefill(core, "warm-up", prompts[0])
            runs = [prefill(core, f"r{n}", p) for n, p in enumerate(prompts[1:])]
            core.close()
            seconds = statistics.median(t for t, _, _ in runs)
            collective = statistics.median(c for _, c, _ in runs)
            tops = [top for _, _, top in runs]
            baseline, reference = baseline or seconds, reference or tops
            # Against the first size's first-token log-probabilities, same token ids.
            drift = max(
                abs(a - b) if i == j else float("inf")
                for ours, theirs in zip(tops, reference, strict=True)
                for (i, a), (j, b) in zip(ours, theirs, strict=True)
            )
            per_layer = 1000 / layers
            print(
                f"{size:>5} {seconds:>10.3f} {baseline / seconds:>8.2f}x "
                f"{seconds * per_layer:>9.2f} {collective * per_layer:>20.2f} "
                f"{(seconds - collective) * per_layer:>17.2f} {drift:>15.2e}"
            )


if __name__ == "__main__":
    main()
