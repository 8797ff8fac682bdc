"""Workload W with speculation on: where a step's time goes, what each verify step accepts,
and interleaved A/B runs of the speculation levers, at one thread on a W subset.

The first `--requests` of W (benchmarks/workload.py; all 64 is W itself) go through
`LLM.generate` with n-gram speculation (`--k` draft tokens), greedy, EOS ignored, no prefix
cache, as benchmarks/throughput_vs_hf.py runs them.

- `--profile`: one run with synchronous steps (the forward on the step thread, so that the
  torch.profiler trace sees it) and the trace split into linears by rows (≤ 8, ≤ 128, more:
  decode, verify-sized, prefill chunks), decode/verify attention (the backend's own time,
  the C++ kernel included), prefill SDPA, lm head, other ops; the engine's phases; and the
  speculation counters: verify steps, draft rows verified, accepted and wasted, τ.
- `--ab LEVER`: rounds alternate the lever on and off in one process (each round a fresh
  generate over the same subset) and each side keeps its best, with the load average.
  Levers: `grouped-verify` (a draft's verify rows read their blocks together in the decode
  kernel, layers/paged_decode.cpp, versus one kernel task per row); `batched-verify-argmax`
  (one blocked argmax over a step's greedy verify rows, versus `argmax` per request).
- `--measure`: best of `--rounds` generates of the tree on PYTHONPATH, for A/B runs of two
  trees (a kernel change) in alternating processes.

    PYTHONPATH=. .venv/bin/python benchmarks/spec_w.py --profile [--requests 32] \
        [--quantization int4]
    PYTHONPATH=. .venv/bin/python benchmarks/spec_w.py --ab grouped-verify [--rounds 3]

(`PYTHONPATH=.` from a worktree: a script run by path imports the editable install's
`deepwell`, not the checkout's.)
"""

import argparse
import os
import time
from collections import defaultdict
from pathlib import Path

import torch
from step_profile import wrap_attention
from torch.profiler import ProfilerActivity, profile, record_function
from workload import make_workload

import deepwell.engine.runner as runner_module
import deepwell.engine.speculative.verify as verify_module
from deepwell.engine import LLM, SamplingParams
from deepwell.engine.step_rows import PagedRows

GREEDY = {"temperature": 0, "ignore_eos": True}
LINEAR_OPS = ("linear", "addmm", "aten::mm", "gemv", "quant")


def make_llm(args, async_scheduling: bool = True) -> LLM:
    llm = LLM(
        dtype=args.dtype,
        enable_prefix_caching=False,
        num_speculative_tokens=args.k,
        quantization=args.quantization,
        num_threads=1,
        async_scheduling=async_scheduling,
        decode_sequence=False,
    )
    # The first generate builds kernels and warms oneDNN; it is not measured.
    llm.generate(
        prompt_token_ids=[[17 + i for i in range(64)]],
        sampling_params=SamplingParams(max_tokens=8, **GREEDY),
        use_tqdm=False,
    )
    return llm


def run_w(llm: LLM, workload: list[dict]) -> tuple[float, float, int]:
    """Wall and CPU seconds of one generate over the workload, and the output tokens it made.
    On a shared machine the process's CPU time is the steadier figure: wall time also counts
    the time other processes held the cores."""
    params = [SamplingParams(max_tokens=r["output_len"], **GREEDY) for r in workload]
    start, cpu_start = time.perf_counter(), time.process_time()
    outputs = llm.generate(
        prompt_token_ids=[r["prompt_ids"] for r in workload],
        sampling_params=params,
        use_tqdm=False,
    )
    tokens = sum(len(o.token_ids) for o in outputs)
    return time.perf_counter() - start, time.process_time() - cpu_start, tokens


# ---- --profile ----


