"""llama.cpp as a benchmark peer: its commands, llama-bench's output, W's checks, and (slow,
where a build is in the cache) the real binaries on the embedded GGUF."""

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import llama_cpp_peer as llama_cpp
import pytest
from llama_cpp_peer import LlamaCpp, LlamaCppError
from throughput_vs_hf import compare_with_llama_cpp, load_workload

# Recorded from `llama-bench -m SmolLM2-135M-Instruct.Q4_1.gguf -t 1 -p 16 -n 16 -r 2
# --repack 0 -o json` (the pinned build, 2-vCPU Xeon): parser input.
RECORDED = Path(__file__).with_name("llama_bench_pp16_tg16.json")
# Recorded from `llama-batched-bench -m SmolLM2-135M-Instruct.Q4_1.gguf -c 512 -b 2048
# -ub 512 -npp 16 -ntg 16 -npl 1,2 -t 1 -nr --output-format jsonl` (same build and machine).
RECORDED_BATCHED = Path(__file__).with_name("llama_batched_bench_pp16_tg16.jsonl")


def option(command: list[str], flag: str) -> str:
    return command[command.index(flag) + 1]


def test_llama_bench_json_gives_each_test_its_mean_and_stddev():
    recorded = json.loads(RECORDED.read_text())
    results = llama_cpp.parse_llama_bench(RECORDED.read_text())
    assert [r.test for r in results] == ["pp16", "tg16"]
    for result, test in zip(results, recorded, strict=True):
        assert (result.tok_s, result.stddev_tok_s) == (test["avg_ts"], test["stddev_ts"])
        assert result.samples_tok_s == tuple(test["samples_ts"])
        assert result.n_threads == 1 and result.build_commit == test["build_commit"]
        assert result.repack is test["repack"] is False


def test_tg128_is_batch1_decode_of_128_tokens_only():
    llama = LlamaCpp(Path("/opt/llama/bin"))
    command = llama_cpp.llama_bench_command(llama, Path("m.gguf"), 2, 0, 128, 5)
    assert command[0] == "/opt/llama/bin/llama-bench"
    assert option(command, "-m") == "m.gguf" and option(command, "-t") == "2"
    assert (option(command, "-p"), option(command, "-n"), option(command, "-r")) == (
        "0",
        "128",
        "5",
    )
    assert option(command, "-o") == "json"
    # llama.cpp's defaults: on an AMX CPU its fastest decode kernel.
    assert option(command, "--repack") == "1"


def test_batched_bench_decodes_each_batch_of_own_prompts_in_one_context():
    llama = LlamaCpp(Path("/opt/llama/bin"))
    command = llama_cpp.batched_bench_command(llama, Path("m.gguf"), 2, 64, 128, [1, 4, 16], False)
    assert command[0] == "/opt/llama/bin/llama-batched-bench"
    assert (option(command, "-npp"), option(command, "-ntg"), option(command, "-npl")) == (
        "64",
        "128",
        "1,4,16",
    )
    assert int(option(command, "-c")) >= 16 * (64 + 128) and option(command, "-t") == "2"
    # No shared prompt; plain buffers only when asked.
    assert "-pps" not in command and "--no-repack" in command
    repacked = llama_cpp.batched_bench_command(llama, Path("m.gguf"), 2, 64, 128, [1], True)
    assert "--no-repack" not in repacked


def test_batched_bench_jsonl_gives_each_batch_its_decode_speed():
    text = "main: loading model\n" + RECORDED_BATCHED.read_text() + "llama_perf: done\n"
    rows = llama_cpp.parse_batched_bench(text, repack=False)
    lines = RECORDED_BATCHED.read_text().splitlines()
    recorded = [json.loads(line) for line in lines if line]
    assert [r.batch for r in rows] == [1, 2]
    for row, line in zip(rows, recorded, strict=True):
        assert row.tok_s == line["speed_tg"] == pytest.approx(line["pl"] * 16 / line["t_tg"])
        assert (row.prompt, row.tokens, row.n_threads, row.repack) == (16, 16, 1, False)


def test_llama_server_holds_every_w_request_whole_in_its_slot():
    workload = load_workload()[0]
    slot = llama_cpp.slot_context(workload)
    assert slot >= max(r["prompt_len"] + r["output_len"] for r in workload)
    command = llama_cpp.llama_server_command(LlamaCpp(Path("/b")), Path("m.gguf"), 2, 16, 16 * slot)
    assert int(option(command, "-c")) // int(option(command, "-np")) == slot
    assert option(command, "-t") == option(command, "-tb") == "2"
    assert "--cont-batching" in command
    # The weights repacked (llama.cpp's default), its fastest on the measured Xeon.
    assert "--no-repack" not in command


