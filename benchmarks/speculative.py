"""Speculative decoding, off vs on, on the embedded model (bf16, one torch thread).

Batch 1, greedy, on a repetitive workload (editing given code, summarising a text): decode
tok/s of each request run alone. 64 concurrent requests on random-token prompts, sampled
at temperature 1 (a non-repetitive workload: greedy decoding from random text falls into
loops that drafts predict): output tok/s of the whole run, the best of `--repeats`
alternating off/on runs (neighbours on a shared machine swing a single run by 30%).
Prints each figure as soon as it is measured, a progress line every `--progress` seconds
of a run, then both ratios and the acceptance and confidence error of the speculative runs:

    .venv/bin/python benchmarks/speculative.py [--threads 1] [--max-tokens 128] [--repeats 2]
        [--dtype bfloat16|float32]

On a CPU without native bf16 (AVX2 only) bf16 linears run ~8x slower than float32 and a
64-concurrent run takes many minutes there: pass `--dtype float32`.

Goals (issue 9): batch-1 speedup ≥ 1.6, 64 concurrent speedup ≥ 1.0.
"""

import argparse
import os
import time

from deepwell.engine import EngineArgs, EngineCore, SamplingParams
from deepwell.engine.bench import BenchConfig, random_requests

CODE = """def load_users(path):
    users = []
    with open(path) as handle:
        for line in handle:
            name, email, age = line.strip().split(",")
            users.append({"name": name, "email": email, "age": int(age)})
    return users


def adult_users(path):
    users = load_users(path)
    return [user for user in users if user["age"] >= 18]
"""
TEXT = (
    "The city council met on Monday evening to discuss the new public transport plan. "
    "Under the plan, bus services would run every ten minutes on the main routes, and a "
    "new tram line would connect the train station with the university and the hospital. "
    "Council members agreed that the plan would reduce traffic in the city centre, but "
    "several members asked how the tram line would be paid for. The mayor said that half "
    "of the cost would come from the national government and the other half from a small "
    "increase in parking fees. A final vote on the plan will take place next month."
)
REPETITIVE = [
    f"Rename the function load_users to read_users everywhere in this code and show the "
    f"full result.\n\n{CODE}",
    f"Add a docstring to each function in this code and show the full result.\n\n{CODE}",
    f"Summarise this text in a few sentences, reusing its wording.\n\n{TEXT}",
    f"Repeat this text exactly, then give it a title.\n\n{TEXT}",
]


def chat(core: EngineCore, text: str) -> list[int]:
    prompt = f"<|im_start|>user\n{text}<|im_end|>\n<|im_start|>assistant\n"
    return core.tokenizer.encode(prompt).ids


def engine(args: argparse.Namespace, k: int, max_num_seqs: int) -> EngineCore:
    core = EngineCore(
        EngineArgs(
            num_threads=args.threads,
            dtype=args.dtype,
            num_speculative_tokens=k,
            max_num_seqs=max_num_seqs,
            memory_gib=1.5,
            max_model_len=2048,
        )
    )
    core.add_request("warmup", [17] * 40, SamplingParams(max_tokens=8, temperature=0))
    while core.has_unfinished():
        core.step()
    return core


def batch1_decode_tok_s(args: argparse.Namespace, k: int) -> tuple[float, str]:
    """Decode tok/s of each repetitive prompt alone (after its first token), pooled."""
    core = engine(args, k, 1)
    tokens = 0
    seconds = 0.0
    for index, text in enumerate(REPETITIVE):
        core.add_request(
            f"r{index}", chat(core, text), SamplingParams(max_tokens=args.max_tokens, temperature=0)
        )
        first = None
        count = 0
        progress = Progress(args, f"batch 1, k={k}, prompt {index + 1}/{len(REPETITIVE)}")
        while core.has_unfinished():
            for output in core.step():
                count += len(output.new_token_ids)
                if first is None and output.new_token_ids:
                    first, first_count = time.perf_counter(), count
            progress.tick(count)
        tokens += count - first_count
        seconds += time.perf_counter() - first
    return tokens / seconds, release(core)


