"""Where a decode step's time goes: linears, attention, model glue, and the engine's own work
per phase, at batch 1 and with W's 64 running requests.

The embedded SmolLM2 runs synchronous steps (no speculation, no prefix cache). Batch 1: a
64-token prompt of W's first request, prefilled, then `--steps` decode steps. W: all 64
requests (benchmarks/workload.py), stepped until each has its first token, then
`--steps` decode steps. The engine's phases (schedule, prepare, forward, logits, sample,
commit) are timed around the engine's own calls; the forward's ops are split by a
torch.profiler trace (CPU, self time per op): matmuls are linears, everything under the
attention backend's `forward` is attention, the remaining ops are glue.

    .venv/bin/python benchmarks/step_profile.py [--dtype bfloat16] [--steps 30]

`--no-trace` skips the torch.profiler trace, for running under py-spy, whose samples
benchmarks/pyspy_split.py splits the same way without the profiler's overhead.
"""

import argparse
import os
import statistics
import time
from collections import defaultdict

from torch.profiler import ProfilerActivity, profile, record_function
from workload import make_workload

from deepwell.engine import EngineArgs, EngineCore, SamplingParams
from deepwell.engine.layers.attention import AttentionBackend

LINEAR_OPS = {"aten::addmm", "aten::mm", "aten::bmm", "aten::matmul", "aten::linear"}
FORWARD_PARTS = ("linears", "attention", "glue", "python")
# `run` is the runner's whole forward call (the model's forward, its logits, and the
# runner's own work around them).
PHASES = ("schedule", "prepare", "run", "forward", "logits", "sample", "commit")


class PhaseTimer:
    """Wall time per engine phase, by wrapping the engine's own calls on one instance."""

    def __init__(self, core: EngineCore) -> None:
        self.seconds: dict[str, list[float]] = defaultdict(list)
        runner, pipeline = core.runner, core.pipeline
        self._wrap(core.scheduler, "schedule", "schedule")
        self._wrap(runner, "prepare", "prepare")
        self._wrap(runner, "forward", "run")
        self._wrap(runner.model, "forward", "forward")
        self._wrap(runner.model, "compute_logits", "logits")
        self._wrap(runner, "sample", "sample")
        self._wrap(pipeline, "_commit", "commit")

    def _wrap(self, owner, name: str, phase: str) -> None:
        method = getattr(owner, name)

        def timed(*args, **kwargs):
            with record_function(f"phase::{phase}"):
                start = time.perf_counter()
                result = method(*args, **kwargs)
                self.seconds[phase].append(time.perf_counter() - start)
            return result

        setattr(owner, name, timed)

    def reset(self) -> None:
        self.seconds.clear()


def wrap_attention(core: EngineCore) -> None:
    """Label every attention call in the trace (one backend instance serves all layers)."""
    backends = {
        id(m.backend): m.backend for m in core.runner.model.modules() if hasattr(m, "backend")
    }
    for backend in backends.values():
        assert isinstance(backend, AttentionBackend)
        forward = backend.forward

        def labelled(*args, _forward=forward, **kwargs):
            with record_function("attention"):
                return _forward(*args, **kwargs)

        backend.forward = labelled


def split_trace(prof) -> dict[str, float]:
    """Self CPU time (s) in the forward: linears, attention (the backend's call, kernel
    included), glue ops, and the forward's own Python time between ops (inflated by the
    profiler)."""
    events = prof.events()
    totals = {"linears": 0.0, "attention": 0.0, "glue": 0.0, "python": 0.0, "glue_ops": 0}

    def spans(name: str) -> list[tuple[float, float]]:
        return [(e.time_range.start, e.time_range.end) for e in events if e.name == name]

    forward, attention = spans("phase::forward"), spans("attention")

    def inside(event, ranges) -> bool:
        return any(a <= event.time_range.start < b for a, b in ranges)

    for event in events:
        seconds = event.self_cpu_time_total / 1e6
        if event.name == "phase::forward":
            totals["python"] += seconds
        elif event.name.startswith("phase::") or not inside(event, forward):
            continue
        elif event.name == "attention" or inside(event, attention):
            totals["attention"] += seconds
        elif event.name in LINEAR_OPS or "linear" in event.name:
            totals["linears"] += seconds
        else:
            totals["glue"] += seconds
            totals["glue_ops"] += 1
    return totals