def test_llama_server_reuses_no_prompt_across_requests():
    command = llama_cpp.llama_server_command(LlamaCpp(Path("/b")), Path("m.gguf"), 2, 16, 768)
    assert "--no-cache-prompt" in command and option(command, "--cache-ram") == "0"
    body = llama_cpp.completion_body([17, 18, 19], 5)
    assert body["cache_prompt"] is False


def test_w_requests_are_greedy_token_ids_that_ignore_eos():
    body = llama_cpp.completion_body([17, 18, 19], 5)
    assert body["prompt"] == [17, 18, 19] and body["n_predict"] == 5
    assert body["ignore_eos"] is True and body["temperature"] == 0


def test_a_request_that_stopped_short_is_an_error():
    llama_cpp.check_completion({"tokens_predicted": 4, "tokens": [1, 2, 3, 4]}, 4)
    with pytest.raises(LlamaCppError, match="generated 3 tokens"):
        llama_cpp.check_completion({"tokens_predicted": 3, "tokens": [1, 2, 3]}, 4)
    with pytest.raises(LlamaCppError, match="3 returned"):
        llama_cpp.check_completion({"tokens_predicted": 4, "tokens": [1, 2, 3]}, 4)


def test_an_empty_cache_holds_no_build(tmp_path):
    assert llama_cpp.find_llama_cpp(tmp_path) is None


def fake_build(cache: Path, stamp: str | None) -> Path:
    bin_dir = llama_cpp.source_dir(cache) / "build" / "bin"
    bin_dir.mkdir(parents=True)
    for target in llama_cpp.TARGETS:
        (bin_dir / target).write_text("")
        (bin_dir / target).chmod(0o755)
    if stamp is not None:
        (bin_dir / llama_cpp.PATCHES_STAMP).write_text(stamp)
    return bin_dir


def test_a_build_from_before_the_patches_is_not_found(tmp_path):
    fake_build(tmp_path, stamp=None)
    assert llama_cpp.find_llama_cpp(tmp_path) is None


def test_a_build_with_every_patch_is_found(tmp_path):
    stamp = "".join(f"{patch.name}\n" for patch in llama_cpp.PATCHES)
    bin_dir = fake_build(tmp_path, stamp)
    assert llama_cpp.find_llama_cpp(tmp_path) == LlamaCpp(bin_dir)


def fake_source(root: Path) -> Path:
    for patch in llama_cpp.PATCHES:
        path = root / patch.path
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(f"before\n{patch.old}after\n")
    return root


def test_patches_replace_their_line_once_and_leave_a_patched_source(tmp_path):
    source = fake_source(tmp_path)
    llama_cpp.apply_patches(source)
    for patch in llama_cpp.PATCHES:
        assert (source / patch.path).read_text() == f"before\n{patch.new}after\n"
    llama_cpp.apply_patches(source)
    for patch in llama_cpp.PATCHES:
        assert (source / patch.path).read_text() == f"before\n{patch.new}after\n"


def test_a_source_without_the_patched_line_is_an_error(tmp_path):
    source = fake_source(tmp_path)
    (patch, *_) = llama_cpp.PATCHES
    (source / patch.path).write_text("changed upstream\n")
    with pytest.raises(LlamaCppError, match=f"patch {patch.name}"):
        llama_cpp.apply_patches(source)


