"""benchmarks/serve_vs_llama_server.py: arrivals, what a stream's chunks count, the latency
figures and the goal; (slow) deepwell serve under W's first requests through its HTTP API."""

import json
import os
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

import pytest
import serve_vs_llama_server as serve
from serve_vs_llama_server import LoadResult, RequestTrace, Verdict

ROOT = Path(__file__).resolve().parents[2]


def test_w_at_t_0_sends_every_request_at_once():
    assert serve.arrival_offsets(5, None) == [0.0] * 5


def test_poisson_arrivals_start_at_0_and_average_one_over_the_rate():
    offsets = serve.arrival_offsets(2000, 4.0)
    assert offsets[0] == 0.0 and offsets == sorted(offsets)
    gaps = [b - a for a, b in zip(offsets, offsets[1:], strict=False)]
    assert statistics.fmean(gaps) == pytest.approx(0.25, rel=0.1)
    # Every engine sees the same schedule.
    assert serve.arrival_offsets(2000, 4.0) == offsets


def test_percentiles_are_nearest_rank():
    values = [float(v) for v in range(1, 101)]
    assert serve.percentile(values, 0.5) == 50.0
    assert serve.percentile(values, 0.99) == 99.0
    assert serve.percentile([7.0], 0.99) == 7.0


def test_a_chunk_of_k_tokens_counts_as_k_even_gaps():
    trace = RequestTrace(sent=1.0, chunks=[(1.5, 1), (1.6, 1), (1.9, 3)])
    assert trace.tokens == 5
    assert trace.ttft() == pytest.approx(0.5)
    assert trace.inter_token_gaps() == pytest.approx([0.1, 0.1, 0.1, 0.1])


def test_deepwell_chunks_add_their_ids_and_llama_server_chunks_carry_the_count():
    chunk = {"choices": [{"text": "ab", "token_ids": [5, 6]}]}
    assert serve.deepwell_tokens(chunk, 3) == 5
    assert serve.deepwell_tokens({"choices": [], "usage": {}}, 3) == 3
    assert serve.llama_server_tokens({"content": "", "tokens_predicted": 9}, 8) == 9
    assert serve.llama_server_tokens({"content": ""}, 8) == 8


def test_both_servers_get_w_greedy_streamed_and_exactly_its_length():
    request = {"prompt_ids": [17, 18], "output_len": 7}
    ours = serve.deepwell_body(request)
    assert ours["prompt"] == [17, 18] and ours["max_tokens"] == 7
    assert ours["ignore_eos"] and ours["stream"] and ours["return_token_ids"]
    assert ours["temperature"] == 0
    theirs = serve.llama_server_body(request)
    assert theirs["prompt"] == [17, 18] and theirs["n_predict"] == 7
    assert theirs["ignore_eos"] and theirs["stream"] and theirs["cache_prompt"] is False


def result(engine: str, rate, tok_s: float, ttft_p99: float) -> LoadResult:
    return LoadResult(engine, rate, 4, int(tok_s * 10), 10.0, 1.0, ttft_p99, 1.0, 2.0, 0.5)


def test_the_goal_needs_3x_the_tokens_at_no_worse_p99_ttft():
    assert Verdict(None, 3.0, 1.0).met
    assert not Verdict(None, 2.9, 0.5).met
    assert not Verdict(None, 4.0, 1.01).met
    best = serve.best_of_rounds(
        [
            [result("deepwell", None, 300.0, 900.0), result("llama-server", None, 100.0, 1000.0)],
            [result("deepwell", None, 250.0, 500.0), result("llama-server", None, 120.0, 800.0)],
        ]
    )
    (verdict,) = serve.verdicts(best, [None])
    # Each engine's round with the most tokens, its own latencies with it.
    assert verdict.ratio == pytest.approx(2.5) and verdict.ttft_p99_ratio == pytest.approx(1.125)
    assert "goal missed" in verdict.line()


def test_poisson_patterns_carry_no_goal_however_fast():
    verdict = Verdict(2.0, 5.0, 0.5)
    assert not verdict.met
    assert "no goal" in verdict.line() and "goal met" not in verdict.line()


@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="needs /proc")
def test_a_servers_cpu_counts_its_children_and_only_them():
    # A sleeping server whose child spins, in a session of their own: no other process's
    # exit can move this tree's sum (a descendant of pytest that exits between two reads
    # takes its ticks out of pytest's tree).
    spawn_spinner = (
        "import subprocess, sys, time;"
        " subprocess.Popen([sys.executable, '-c', 'while True: pass']); time.sleep(600)"
    )
    server = subprocess.Popen([sys.executable, "-c", spawn_spinner], start_new_session=True)
    try:
        deadline = time.monotonic() + 30
        children = Path(f"/proc/{server.pid}/task/{server.pid}/children")
        while not children.read_text().split():
            assert time.monotonic() < deadline, "the server never started its child"
            time.sleep(0.05)
        (spinner,) = children.read_text().split()
        while serve.tree_cpu_seconds(int(spinner)) < 0.5:
            assert time.monotonic() < deadline, "the busy child's CPU never showed"
            time.sleep(0.05)
        spinner_s = serve.tree_cpu_seconds(int(spinner))
        server_tree_s = serve.tree_cpu_seconds(server.pid)
        # The child's CPU shows in its parent's tree; beside it only the parent's own start-up,
        # nothing of this test process (the parent's parent).
        assert server_tree_s >= spinner_s >= 0.5
        assert server_tree_s - spinner_s < 0.5
    finally:
        os.killpg(server.pid, signal.SIGKILL)
        server.wait()
    assert serve.tree_cpu_seconds(server.pid) is None
    row = LoadResult("deepwell", None, 4, 500, 10.0, 1.0, 2.0, 1.0, 2.0, 0.5, server_cpu_s=2.0)
    assert row.cpu_ms_per_token == pytest.approx(4.0)
    assert "server CPU 4.0 ms/token" in serve.describe(row)


def test_deepwell_serves_the_same_gguf_with_int4_and_no_prefix_cache():
    class Args:
        threads, max_num_seqs, speculative_tokens, memory_gib = 2, 64, 0, 2.0

    command = serve.deepwell_command(Args)
    assert command[command.index("serve") + 1].endswith(".gguf")
    assert command[command.index("--quantization") + 1] == "int4"
    assert "--no-enable-prefix-caching" in command
    assert command[command.index("--num-speculative-tokens") + 1] == "0"


@pytest.mark.slow
def test_deepwell_serve_streams_each_request_whole_under_poisson_arrivals(tmp_path):
    out = tmp_path / "serve.json"
    command = [sys.executable, str(ROOT / "benchmarks" / "serve_vs_llama_server.py")]
    command += ["--engines", "deepwell", "--requests", "3", "--rates", "4", "--json", str(out)]
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    subprocess.run(command, cwd=ROOT, env=env, check=True, timeout=1200)
    summary = json.loads(out.read_text())
    patterns = [(r["engine"], r["rate"]) for r in summary["results"]]
    assert patterns == [("deepwell", None), ("deepwell", 4.0)]
    expected = sum(r["output_len"] for r in serve.make_workload()[:3])
    for row in summary["results"]:
        assert row["output_tokens"] == expected and row["ttft_p99_ms"] > 0
    assert summary["ratios"] == []
