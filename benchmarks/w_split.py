"""Where workload W's time goes: each step's shape and its thread CPU time by part, over the
whole of W (prefill, mixed and decode steps), and W's greedy tokens for comparing trees.

One torch thread and synchronous steps, so every part of a step runs on the calling thread
and its thread CPU time (`time.thread_time`) counts it alone: on a shared machine that
moves far less with the neighbours' load than wall time. Speculation and the prefix cache
are off, as in `throughput_vs_hf.py`'s W. The parts are timed by wrapping the engine's own
calls: the layer and head linears (each linear class's `forward`), the attention backend (K/V
store, prefill and decode attention), `compute_logits` (the head, inside `linear` too),
the sampler, schedule, prepare and commit; what is left of the forward is glue. Steps are
grouped by shape: prefill-only, mixed (decode rows beside prefill chunks), decode-only
with 32 rows or more, and fewer. The linears' oneDNN calls are also split by whether their
(shape, row count) is new in the timed run: oneDNN creates a primitive for each new one.

    PYTHONPATH=. .venv/bin/python benchmarks/w_split.py [--requests 64] [--tokens W.json]

`--tokens` writes {request id: greedy tokens}; two trees' files are equal when a change
keeps W's greedy outputs.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from dataclasses import dataclass, field

import torch
from torch import nn
from workload import make_workload

from deepwell.engine import EngineArgs, EngineCore, SamplingParams
from deepwell.engine.layers.packed_linear import PackedLinear, takes_panels

PARTS = ("linear", "attention", "logits", "sample", "forward", "schedule", "prepare", "commit")
# Below this many decode rows a decode-only step streams its weights more than it computes.
SMALL_DECODE = 32


@dataclass
class StepShape:
    decode_rows: int
    prefill_tokens: int
    # Summed over the decode rows: the keys their attention reads.
    decode_context: int

    @property
    def kind(self) -> str:
        if not self.decode_rows:
            return "prefill-only"
        if self.prefill_tokens:
            return "mixed"
        return f"decode>={SMALL_DECODE}" if self.decode_rows >= SMALL_DECODE else "decode<32"


@dataclass
class StepClock:
    """One step's thread CPU and wall seconds, in all and by part."""

    cpu_s: float
    parts: dict[str, float]
    wall_s: float
    parts_wall: dict[str, float]


@dataclass
class KindTotals:
    steps: int = 0
    cpu_s: float = 0.0
    wall_s: float = 0.0
    decode_rows: int = 0
    prefill_tokens: int = 0
    decode_context: int = 0
    parts: dict[str, float] = field(default_factory=lambda: dict.fromkeys(PARTS, 0.0))
    parts_wall: dict[str, float] = field(default_factory=lambda: dict.fromkeys(PARTS, 0.0))

    def line(self, kind: str) -> str:
        p = self.parts
        glue = p["forward"] - p["linear"] - p["attention"]
        return (
            f"{kind}: {self.steps} steps, CPU {self.cpu_s:.2f} s; decode rows {self.decode_rows} "
            f"(mean {self.decode_rows / self.steps:.1f}, mean context "
            f"{self.decode_context / max(self.decode_rows, 1):.0f}), prefill tokens "
            f"{self.prefill_tokens}; linears {p['linear']:.2f} (head inside: logits "
            f"{p['logits']:.2f}), attention {p['attention']:.2f}, glue {glue:.2f}, "
            f"sample {p['sample']:.2f}, schedule {p['schedule']:.2f}, prepare "
            f"{p['prepare']:.2f}, commit {p['commit']:.2f}"
        )

    def wall_line(self, kind: str) -> str:
        w = self.parts_wall
        glue = w["forward"] - w["linear"] - w["attention"]
        # What no part's clock covers: the step loop's own Python between the parts.
        loop = self.wall_s - w["forward"] - w["sample"] - w["schedule"] - w["prepare"]
        loop -= w["commit"]
        return (
            f"{kind} wall: {self.wall_s:.2f} s; linears {w['linear']:.2f}, attention "
            f"{w['attention']:.2f}, glue {glue:.2f}, sample {w['sample']:.2f}, schedule "
            f"{w['schedule']:.2f}, prepare {w['prepare']:.2f}, commit {w['commit']:.2f}, "
            f"loop {loop:.2f}"
        )


