"""Whether a machine can hold a model: its footprint (from config.json alone) against a
memory budget, and how many sequences of the longest context fit beside the weights.

The engine refuses with the same reason before it loads anything (engine/build.py).
"""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from deepwell.engine.errors import MemoryBudgetError, ModelLoadError
from deepwell.engine.kv.slot_pool import num_slots_for
from deepwell.engine.plan.footprint import ModelFootprint
from deepwell.engine.plan.sizes import GIB, human
from deepwell.settings.engine import ACTIVATION_RESERVE, BLOCK_SIZE

if TYPE_CHECKING:
    from deepwell.engine.models.architectures import Architecture


@dataclass(frozen=True)
class MemoryPlan:
    """A model's footprint set against `memory_bytes`, and the verdict."""

    model: str
    footprint: ModelFootprint
    memory_bytes: int
    # Kept for activations and the allocator, as the engine keeps it (kv/cache.py).
    activation_reserve: float
    max_model_len: int
    # The --max-num-seqs asked for (state slots are reserved for that many), or None.
    requested_num_seqs: int | None
    # Sequences of max_model_len tokens that fit beside the weights (capped by the request).
    max_num_seqs: int
    fits: bool
    # Why it does not fit and what to do; when it fits, the summary.
    reason: str
    # The smallest budget that holds the weights and one sequence of max_model_len tokens.
    needed_bytes: int

    @property
    def usable_bytes(self) -> int:
        return int(self.memory_bytes * (1 - self.activation_reserve))

    @property
    def sequence_kv_bytes(self) -> int:
        """Paged KV of one max_model_len sequence: whole blocks."""
        kv = self.footprint.kv
        return -(-self.max_model_len // kv.block_size) * kv.bytes_per_block

    def to_json(self) -> dict[str, Any]:
        weights, kv = self.footprint.weights, self.footprint.kv

        def shares(rows) -> list[dict[str, Any]]:
            return [
                {"name": s.name, "tensors": s.tensors, "params": s.params, "bytes": s.bytes}
                for s in rows
            ]

        return {
            "model": self.model,
            "architecture": self.footprint.architecture,
            "params": weights.params,
            "tensors": weights.tensors,
            "weight_bytes": weights.bytes,
            "weights_by_kind": shares(weights.by_kind),
            "weights_by_encoding": shares(weights.by_encoding),
            "kv_bytes_per_token": kv.bytes_per_token,
            "kv_bytes_per_block": kv.bytes_per_block,
            "block_size": kv.block_size,
            "kv_encoding": kv.encoding,
            "state_bytes_per_sequence": kv.state_bytes_per_sequence,
            "state_parts": [{"name": p.name, "bytes": p.bytes} for p in kv.state_parts],
            "memory_bytes": self.memory_bytes,
            "activation_reserve": self.activation_reserve,
            "max_model_len": self.max_model_len,
            "sequence_kv_bytes": self.sequence_kv_bytes,
            "requested_num_seqs": self.requested_num_seqs,
            "max_num_seqs": self.max_num_seqs,
            "needed_bytes": self.needed_bytes,
            "fits": self.fits,
            "reason": self.reason,
        }


def read_footprint(
    model: str | Path, block_size: int = BLOCK_SIZE, compute_dtype: str | None = None
) -> ModelFootprint:
    """The footprint of a checkpoint directory (or its config.json), from config.json alone.

    `compute_dtype` is the engine's, for dense models (it converts their weights and KV to
    it); DeepSeek-V4.1 stays in its released encodings."""
    path = Path(model)
    config_path = path / "config.json" if path.is_dir() else path
    if not path.exists():
        raise ModelLoadError(f"model path {str(path)!r} does not exist")
    if path.suffix == ".gguf":
        raise ModelLoadError(
            f"{str(path)!r}: plan reads a config.json; GGUF files are not planned yet"
        )
    if not config_path.is_file():
        raise ModelLoadError(f"{str(config_path)!r} is missing: plan needs the model's config.json")
    try:
        config = json.loads(config_path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise ModelLoadError(f"{str(config_path)!r} is not valid JSON: {error}") from error
    if not isinstance(config, dict):
        raise ModelLoadError(f"{str(config_path)!r} should hold a JSON object")
    architecture = _planned_architecture(config)
    if architecture is None or architecture.footprint is None:
        name = None if architecture is None else architecture.name
        raise ModelLoadError(
            f"{str(config_path)!r}: cannot plan architecture {name!r}; plan knows "
            f"{', '.join(_plannable_names())}"
        )
    try:
        return architecture.footprint(config, architecture.name, block_size, compute_dtype)
    except (ModelLoadError, KeyError, TypeError, ValueError) as error:
        raise ModelLoadError(f"{str(config_path)!r}: {error}") from None


def plan_memory(
    model: str | Path,
    memory_bytes: int,
    *,
    max_model_len: int | None = None,
    max_num_seqs: int | None = None,
    block_size: int = BLOCK_SIZE,
    memory_flag: str = "--memory",
    compute_dtype: str | None = None,
) -> MemoryPlan:
    """Plan `model` into `memory_bytes`: max_model_len defaults to the model's context; with
    max_num_seqs, state slots for that many are set aside first, as the engine does."""
    footprint = read_footprint(model, block_size, compute_dtype)
    return fit(str(model), footprint, memory_bytes, max_model_len, max_num_seqs, memory_flag)


def refuse_unfit(
    model: str | None,
    memory_gib: float,
    *,
    max_model_len: int | None,
    max_num_seqs: int | None,
    block_size: int,
    compute_dtype: str,
    memory_flag: str = "--memory-gib",
) -> None:
    """Raise MemoryBudgetError with the plan's reason when `model` cannot fit `memory_gib`.

    `serve` and the engine call it before reading any weights. Models the planner does not
    know (GGUF files, other architectures, unreadable configs) pass: the loader names what
    is wrong with them, and the engine checks its budget once they are loaded.
    """
    if model is None or not _plannable(Path(model)):
        return
    plan = plan_memory(
        model,
        int(memory_gib * GIB),
        max_model_len=max_model_len,
        max_num_seqs=max_num_seqs,
        block_size=block_size,
        memory_flag=memory_flag,
        compute_dtype=compute_dtype,
    )
    if not plan.fits:
        raise MemoryBudgetError(
            f"memory budget {memory_gib:.2f} GiB is too small for {Path(model).name}: {plan.reason}"
        )


def _plannable(path: Path) -> bool:
    try:
        config = json.loads((path / "config.json").read_text())
    except (OSError, ValueError):
        return False
    if not isinstance(config, dict):
        return False
    architecture = _planned_architecture(config)
    return architecture is not None and architecture.footprint is not None


def _planned_architecture(config: dict[str, Any]) -> Architecture | None:
    """The config's entry in models/architectures.py, which carries its footprint function."""
    # Imported here: the table imports this package's footprint modules.
    from deepwell.engine.models.architectures import architecture_of

    return architecture_of(config)


def _plannable_names() -> list[str]:
    from deepwell.engine.models.architectures import ARCHITECTURES

    return [entry.name for entry in ARCHITECTURES.values() if entry.footprint is not None]


def fit(
    model: str,
    footprint: ModelFootprint,
    memory_bytes: int,
    max_model_len: int | None,
    max_num_seqs: int | None,
    memory_flag: str = "--memory",
) -> MemoryPlan:
    """The plan of `footprint` in `memory_bytes`; the reason names the budget `memory_flag`."""
    if max_model_len is not None and max_model_len <= 0:
        raise ValueError(f"max_model_len must be positive, got {max_model_len}")
    if max_num_seqs is not None and max_num_seqs <= 0:
        raise ValueError(f"max_num_seqs must be positive, got {max_num_seqs}")
    length = min(max_model_len or footprint.max_context, footprint.max_context)
    kv = footprint.kv
    weights = footprint.weights.bytes
    sequence = -(-length // kv.block_size) * kv.bytes_per_block
    state = kv.state_bytes_per_sequence
    usable = int(memory_bytes * (1 - ACTIVATION_RESERVE))
    if max_num_seqs is None:
        # every sequence brings its own state slot
        slots_bytes = state
        count = max(0, (usable - weights) // (sequence + state))
    else:
        slots_bytes = num_slots_for(max_num_seqs) * state
        count = min(max_num_seqs, max(0, (usable - weights - slots_bytes) // sequence))
    needed = math.ceil((weights + sequence + slots_bytes) / (1 - ACTIVATION_RESERVE))
    plan = MemoryPlan(
        model=model,
        footprint=footprint,
        memory_bytes=memory_bytes,
        activation_reserve=ACTIVATION_RESERVE,
        max_model_len=length,
        requested_num_seqs=max_num_seqs,
        max_num_seqs=int(count),
        fits=count >= 1,
        reason="",
        needed_bytes=int(needed),
    )
    return _with_reason(plan, slots_bytes, memory_flag)


def _with_reason(plan: MemoryPlan, slots_bytes: int, memory_flag: str) -> MemoryPlan:
    weights = plan.footprint.weights.bytes
    budget = (
        f"{memory_flag} {human(plan.memory_bytes)} leaves {human(plan.usable_bytes)} after the "
        f"{plan.activation_reserve:.0%} kept for activations"
    )
    # the engine's slots for --max-num-seqs (kv/slot_pool.py), one without it
    slots = 1 if plan.requested_num_seqs is None else num_slots_for(plan.requested_num_seqs)
    sequence = (
        f"one {plan.max_model_len:,}-token sequence ({human(plan.sequence_kv_bytes)} KV) + "
        f"{slots} state {'slot' if slots == 1 else 'slots'} ({human(slots_bytes)})"
    )
    if plan.fits:
        reason = (
            f"weights {human(weights)} + {plan.max_num_seqs:,} sequences of "
            f"{plan.max_model_len:,} tokens; {budget}"
        )
    elif weights > plan.usable_bytes:
        experts = any(share.name == "routed experts" for share in plan.footprint.weights.by_kind)
        reason = (
            f"the weights alone take {human(weights)}; {budget}. The weights + {sequence} "
            f"need at least {human(plan.needed_bytes)}: use a machine with more memory"
            + (
                ", or split the routed experts over several ranks with --expert-parallel"
                if experts
                else ""
            )
        )
    else:
        reason = (
            f"weights {human(weights)} + {sequence} need {human(plan.needed_bytes)}; {budget}: "
            "use more memory or lower --max-model-len"
            + ("" if plan.requested_num_seqs is None else " or --max-num-seqs")
        )
    return dataclasses.replace(plan, reason=reason)
