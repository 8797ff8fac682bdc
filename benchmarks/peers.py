"""Every peer comparison of issue 33 in one command, each engine in its own process, and one
table of ratios: machine, SIMD flags, load, the command behind each row.

Each comparison is one script of benchmarks/ run as its own process (the scripts run every
engine in a child of their own) with `--json`, from which its rows are read:

    w         W vs transformers' best static batch          throughput_vs_hf.py
    decode    batch-1 decode at the memory limit, and vs
              llama.cpp's tg128                              memory_limit.py
    batches   decode at each batch size vs llama.cpp         decode_batches.py
    pp512     one 512-token prompt vs llama.cpp's pp512      prompt_vs_llama_cpp.py
    prefill   long prompts, where benchmarks/ has the
              script (its lines "... ratio ...: X" read)     prefill_long.py
    serve     W through HTTP vs llama-server -np 16          serve_vs_llama_server.py
    sampled   W sampled (temperature 0.8, top_p 0.95) vs
              W greedy                                       sampled_w.py
    invariance  batch-invariant decode steps vs the default,
              CPU ms a step at batch 1 and 16 (one thread)   invariance_cost.py

`--quick` runs each at its smallest (a smoke run: the figures mean nothing); `--dry-run`
prints the plan and runs nothing. llama.cpp must be built (benchmarks/llama_cpp_peer.py, or
`--build-llama-cpp`); without it the comparisons that need it are skipped and say so.

    PYTHONPATH=. .venv/bin/python benchmarks/peers.py [--only w,serve] [--quick] [--dry-run]
        [--threads 2] [--build-llama-cpp] [--timeout 3600] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import llama_cpp_peer as llama_cpp

ROOT = Path(__file__).resolve().parents[1]
BENCHMARKS = Path(__file__).resolve().parent


@dataclass(frozen=True)
class Row:
    """One line of the table: a ratio of deepwell's figure over its peer's, same run."""

    comparison: str
    what: str
    ratio: float
    # deepwell's figure / the peer's, with units.
    figures: str
    # The goal and whether this row meets it; "" where none is set.
    goal: str = ""


@dataclass(frozen=True)
class Comparison:
    name: str
    script: str
    full: tuple[str, ...]
    quick: tuple[str, ...]
    needs_llama_cpp: bool
    # The script's --json summary -> rows; None: the script's own "... ratio ...: X" lines.
    rows: Callable[[dict], list[Row]] | None
    # Whether it runs at peers.py's --threads (invariance_cost.py measures at one thread).
    takes_threads: bool = True


def met(ok: bool) -> str:
    return "met" if ok else "missed"


# ---- each script's summary -> rows ----


def w_rows(summary: dict) -> list[Row]:
    results = summary["results"]
    best = summary["transformers_best"]
    peer = results[best]["output_tok_s"]
    rows = []
    for name, result in results.items():
        if not name.startswith("deepwell") or "output_tok_s" not in result:
            continue
        ratio = result["output_tok_s"] / peer
        goal = f">= 5x: {met(ratio >= 5)}" if name.endswith("speculation off") else ""
        rows.append(
            Row(
                "w",
                f"W output tok/s, {name} vs transformers' best ({best})",
                ratio,
                f"{result['output_tok_s']:.1f} / {peer:.1f} tok/s",
                goal,
            )
        )
    return rows


def decode_rows(summary: dict) -> list[Row]:
    bandwidth = summary["bandwidth_bytes_s"]
    rows = []
    for row in summary["rows"]:
        rows.append(
            Row(
                "decode",
                f"batch-1 decode x weight bytes / read bandwidth, {row['engine']}",
                row["fraction"],
                f"{row['tok_s']:.1f} tok/s x {row['weight_bytes'] / 1e6:.1f} MB"
                f" / {bandwidth / 1e9:.1f} GB/s",
                f">= 0.85: {met(row['fraction'] >= 0.85)}"
                if row["engine"] != "llama.cpp tg128"
                else "",
            )
        )
    llama = next((r for r in summary["rows"] if r["engine"] == "llama.cpp tg128"), None)
    for row in summary["rows"]:
        if llama is not None and row is not llama:
            rows.append(
                Row(
                    "decode",
                    f"batch-1 decode, {row['engine']} vs llama.cpp's tg128 (same GGUF)",
                    row["tok_s"] / llama["tok_s"],
                    f"{row['tok_s']:.1f} / {llama['tok_s']:.1f} tok/s",
                )
            )
    return rows


def batches_rows(summary: dict) -> list[Row]:
    engines = summary["engines"]
    rows = []
    for size, ratio in summary["ratios"].items():
        ours = max(v[size] for n, v in engines.items() if n.startswith("deepwell") and size in v)
        theirs = max(v[size] for n, v in engines.items() if n.startswith("llama.cpp") and size in v)
        rows.append(
            Row(
                "batches",
                f"decode at batch {size} vs llama.cpp's best (batched-bench, tg128 at 1)",
                ratio,
                f"{ours:.1f} / {theirs:.1f} tok/s",
                f"ahead: {met(ratio > 1)}",
            )
        )
    return rows


def pp_rows(summary: dict) -> list[Row]:
    ratio = summary["ratio"]
    return [
        Row(
            "pp512",
            f"one {summary['n_prompt']}-token prompt vs llama.cpp's pp{summary['n_prompt']}",
            ratio,
            f"{summary['deepwell_tok_s']:.1f} / {summary['llama_cpp_tok_s']:.1f} tok/s",
            f">= 3x: {met(ratio >= 3)}",
        )
    ]


def serve_rows(summary: dict) -> list[Row]:
    results = {(r["engine"], r["rate"]): r for r in summary["results"]}
    rows = []
    for verdict in summary["ratios"]:
        rate = verdict["rate"]
        ours, theirs = results[("deepwell", rate)], results[("llama-server", rate)]
        pattern = "at t = 0" if rate is None else f"Poisson {rate:g} req/s"
        rows.append(
            Row(
                "serve",
                f"W {pattern} through HTTP, output tok/s vs llama-server -np 16"
                f" (p99 TTFT {ours['ttft_p99_ms']:.0f} / {theirs['ttft_p99_ms']:.0f} ms)",
                verdict["ratio"],
                f"{ours['output_tok_s']:.1f} / {theirs['output_tok_s']:.1f} tok/s",
                f">= 3x at no worse p99 TTFT: {met(verdict['met'])}" if rate is None else "",
            )
        )
    return rows


def sampled_rows(summary: dict) -> list[Row]:
    ratio = summary["ratio_wall"]
    top_k = f", top_k {summary['top_k']}" if summary["top_k"] > 0 else ""
    return [
        Row(
            "sampled",
            f"W sampled (temperature {summary['temperature']:g}, top_p {summary['top_p']:g}"
            f"{top_k}) / W greedy, output tok/s (CPU {summary['ratio_cpu']:.3f}x)",
            ratio,
            f"{summary['sampled_tok_s']:.1f} / {summary['greedy_tok_s']:.1f} tok/s",
            f">= 0.95x: {met(ratio >= 0.95)}",
        )
    ]


def invariance_rows(summary: dict) -> list[Row]:
    rows = []
    for batch, figures in summary["batches"].items():
        ratio = figures["ratio"]
        rows.append(
            Row(
                "invariance",
                f"batch-invariant decode step at batch {batch} / the default's, CPU ms"
                " (lower is better)",
                ratio,
                f"{figures['invariant_cpu_ms']:.2f} / {figures['default_cpu_ms']:.2f} ms",
                f"<= 1.2x: {met(ratio <= 1.2)}",
            )
        )
    return rows


RATIO_LINE = re.compile(r"^(?P<what>.*\bratio\b.*):\s*(?P<ratio>\d+(?:\.\d+)?)\b")


def ratio_lines(name: str, text: str) -> list[Row]:
    """Rows from a script's own "<what> ratio <…>: X" lines, for scripts read as they print."""
    rows = []
    for line in text.splitlines():
        found = RATIO_LINE.match(line.strip())
        if found:
            rows.append(Row(name, found["what"], float(found["ratio"]), "see its output"))
    return rows


