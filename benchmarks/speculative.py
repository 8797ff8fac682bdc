"""Speculative decoding, off vs on, on the embedded model (bf16, one torch thread).

Batch 1, greedy, on a repetitive workload (editing given code, summarising a text): decode
tok/s of each request run alone. 64 concurrent requests on random-token prompts, sampled
at temperature 1 (a non-repetitive workload: greedy decoding from random text falls into
loops that drafts predict): output tok/s of the whole run, the best of `--repeats`
alternating off/on runs (neighbours on a shared machine swing a single run by 30%).
Prints both ratios, and the acceptance and confidence error of the speculative runs:

    .venv/bin/python benchmarks/speculative.py [--threads 1] [--max-tokens 128] [--repeats 2]

Goals (issue 9): batch-1 speedup ≥ 1.6, 64 concurrent speedup ≥ 1.0.
"""

import argparse
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


def batch1_decode_tok_s(args: argparse.Namespace, k: int) -> tuple[float, EngineCore]:
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
        while core.has_unfinished():
            for output in core.step():
                count += len(output.new_token_ids)
                if first is None and output.new_token_ids:
                    first, first_count = time.perf_counter(), count
        tokens += count - first_count
        seconds += time.perf_counter() - first
    return tokens / seconds, core


def concurrent_tok_s(args: argparse.Namespace, k: int) -> tuple[float, EngineCore]:
    """Output tok/s of 64 random-prompt requests submitted at once."""
    core = engine(args, k, 64)
    config = BenchConfig(num_requests=64, input_len=(64, 256), output_len=(64, 128))
    requests = random_requests(config, core.vocab_size)
    start = time.perf_counter()
    for index, (prompt, output_len) in enumerate(requests):
        params = SamplingParams(max_tokens=output_len, seed=index, ignore_eos=True)
        core.add_request(f"c{index}", prompt, params)
    while core.has_unfinished():
        core.step()
    return sum(n for _, n in requests) / (time.perf_counter() - start), core


def describe(core: EngineCore) -> str:
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
    args = parser.parse_args()

    off, _ = batch1_decode_tok_s(args, 0)
    on, core = batch1_decode_tok_s(args, args.k)
    print(f"batch-1 decode tok/s: off {off:.1f}, on {on:.1f}")
    print(f"batch-1 speculation: {describe(core)}")
    many_off = many_on = 0.0
    for _ in range(args.repeats):
        many_off = max(many_off, concurrent_tok_s(args, 0)[0])
        rate, core = concurrent_tok_s(args, args.k)
        many_on = max(many_on, rate)
    print(f"64 concurrent output tok/s: off {many_off:.1f}, on {many_on:.1f}")
    print(f"64 concurrent speculation: {describe(core)}")
    print(f"batch-1 speedup: {on / off:.2f}")
    print(f"64 concurrent speedup: {many_on / many_off:.2f}")


if __name__ == "__main__":
    main()
