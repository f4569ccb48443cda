"""What a drafted token costs: step time fitted as a + b * rows over recent steps without
prompt chunks (least squares, older steps weighing less). Verifying one more row costs b;
with N rows decoding, a step yields a token per (a + b N) / N seconds, so a draft that is
accepted with probability q pays when q exceeds `row_cost(N)` = b N / (a + b N)."""

from __future__ import annotations

from dataclasses import dataclass

DECAY = 0.98  # per step: the fit follows the last ~50 steps
PRIOR_ROW_SHARE = 0.02  # b / a before any step is measured: rows nearly free (one stream)
MIN_ROWS_SPREAD = 1.0  # weighted variance of the row counts below which b keeps its prior


@dataclass(slots=True)
class StepCost:
    weight: float = 0.0
    rows: float = 0.0  # weighted sums
    seconds: float = 0.0
    rows_squared: float = 0.0
    rows_seconds: float = 0.0

    def observe(self, num_rows: int, seconds: float) -> None:
        self.weight = self.weight * DECAY + 1
        self.rows = self.rows * DECAY + num_rows
        self.seconds = self.seconds * DECAY + seconds
        self.rows_squared = self.rows_squared * DECAY + num_rows * num_rows
        self.rows_seconds = self.rows_seconds * DECAY + num_rows * seconds

    @property
    def fit(self) -> tuple[float, float]:
        """(a, b), each at least a small positive share of the step."""
        if self.weight == 0:
            return 1.0, PRIOR_ROW_SHARE
        mean_rows, mean_seconds = self.rows / self.weight, self.seconds / self.weight
        spread = self.rows_squared / self.weight - mean_rows ** 2
        if spread < MIN_ROWS_SPREAD:
            a = mean_seconds / (1 + PRIOR_ROW_SHARE * mean_rows)
            return a, a * PRIOR_ROW_SHARE
        b = (self.rows_seconds / self.weight - mean_rows * mean_seconds) / spread
        b = max(b, 1e-3 * mean_seconds / max(mean_rows, 1.0))
        a = max(mean_seconds - b * mean_rows, 0.05 * mean_seconds)
        return a, b

    def row_cost(self, num_rows: int) -> float:
        a, b = self.fit
        return b * num_rows / (a + b * num_rows)
