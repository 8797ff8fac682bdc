"""Structured output on the step loop: what masks cost per step, and whether compiles stall it.

On the embedded SmolLM2 (bf16, greedy, EOS ignored so the batch stays full):
1. 32 concurrent requests unconstrained, then 32 with half constrained by JSON schemas;
   prints the median decode-step time ratio constrained/unconstrained (goal <= 1.10), and
   the time of the masking work alone for the 16 constrained rows.
2. 32 unconstrained requests decoding while a heavy schema (5000 pattern fields, ~1 s to
   compile) compiles in the grammar pool; prints the worst decode step during the compile
   against the median step time (goal: within 10 %), and the same for a control window of
   steps without a compile. The step that admits the compiled request also runs its prompt,
   so it is reported on its own.

    .venv/bin/python benchmarks/structured.py [--threads N] [--json out.json]
"""

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests" / "serve"))
sys.path.insert(0, str(ROOT / "tests" / "engine" / "structured"))

from schemas import heavy_schema  # noqa: E402
from structured_schemas import SCHEMAS  # noqa: E402

from deepwell.engine import EngineArgs, EngineCore, SamplingParams  # noqa: E402
from deepwell.engine.structured import StructuredOutput, apply_masks  # noqa: E402

NUM_REQUESTS = 32
MAX_TOKENS = 64
CONTROL_STEPS = 20
PROMPT = "<|im_start|>user\nWrite one JSON object with made-up example values.<|im_end|>\n"


def decode_step_times(core: EngineCore) -> list[float]:
    """Step until idle; the wall time of every decode-only step."""
    times = []
    while core.has_unfinished():
        start = time.perf_counter()
        core.step()
        elapsed = time.perf_counter() - start
        if core.last_step.prefill_tokens == 0 and core.last_step.decode_tokens:
            times.append(elapsed)
    return times


def params(structured: StructuredOutput | None = None) -> SamplingParams:
    return SamplingParams(
        max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True, structured_output=structured
    )


def mask_overhead(core: EngineCore, prompt: list[int]) -> dict:
    # Warm the grammar vocabulary and cache so compiles do not overlap the measured run.
    for index in range(NUM_REQUESTS // 2):
        spec = StructuredOutput("json_schema", json.dumps(SCHEMAS[index]))
        core.add_request(f"warm{index}", prompt, params(spec))
    decode_step_times(core)
    for index in range(NUM_REQUESTS):
        core.add_request(f"free{index}", prompt, params())
    free = decode_step_times(core)
    for index in range(NUM_REQUESTS):
        spec = None
        if index % 2 == 0:
            spec = StructuredOutput("json_schema", json.dumps(SCHEMAS[index // 2]))
        core.add_request(f"mixed{index}", prompt, params(spec))
    mixed = decode_step_times(core)
    free_ms, mixed_ms = statistics.median(free) * 1e3, statistics.median(mixed) * 1e3
    return {
        "unconstrained_step_ms": round(free_ms, 2),
        "half_constrained_step_ms": round(mixed_ms, 2),
        "ratio": round(mixed_ms / free_ms, 3),
        "mask_ms_per_step": round(mask_cost(core, prompt) * 1e3, 3),
    }


def mask_cost(core: EngineCore, prompt: list[int]) -> float:
    """The masking work alone for 16 constrained rows (fill + apply), median of 50 runs.

    Unlike whole steps it hardly moves with the machine's load, so it bounds the ratio.
    """
    rows = NUM_REQUESTS // 2
    for index in range(rows):
        spec = StructuredOutput("json_schema", json.dumps(SCHEMAS[index]))
        core.add_request(f"mask{index}", prompt, params(spec))
    while any(r.matcher is None or r.num_output_tokens < 8 for r in core.requests.values()):
        core.step()
    matchers = [r.matcher for r in core.requests.values()]
    logits = torch.randn(NUM_REQUESTS, core.vocab_size)
    times = []
    for _ in range(50):
        start = time.perf_counter()
        masks = np.empty((rows, (core.vocab_size + 31) // 32), dtype=np.uint32)
        for index, matcher in enumerate(matchers):
            matcher.fill_mask(masks[index])
        apply_masks(logits, list(range(0, NUM_REQUESTS, 2)), masks)
        times.append(time.perf_counter() - start)
    for request_id in list(core.requests):
        core.abort(request_id)
    core.step()
    return statistics.median(times)


def compile_stall(core: EngineCore, prompt: list[int]) -> dict:
    for index in range(NUM_REQUESTS):
        core.add_request(f"bg{index}", prompt, SamplingParams(max_tokens=160, ignore_eos=True))
    # Past prefill: decode steps only from here.
    core.step()
    while core.last_step.prefill_tokens:
        core.step()
    # A control window of the same kind of steps with no compile: on a shared machine the
    # step time swings on its own, and this says by how much.
    control = [_timed_step(core) for _ in range(CONTROL_STEPS)]
    spec = StructuredOutput("json_schema", json.dumps(heavy_schema()))
    submitted = time.perf_counter()
    core.add_request("heavy", prompt, SamplingParams(max_tokens=4, structured_output=spec))
    during = []
    admission_ms = None
    while "heavy" in core.intake.compiling:
        elapsed = _timed_step(core)
        if core.last_step.prefill_tokens:
            # The step that admitted the compiled request also ran its prompt: not a stall.
            admission_ms = round(elapsed * 1e3, 2)
        else:
            during.append(elapsed)
    compile_s = time.perf_counter() - submitted
    if "heavy" not in core.requests:
        raise RuntimeError("the heavy grammar did not compile")
    after = [_timed_step(core) for _ in range(CONTROL_STEPS)]
    for request_id in list(core.requests):
        core.abort(request_id)
    core.step()
    median = statistics.median(control + after)
    return {
        "compile_s": round(compile_s, 2),
        "steps_during_compile": len(during),
        "median_step_ms": round(median * 1e3, 2),
        "worst_step_during_compile_ms": round(max(during) * 1e3, 2),
        "worst_over_median": round(max(during) / median, 3),
        "admission_step_ms": admission_ms,
        "control_worst_over_median": round(max(control) / median, 3),
    }


def _timed_step(core: EngineCore) -> float:
    start = time.perf_counter()
    core.step()
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    # A generous compile timeout: the heavy compile must finish to be measured.
    core = EngineCore(
        EngineArgs(max_num_seqs=NUM_REQUESTS + 1, memory_gib=2, grammar_compile_timeout_s=120)
    )
    prompt = core.tokenizer.encode(PROMPT + "<|im_start|>assistant\n").ids
    result = {"threads": args.threads, "requests": NUM_REQUESTS}
    result["masks"] = mask_overhead(core, prompt)
    result["compile"] = compile_stall(core, prompt)
    print(json.dumps(result, indent=2))
    print(f"step time ratio (half constrained / unconstrained): {result['masks']['ratio']}")
    compile_result = result["compile"]
    print(
        f"worst step while compiling / median: {compile_result['worst_over_median']} "
        f"(no compile: {compile_result['control_worst_over_median']})"
    )
    if args.json:
        args.json.write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
