"""What a step of R rows (decodes and their drafts) takes, learned from the steps run: the
latest time seen at each row count (smoothed), and for counts not yet seen a line fitted
through the seen ones, never below a smaller count's time. Step time is far from linear in
the rows on a CPU (a 4-bit kernel serves up to 4 rows, a dense copy above: one stream's
step doubles from 4 rows to 5), so the table is what decides; the line only guesses, and a
guess that is too cheap gets tried once and measured."""

from __future__ import annotations

from dataclasses import dataclass, field

SMOOTHING = 0.3  # weight of the newest step at its row count
PRIOR_ROW_SHARE = 0.02  # a row's share of a one-row step, before two row counts are seen


@dataclass(slots=True)
class StepCost:
    seconds_by_rows: dict[int, float] = field(default_factory=dict)
    _line_fit: tuple[float, float] | None = None  # until the next observation

    def observe(self, num_rows: int, seconds: float) -> None:
        seen = self.seconds_by_rows.get(num_rows)
        self.seconds_by_rows[num_rows] = seconds if seen is None else (
            seen + SMOOTHING * (seconds - seen))
        self._line_fit = None

    def seconds(self, num_rows: int) -> float:
        """The step time expected at `num_rows` (1.0 per step before anything is seen)."""
        return self.seconds_from(num_rows, 0)[0]

    def seconds_from(self, first_rows: int, count: int) -> list[float]:
        """`seconds(r)` for r = first_rows .. first_rows + count, in one pass."""
        if self._line_fit is None:
            self._line_fit = self._line()
        a, b = self._line_fit
        seen = self.seconds_by_rows
        floor = max((t for rows, t in seen.items() if rows < first_rows), default=0.0)
        times = []
        for rows in range(first_rows, first_rows + count + 1):
            time = seen.get(rows)
            if time is None:
                time = max(a + b * rows, floor)
            else:
                floor = max(floor, time)
            times.append(time)
        return times

    def _line(self) -> tuple[float, float]:
        """Least squares through the seen counts; with fewer than two, a line through the
        one seen (or 1 s) with the prior slope."""
        points = self.seconds_by_rows
        if len(points) < 2:
            rows, seconds = next(iter(points.items()), (1, 1.0))
            a = seconds / (1 + PRIOR_ROW_SHARE * rows)
            return a, a * PRIOR_ROW_SHARE
        n = len(points)
        mean_rows = sum(points) / n
        mean_seconds = sum(points.values()) / n
        spread = sum((rows - mean_rows) ** 2 for rows in points)
        b = sum((rows - mean_rows) * (t - mean_seconds) for rows, t in points.items()) / spread
        b = max(b, 1e-3 * mean_seconds)
        return max(mean_seconds - b * mean_rows, 0.05 * min(points.values())), b
