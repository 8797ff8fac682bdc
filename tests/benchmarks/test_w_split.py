"""benchmarks/w_split.py: W's steps grouped by shape, and a small real run's tokens."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
from w_split import PARTS, StepClock, StepShape, group_steps
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