def test_building_without_cmake_says_what_to_install(tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", str(tmp_path))
    with pytest.raises(LlamaCppError, match="needs cmake.*apt-get install cmake"):
        llama_cpp.ensure_llama_cpp(tmp_path / "cache")
    assert not (tmp_path / "cache").exists()


def test_batch1_ratio_is_against_the_measured_tg128_and_w_against_llama_server():
    deepwell = {"batch1_decode_tok_s": 30.0, "output_tok_s": 300.0, "seconds": 40.0}
    llama = {"batch1_decode_tok_s": 150.0, "output_tok_s": 200.0, "seconds": 60.0}
    lines, entries = compare_with_llama_cpp("speculation off", deepwell, llama)
    assert entries == {
        "batch1_decode_ratio_vs_llama_cpp": pytest.approx(0.2),
        "throughput_ratio_vs_llama_server": pytest.approx(1.5),
    }
    assert lines == [
        "batch-1 decode ratio vs llama.cpp tg128, speculation off (deepwell/llama.cpp): 0.20",
        "throughput ratio vs llama-server -np 16, speculation off (deepwell/llama.cpp): 1.50",
    ]


def test_tg128_alone_gives_no_w_ratio():
    deepwell = {"batch1_decode_tok_s": 30.0, "output_tok_s": 300.0, "seconds": 40.0}
    llama = {"batch1_decode_tok_s": 150.0, "seconds": None}
    lines, entries = compare_with_llama_cpp("speculation on", deepwell, llama)
    assert list(entries) == ["batch1_decode_ratio_vs_llama_cpp"] and len(lines) == 1


def test_without_llama_cpp_batch1_is_against_the_quoted_figure_and_says_so():
    deepwell = {"batch1_decode_tok_s": 83.0, "output_tok_s": 300.0, "seconds": 40.0}
    lines, entries = compare_with_llama_cpp("speculation on", deepwell, None)
    low, high = llama_cpp.QUOTED_TG128_2_THREADS
    assert entries["batch1_decode_ratio_vs_quoted_llama_cpp"] == [83.0 / high, 83.0 / low]
    (line,) = lines
    assert f"{83.0 / high:.2f}–{83.0 / low:.2f}" in line
    assert "issue 16 quotes" in line and "not built here" in line


# ---- the real binaries (built once by `python benchmarks/llama_cpp_peer.py`) ----

needs_build = pytest.mark.skipif(
    llama_cpp.find_llama_cpp() is None, reason=f"no llama.cpp build in {llama_cpp.CACHE_DIR}"
)


@pytest.mark.slow
@needs_build
def test_tg128_runs_on_the_embedded_gguf():
    result = llama_cpp.tg128(llama_cpp.find_llama_cpp(), threads=1, repetitions=1)
    assert result.test == "tg128" and result.n_threads == 1
    assert result.tok_s > 0 and len(result.samples_tok_s) == 1


@pytest.mark.slow
@needs_build
def test_a_prompt_runs_on_the_repacked_weights():
    # On an AMX CPU a prompt of 2+ tokens takes llama.cpp's AMX tile matmul: SIGILL when
    # built by gcc 12 without the amx-whole-tile-config patch.
    llama = llama_cpp.find_llama_cpp()
    (result,) = llama_cpp.llama_bench(llama, 1, n_prompt=64, n_gen=0, repetitions=1)
    assert result.test == "pp64" and result.repack is True and result.tok_s > 0


@pytest.mark.slow
@needs_build
def test_batched_decode_runs_each_batch_size_on_the_embedded_gguf():
    rows = llama_cpp.batched_decode(llama_cpp.find_llama_cpp(), 1, [1, 2], prompt=16, tokens=8)
    assert [(r.batch, r.tokens) for r in rows] == [(1, 8), (2, 8)]
    assert all(r.tok_s > 0 for r in rows)


@pytest.mark.slow
@needs_build
def test_llama_server_generates_each_w_request_whole():
    requests = [
        {"prompt_len": 64, "output_len": 8 + i, "prompt_ids": r["prompt_ids"][:64]}
        for i, r in enumerate(load_workload()[0][:3])
    ]
    served = llama_cpp.serve_w(llama_cpp.find_llama_cpp(), 1, requests, parallel=2)
    assert (served.requests, served.output_tokens) == (3, 8 + 9 + 10)
    assert served.seconds > 0


@pytest.mark.slow
@needs_build
def test_llama_server_dies_with_a_benchmark_killed_on_timeout(tmp_path):
    child = tmp_path / "child.py"
    child.write_text(
        "import sys, time\n"
        "from pathlib import Path\n"
        "import llama_cpp_peer as llama_cpp\n"
        "llama = llama_cpp.find_llama_cpp()\n"
        "command = llama_cpp.llama_server_command(llama, llama_cpp.model_path(), 1, 1, 256)\n"
        "with llama_cpp.LlamaServer(command, Path(sys.argv[1])) as server:\n"
        "    print(server.process.pid, flush=True)\n"
        "    time.sleep(120)\n"
    )
    env = dict(os.environ, PYTHONPATH=str(Path(llama_cpp.__file__).parent))
    process = subprocess.Popen(
        [sys.executable, str(child), str(tmp_path / "server.log")],
        stdout=subprocess.PIPE,
        text=True,
        env=env,
    )
    server_pid = int(process.stdout.readline())
    process.kill()  # what subprocess.run does on its timeout: no cleanup runs
    process.wait()
    deadline = time.monotonic() + 10
    while Path(f"/proc/{server_pid}").exists() and time.monotonic() < deadline:
        time.sleep(0.1)
    assert (
        not Path(f"/proc/{server_pid}").exists()
        or "Z" in Path(f"/proc/{server_pid}/stat").read_text().split()[2]
    )
