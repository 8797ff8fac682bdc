"""BoundedReplay: how far DeepSeek-V4.1's YOCO consumer layers look back through their
window during a prompt, and so how far a prefix hit may reach (spec/deepinfer.md §1.6).

Layers before the YOCO boundary (producers) run over every position and their state is
exact. In `mask` and `compact` modes the consumer layers' window sees only the prompt's
last `keep_tokens` positions, from the request's *replay start*; `compact` also skips
their rows before it. A prefix hit may then cover at most the replay start, so the
consumer layers recompute that whole suffix and their rings never need restoring: a hit
gives the same tokens as no hit in the same mode.
"""

from dataclasses import dataclass
from enum import Enum

from deepwell.engine.kv.layout import CacheRole, KVLayout


class TruncationMode(Enum):
    # Every layer over every position: exact.
    OFF = "off"
    # Consumer layers keep every query row; their window is narrowed to the replayed suffix.
    MASK = "mask"
    # Consumer layers compute only the rows of the replayed suffix.
    COMPACT = "compact"


@dataclass(frozen=True)
class BoundedReplay:
    mode: TruncationMode = TruncationMode.OFF
    keep_tokens: int = 0

    @property
    def bounded(self) -> bool:
        return self.mode is not TruncationMode.OFF

    def check(self, layout: KVLayout) -> None:
        """Refuse a truncation mode the model cannot run (DeepInfer's rule: keep must cover
        the window and the backtracking rows)."""
        if not self.bounded:
            return
        if layout.yoco_boundary is None:
            raise ValueError(
                f"YOCO prefill truncation mode {self.mode.value!r} applies to models with YOCO "
                "consumer layers (DeepSeek-V4.1); this model has none: use mode 'off'"
            )
        windows = [ring for ring in layout.rings if ring.role is CacheRole.WINDOW]
        needed = max(ring.window + ring.max_backtrack for ring in windows)
        if self.keep_tokens < needed:
            raise ValueError(
                f"yoco_prefill_keep_tokens {self.keep_tokens} is too small: it must be at "
                f"least the window plus the backtracking rows ({needed}) "
                "(DEEPWELL_YOCO_PREFILL_KEEP_TOKENS, --yoco-prefill-keep-tokens)"
            )

    def replay_start(self, num_tokens: int) -> int:
        """The first position the consumer layers' window may see, for a request admitted
        with `num_tokens` tokens; 0 when exact."""
        if not self.bounded:
            return 0
        return max(0, num_tokens - self.keep_tokens)

    def hit_limit(self, num_tokens: int) -> int:
        """The most tokens a prefix hit may cover: all but the last one when exact; the
        replay start otherwise (the suffix from there is recomputed)."""
        if not self.bounded:
            return num_tokens - 1
        return self.replay_start(num_tokens)


# Every layer over every position: the default for models and tests that set no mode.
EXACT = BoundedReplay()
