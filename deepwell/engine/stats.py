"""EngineStats: one engine's load and counters, and the sum over several engines.

Torch-free: a worker sends it as it is to the HTTP process, whose metrics and router read it.
"""

from dataclasses import dataclass, field, fields, replace


@dataclass(frozen=True)
class SpecStats:
    # Request-steps that produced tokens, and those that verified at least one draft position.
    decode_steps: int = 0
    verify_steps: int = 0
    verified_tokens: int = 0
    accepted_tokens: int = 0
    # Per draft position: accepted / verified.
    position_accept_rates: tuple[float, ...] = ()
    confidence_error: float = 0.0

    def __post_init__(self) -> None:
        # A message decoded from the wire holds a list here.
        object.__setattr__(self, "position_accept_rates", tuple(self.position_accept_rates))

    @property
    def accept_rate(self) -> float:
        return self.accepted_tokens / self.verified_tokens if self.verified_tokens else 0.0

    @property
    def avg_verified_len(self) -> float:
        """Draft positions verified per request-step that verified any."""
        return self.verified_tokens / self.verify_steps if self.verify_steps else 0.0

    @property
    def tokens_per_decode(self) -> float:
        """Tokens a request gains per step it decodes in (1 without speculation)."""
        if not self.decode_steps:
            return 0.0
        return (self.decode_steps + self.accepted_tokens) / self.decode_steps


@dataclass(frozen=True)
class EngineStats:
    running: int
    waiting: int
    kv_blocks_used: int
    kv_blocks_total: int
    num_preemptions: int = 0
    # Prompt tokens looked up in the prefix cache at admission, and those it supplied
    # (from memory or the KV store).
    prefix_queried_tokens: int = 0
    prefix_hit_tokens: int = 0
    store_hits: int = 0
    store_misses: int = 0
    store_read_bytes: int = 0
    store_written_bytes: int = 0
    # Unreadable, corrupt, truncated or foreign block files, and dropped writes.
    store_errors: int = 0
    # Requests the watchdog ended because the step loop had stranded them (watchdog.py).
    stuck_requests_ended: int = 0
    # Speculative decoding (speculative/): request-steps that decoded, draft positions
    # verified and accepted, per-position acceptance and the confidence error.
    spec: SpecStats = field(default_factory=SpecStats)


def combine_stats(stats: list[EngineStats]) -> EngineStats:
    """Several engines as one (a worker pool): counters summed; speculative rates and errors
    averaged, weighted by how many request-steps each engine decoded."""
    counters = {
        f.name: sum(getattr(s, f.name) for s in stats)
        for f in fields(EngineStats)
        if f.name != "spec"
    }
    return EngineStats(**counters, spec=_combine_spec([s.spec for s in stats]))


def _combine_spec(stats: list[SpecStats]) -> SpecStats:
    counters = {
        f.name: sum(getattr(s, f.name) for s in stats)
        for f in fields(SpecStats)
        if f.name not in ("position_accept_rates", "confidence_error")
    }
    summed = SpecStats(**counters)
    steps = summed.decode_steps
    if not steps:
        return summed
    positions = max(len(s.position_accept_rates) for s in stats)
    rates = tuple(
        sum(
            s.decode_steps * s.position_accept_rates[i]
            for s in stats
            if i < len(s.position_accept_rates)
        )
        / steps
        for i in range(positions)
    )
    error = sum(s.decode_steps * s.confidence_error for s in stats) / steps
    return replace(summed, position_accept_rates=rates, confidence_error=error)
