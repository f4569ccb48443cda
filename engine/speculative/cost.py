"""What a step of R rows (decodes and their drafts) takes, learned from the steps run: the
latest time seen at each row count (smoothed), weighed against a line fitted through all
the counts seen by how often that count was seen; for counts not yet seen the line, never
below a smaller count's time. Step time is far from linear in the rows on a CPU (a 4-bit
kernel serves up to 4 rows, a dense copy above: one stream's step doubles from 4 rows to 5),
so a count seen often decides by itself; one seen once or twice (a busy server's drafted
steps, each a few rows more than its decodes, timed on a noisy machine) leans on the line,
whose slope all the counts measure."""

from __future__ import annotations

from dataclasses import dataclass, field

SMOOTHING = 0.3  # weight of the newest step at its row count
LINE_WEIGHT = 4.0  # the line counts as this many steps seen at a row count
PRIOR_ROW_SHARE = 0.02  # a row's share of a one-row step, before two row counts are seen


@dataclass(slots=True)
class StepCost:
    seconds_by_rows: dict[int, float] = field(default_factory=dict)
    times_seen: dict[int, int] = field(default_factory=dict)
    _line_fit: tuple[float, float] | None = None  # until the next observation

    def observe(self, num_rows: int, seconds: float) -> None:
        seen = self.seconds_by_rows.get(num_rows)
        self.seconds_by_rows[num_rows] = seconds if seen is None else (
            seen + SMOOTHING * (seconds - seen))
        self.times_seen[num_rows] = self.times_seen.get(num_rows, 0) + 1
        self._line_fit = None

    def seconds(self, num_rows: int) -> float:
        """The step time expected at `num_rows` (1.0 per step before anything is seen)."""
        return self.seconds_from(num_rows, 0)[0]

    def seconds_from(self, first_rows: int, count: int) -> list[float]:
        """`seconds(r)` for r = first_rows .. first_rows + count, in one pass."""
        if self._line_fit is None:
            self._line_fit = self._line()
        a, b = self._line_fit
        floor = max((self._blended(rows, a + b * rows) for rows in self.seconds_by_rows
                     if rows < first_rows), default=0.0)
        times = []
        for rows in range(first_rows, first_rows + count + 1):
            if rows in self.seconds_by_rows:
                time = self._blended(rows, a + b * rows)
                floor = max(floor, time)
            else:
                time = max(a + b * rows, floor)
            times.append(time)
        return times

    def _blended(self, rows: int, on_line: float) -> float:
        """A seen count's time, weighed against the line's by how often it was seen."""
        weight = self.times_seen[rows]
        return (weight * self.seconds_by_rows[rows] + LINE_WEIGHT * on_line) / (
            weight + LINE_WEIGHT)

    def _line(self) -> tuple[float, float]:
        """Least squares through the seen counts, each weighed by how often it was seen; with
        fewer than two counts, a line through the one seen (or 1 s) with the prior slope."""
        points = self.seconds_by_rows
        if len(points) < 2:
            rows, seconds = next(iter(points.items()), (1, 1.0))
            a = seconds / (1 + PRIOR_ROW_SHARE * rows)
            return a, a * PRIOR_ROW_SHARE
        weights = self.times_seen
        total = sum(weights.values())
        mean_rows = sum(rows * weights[rows] for rows in points) / total
        mean_seconds = sum(t * weights[rows] for rows, t in points.items()) / total
        spread = sum(weights[rows] * (rows - mean_rows) ** 2 for rows in points)
        b = sum(weights[rows] * (rows - mean_rows) * (t - mean_seconds)
                for rows, t in points.items()) / spread
        b = max(b, 1e-3 * mean_seconds)
        return max(mean_seconds - b * mean_rows, 0.05 * min(points.values())), b
