"""Models by name: a local path is used as given; otherwise a Hugging Face repo id (ORG/NAME)
is resolved into the hub cache, downloaded there unless HF_HUB_OFFLINE is set.

Every command reads its model through the `model` setting (settings/engine.py), whose flag
parses with `model_argument`; huggingface_hub is imported only when a name needs the hub.
"""

from __future__ import annotations

import argparse
import os
import re
import sys
from collections.abc import Callable, Mapping
from pathlib import Path

# What the engine reads of a checkpoint directory: config.json, tokenizer.json,
# tokenizer_config.json, the safetensors shards and their index (engine/models/loader.py).
CHECKPOINT_FILES = ("*.json", "*.safetensors")
# `deepwell plan` reads config.json alone; it should not fetch hundreds of GiB to do that.
CONFIG_FILES = ("config.json",)

# The hub's repo ids: an owner and a name of letters, digits and ._- (no "--" or "..",
# which its cache layout and URLs reserve).
_REPO_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,95}/[A-Za-z0-9][A-Za-z0-9._-]{0,95}")
# A snapshot in the hub cache: <cache>/models--ORG--NAME/snapshots/<commit>.
_SNAPSHOT = re.compile(r"models--(.+?)--(.+)")


class ModelSourceError(ValueError):
    """The model name is neither a local path nor a repo id the hub cache can supply."""


def resolve_model(
    name: str, files: tuple[str, ...] = CHECKPOINT_FILES, environ: Mapping[str, str] = os.environ
) -> str:
    """The local path of model `name`: `name` itself when it exists on disk or cannot be a
    repo id (the loader then says it is missing), else the hub cache's snapshot of repo
    `name` holding `files` (glob patterns), fetched if missing."""
    if Path(name).expanduser().exists() or not is_repo_id(name):
        return name
    from huggingface_hub import constants, snapshot_download
    from huggingface_hub.errors import (
        GatedRepoError,
        HfHubHTTPError,
        LocalEntryNotFoundError,
        RepositoryNotFoundError,
    )

    offline = _is_true(environ.get("HF_HUB_OFFLINE"))
    cache = hub_cache(environ) or constants.HF_HUB_CACHE
    if not offline:
        print(f"fetching {name} into {cache} …", file=sys.stderr, flush=True)
    try:
        return snapshot_download(
            name,
            cache_dir=cache,
            local_files_only=offline,
            allow_patterns=list(files),
            endpoint=environ.get("HF_ENDPOINT") or None,
        )
    except LocalEntryNotFoundError:
        if offline:
            raise ModelSourceError(
                f"model {name} is not in the Hugging Face cache {cache} and HF_HUB_OFFLINE is "
                f"set: unset HF_HUB_OFFLINE to download it, or fetch it where there is network "
                f"(`hf download {name}`) and copy the cache here (or point HF_HUB_CACHE at it)"
            ) from None
        raise ModelSourceError(
            f"cannot download model {name}: the Hugging Face Hub is unreachable and the cache "
            f"{cache} does not hold it. Check the network (or HF_ENDPOINT), or fetch it where "
            f"there is network (`hf download {name}`) and copy the cache here (or point "
            "HF_HUB_CACHE at it), then run with HF_HUB_OFFLINE=1"
        ) from None
    except GatedRepoError:
        raise ModelSourceError(
            f"model {name} is gated: accept its terms on huggingface.co, then log in "
            "(`hf auth login`) or set HF_TOKEN"
        ) from None
    except RepositoryNotFoundError:
        raise ModelSourceError(
            f"model {name} is not on the Hugging Face Hub (or is private: log in with "
            "`hf auth login` or set HF_TOKEN), and there is no local path of that name"
        ) from None
    except HfHubHTTPError as error:
        raise ModelSourceError(f"cannot download model {name}: {error}") from None


def model_argument(files: tuple[str, ...] = CHECKPOINT_FILES) -> Callable[[str], str]:
    """An argparse `type` resolving a model flag or positional, its refusal worded as the
    error argparse prints."""

    def parse(text: str) -> str:
        try:
            return resolve_model(text, files)
        except ModelSourceError as error:
            raise argparse.ArgumentTypeError(str(error)) from None

    parse.__name__ = "model"
    return parse


def is_repo_id(name: str) -> bool:
    return bool(_REPO_ID.fullmatch(name)) and "--" not in name and ".." not in name


def repo_id_of(path: Path) -> str | None:
    """ORG/NAME when `path` is a snapshot in a hub cache, else None: the served name of a
    model fetched by name is its repo id, not the snapshot's commit."""
    # Absolute without following links: a snapshot's files are links into the blobs.
    parts = Path(os.path.abspath(path)).parts
    if len(parts) < 3 or parts[-2] != "snapshots":
        return None
    match = _SNAPSHOT.fullmatch(parts[-3])
    return f"{match.group(1)}/{match.group(2)}" if match else None


def hub_cache(environ: Mapping[str, str] = os.environ) -> str | None:
    """The hub cache the environment names (HF_HUB_CACHE, else HF_HOME/hub); None: the hub's
    default."""
    if environ.get("HF_HUB_CACHE"):
        return environ["HF_HUB_CACHE"]
    if environ.get("HF_HOME"):
        return str(Path(environ["HF_HOME"]) / "hub")
    return None


def _is_true(text: str | None) -> bool:
    # As huggingface_hub reads its switches.
    return text is not None and text.strip().upper() in ("1", "ON", "YES", "TRUE")