def group_steps(shapes: list[StepShape], steps: list[StepClock]) -> dict[str, KindTotals]:
    """Totals per step kind, in the order kinds first appear."""
    kinds: dict[str, KindTotals] = {}
    for shape, step in zip(shapes, steps, strict=True):
        totals = kinds.setdefault(shape.kind, KindTotals())
        totals.steps += 1
        totals.cpu_s += step.cpu_s
        totals.wall_s += step.wall_s
        totals.decode_rows += shape.decode_rows
        totals.prefill_tokens += shape.prefill_tokens
        totals.decode_context += shape.decode_context
        for part in PARTS:
            totals.parts[part] += step.parts[part]
            totals.parts_wall[part] += step.parts_wall[part]
    return kinds


@dataclass
class ShapeCalls:
    """One (linear shape, row count)'s oneDNN calls: the first's thread CPU, the repeats'."""

    first_s: float
    repeat_s: float = 0.0
    repeats: int = 0


class FirstCalls:
    """The linears' oneDNN calls (not the panels') in the timed run, by (in, out) shape and
    row count: oneDNN creates (JITs) a primitive for each new one and caches it, so a first
    call costs more than a repeat. The warm-up request's row counts count as new here
    although it made their primitives."""

    def __init__(self) -> None:
        self.calls: dict[tuple[int, int], dict[int, ShapeCalls]] = {}

    def add(self, linear: PackedLinear, x: torch.Tensor, seconds: float) -> None:
        if takes_panels(linear, x):
            return
        counts = self.calls.setdefault((linear.in_features, linear.out_features), {})
        calls = counts.get(x.shape[0])
        if calls is None:
            counts[x.shape[0]] = ShapeCalls(seconds)
        else:
            calls.repeat_s += seconds
            calls.repeats += 1

    def lines(self) -> list[str]:
        """Per shape: its row counts, and what their first calls cost above a repeat of the
        same count (over the counts that repeat)."""
        lines = []
        for (fan_in, fan_out), counts in self.calls.items():
            repeated = [c for c in counts.values() if c.repeats]
            first = sum(c.first_s for c in repeated)
            excess = first - sum(c.repeat_s / c.repeats for c in repeated)
            calls = sum(1 + c.repeats for c in counts.values())
            total = sum(c.first_s + c.repeat_s for c in counts.values())
            lines.append(
                f"oneDNN {fan_in}->{fan_out}: {calls} calls, CPU {total:.3f} s; {len(counts)} "
                f"row counts ({min(counts)}..{max(counts)}); first calls of the "
                f"{len(repeated)} that repeat: {first:.3f} s, {excess:.3f} s above a repeat "
                f"({excess / max(len(repeated), 1) * 1e3:.2f} ms each)"
            )
        return lines


