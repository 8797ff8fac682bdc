"""Per-position survival probabilities of n-gram drafts, learned online from acceptance.

A position survives when it and every draft position before it are accepted. Counts are
kept per (match length, position) with a Beta prior. The confidence error is that of the
planner's input: per verification, |expected accepted (the survival sum) - accepted|
over the positions verified (spec/deepinfer.md §1.6 `avg_confidence_error`).
"""

# Beta prior of an unseen (bucket, position): mean 0.5, worth two observations.
_PRIOR_SURVIVED = 1.0
_PRIOR_TRIALS = 2.0


class ConfidenceTable:
    def __init__(self, max_positions: int) -> None:
        self.max_positions = max_positions
        # bucket → per position [survived, trials]
        self._counts: dict[int, list[list[float]]] = {}
        self.error_sum = 0.0
        self.error_count = 0

    def survival(self, bucket: int, num_positions: int) -> list[float]:
        """Estimated survival of positions 1..num_positions, non-increasing."""
        counts = self._counts.get(bucket)
        estimates: list[float] = []
        previous = 1.0
        for position in range(num_positions):
            survived, trials = counts[position] if counts else (0.0, 0.0)
            estimate = (survived + _PRIOR_SURVIVED) / (trials + _PRIOR_TRIALS)
            previous = min(previous, estimate)
            estimates.append(previous)
        return estimates

    def observe(self, bucket: int, predicted: list[float], num_accepted: int) -> None:
        """Record a verification of `len(predicted)` positions of which the first
        `num_accepted` were accepted; `predicted` are the survival estimates used."""
        counts = self._counts.setdefault(bucket, [[0.0, 0.0] for _ in range(self.max_positions)])
        for position in range(len(predicted)):
            counts[position][0] += position < num_accepted
            counts[position][1] += 1.0
        self.record_error(predicted, num_accepted)

    def record_error(self, predicted: list[float], num_accepted: int) -> None:
        """Count a verification's confidence error (drafters with their own survival
        estimates report here too)."""
        if predicted:
            self.error_sum += abs(sum(predicted) - num_accepted) / len(predicted)
            self.error_count += 1

    @property
    def mean_error(self) -> float:
        return self.error_sum / self.error_count if self.error_count else 0.0
