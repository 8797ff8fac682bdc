"""`deepwell plan` on the released DeepSeek-V4.1-Flash config.json, and `generate` refusing
a budget the plan says is too small before it reads any weight."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from deepwell import cli
from deepwell.engine.models.deepseek_v41.writer import write_tiny_checkpoint

ROOT = Path(__file__).resolve().parents[1]
FLASH_CONFIG = ROOT / "tests" / "engine" / "data" / "deepseek_v41_flash_config.json"


@pytest.fixture(scope="module")
def flash_dir(tmp_path_factory) -> Path:
    """A directory holding only the released config.json: no weights, no tokenizer."""
    path = tmp_path_factory.mktemp("DeepSeek-V4.1-Flash")
    (path / "config.json").write_text(FLASH_CONFIG.read_text())
    return path


def test_plan_prints_the_released_numbers_and_fits_1tib(flash_dir, capsys) -> None:
    argv = ["plan", str(flash_dir), "--memory", "1TiB", "--max-model-len", "131072"]
    assert cli.main(argv) == 0
    out = capsys.readouterr().out
    assert "763,205,315,794 parameters in 96,085 stored tensors" in out
    assert "510,286,023,000" in out and "475.24" in out
    assert "890 B" in out
    assert "FITS:" in out


def test_plan_says_why_256gib_is_not_enough(flash_dir, capsys) -> None:
    argv = ["plan", str(flash_dir), "--memory", "256GiB", "--max-model-len", "131072"]
    assert cli.main(argv) == 1
    out = capsys.readouterr().out
    assert "DOES NOT FIT: the weights alone take 475.24 GiB" in out


def test_plan_json_is_one_object_with_the_issue_keys(flash_dir, capsys) -> None:
    assert cli.main(["plan", str(flash_dir), "--memory", "1.5T", "--json"]) == 0
    plan = json.loads(capsys.readouterr().out)
    assert plan["params"] == 763_205_315_794
    assert plan["weight_bytes"] == 510_286_023_000
    assert plan["kv_bytes_per_token"] == 890
    assert plan["state_bytes_per_sequence"] == 3_128_376
    assert plan["max_num_seqs"] > 0 and plan["fits"] is True
    assert isinstance(plan["reason"], str) and plan["reason"]


def test_plan_loads_no_torch(flash_dir) -> None:
    script = textwrap.dedent(
        f"""
        import sys
        from deepwell import cli
        code = cli.main(["plan", {str(flash_dir)!r}, "--memory", "1TiB", "--json"])
        assert "torch" not in sys.modules, "plan imported torch"
        sys.exit(code)
        """
    )
    result = subprocess.run(
        [sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, check=False
    )
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout)["fits"] is True


def test_plan_names_a_missing_or_bad_config(tmp_path, capsys) -> None:
    assert cli.main(["plan", str(tmp_path)]) == 2
    assert "config.json' is missing" in capsys.readouterr().err
    (tmp_path / "config.json").write_text("[1, 2")
    assert cli.main(["plan", str(tmp_path)]) == 2
    assert "not valid JSON" in capsys.readouterr().err
    assert cli.main(["plan", str(FLASH_CONFIG), "--memory", "lots"]) == 2
    assert "cannot read 'lots' as a memory size" in capsys.readouterr().err


def test_generate_refuses_a_budget_too_small_before_reading_weights(tmp_path, capsys) -> None:
    checkpoint = write_tiny_checkpoint(tmp_path / "tiny").path
    # Corrupt every shard: a load that started would fail on them, not on the budget.
    for shard in checkpoint.glob("*.safetensors"):
        shard.write_bytes(b"\x00" * 16)
    argv = ["generate", "--model", str(checkpoint), "--raw", "hi", "--memory-gib", "0.001"]
    assert cli.main(argv) == 1
    err = capsys.readouterr().err
    assert "memory budget 0.00 GiB is too small for tiny: the weights alone take" in err
    assert "--memory-gib" in err
    assert "shard" not in err


def test_serve_refuses_a_budget_too_small_before_starting_workers(tmp_path, capsys) -> None:
    checkpoint = write_tiny_checkpoint(tmp_path / "tiny").path
    for shard in checkpoint.glob("*.safetensors"):
        shard.write_bytes(b"\x00" * 16)  # a worker that started loading would fail on these
    argv = ["serve", "--model", str(checkpoint), "--memory-gib", "0.001", "--port", "0"]
    # serve configures the process's logging itself (its own stderr handler, text or JSON).
    assert cli.main(argv) == 1
    err = capsys.readouterr().err
    assert "memory budget 0.00 GiB is too small for tiny: the weights alone take" in err
