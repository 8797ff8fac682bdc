"""SlotPool: per-sequence state slots (sliding-window rings, compressor state).

DeepInfer sizes it int(max_num_seqs * 1.2) + 1 (DEEPINFER_NUM_STATE_SLOTS_RATIO; ours is
EngineArgs.num_state_slots_ratio).
"""

SLOTS_PER_SEQ = 1.2


def num_slots_for(max_num_seqs: int, ratio: float = SLOTS_PER_SEQ) -> int:
    return int(max_num_seqs * ratio) + 1


class SlotPool:
    def __init__(self, num_slots: int) -> None:
        self.num_slots = num_slots
        self.free_ids = list(range(num_slots - 1, -1, -1))

    @property
    def num_free(self) -> int:
        return len(self.free_ids)

    def allocate(self) -> int:
        if not self.free_ids:
            raise RuntimeError("no free state slot")
        return self.free_ids.pop()

    def free(self, slot: int) -> None:
        self.free_ids.append(slot)
