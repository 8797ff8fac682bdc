"""The plan as a table for people (`deepwell plan` without --json)."""

from __future__ import annotations

from deepwell.engine.plan.footprint import WeightShare
from deepwell.engine.plan.memory import MemoryPlan
from deepwell.engine.plan.sizes import human

_NAME_WIDTH = 34


def render_plan(plan: MemoryPlan) -> str:
    weights, kv = plan.footprint.weights, plan.footprint.kv
    lines = [
        f"{plan.model} ({plan.footprint.architecture}): {weights.params:,} parameters in "
        f"{weights.tensors:,} stored tensors (scales included)",
        "",
        *_shares("weights by kind", weights.by_kind),
        "",
        *_shares("weights by encoding", weights.by_encoding),
        "",
        f"KV cache ({kv.encoding})",
        _row("per token", f"{kv.bytes_per_token:,.2f} B".replace(".00 B", " B")),
        _row(f"per block of {kv.block_size} tokens", f"{kv.bytes_per_block:,} B"),
        _row(
            "state per sequence",
            f"{kv.state_bytes_per_sequence:,} B",
            human(kv.state_bytes_per_sequence),
        ),
        *(f"{'':<{_NAME_WIDTH}}{part.bytes:>17,} B  {part.name}" for part in kv.state_parts),
        "",
        _row("memory", human(plan.memory_bytes), f"{human(plan.usable_bytes)} usable"),
        _row("weights", human(weights.bytes)),
        _row(
            f"one sequence of {plan.max_model_len:,} tokens",
            human(plan.sequence_kv_bytes + kv.state_bytes_per_sequence),
            "KV and state",
        ),
        _row(
            "sequences that fit",
            f"{plan.max_num_seqs:,}",
            "" if plan.requested_num_seqs is None else f"of {plan.requested_num_seqs} asked",
        ),
        _row("needs at least", human(plan.needed_bytes)),
        "",
        ("FITS: " if plan.fits else "DOES NOT FIT: ") + plan.reason,
    ]
    return "\n".join(lines)


def _shares(title: str, shares: tuple[WeightShare, ...]) -> list[str]:
    header = f"{title:<{_NAME_WIDTH}}{'tensors':>9}{'parameters':>19}{'bytes':>19}{'GiB':>10}"
    total = WeightShare(
        "total",
        sum(s.tensors for s in shares),
        sum(s.params for s in shares),
        sum(s.bytes for s in shares),
    )
    return [header] + [
        f"  {s.name:<{_NAME_WIDTH - 2}}{s.tensors:>9,}{s.params:>19,}{s.bytes:>19,}"
        f"{s.bytes / (1 << 30):>10.2f}"
        for s in (*shares, total)
    ]


def _row(label: str, value: str, note: str = "") -> str:
    return f"{label:<{_NAME_WIDTH}}{value:>19}" + (f"  ({note})" if note else "")