def measure(core: EngineCore, timer: PhaseTimer | None, steps: int, label: str) -> None:
    if timer is not None:
        timer.reset()
    walls = []
    for _ in range(steps):
        start = time.perf_counter()
        core.step()
        walls.append(time.perf_counter() - start)
    step_ms = statistics.median(walls) * 1e3
    if timer is None:
        print(f"{label}: median step {step_ms:.2f} ms (load average {os.getloadavg()[0]:.2f})")
        return
    phases = {p: statistics.median(timer.seconds[p]) * 1e3 for p in PHASES if timer.seconds[p]}
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(min(steps, 10)):
            core.step()
    split = split_trace(prof)
    traced = min(steps, 10)
    forward_ms = phases["forward"]
    print(f"{label}: median step {step_ms:.2f} ms (load average {os.getloadavg()[0]:.2f})")
    print("  phases (median ms): " + ", ".join(f"{p} {v:.2f}" for p, v in phases.items()))
    outside = step_ms - forward_ms - phases.get("logits", 0)
    named = sum(
        phases[p] for p in ("schedule", "prepare", "run", "sample", "commit") if p in phases
    )
    print(
        f"  engine work outside the forward and logits: {outside:.2f} ms "
        f"(runner around the forward {phases['run'] - forward_ms - phases.get('logits', 0):.2f}, "
        f"step loop between phases {step_ms - named:.2f})"
    )
    traced_total = sum(split[part] for part in FORWARD_PARTS)
    for part in FORWARD_PARTS:
        share = split[part] / traced_total if traced_total else 0.0
        print(
            f"  forward {part}: {share:.0%} of traced op time "
            f"(≈ {share * forward_ms:.2f} ms of the {forward_ms:.2f} ms forward)"
        )
    print(f"  glue ops per forward (nested ops counted): {split['glue_ops'] / traced:.0f}")
    table = prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=25)
    if os.environ.get("STEP_PROFILE_TABLE"):
        print(table)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"))
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--batch", choices=("1", "64", "both"), default="both")
    parser.add_argument("--no-trace", dest="trace", action="store_false")
    args = parser.parse_args()
    core = EngineCore(
        EngineArgs(
            dtype=args.dtype,
            enable_prefix_caching=False,
            num_speculative_tokens=0,
            async_scheduling=False,
            num_threads=1,
        )
    )
    # Under py-spy (--no-trace) the engine runs unwrapped: the wrappers' own calls would
    # count as step-loop work.
    timer = None
    if args.trace:
        timer = PhaseTimer(core)
        wrap_attention(core)
    workload = make_workload()
    greedy = {"temperature": 0, "ignore_eos": True}
    if args.batch in ("1", "both"):
        prompt = workload[0]["prompt_ids"][:64]
        core.add_request("b1", prompt, SamplingParams(max_tokens=2 * args.steps + 40, **greedy))
        for _ in range(5):
            core.step()
        measure(core, timer, args.steps, f"batch-1 decode, {args.dtype}")
        core.abort("b1")
        core.step()
    if args.batch in ("64", "both"):
        for request in workload:
            params = SamplingParams(max_tokens=request["output_len"], **greedy)
            core.add_request(str(request["id"]), request["prompt_ids"], params)
        started: set[str] = set()
        while len(started) < len(workload):
            started |= {out.request_id for out in core.step() if out.new_token_ids}
        measure(core, timer, args.steps, f"W decode step (64 running), {args.dtype}")


if __name__ == "__main__":
    main()
