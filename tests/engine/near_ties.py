"""Near-ties in greedy completions: where two float orders may pick different tokens."""


def first_near_tie(completion, gap: float = 0.05) -> int:
    """The first position whose top two logprobs lie within `gap` nats, where a rounding
    step may pick either; the completion's length when none does."""
    return next(
        (k for k, lp in enumerate(completion.logprobs) if lp.top[0][1] - lp.top[1][1] < gap),
        len(completion.token_ids),
    )
