"""The step-time curve: seconds per model step as a function of query rows in the batch,
measured online (median of the recent steps at each row count).

Unmeasured row counts interpolate between measured neighbours; past the largest measured
count the curve extends with the least-squares slope of the medians (0 until two counts
are known, which makes the planner try longer batches and so measure them).
"""

import statistics
from collections import deque

# Recent steps kept per row count: enough for a stable median, short enough to follow drift.
_WINDOW = 32


class StepTimeCurve:
    def __init__(self) -> None:
        self._samples: dict[int, deque[float]] = {}
        self._medians: dict[int, float] = {}

    def record(self, rows: int, seconds: float) -> None:
        samples = self._samples.setdefault(rows, deque(maxlen=_WINDOW))
        samples.append(seconds)
        self._medians[rows] = statistics.median(samples)

    def points(self) -> list[tuple[int, float]]:
        return sorted(self._medians.items())

    def estimate(self, rows: int) -> float:
        """Estimated seconds of a step of `rows` query rows (1.0 before any measurement)."""
        if rows in self._medians:
            return self._medians[rows]
        points = self.points()
        if not points:
            return 1.0
        below = [p for p in points if p[0] < rows]
        above = [p for p in points if p[0] > rows]
        if below and above:
            (x0, y0), (x1, y1) = below[-1], above[0]
            return y0 + (y1 - y0) * (rows - x0) / (x1 - x0)
        anchor = below[-1] if below else above[0]
        return max(anchor[1] + self._slope(points) * (rows - anchor[0]), 1e-9)

    @staticmethod
    def _slope(points: list[tuple[int, float]]) -> float:
        if len(points) < 2:
            return 0.0
        mean_x = sum(x for x, _ in points) / len(points)
        mean_y = sum(y for _, y in points) / len(points)
        var = sum((x - mean_x) ** 2 for x, _ in points)
        cov = sum((x - mean_x) * (y - mean_y) for x, y in points)
        return max(cov / var, 0.0)
