"""Pictures of benchmark sweeps, drawn as DeepInfer draws them: throughput per process against
speed per user (a point per concurrency), and prefill throughput and step latency against
batch tokens; several sweeps overlay for comparison.

matplotlib is the optional extra `deepwell[plot]`; without it `draw` raises `PlotUnavailable`.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from deepwell.engine.sweep import SweepResult

DECODE_PICTURE = "decode.png"
PREFILL_PICTURE = "prefill.png"


class PlotUnavailable(RuntimeError):
    """matplotlib is not installed."""


def draw(runs: Sequence[SweepResult], out_dir: Path) -> list[Path]:
    """Write the two pictures of `runs` (one line each) into `out_dir`; return their paths."""
    try:
        import matplotlib

        matplotlib.use("Agg")  # files only, no display
        import matplotlib.pyplot as plt
    except ImportError:
        raise PlotUnavailable("drawing needs matplotlib: pip install 'deepwell[plot]'") from None
    out_dir.mkdir(parents=True, exist_ok=True)
    subtitle = _subtitle(runs)

    figure, axes = plt.subplots(figsize=(8, 6))
    for run in runs:
        points = sorted(run.decode, key=lambda p: p.concurrency)
        xs = [p.tok_s_per_user for p in points]
        ys = [p.decode_tok_s for p in points]
        (line,) = axes.plot(xs, ys, marker="o", label=run.label)
        for point, x, y in zip(points, xs, ys, strict=True):
            axes.annotate(
                str(point.concurrency),
                (x, y),
                textcoords="offset points",
                xytext=(5, 5),
                fontsize=8,
                color=line.get_color(),
            )
    axes.set_xlabel("output tok/s per user (1 / mean time per output token)")
    axes.set_ylabel("output tok/s per process (decode steps)")
    axes.set_title(f"Decode throughput vs interactivity (labels: concurrency)\n{subtitle}")
    axes.grid(True, alpha=0.3)
    axes.legend()
    decode_path = out_dir / DECODE_PICTURE
    figure.tight_layout()
    figure.savefig(decode_path, dpi=110)
    plt.close(figure)

    figure, (throughput, latency) = plt.subplots(1, 2, figsize=(12, 5))
    for run in runs:
        points = sorted(run.prefill, key=lambda p: p.batch_tokens)
        batch = [p.batch_tokens for p in points]
        throughput.plot(batch, [p.prefill_tok_s for p in points], marker="o", label=run.label)
        latency.plot(batch, [p.step_ms for p in points], marker="o", label=run.label)
    for axes, ylabel in ((throughput, "prefill tok/s"), (latency, "step latency (ms)")):
        axes.set_xscale("log", base=2)
        axes.set_xlabel("batch tokens (one step)")
        axes.set_ylabel(ylabel)
        axes.grid(True, alpha=0.3)
        axes.legend()
    figure.suptitle(f"Prefill throughput and step latency vs batch tokens\n{subtitle}")
    prefill_path = out_dir / PREFILL_PICTURE
    figure.tight_layout()
    figure.savefig(prefill_path, dpi=110)
    plt.close(figure)
    return [decode_path, prefill_path]


def _subtitle(runs: Sequence[SweepResult]) -> str:
    """The machine and model once when all runs share them, else each run's."""
    facts = {
        (
            run.machine.model,
            run.machine.cpu_model,
            run.machine.dtype,
            run.machine.torch_threads,
        )
        for run in runs
    }
    if len(facts) != 1:
        return "; ".join(f"{run.label}: {run.machine.cpu_model}" for run in runs)
    model, cpu, dtype, threads = facts.pop()
    return f"{model}, {dtype}, {threads} thread(s), {cpu}"