class Progress:
    """Prints a line every `--progress` seconds of a run: a slow run and a stuck one look
    the same from outside until its token count stops moving."""

    def __init__(self, args: argparse.Namespace, label: str) -> None:
        self.every = args.progress
        self.label = label
        self.start = self.last = time.perf_counter()

    def tick(self, tokens: int, finished: int | None = None) -> None:
        now = time.perf_counter()
        if now - self.last < self.every:
            return
        self.last = now
        done = "" if finished is None else f", {finished} requests finished"
        print(
            f"  … {self.label}: {tokens} tokens in {now - self.start:.0f} s{done} "
            f"(load average {os.getloadavg()[0]:.1f})",
            flush=True,
        )


def concurrent_tok_s(args: argparse.Namespace, k: int) -> tuple[float, str]:
    """Output tok/s of 64 random-prompt requests submitted at once."""
    core = engine(args, k, 64)
    config = BenchConfig(num_requests=64, input_len=(64, 256), output_len=(64, 128))
    requests = random_requests(config, core.vocab_size)
    start = time.perf_counter()
    for index, (prompt, output_len) in enumerate(requests):
        params = SamplingParams(max_tokens=output_len, seed=index, ignore_eos=True)
        core.add_request(f"c{index}", prompt, params)
    progress = Progress(args, f"64 concurrent, k={k}")
    tokens = finished = 0
    while core.has_unfinished():
        for output in core.step():
            tokens += len(output.new_token_ids)
            finished += output.finished
        progress.tick(tokens, finished)
    return sum(n for _, n in requests) / (time.perf_counter() - start), release(core)


def release(core: EngineCore) -> str:
    """Closes the engine before the next one is built and describes its speculation. Each
    engine holds its whole KV budget; two alive at once (the last one kept for its stats)
    doubled the peak memory, and on a shared box that got the run OOM-killed."""
    core.close()
    if core.speculator is None:
        return "off"
    stats = core.speculator.stats()
    rates = " ".join(f"{rate:.2f}" for rate in stats.position_accept_rates)
    return (
        f"accept rate {stats.accept_rate:.2f} (per position {rates}), "
        f"verified per drafting step {stats.avg_verified_len:.2f}, "
        f"tokens per decode step {stats.tokens_per_decode:.2f}, "
        f"confidence error {stats.confidence_error:.3f}"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    # One thread: on a shared machine a busy neighbour stalls every parallel region.
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--k", type=int, default=5, help="num_speculative_tokens when on")
    parser.add_argument("--repeats", type=int, default=2, help="64-concurrent runs of each")
    parser.add_argument("--dtype", default=EngineArgs.dtype, help="the engine's compute dtype")
    parser.add_argument(
        "--progress", type=float, default=30.0, help="seconds between progress lines of a run"
    )
    args = parser.parse_args()
    print(f"{args.dtype}, {args.threads} torch thread(s)", flush=True)

    off, _ = batch1_decode_tok_s(args, 0)
    print(f"batch-1 decode tok/s, off: {off:.1f}", flush=True)
    on, described = batch1_decode_tok_s(args, args.k)
    print(f"batch-1 decode tok/s: off {off:.1f}, on {on:.1f}", flush=True)
    print(f"batch-1 speculation: {described}", flush=True)
    many_off = many_on = 0.0
    for repeat in range(args.repeats):
        rate = concurrent_tok_s(args, 0)[0]
        print(f"64 concurrent run {repeat + 1}/{args.repeats}, off: {rate:.1f} tok/s", flush=True)
        many_off = max(many_off, rate)
        rate, described = concurrent_tok_s(args, args.k)
        print(f"64 concurrent run {repeat + 1}/{args.repeats}, on: {rate:.1f} tok/s", flush=True)
        many_on = max(many_on, rate)
    print(f"64 concurrent output tok/s: off {many_off:.1f}, on {many_on:.1f}")
    print(f"64 concurrent speculation: {described}")
    print(f"batch-1 speedup: {on / off:.2f}")
    print(f"64 concurrent speedup: {many_on / many_off:.2f}")


if __name__ == "__main__":
    main()