COMPARISONS = (
    Comparison(
        "w",
        "throughput_vs_hf.py",
        (
            "--rounds",
            "1",
            "--quantizations",
            "none,int4",
            "--hf-batch-sizes",
            "32",
            "--no-hf-continuous",
        ),
        (
            "--requests",
            "8",
            "--quantizations",
            "int4",
            "--hf-batch-sizes",
            "8",
            "--hf-caches",
            "dynamic",
            "--no-hf-continuous",
        )
        + ("--decode-tokens", "16", "--decode-repetitions", "1", "--k", "0"),
        False,
        w_rows,
    ),
    Comparison(
        "decode",
        "memory_limit.py",
        ("--quantizations", "none,int4", "--tokens", "128", "--repetitions", "3"),
        ("--quantizations", "int4", "--tokens", "16", "--repetitions", "1", "--repeats", "2"),
        True,
        decode_rows,
    ),
    Comparison(
        "batches",
        "decode_batches.py",
        ("--batch-sizes", "1,2,4,8,16,32", "--tokens", "128", "--repetitions", "2"),
        ("--batch-sizes", "1,4", "--tokens", "16", "--repetitions", "1", "--quantizations", "int4"),
        True,
        batches_rows,
    ),
    Comparison(
        "pp512",
        "prompt_vs_llama_cpp.py",
        ("--n-prompt", "512", "--repetitions", "5"),
        ("--n-prompt", "512", "--repetitions", "1"),
        True,
        pp_rows,
    ),
    Comparison("prefill", "prefill_long.py", (), ("--quick",), True, None),
    Comparison(
        "serve",
        "serve_vs_llama_server.py",
        ("--rates", "0.5,1,2", "--rounds", "1"),
        ("--requests", "8", "--rates", "2"),
        True,
        serve_rows,
    ),
    Comparison(
        "sampled",
        "sampled_w.py",
        ("--rounds", "2"),
        ("--requests", "8", "--rounds", "1"),
        False,
        sampled_rows,
    ),
    Comparison(
        "invariance",
        "invariance_cost.py",
        ("--batch", "1", "16", "--rounds", "2"),
        ("--batch", "1", "--rounds", "1", "--steps", "5"),
        False,
        invariance_rows,
        takes_threads=False,
    ),
)
NAMES = tuple(c.name for c in COMPARISONS)


