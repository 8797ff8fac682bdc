"""benchmarks/peers.py: the plan of every comparison (run as a user runs it, nothing measured)
and each script's summary read into the table's rows."""

import json
import os
import subprocess
import sys
from pathlib import Path

import peers
import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "benchmarks" / "peers.py"


def peers_command(*arguments: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    return subprocess.run(
        [sys.executable, str(SCRIPT), *arguments],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=180,
    )


def test_quick_dry_run_plans_every_comparison_at_its_smallest_and_runs_none():
    result = peers_command("--quick", "--dry-run", "--threads", "2")
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert lines[0].startswith("plan (quick;")
    planned = {line.split(":")[0].strip(): line for line in lines[1:]}
    assert list(planned) == list(peers.NAMES)
    assert "throughput_vs_hf.py --requests 8" in planned["w"]
    assert "serve_vs_llama_server.py --requests 8 --rates 2 --threads 2" in planned["serve"]
    assert "memory_limit.py" in planned["decode"] and "--tokens 16" in planned["decode"]
    assert "decode_batches.py --batch-sizes 1,4" in planned["batches"]
    assert "prompt_vs_llama_cpp.py --n-prompt 512" in planned["pp512"]
    assert "sampled_w.py --requests 8 --rounds 1 --threads 2" in planned["sampled"]
    # Batch invariance is measured at one thread, whatever --threads says.
    assert "invariance_cost.py --batch 1 --rounds 1 --steps 5" in planned["invariance"]
    assert "--threads" not in planned["invariance"]


def test_only_restricts_the_plan_and_an_unknown_name_is_refused():
    result = peers_command("--dry-run", "--only", "serve,pp512")
    assert result.returncode == 0, result.stderr
    assert [line.split(":")[0].strip() for line in result.stdout.splitlines()[1:]] == [
        "pp512",
        "serve",
    ]
    assert "--rates 0.5,1,2" in result.stdout
    refused = peers_command("--dry-run", "--only", "serve,nonsense")
    assert refused.returncode == 2
    assert "unknown comparisons ['nonsense']" in refused.stderr and "known: w," in refused.stderr


def test_without_llama_cpp_its_comparisons_are_skipped_and_say_why():
    planned = peers.plan(["w", "serve"], quick=True, threads=2, llama_built=False)
    (w, w_command, w_why), (serve, serve_command, serve_why) = planned
    assert w.name == "w" and w_command is not None and w_why == ""
    assert serve.name == "serve" and serve_command is None and "needs llama.cpp" in serve_why


def roundtrip(summary: dict) -> dict:
    # The scripts write their summaries as JSON: integer keys come back as strings.
    return json.loads(json.dumps(summary))


def test_batches_rows_compare_deepwells_best_with_llama_cpps_best_at_each_size():
    summary = roundtrip(
        {
            "engines": {
                "deepwell none": {1: 60.0, 4: 200.0},
                "deepwell int4": {1: 180.0, 4: 150.0},
                "llama.cpp plain buffers": {1: 90.0, 4: 100.0},
                "llama.cpp tg128 (repacked)": {1: 120.0},
            },
            "ratios": {1: 1.5, 4: 2.0},
        }
    )
    rows = peers.batches_rows(summary)
    assert [(r.ratio, r.figures) for r in rows] == [
        (1.5, "180.0 / 120.0 tok/s"),
        (2.0, "200.0 / 100.0 tok/s"),
    ]
    assert all(r.goal == "ahead: met" for r in rows)


def test_decode_rows_give_each_engine_its_share_of_the_bandwidth_and_the_tg128_ratio():
    summary = {
        "bandwidth_bytes_s": 20e9,
        "rows": [
            {"engine": "deepwell int4", "tok_s": 180.0, "weight_bytes": 100e6, "fraction": 0.9},
            {"engine": "llama.cpp tg128", "tok_s": 90.0, "weight_bytes": 96e6, "fraction": 0.432},
        ],
    }
    rows = peers.decode_rows(summary)
    assert [r.ratio for r in rows] == [0.9, 0.432, 2.0]
    assert rows[0].goal == ">= 0.85: met" and rows[1].goal == ""
    assert "vs llama.cpp's tg128" in rows[2].what


def test_serve_rows_judge_the_goal_on_w_at_t_0_only():
    results = []
    for rate, ours, theirs in ((None, 300.0, 100.0), (1.0, 150.0, 90.0)):
        results.append(
            {"engine": "deepwell", "rate": rate, "output_tok_s": ours, "ttft_p99_ms": 900}
        )
        results.append(
            {"engine": "llama-server", "rate": rate, "output_tok_s": theirs, "ttft_p99_ms": 1000}
        )
    summary = {
        "results": results,
        "ratios": [
            {"rate": None, "ratio": 3.0, "ttft_p99_ratio": 0.9, "met": True},
            {"rate": 1.0, "ratio": 1.67, "ttft_p99_ratio": 0.9, "met": False},
        ],
    }
    burst, poisson = peers.serve_rows(summary)
    assert burst.goal == ">= 3x at no worse p99 TTFT: met" and "at t = 0" in burst.what
    assert poisson.goal == "" and "Poisson 1 req/s" in poisson.what
    assert poisson.figures == "150.0 / 90.0 tok/s"


def test_w_rows_set_the_goal_on_speculation_off_against_transformers_best():
    summary = {
        "transformers_best": "transformers static batch 32",
        "results": {
            "deepwell, speculation off": {"output_tok_s": 400.0},
            "deepwell, speculation on": {"output_tok_s": 600.0},
            "transformers static batch 32": {"output_tok_s": 100.0},
            "llama.cpp": {"seconds": None, "batch1_decode_tok_s": 100.0},
        },
    }
    off, on = peers.w_rows(summary)
    assert (off.ratio, off.goal) == (4.0, ">= 5x: missed")
    assert (on.ratio, on.goal) == (6.0, "")


def test_sampled_rows_judge_sampled_w_against_greedy_w():
    summary = roundtrip(
        {
            "tokens": 1000,
            "temperature": 0.8,
            "top_p": 0.95,
            "top_k": -1,
            "greedy_tok_s": 700.0,
            "sampled_tok_s": 650.0,
            "ratio_wall": 650.0 / 700.0,
            "ratio_cpu": 0.94,
        }
    )
    (row,) = peers.sampled_rows(summary)
    assert row.goal == ">= 0.95x: missed" and row.ratio == pytest.approx(0.9286, abs=1e-4)
    assert "top_p 0.95" in row.what and "top_k" not in row.what
    assert row.figures == "650.0 / 700.0 tok/s"


def test_invariance_rows_give_each_batch_its_ratio_lower_being_better():
    summary = roundtrip(
        {
            "batches": {
                1: {"default_cpu_ms": 20.0, "invariant_cpu_ms": 22.0, "ratio": 1.1},
                16: {"default_cpu_ms": 30.0, "invariant_cpu_ms": 39.0, "ratio": 1.3},
            }
        }
    )
    one, sixteen = peers.invariance_rows(summary)
    assert "batch 1 " in one.what and one.goal == "<= 1.2x: met"
    assert "batch 16 " in sixteen.what and sixteen.goal == "<= 1.2x: missed"
    assert sixteen.figures == "39.00 / 30.00 ms"


def test_a_script_read_by_its_lines_gives_a_row_per_ratio_line():
    text = "warming up\nprefill ratio at 4096 tokens (deepwell / llama.cpp): 2.41\nratio: none\n"
    (row,) = peers.ratio_lines("prefill", text)
    assert row.what == "prefill ratio at 4096 tokens (deepwell / llama.cpp)"
    assert row.ratio == pytest.approx(2.41)


def test_the_table_names_the_machine_the_load_and_each_command():
    outcome = peers.Outcome(
        "pp512",
        "PYTHONPATH=. python benchmarks/prompt_vs_llama_cpp.py --n-prompt 512",
        peers.pp_rows(
            {"n_prompt": 512, "deepwell_tok_s": 900.0, "llama_cpp_tok_s": 300.0, "ratio": 3.0}
        ),
        "",
        1.0,
        2.5,
        10.0,
    )
    skipped = peers.Outcome("serve", "—", [], "skipped: needs llama.cpp", 1.0, 1.0, 0.0)
    text = peers.table([outcome, skipped], threads=2)
    assert text.startswith("machine: ") and "SIMD flags:" in text
    assert "| pp512 | one 512-token prompt vs llama.cpp's pp512 | **3.00** |" in text
    assert ">= 3x: met | 1.0–2.5 | `PYTHONPATH=. python benchmarks/prompt_vs_llama_cpp.py" in text
    assert "| serve | skipped: needs llama.cpp |" in text
