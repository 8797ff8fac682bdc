"""Where each routed expert lives: physical slots (logical experts plus redundant replicas)
laid out rank-major, and EPLB's greedy placement of replicas by load."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class ExpertPlacement:
    """Physical slot → logical expert; rank r holds slots [r * S, (r + 1) * S)."""

    num_experts: int
    num_ranks: int
    slot_experts: tuple[int, ...]

    def __post_init__(self) -> None:
        if len(self.slot_experts) % self.num_ranks:
            raise ValueError(
                f"{len(self.slot_experts)} expert slots do not divide over {self.num_ranks} ranks"
            )
        if set(self.slot_experts) != set(range(self.num_experts)):
            raise ValueError("a placement must hold every logical expert at least once")

    @property
    def slots_per_rank(self) -> int:
        return len(self.slot_experts) // self.num_ranks

    def rank_experts(self, rank: int) -> tuple[int, ...]:
        """The logical experts of `rank`'s slots, in slot order."""
        per_rank = self.slots_per_rank
        return self.slot_experts[rank * per_rank : (rank + 1) * per_rank]

    def replicas(self) -> list[list[int]]:
        """Each logical expert's physical slots, ascending."""
        slots: list[list[int]] = [[] for _ in range(self.num_experts)]
        for slot, expert in enumerate(self.slot_experts):
            slots[expert].append(slot)
        return slots

    def rank_loads(self, expert_loads: Sequence[float]) -> list[float]:
        """Tokens each rank computes when an expert's tokens split evenly over its replicas."""
        copies = [len(slots) for slots in self.replicas()]
        loads = [0.0] * self.num_ranks
        for slot, expert in enumerate(self.slot_experts):
            loads[slot // self.slots_per_rank] += expert_loads[expert] / copies[expert]
        return loads


def imbalance(rank_loads: Sequence[float]) -> float:
    """max / mean rank load (1.0 is perfect balance; 1.0 for no load at all)."""
    mean = sum(rank_loads) / len(rank_loads)
    return max(rank_loads) / mean if mean else 1.0


def worth_moving(
    expert_loads: Sequence[float], old: ExpertPlacement, new: ExpertPlacement, min_gain: float
) -> bool:
    """Whether `new` lowers the max/mean rank load of `expert_loads` by `min_gain` or more
    against `old` (EPLB's hysteresis: a balanced placement stays put)."""
    if new == old:
        return False
    before = imbalance(old.rank_loads(expert_loads))
    after = imbalance(new.rank_loads(expert_loads))
    return before - after >= min_gain


def check_divisible(num_experts: int, num_ranks: int, redundant: int) -> None:
    """Refuse expert counts that cannot fill every rank with the same number of slots."""
    slots = num_experts + redundant
    if slots % num_ranks:
        raise ValueError(
            f"{num_experts} routed experts + {redundant} redundant slots = {slots} do not "
            f"divide over {num_ranks} expert-parallel ranks; choose --data-parallel-size "
            "dividing the experts, or --eplb-redundant-experts to make up the difference"
        )
    if redundant > num_experts * (num_ranks - 1):
        raise ValueError(
            f"{redundant} redundant slots exceed one replica of every expert per other rank"
        )


def balanced_placement(
    expert_loads: Sequence[float], num_ranks: int, num_slots: int
) -> ExpertPlacement:
    """EPLB's policy (DeepSeek's eplb, greedy form): each redundant slot goes to the expert
    with the most load per replica; then replicas, heaviest first, each go to the least
    loaded rank with a free slot that does not hold that expert yet (ties: lower ids).
    Deterministic in its input, so every rank computes the same placement from the same
    all-reduced loads. Uniform loads give the round-robin placement r, r + N, ..."""
    num_experts = len(expert_loads)
    check_divisible(num_experts, num_ranks, num_slots - num_experts)
    copies = [1] * num_experts
    for _ in range(num_slots - num_experts):
        hottest = min(range(num_experts), key=lambda e: (-expert_loads[e] / copies[e], e))
        copies[hottest] += 1
    replicas = sorted(
        ((expert_loads[e] / copies[e], e) for e in range(num_experts) for _ in range(copies[e])),
        key=lambda item: (-item[0], item[1]),
    )
    per_rank = num_slots // num_ranks
    held: list[list[int]] = [[] for _ in range(num_ranks)]
    loads = [0.0] * num_ranks
    for load, expert in replicas:
        free = [r for r in range(num_ranks) if len(held[r]) < per_rank]
        # Two copies on one rank would balance nothing; taken only if nothing else is free.
        fresh = [r for r in free if expert not in held[r]] or free
        rank = min(fresh, key=lambda r: (loads[r], r))
        held[rank].append(expert)
        loads[rank] += load
    slots = tuple(expert for rank in range(num_ranks) for expert in sorted(held[rank]))
    return ExpertPlacement(num_experts, num_ranks, slots)
