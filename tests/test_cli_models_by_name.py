"""`deepwell generate ORG/NAME` and `plan ORG/NAME` from a hub cache laid out by hand, with
HF_HUB_OFFLINE=1 (no network), and the refusal of a repo the cache lacks."""

from __future__ import annotations

import shutil

import pytest

from deepwell import cli
from deepwell.engine.models.loader import load_checkpoint

COMMIT = "fedcba9876543210fedcba9876543210fedcba98"


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    """A hub cache holding `tiny-org/tiny-v41` (written by `deepwell tiny-checkpoint`)."""
    root = tmp_path_factory.mktemp("hub")
    written = root / "written"
    assert cli.main(["tiny-checkpoint", str(written), "--seed", "3"]) == 0
    repo = root / "cache" / "models--tiny-org--tiny-v41"
    shutil.copytree(written, repo / "snapshots" / COMMIT)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(COMMIT)
    return root / "cache"


@pytest.fixture
def offline(cache, monkeypatch):
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    return cache


def test_generate_answers_with_a_model_named_by_its_repo_id(offline, capsys):
    argv = ["generate", "--model", "tiny-org/tiny-v41", "--raw", "Hi", "--max-tokens", "4"]
    assert cli.main([*argv, "--threads", "1", "--memory-gib", "0.5"]) == 0
    assert capsys.readouterr().out.strip()


def test_the_served_name_of_a_cached_snapshot_is_its_repo_id(offline):
    args = cli.build_parser().parse_args(["serve", "tiny-org/tiny-v41"])
    assert load_checkpoint(args.model_tag).name == "tiny-org/tiny-v41"


def test_plan_reads_a_model_named_by_its_repo_id(offline, capsys):
    assert cli.main(["plan", "tiny-org/tiny-v41", "--memory", "64GiB"]) == 0
    assert "fits" in capsys.readouterr().out.lower()


def test_offline_a_repo_missing_from_the_cache_is_refused_with_what_to_do(offline, capsys):
    with pytest.raises(SystemExit) as exited:
        cli.main(["generate", "--model", "tiny-org/absent", "Hi"])
    assert exited.value.code == 2
    error = capsys.readouterr().err
    assert "tiny-org/absent is not in the Hugging Face cache" in error
    assert "unset HF_HUB_OFFLINE" in error


def test_a_name_neither_on_disk_nor_a_repo_id_is_refused_by_the_loader(offline, capsys):
    assert cli.main(["generate", "--model", "no/such/model", "Hi"]) == 1
    error = capsys.readouterr().err
    assert "'no/such/model' does not exist (a model by name is a Hugging Face repo id" in error
