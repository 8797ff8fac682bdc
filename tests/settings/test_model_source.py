"""Models by name: local paths first, then the hub cache (laid out by hand: no network)."""

from __future__ import annotations

import socket
from pathlib import Path

import pytest

from deepwell.settings.model_source import (
    CONFIG_FILES,
    ModelSourceError,
    is_repo_id,
    repo_id_of,
    resolve_model,
)

COMMIT = "0123456789abcdef0123456789abcdef01234567"


def hub_cache(root: Path, repo_id: str, files: dict[str, str]) -> Path:
    """A hub cache holding one snapshot of `repo_id` as `refs/main` names it."""
    repo = root / ("models--" + repo_id.replace("/", "--"))
    snapshot = repo / "snapshots" / COMMIT
    snapshot.mkdir(parents=True)
    for name, text in files.items():
        (snapshot / name).write_text(text)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(COMMIT)
    return snapshot


def closed_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def test_a_repo_id_resolves_to_its_cached_snapshot_offline(tmp_path):
    snapshot = hub_cache(tmp_path, "org/tiny", {"config.json": "{}"})
    environ = {"HF_HUB_CACHE": str(tmp_path), "HF_HUB_OFFLINE": "1"}
    assert Path(resolve_model("org/tiny", environ=environ)) == snapshot


def test_hf_home_names_the_cache_when_hf_hub_cache_does_not(tmp_path):
    snapshot = hub_cache(tmp_path / "hub", "org/tiny", {"config.json": "{}"})
    environ = {"HF_HOME": str(tmp_path), "HF_HUB_OFFLINE": "1"}
    assert Path(resolve_model("org/tiny", CONFIG_FILES, environ)) == snapshot


def test_a_local_path_wins_over_a_repo_of_the_same_name(tmp_path, monkeypatch):
    hub_cache(tmp_path / "cache", "org/tiny", {"config.json": "{}"})
    monkeypatch.chdir(tmp_path)
    (tmp_path / "org" / "tiny").mkdir(parents=True)
    environ = {"HF_HUB_CACHE": str(tmp_path / "cache"), "HF_HUB_OFFLINE": "1"}
    assert resolve_model("org/tiny", environ=environ) == "org/tiny"


def test_offline_a_repo_missing_from_the_cache_says_what_to_do(tmp_path):
    environ = {"HF_HUB_CACHE": str(tmp_path), "HF_HUB_OFFLINE": "1"}
    with pytest.raises(ModelSourceError) as refused:
        resolve_model("org/absent", environ=environ)
    message = str(refused.value)
    assert "org/absent is not in the Hugging Face cache" in message
    assert "unset HF_HUB_OFFLINE" in message and "hf download org/absent" in message


def test_an_unreachable_hub_says_what_to_do(tmp_path):
    # A closed loopback port stands in for a machine without network.
    environ = {"HF_HUB_CACHE": str(tmp_path), "HF_ENDPOINT": f"http://127.0.0.1:{closed_port()}"}
    with pytest.raises(ModelSourceError, match="Hub is unreachable") as refused:
        resolve_model("org/absent", environ=environ)
    assert "HF_HUB_OFFLINE=1" in str(refused.value)


@pytest.mark.parametrize("name", ["./missing", "/no/such/model.gguf", "a/b/c", "plain", "a--b/c"])
def test_a_name_that_cannot_be_a_repo_id_is_left_for_the_loader_to_find(name, tmp_path):
    # The hub is never asked: its address is a closed port, which would raise.
    environ = {"HF_HUB_CACHE": str(tmp_path), "HF_ENDPOINT": f"http://127.0.0.1:{closed_port()}"}
    assert resolve_model(name, environ=environ) == name


def test_repo_ids_are_org_slash_name():
    assert is_repo_id("deepseek-ai/DeepSeek-V4.1-Flash")
    assert not is_repo_id("deepseek-ai/DeepSeek..V4") and not is_repo_id("/abs/path")


def test_a_snapshot_is_named_by_its_repo_id(tmp_path):
    snapshot = hub_cache(tmp_path, "org/Tiny-1.5B", {"config.json": "{}"})
    assert repo_id_of(snapshot) == "org/Tiny-1.5B"
    assert repo_id_of(tmp_path) is None
