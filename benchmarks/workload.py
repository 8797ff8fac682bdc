"""Workload W: the fixed, seeded request set every comparative benchmark serves.

W is 64 requests; for each, in order: a prompt length uniform in [64, 512], an output length
uniform in [64, 256] (generated exactly, EOS ignored), and that many prompt ids uniform in
[17, 49152). Prompts are random token ids, not text: ids 0-16 are SmolLM2's control tokens,
17-49151 its ordinary ones. Every engine is fed the ids as they are (no tokenizer, no chat
template, no BOS), so each sees the same prompts.

Only the stdlib's `random.Random(seed)` draws them (its `randint` is stable across CPython
versions), so the same W is rebuilt anywhere; its canonical JSON hashes to `W_SHA256`. This
is the project's own copy of the workload definition the baselines were first measured on.

    python benchmarks/workload.py [--out W.json]   # prints W's summary and sha256
"""

from __future__ import annotations

import argparse
import hashlib
import json
import random

SEED = 20261129
REQUESTS = 64
PROMPT_LEN = (64, 512)  # inclusive
OUTPUT_LEN = (64, 256)  # inclusive
# Half-open: SmolLM2's ordinary (non-control) token ids.
VOCAB = (17, 49152)
W_SHA256 = "7a1013534a79621759025f50abd3b6747afb6dc3c7395e4b6c309b1b871e61fc"


def make_workload(seed: int = SEED, requests: int = REQUESTS) -> list[dict]:
    """W's requests in order: dicts of id, prompt_len, output_len and prompt_ids."""
    rng = random.Random(seed)
    workload = []
    for index in range(requests):
        prompt_len = rng.randint(*PROMPT_LEN)
        output_len = rng.randint(*OUTPUT_LEN)
        prompt_ids = [rng.randrange(*VOCAB) for _ in range(prompt_len)]
        workload.append(
            {
                "id": index,
                "prompt_len": prompt_len,
                "output_len": output_len,
                "prompt_ids": prompt_ids,
            }
        )
    return workload


def canonical_json(workload: list[dict]) -> str:
    return json.dumps(workload, separators=(",", ":"), sort_keys=True)


def workload_sha256(workload: list[dict]) -> str:
    return hashlib.sha256(canonical_json(workload).encode()).hexdigest()


def summary(workload: list[dict]) -> dict:
    prompts = [r["prompt_len"] for r in workload]
    outputs = [r["output_len"] for r in workload]
    return {
        "n": len(workload),
        "prompt_tokens": sum(prompts),
        "output_tokens": sum(outputs),
        "prompt_len_min_mean_max": (
            min(prompts),
            round(sum(prompts) / len(prompts), 1),
            max(prompts),
        ),
        "output_len_min_mean_max": (
            min(outputs),
            round(sum(outputs) / len(outputs), 1),
            max(outputs),
        ),
        "sha256": workload_sha256(workload),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seed", type=int, default=SEED)
    parser.add_argument("--requests", type=int, default=REQUESTS)
    parser.add_argument("--out", help="also write the workload's canonical JSON here")
    args = parser.parse_args()
    workload = make_workload(args.seed, args.requests)
    if args.out:
        with open(args.out, "w", encoding="utf-8") as f:
            f.write(canonical_json(workload))
    print(json.dumps(summary(workload)))


if __name__ == "__main__":
    main()
