"""Prefix cache TTFT: a 4,000-token shared prefix plus a short question, on the embedded model.

One engine answers question 1 cold (it computes the prefix and writes it to a KV store),
then question 2 with a memory hit; a fresh process on the same store directory answers
question 3 with a store hit. Prints the TTFT of each hit over the cold TTFT:

    .venv/bin/python benchmarks/prefix_cache.py [--prefix-tokens 4000] [--threads 2]

Goals (issue 6): memory hit ≤ 0.15, store hit ≤ 0.30.
"""

import argparse
import json
import random
import subprocess
import sys
import tempfile
import time

from deepwell.engine import EngineArgs, EngineCore, SamplingParams

QUESTION_TOKENS = 24
# Ids below 17 are SmolLM2's control tokens; prompts stay ordinary text ids.
FIRST_TEXT_ID = 17


def prompts(prefix_tokens: int, vocab_size: int) -> tuple[list[int], list[list[int]]]:
    """The shared prefix, and three prompts that end in different short questions."""
    rng = random.Random(0)
    prefix = [rng.randrange(FIRST_TEXT_ID, vocab_size) for _ in range(prefix_tokens)]
    questions = [
        [rng.randrange(FIRST_TEXT_ID, vocab_size) for _ in range(QUESTION_TOKENS)] for _ in range(3)
    ]
    return prefix, [prefix + question for question in questions]


def ttft(core: EngineCore, request_id: str, prompt: list[int]) -> tuple[float, int]:
    """Seconds from submission to the first token, and the prompt tokens taken from cache."""
    start = time.perf_counter()
    core.add_request(request_id, prompt, SamplingParams(max_tokens=1, temperature=0))
    while core.has_unfinished():
        for output in core.step():
            if output.new_token_ids:
                return time.perf_counter() - start, output.num_cached_tokens
    raise RuntimeError(f"request {request_id} produced no token")


def engine(args: argparse.Namespace, store: str) -> EngineCore:
    core = EngineCore(EngineArgs(kv_store_path=store, num_threads=args.threads))
    # Allocator and kernels warm, on ids that share no block with the prompts.
    core.add_request("warmup", [FIRST_TEXT_ID] * 300, SamplingParams(max_tokens=2))
    while core.has_unfinished():
        core.step()
    return core


def store_hit(args: argparse.Namespace, store: str) -> None:
    """The fresh process: question 3 against what the first process stored."""
    core = engine(args, store)
    _, (_, _, third) = prompts(args.prefix_tokens, core.vocab_size)
    before = core.stats().store_hits
    seconds, cached = ttft(core, "third", third)
    core.close()
    hits = core.stats().store_hits - before
    print(json.dumps({"ttft_s": seconds, "cached": cached, "store_hits": hits}))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--prefix-tokens", type=int, default=4000)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--store", help=argparse.SUPPRESS)  # the fresh process's store
    args = parser.parse_args()
    if args.store:
        store_hit(args, args.store)
        return
    with tempfile.TemporaryDirectory(prefix="deepwell-kv-") as store:
        core = engine(args, store)
        _, (first, second, _) = prompts(args.prefix_tokens, core.vocab_size)
        cold, _ = ttft(core, "first", first)
        memory, memory_cached = ttft(core, "second", second)
        core.close()  # every block on disk before the fresh process looks
        command = [sys.executable, __file__, "--store", store]
        command += ["--prefix-tokens", str(args.prefix_tokens)]
        if args.threads:
            command += ["--threads", str(args.threads)]
        done = subprocess.run(command, capture_output=True, text=True, check=True)
        fresh = json.loads(done.stdout.strip().splitlines()[-1])
    print(f"prompt: {args.prefix_tokens}-token shared prefix + {QUESTION_TOKENS}-token question")
    print(f"cold TTFT: {cold * 1e3:.0f} ms")
    print(f"memory hit TTFT: {memory * 1e3:.0f} ms ({memory_cached} tokens cached)")
    print(
        f"store hit TTFT: {fresh['ttft_s'] * 1e3:.0f} ms ({fresh['cached']} tokens cached, "
        f"{fresh['store_hits']} blocks read, fresh process)"
    )
    print(f"memory hit TTFT ratio: {memory / cold:.3f}")
    print(f"store hit TTFT ratio: {fresh['ttft_s'] / cold:.3f}")


if __name__ == "__main__":
    main()