class StepLog:
    """Per prepared step: rows, decode-shaped rows, draft rows; and the engine's phases."""

    def __init__(self, llm: LLM) -> None:
        core = llm.core
        self.rows: list[tuple[int, int, int]] = []
        self.phases: dict[str, float] = defaultdict(float)
        runner = core.runner
        prepare = runner.prepare

        def logged_prepare(chunks):
            step = prepare(chunks)
            paged = step.meta.paged
            decodes = paged.num_decodes if paged is not None else 0
            self.rows.append((step.num_rows, decodes, sum(len(c.draft) for c in chunks)))
            return step

        runner.prepare = logged_prepare
        self._wrap(runner, "prepare", "prepare (inputs, metadata)")
        self._wrap(runner, "forward", "run (forward + lm head)")
        self._wrap(runner, "sample", "sample + verify")
        self._wrap(core.scheduler, "schedule", "schedule")
        self._wrap(core.speculator, "propose", "propose (drafts, verify lengths)")
        self._wrap(core.pipeline, "_commit", "commit")
        self._wrap(runner.model, "compute_logits", "lm head")

    def _wrap(self, owner, name: str, phase: str) -> None:
        method = getattr(owner, name)

        def timed(*args, **kwargs):
            with record_function(f"phase::{phase}"):
                start = time.perf_counter()
                result = method(*args, **kwargs)
                self.phases[phase] += time.perf_counter() - start
            return result

        setattr(owner, name, timed)


def split_ops(prof) -> dict[str, float]:
    """Self CPU seconds by part: linears by their rows, attention (SDPA of prefill chunks
    apart), lm head, other ops."""
    parts: dict[str, float] = defaultdict(float)
    for event in prof.key_averages(group_by_input_shape=True):
        seconds = event.self_cpu_time_total / 1e6
        name = event.key
        if name.startswith("phase::"):
            continue
        if name == "attention":
            parts["attention: decode/verify rows (kernel + backend)"] += seconds
        elif "scaled_dot_product" in name:
            parts["attention: prefill SDPA"] += seconds
        elif any(op in name for op in LINEAR_OPS):
            shapes = event.input_shapes
            rows = shapes[0][0] if shapes and shapes[0] else 0
            weight_rows = shapes[1][0] if len(shapes) > 1 and shapes[1] else 0
            if weight_rows > 10_000:
                parts["lm head"] += seconds
            else:
                size = "≤ 8" if rows <= 8 else "≤ 128" if rows <= 128 else "> 128"
                parts[f"linears, {size} rows"] += seconds
        else:
            parts["other ops"] += seconds
    return parts


def profile_w(args, workload: list[dict]) -> None:
    llm = make_llm(args, async_scheduling=False)
    log = StepLog(llm)
    wrap_attention(llm.core)
    with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
        seconds, _, tokens = run_w(llm, workload)
    print(
        f"W[:{len(workload)}], {args.dtype}, quantization {args.quantization}, k {args.k}, "
        f"1 thread, synchronous steps, traced: {tokens} tokens in {seconds:.1f} s, "
        f"{len(log.rows)} steps (load average {os.getloadavg()[0]:.2f})"
    )
    stats = llm.core.stats().spec
    wasted = stats.verified_tokens - stats.accepted_tokens
    print(
        f"  speculation: {stats.decode_steps} request-steps, {stats.verify_steps} verified a "
        f"draft; draft rows verified {stats.verified_tokens}, accepted {stats.accepted_tokens}, "
        f"wasted {wasted} ({wasted / max(stats.verified_tokens, 1):.0%}); "
        f"τ (tokens per request-step) {stats.tokens_per_decode:.2f}; per position "
        + " ".join(f"{r:.2f}" for r in stats.position_accept_rates)
    )
    rows = [r for r, _, _ in log.rows]
    decode_rows = [d for _, d, _ in log.rows]
    print(
        f"  rows per step: mean {sum(rows) / len(rows):.0f}, decode-shaped (one token or a "
        f"verify row) mean {sum(decode_rows) / len(decode_rows):.0f}; steps with a prefill "
        f"chunk {sum(1 for r, d, _ in log.rows if r > d)}"
    )
    parts = split_ops(prof)
    total = sum(parts.values())
    for part, value in sorted(parts.items(), key=lambda item: -item[1]):
        print(f"  {part}: {value:.2f} s ({value / total:.0%} of traced op time)")
    for phase, value in log.phases.items():
        print(f"  phase {phase}: {value:.2f} s")


# ---- --ab ----