def command_of(comparison: Comparison, quick: bool, threads: int) -> list[str] | None:
    """The comparison's command; None where a script read by its lines has no quick form."""
    script = BENCHMARKS / comparison.script
    arguments = list(comparison.quick if quick else comparison.full)
    if comparison.rows is None:
        # Another engineer's script: its options are only known by what its source names.
        source = script.read_text() if script.exists() else ""
        if quick and "--quick" not in source:
            return None
        if "--threads" in source:
            arguments += ["--threads", str(threads)]
    elif comparison.takes_threads:
        arguments += ["--threads", str(threads)]
    return [sys.executable, str(script), *arguments]


def shown(command: list[str]) -> str:
    """The command as a reader reruns it from the repository root."""
    script = Path(command[1]).relative_to(ROOT)
    return " ".join(["PYTHONPATH=. python", str(script), *command[2:]])


@dataclass(frozen=True)
class Outcome:
    comparison: str
    command: str
    rows: list[Row]
    # Why it has no rows: skipped or failed; "" when it ran.
    note: str
    load_before: float
    load_after: float
    seconds: float


def plan(only: list[str], quick: bool, threads: int, llama_built: bool) -> list[tuple]:
    """(comparison, command or None, why not run) for each selected comparison."""
    planned = []
    for comparison in COMPARISONS:
        if comparison.name not in only:
            continue
        command = command_of(comparison, quick, threads)
        if not (BENCHMARKS / comparison.script).exists():
            why = f"benchmarks/{comparison.script} is not in this tree"
            planned.append((comparison, None, why))
        elif command is None:
            planned.append((comparison, None, f"{comparison.script} has no --quick"))
        elif comparison.needs_llama_cpp and not llama_built:
            planned.append((comparison, None, "needs llama.cpp: no build (--build-llama-cpp)"))
        else:
            planned.append((comparison, command, ""))
    return planned


def run(comparison: Comparison, command: list[str], timeout: float) -> Outcome:
    """The script in its own process, its output shown as it runs (on stderr), its rows read."""
    before, start = os.getloadavg()[0], time.perf_counter()
    env = dict(os.environ, PYTHONPATH=str(ROOT), HF_HUB_OFFLINE="1")
    with tempfile.TemporaryDirectory() as scratch:
        summary_path = Path(scratch) / "summary.json"
        json_option = [] if comparison.rows is None else ["--json", str(summary_path)]
        printed: list[str] = []
        try:
            process = subprocess.Popen(
                [*command, *json_option], cwd=ROOT, env=env, stdout=subprocess.PIPE, text=True
            )
        except OSError as error:
            process, note = None, f"could not start: {error}"
        if process is not None:
            # SIGTERM: each script stops its servers and children on it.
            watchdog = threading.Timer(timeout, process.terminate)
            watchdog.start()
            try:
                for line in process.stdout:
                    printed.append(line)
                    print(f"  [{comparison.name}] {line.rstrip()}", file=sys.stderr, flush=True)
            except BaseException:
                # peers.py stopped (SIGTERM, Ctrl-C): the script stops too, and its servers.
                process.terminate()
                process.wait()
                raise
            process.wait()
            timed_out = not watchdog.is_alive()
            watchdog.cancel()
            note = ""
            if timed_out:
                note = f"stopped after {timeout:.0f} s"
            elif process.returncode:
                note = f"failed (exit {process.returncode}): {''.join(printed[-1:]).strip()}"
        rows = []
        if not note:
            if comparison.rows is None:
                rows = ratio_lines(comparison.name, "".join(printed))
            else:
                rows = comparison.rows(json.loads(summary_path.read_text()))
    seconds = time.perf_counter() - start
    return Outcome(comparison.name, shown(command), rows, note, before, os.getloadavg()[0], seconds)


