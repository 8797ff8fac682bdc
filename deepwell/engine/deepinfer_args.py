"""DeepInfer's `LLM` keywords (spec/deepinfer.md §1.3) mapped onto deepwell's EngineArgs, with
its defaults; the ones that cannot apply here are kept as notes for the caller to log once.

Torch-free: the mapping is checked without loading anything.
"""

import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from deepwell.settings.engine import EngineArgs
from deepwell.settings.parallel import ParallelConfig

# DeepInfer's offline defaults where its EngineArgs and deepwell's share a name (§1.3).
DEEPINFER_DEFAULTS: dict[str, Any] = {
    "max_model_len": 4096,
    "max_num_seqs": 256,
    "chunked_prefill": False,
}
# DeepInfer keywords that do not change what deepwell computes: their DeepInfer default,
# and why another value has no effect here.
_NO_EFFECT: dict[str, tuple[Any, str]] = {
    "served_model_name": ("deepinfer-model", "offline generation names no model"),
    "engine_group_rank": (0, "deepwell's ranks are numbered by engine_rank alone"),
    "disable_log_stats": (True, "the offline engine logs no periodic stats"),
    "stop_preempted_request": (
        False,
        "a preempted request is recomputed and finishes normally, never stopped",
    ),
    "engine_type": ("NORMAL", "one engine kind runs prefill and decode together"),
    "ignore_len": (128 << 20, "requests are bounded by max_model_len"),
    "lookahead_tokens": (0, "decode headroom comes from the draft length"),
    "offline_inference": (True, "LLM is the offline engine"),
    "trust_remote_code": (False, "no remote code runs: models are deepwell's own classes"),
}
# tokens_per_block's "resolve it" value (§1.3).
_AUTO_BLOCK = -1


@dataclass(frozen=True)
class OfflineArgs:
    """What `LLM(...)`'s keywords ask for, in deepwell's terms."""

    engine: EngineArgs
    # A tokenizer to use in place of the model's (a tokenizer.json or a directory with one).
    tokenizer: str | None
    # Arguments accepted that have no effect on deepwell, each with why, to log once.
    notes: tuple[str, ...]


def offline_engine_args(
    model: str | None,
    *,
    tokenizer: str | None = None,
    revision: str | None = None,
    tokenizer_revision: str | None = None,
    expert_parallel_size: int = 1,
    **kwargs: Any,
) -> OfflineArgs:
    """deepwell's EngineArgs for DeepInfer's keywords and deepwell's own (which keep their
    meaning); raises TypeError for a keyword neither has, ValueError for a bad value."""
    notes = []
    for name, (default, why) in _NO_EFFECT.items():
        value = kwargs.pop(name, default)
        if value != default:
            notes.append(f"{name}={value!r} has no effect here: {why}")
    fields = {f.name for f in dataclasses.fields(EngineArgs)}
    unknown = sorted(
        set(kwargs)
        - fields
        - {"tokens_per_block", "data_parallel_size", "engram_parallel_size", "engine_rank"}
    )
    if unknown:
        raise TypeError(f"LLM() got unexpected keyword argument(s): {', '.join(unknown)}")
    _block_size(kwargs)
    parallel = _parallel(kwargs, expert_parallel_size, notes)
    if parallel is not None:
        kwargs["parallel"] = parallel
    kwargs = DEEPINFER_DEFAULTS | kwargs
    if "max_num_batched_tokens" not in kwargs:
        kwargs["max_num_batched_tokens"] = default_batched_tokens(
            kwargs["max_model_len"],
            kwargs["max_num_seqs"],
            kwargs.get("num_speculative_tokens", EngineArgs().num_speculative_tokens),
        )
    args = EngineArgs(
        model=None if model is None else resolve_revision(model, revision, "model"), **kwargs
    )
    tokenizer_path = tokenizer if tokenizer is not None else model
    if tokenizer_revision is not None or tokenizer is not None:
        if tokenizer_path is None:
            raise ValueError("tokenizer_revision needs a model or tokenizer path")
        tokenizer_path = resolve_revision(tokenizer_path, tokenizer_revision, "tokenizer")
    return OfflineArgs(args, tokenizer_path if tokenizer is not None else None, tuple(notes))