def per_row_verify(on: bool) -> None:
    """Lever grouped-verify off: decode metadata without sequences, so every verify row is
    its own kernel task (as before the lever)."""
    grouped = _original(PagedRows, "metadata")
    if on:
        PagedRows.metadata = grouped
        return

    def ungrouped(self, *args, **kwargs):
        meta = grouped(self, *args, **kwargs)
        meta.decode_sequence_rows = None
        return meta

    PagedRows.metadata = ungrouped


def batched_verify_argmax(on: bool) -> None:
    """Lever batched-verify-argmax off: each verifying request takes `argmax` of its own
    rows (as before the lever)."""
    takes = _original(runner_module, "takes_batched_argmax")
    first = _original(verify_module, "first_argmax")
    runner_module.takes_batched_argmax = takes if on else lambda request: False
    verify_module.first_argmax = first if on else lambda rows: rows.argmax(dim=-1)


_ORIGINALS: dict[tuple[int, str], object] = {}


def _original(owner, name: str):
    """What `owner.name` was before any lever was toggled."""
    return _ORIGINALS.setdefault((id(owner), name), getattr(owner, name))


LEVERS = {"grouped-verify": per_row_verify, "batched-verify-argmax": batched_verify_argmax}


def measure(args, workload: list[dict]) -> None:
    """Best of `--rounds` generates of this tree as it is: for A/B runs of two trees in
    alternating processes (a compiled kernel cannot be toggled in one process)."""
    llm = make_llm(args)
    best_wall = best_cpu = 0.0
    for _ in range(args.rounds):
        seconds, cpu_seconds, tokens = run_w(llm, workload)
        best_wall = max(best_wall, tokens / seconds)
        best_cpu = max(best_cpu, tokens / cpu_seconds)
    print(
        f"W[:{len(workload)}], quantization {args.quantization}, k {args.k}, 1 thread, best of "
        f"{args.rounds}: {best_wall:.1f} tok/s, {best_cpu:.1f} tok per CPU-s (load average "
        f"{os.getloadavg()[0]:.2f}; deepwell from {Path(runner_module.__file__).parents[2]})"
    )


def ab(args, workload: list[dict]) -> None:
    llm = make_llm(args)
    toggle = LEVERS[args.ab]
    # Per side: best tokens per wall second and per CPU second.
    best: dict[bool, list[float]] = {True: [0.0, 0.0], False: [0.0, 0.0]}
    for round_index in range(args.rounds):
        for on in (True, False) if round_index % 2 == 0 else (False, True):
            toggle(on)
            seconds, cpu_seconds, tokens = run_w(llm, workload)
            rates = [tokens / seconds, tokens / cpu_seconds]
            best[on] = [max(b, r) for b, r in zip(best[on], rates, strict=True)]
            print(
                f"  round {round_index + 1}, {args.ab} {'on' if on else 'off'}: "
                f"{rates[0]:.1f} tok/s, {rates[1]:.1f} tok per CPU-s ({tokens} tokens, "
                f"{seconds:.1f} s; load average {os.getloadavg()[0]:.2f})",
                flush=True,
            )
    (on_wall, on_cpu), (off_wall, off_cpu) = best[True], best[False]
    print(
        f"W[:{len(workload)}], quantization {args.quantization}, k {args.k}, 1 thread, best of "
        f"{args.rounds}: {args.ab} on {on_wall:.1f} tok/s ({on_cpu:.1f} per CPU-s), off "
        f"{off_wall:.1f} tok/s ({off_cpu:.1f} per CPU-s): {on_wall / off_wall - 1:+.1%} wall, "
        f"{on_cpu / off_cpu - 1:+.1%} CPU"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=32, help="the first N of W's 64")
    parser.add_argument("--k", type=int, default=5)
    parser.add_argument("--quantization", default="none", choices=("none", "int4"))
    parser.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"))
    parser.add_argument("--rounds", type=int, default=3)
    mode = parser.add_mutually_exclusive_group(required=True)
    mode.add_argument("--profile", action="store_true")
    mode.add_argument("--ab", choices=sorted(LEVERS))
    mode.add_argument("--measure", action="store_true")
    args = parser.parse_args()
    torch.set_num_threads(1)
    workload = make_workload()[: args.requests]
    if args.profile:
        profile_w(args, workload)
    elif args.measure:
        measure(args, workload)
    else:
        ab(args, workload)


if __name__ == "__main__":
    main()