def machine() -> str:
    text = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
    fields = dict(
        (key.strip(), value.strip())
        for key, _, value in (line.partition(":") for line in text.splitlines())
    )
    return f"{fields.get('Model name', 'unknown CPU')}, {os.cpu_count()} CPUs"


def commit() -> str:
    result = subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True
    )
    return result.stdout.strip() or "unknown"


def table(outcomes: list[Outcome], threads: int) -> str:
    lines = [
        f"machine: {machine()}; SIMD flags: {' '.join(llama_cpp.simd_flags())}",
        f"{threads} threads; commit {commit()}; {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}",
        "",
        "| comparison | what | ratio | deepwell / peer | goal | load | command |",
        "|---|---|---|---|---|---|---|",
    ]
    for outcome in outcomes:
        load = f"{outcome.load_before:.1f}–{outcome.load_after:.1f}"
        command = f"`{outcome.command}`"
        if outcome.note:
            lines.append(
                f"| {outcome.comparison} | {outcome.note} | — | — | — | {load} | {command} |"
            )
        for row in outcome.rows:
            lines.append(
                f"| {row.comparison} | {row.what} | **{row.ratio:.2f}** | {row.figures} |"
                f" {row.goal} | {load} | {command} |"
            )
    return "\n".join(lines)


def parse_only(text: str) -> list[str]:
    names = [name for name in text.split(",") if name]
    unknown = sorted(set(names) - set(NAMES))
    if unknown:
        raise argparse.ArgumentTypeError(
            f"unknown comparisons {unknown}; known: {', '.join(NAMES)}"
        )
    return names


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--only",
        type=parse_only,
        default=list(NAMES),
        help=f"comparisons to run, comma-separated (default: all of {','.join(NAMES)})",
    )
    parser.add_argument("--quick", action="store_true", help="each at its smallest: a smoke run")
    parser.add_argument("--dry-run", action="store_true", help="print the plan, run nothing")
    parser.add_argument("--threads", type=int, default=os.cpu_count(), help="every engine's")
    parser.add_argument(
        "--build-llama-cpp", action="store_true", help="build llama.cpp first if needed (~15 min)"
    )
    parser.add_argument(
        "--timeout", type=float, default=3600.0, help="seconds one comparison may take"
    )
    parser.add_argument("--json", type=Path, help="also write the rows here")
    args = parser.parse_args()
    # Stopped with SIGTERM, the running comparison's script is stopped with it (run's finally).
    signal.signal(signal.SIGTERM, lambda *_: sys.exit("stopped (SIGTERM)"))

    if args.build_llama_cpp and not args.dry_run:
        try:
            llama_cpp.ensure_llama_cpp()
        except llama_cpp.LlamaCppError as error:
            sys.exit(str(error))
    llama_built = llama_cpp.find_llama_cpp() is not None
    planned = plan(args.only, args.quick, args.threads, llama_built or args.dry_run)
    if args.dry_run:
        print(f"plan ({'quick' if args.quick else 'full'}; llama.cpp built: {llama_built}):")
        for comparison, command, why in planned:
            print(f"  {comparison.name}: {shown(command) if command else why}")
        return
    outcomes = []
    for comparison, command, why in planned:
        if command is None:
            load = os.getloadavg()[0]
            outcomes.append(Outcome(comparison.name, "—", [], f"skipped: {why}", load, load, 0.0))
            continue
        print(f"{comparison.name}: {shown(command)}", file=sys.stderr, flush=True)
        outcomes.append(run(comparison, command, args.timeout))
    print(table(outcomes, args.threads))
    if args.json:
        args.json.write_text(json.dumps([asdict(o) for o in outcomes], indent=2))


if __name__ == "__main__":
    main()
