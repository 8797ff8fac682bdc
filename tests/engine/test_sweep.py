"""`deepwell bench --sweep` on a tiny range: every point in the JSON, with the machine's facts,
read back by `--compare`, and both pictures drawn."""

from __future__ import annotations

import importlib.util
import json

import pytest

from deepwell import cli
from deepwell.engine.sweep import CPU_FLAGS, SweepConfig, SweepResult

CONCURRENCY = (2, 1)
PREFILL = (48, 16)


@pytest.fixture(scope="module")
def sweep_dir(tiny_llama, tmp_path_factory):
    out = tmp_path_factory.mktemp("sweep")
    code = cli.main(
        [
            "bench",
            "--sweep",
            "--model",
            str(tiny_llama),
            "--dtype",
            "float32",
            "--block-size",
            "16",
            "--memory-gib",
            "0.25",
            "--threads",
            "1",
            "--concurrency",
            ",".join(map(str, CONCURRENCY)),
            "--prefill-batch-tokens",
            ",".join(map(str, PREFILL)),
            "--input-len",
            "12",
            "12",
            "--output-len",
            "4",
            "4",
            "--output-dir",
            str(out),
            "--label",
            "tiny",
        ]
    )
    # Without matplotlib (the [plot] extra) the JSON is written and the drawing refused.
    assert code == (0 if importlib.util.find_spec("matplotlib") else 1)
    return out


def test_the_sweep_json_has_every_point_in_order(sweep_dir):
    result = SweepResult.from_json((sweep_dir / "sweep.json").read_text())
    assert result.label == "tiny"
    assert [p.concurrency for p in result.decode] == sorted(CONCURRENCY)
    assert [p.batch_tokens for p in result.prefill] == sorted(PREFILL)
    for point in result.decode:
        assert point.decode_tok_s > 0 and point.ttft_ms_p50 > 0
        # The decode window is part of the point, and all users share it evenly.
        assert 0 < point.decode_window_s < point.elapsed_s
        assert point.tok_s_per_user == pytest.approx(point.decode_tok_s / point.concurrency)
    for point in result.prefill:
        # The token budget covers the largest batch: one step computes it.
        assert point.steps_per_batch == 1
        assert point.prefill_tok_s > 0 and point.step_ms > 0
    assert result.config == SweepConfig(
        concurrency=CONCURRENCY, prefill_batch_tokens=PREFILL, input_len=12, output_len=4
    )
    # The cache is off: every point computes its prompts.
    assert result.engine_args["enable_prefix_caching"] is False


def test_the_sweep_json_records_the_machine(sweep_dir):
    machine = json.loads((sweep_dir / "sweep.json").read_text())["machine"]
    assert machine["dtype"] == "float32" and machine["torch_threads"] == 1
    assert set(machine["cpu_flags"]) <= set(CPU_FLAGS)
    assert machine["cpu_model"] and machine["cpu_count"] >= 1
    assert machine["model"]
    # Run from a checkout, the commit is known.
    assert machine["commit"]


def test_the_sweep_draws_both_pictures(sweep_dir):
    pytest.importorskip("matplotlib", reason="matplotlib is the [plot] extra")
    for name in ("decode.png", "prefill.png"):
        assert (sweep_dir / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_compare_overlays_sweep_files(sweep_dir, tmp_path):
    pytest.importorskip("matplotlib", reason="matplotlib is the [plot] extra")
    data = json.loads((sweep_dir / "sweep.json").read_text())
    other = tmp_path / "other.json"
    other.write_text(json.dumps({**data, "label": "other"}))
    out = tmp_path / "compare"
    assert (
        cli.main(
            [
                "bench",
                "--compare",
                str(sweep_dir / "sweep.json"),
                str(other),
                "--output-dir",
                str(out),
            ]
        )
        == 0
    )
    assert (out / "decode.png").exists() and (out / "prefill.png").exists()


def test_compare_refuses_a_file_that_is_not_a_sweep(tmp_path, capsys):
    path = tmp_path / "bench.json"
    path.write_text(json.dumps({"engine_args": {}, "config": {}, "result": {}}))
    assert cli.main(["bench", "--compare", str(path)]) == 1
    assert "not a sweep file" in capsys.readouterr().err


def test_sweep_lists_must_be_positive_integers(capsys):
    with pytest.raises(SystemExit):
        cli.main(["bench", "--sweep", "--concurrency", "1,x"])
    assert "comma-separated list" in capsys.readouterr().err