class PartClock:
    """Thread CPU and wall seconds per part, by wrapping the engine's calls on one instance."""

    def __init__(self, core: EngineCore, shapes: list[StepShape]) -> None:
        self.seconds = dict.fromkeys(PARTS, 0.0)
        self.wall = dict.fromkeys(PARTS, 0.0)
        self.first_calls = FirstCalls()
        runner = core.runner
        backend = runner.model.layers[0].self_attn.backend  # one instance serves every layer
        self._wrap(backend, "forward", "attention")
        self._wrap(runner.model, "compute_logits", "logits")
        self._wrap(runner, "sample", "sample")
        self._wrap(runner, "forward", "forward")
        self._wrap(runner, "prepare", "prepare")
        self._wrap(core.pipeline, "_commit", "commit")
        self._wrap_linears(runner.model)
        schedule = core.scheduler.schedule

        def shaped():
            out = schedule()
            decodes = [c for c in out.chunks if c.num_tokens == 1]
            shapes.append(
                StepShape(
                    decode_rows=len(decodes),
                    prefill_tokens=sum(c.num_tokens for c in out.chunks if c.num_tokens > 1),
                    decode_context=sum(c.start + 1 for c in decodes),
                )
            )
            return out

        core.scheduler.schedule = shaped
        self._wrap(core.scheduler, "schedule", "schedule")

    def _wrap(self, owner, name: str, part: str) -> None:
        method = getattr(owner, name)

        def timed(*args, **kwargs):
            start, wall = time.thread_time(), time.perf_counter()
            result = method(*args, **kwargs)
            self.seconds[part] += time.thread_time() - start
            self.wall[part] += time.perf_counter() - wall
            return result

        setattr(owner, name, timed)

    def _wrap_linears(self, model: nn.Module) -> None:
        """The `forward` of every linear class the model holds (nn.Linear, PackedLinear,
        RowPaddedLinear, Float32Head, ...), wrapped where each class or its bases up to
        nn.Linear define it; a call made inside another (a subclass calling its base) counts
        once."""
        seconds, walls, first_calls = self.seconds, self.wall, self.first_calls
        depth = [0]

        def timing(call):
            def timed(linear, x):
                depth[0] += 1
                start, wall = time.thread_time(), time.perf_counter()
                try:
                    return call(linear, x)
                finally:
                    depth[0] -= 1
                    if not depth[0]:
                        cpu = time.thread_time() - start
                        seconds["linear"] += cpu
                        walls["linear"] += time.perf_counter() - wall
                        if isinstance(linear, PackedLinear):
                            first_calls.add(linear, x, cpu)

            return timed

        owners = set()
        for linear in {type(m) for m in model.modules() if isinstance(m, nn.Linear)}:
            owners.update(linear.__mro__[: linear.__mro__.index(nn.Linear) + 1])
        for owner in owners:
            if "forward" in vars(owner):
                owner.forward = timing(vars(owner)["forward"])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=64, help="W's first N requests")
    parser.add_argument("--threads", type=int, default=1, help="torch threads")
    parser.add_argument("--tokens", help="write the greedy tokens here (JSON)")
    parser.add_argument(
        "--dtype", default="auto", help="the engine's --dtype (float32 to compare trees alike)"
    )
    args = parser.parse_args()
    engine_args = EngineArgs(
        dtype=args.dtype,
        enable_prefix_caching=False,
        num_speculative_tokens=0,
        num_threads=args.threads,
        async_scheduling=False,
    )
    core = EngineCore(engine_args)
    workload = make_workload(requests=args.requests)
    greedy = {"temperature": 0, "ignore_eos": True}
    core.add_request("warm", workload[0]["prompt_ids"][:64], SamplingParams(max_tokens=8, **greedy))
    while core.has_unfinished():
        core.step()
    shapes: list[StepShape] = []
    clock = PartClock(core, shapes)
    for request in workload:
        params = SamplingParams(max_tokens=request["output_len"], **greedy)
        core.add_request(str(request["id"]), request["prompt_ids"], params)
    steps: list[StepClock] = []
    tokens: dict[str, list[int]] = {}
    wall, cpu, process = time.perf_counter(), time.thread_time(), time.process_time()
    while core.has_unfinished():
        before, before_wall = dict(clock.seconds), dict(clock.wall)
        start, start_wall = time.thread_time(), time.perf_counter()
        for out in core.step():
            tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
        steps.append(
            StepClock(
                time.thread_time() - start,
                {p: clock.seconds[p] - before[p] for p in PARTS},
                time.perf_counter() - start_wall,
                {p: clock.wall[p] - before_wall[p] for p in PARTS},
            )
        )
    wall, cpu = time.perf_counter() - wall, time.thread_time() - cpu
    process = time.process_time() - process
    output = sum(len(t) for t in tokens.values())
    print(
        f"W[:{args.requests}]: {output} tokens, {len(steps)} steps, {args.threads} threads, "
        f"{engine_args.torch_dtype} at torch's {torch.backends.cpu.get_cpu_capability()}, "
        f"thread CPU {cpu:.2f} s ({output / cpu:.1f} tokens a CPU second), process CPU "
        f"{process:.2f} s, wall {wall:.1f} s, load average {os.getloadavg()[0]:.1f}"
    )
    print("parts (CPU s): " + ", ".join(f"{p} {clock.seconds[p]:.2f}" for p in PARTS))
    print("parts (wall s): " + ", ".join(f"{p} {clock.wall[p]:.2f}" for p in PARTS))
    for kind, totals in group_steps(shapes, steps).items():
        print(totals.line(kind))
        print(totals.wall_line(kind))
    print("\n".join(clock.first_calls.lines()))
    if args.tokens:
        with open(args.tokens, "w", encoding="utf-8") as f:
            json.dump(tokens, f)


if __name__ == "__main__":
    main()
