"""benchmarks/w_split.py: W's steps grouped by shape, and a small real run's tokens."""

import json
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from w_split import PARTS, FirstCalls, StepClock, StepShape, group_steps
from workload import make_workload

ROOT = Path(__file__).resolve().parents[2]


def test_steps_are_grouped_by_shape_and_their_parts_summed():
    shapes = [
        StepShape(decode_rows=0, prefill_tokens=1024, decode_context=0),
        StepShape(decode_rows=5, prefill_tokens=1019, decode_context=500),
        StepShape(decode_rows=40, prefill_tokens=0, decode_context=8000),
        StepShape(decode_rows=64, prefill_tokens=0, decode_context=20000),
        StepShape(decode_rows=3, prefill_tokens=0, decode_context=900),
    ]
    steps = [
        StepClock(1.0 + i, {part: 0.1 * i for part in PARTS}, 2.0 + i, {p: 0.2 * i for p in PARTS})
        for i in range(len(shapes))
    ]
    kinds = group_steps(shapes, steps)
    assert list(kinds) == ["prefill-only", "mixed", "decode>=32", "decode<32"]
    large = kinds["decode>=32"]
    assert (large.steps, large.decode_rows, large.decode_context) == (2, 104, 28000)
    assert large.cpu_s == pytest.approx(3.0 + 4.0)
    assert large.parts["attention"] == pytest.approx(0.2 + 0.3)
    assert large.wall_s == pytest.approx(4.0 + 5.0)
    assert large.parts_wall["sample"] == pytest.approx(0.4 + 0.6)
    assert kinds["mixed"].prefill_tokens == 1019


def test_first_calls_are_split_from_repeats_per_shape_and_row_count():
    first_calls = FirstCalls()
    linear = SimpleNamespace(in_features=8, out_features=4, panels=None)
    for rows, seconds in ((100, 3.0), (100, 1.0), (200, 5.0), (100, 0.5), (200, 2.0)):
        first_calls.add(linear, torch.empty(rows, 8), seconds)
    # A call the panels take never reaches oneDNN: not counted.
    first_calls.add(
        SimpleNamespace(in_features=8, out_features=4, panels=object()), torch.empty(2, 8), 9.0
    )
    counts = first_calls.calls[(8, 4)]
    assert set(counts) == {100, 200}
    assert (counts[100].first_s, counts[100].repeat_s, counts[100].repeats) == (3.0, 1.5, 2)
    (line,) = first_calls.lines()
    # Above a repeat: (3.0 - 1.5 / 2) + (5.0 - 2.0) over the two counts.
    assert line.startswith("oneDNN 8->4: 5 calls, CPU 11.500 s; 2 row counts (100..200)")
    assert "first calls of the 2 that repeat: 8.000 s, 5.250 s above a repeat" in line


@pytest.mark.slow
def test_a_small_run_writes_every_requests_greedy_tokens(tmp_path):
    tokens = tmp_path / "tokens.json"
    result = subprocess.run(
        [sys.executable, "benchmarks/w_split.py", "--requests", "2", "--tokens", str(tokens)],
        cwd=ROOT,
        env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"},
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == 0, result.stderr
    assert "parts (CPU s)" in result.stdout and "parts (wall s)" in result.stdout
    written = json.loads(tokens.read_text())
    # EOS ignored: each request generates exactly its W output length.
    assert {k: len(v) for k, v in written.items()} == {
        str(r["id"]): r["output_len"] for r in make_workload(requests=2)
    }