def default_batched_tokens(
    max_model_len: int | None, max_num_seqs: int, num_speculative_tokens: int
) -> int:
    """DeepInfer's max_num_batched_tokens when none is given: max(max_model_len, 4096,
    max_num_seqs * (1 + draft tokens))."""
    return max(max_model_len or 4096, 4096, max_num_seqs * (1 + num_speculative_tokens))


def resolve_revision(path: str, revision: str | None, what: str) -> str:
    """The directory of `revision` in a Hugging Face cache layout (`snapshots/<commit>`,
    `refs/<name>`) under `path`; `path` itself when it has no such layout and no revision
    is asked for. Local only: nothing is downloaded."""
    root = Path(path)
    snapshots = root / "snapshots"
    if not snapshots.is_dir():
        if revision is None:
            return path
        raise ValueError(
            f"{what} revision {revision!r} needs a Hugging Face cache directory "
            f"(snapshots/<commit>, refs/<name>) at {path!r}, which has no snapshots/ folder; "
            "deepwell reads local directories only"
        )
    name = revision or "main"
    ref = root / "refs" / name
    commit = ref.read_text().strip() if ref.is_file() else name
    available = sorted(p.name for p in snapshots.iterdir() if p.is_dir())
    if revision is None and not ref.is_file() and len(available) == 1:
        commit = available[0]
    chosen = snapshots / commit
    if not chosen.is_dir():
        raise ValueError(
            f"{what} revision {name!r} is not in {str(snapshots)!r}; it holds {available}"
        )
    return str(chosen)


def _block_size(kwargs: dict[str, Any]) -> None:
    """DeepInfer's tokens_per_block (-1 → 128) into deepwell's block_size."""
    tokens = kwargs.pop("tokens_per_block", _AUTO_BLOCK)
    if tokens == _AUTO_BLOCK:
        return
    if not isinstance(tokens, int) or tokens < 1:
        raise ValueError(f"tokens_per_block must be -1 (auto, 128) or positive, got {tokens!r}")
    if kwargs.get("block_size", tokens) != tokens:
        raise ValueError(
            f"tokens_per_block {tokens} and block_size {kwargs['block_size']} are one setting"
        )
    kwargs["block_size"] = tokens


def _parallel(
    kwargs: dict[str, Any], expert_parallel_size: int, notes: list[str]
) -> ParallelConfig | None:
    """DeepInfer's data/expert/engram parallel sizes and engine_rank as deepwell's
    ParallelConfig, whose EP size is its DP size; None when they ask for one rank."""
    data = kwargs.pop("data_parallel_size", 0)
    engram = kwargs.pop("engram_parallel_size", 0)
    rank = kwargs.pop("engine_rank", 0)
    context = kwargs.get("context_parallel_size", 1)
    if not isinstance(expert_parallel_size, int) or expert_parallel_size < 1:
        raise ValueError(f"expert_parallel_size must be >= 1, got {expert_parallel_size!r}")
    if not isinstance(rank, int) or rank < 0:
        raise ValueError(f"engine_rank must be >= 0, got {rank!r}")
    # DeepInfer: 0 → max(1, EP // CP).
    resolved = data or max(1, expert_parallel_size // context)
    if expert_parallel_size > 1 and resolved != expert_parallel_size:
        raise ValueError(
            f"expert_parallel_size {expert_parallel_size} with data_parallel_size {resolved}: "
            "deepwell's expert-parallel group is its data-parallel ranks, so the two must be "
            "equal"
        )
    if engram not in (0, context * resolved):
        notes.append(
            f"engram_parallel_size={engram} has no effect here: every rank holds the Engram "
            "tables whole"
        )
    if resolved == 1 and rank == 0:
        return None
    if "parallel" in kwargs:
        raise ValueError(
            "pass either deepwell's parallel=ParallelConfig(...) or DeepInfer's "
            "expert_parallel_size / data_parallel_size / engine_rank, not both"
        )
    return ParallelConfig(
        data_parallel_size=resolved, expert_parallel=expert_parallel_size > 1, rank=rank
    )
