"""What a step of R rows (decodes and their drafts) takes, learned from the steps run.

A step's time is a level times a shape: the level is what a step at the anchor's row count
(the count run most of late) takes now, following it as contexts grow and the machine's
speed moves; the shape is what R rows take relative to the anchor's count, the median of
the latest steps at R, each taken over the level of its moment. So one slow step moves
nothing much (at most LEVEL_CLIP of the level, and one of a count's latest shapes), and a
count seen long ago compares right with one seen now: a busy server's drafted steps (a
few rows more than its decodes) are rare, and their absolute times went stale as contexts
grew; their ratio to the plain step did not.

Step time is far from linear in the rows on a CPU (a 4-bit kernel serves up to 4 rows, a
dense copy above: one stream's step doubles from 4 rows to 5), so a count seen often
decides by itself; one seen a few times leans on a line fitted through all the counts'
shapes by how often each was seen; a count not seen takes the line, never below a smaller
count's time."""

from __future__ import annotations

import math
from collections import Counter, deque
from dataclasses import dataclass, field
from statistics import median

SHAPE_WINDOW = 16  # a count's latest steps whose median is its shape
LEVEL_RATE = 0.2  # weight of the newest step at the anchor's count in the level
LEVEL_CLIP = 0.2  # in log time: how far one step at the anchor's count pulls the level
ANCHOR_SPAN = 64  # steps: an anchor run in none of the latest this many is moved
LINE_WEIGHT = 4.0  # the line counts as this many steps seen at a row count
PRIOR_ROW_SHARE = 0.02  # a row's share of a one-row step, before two row counts are seen


@dataclass(slots=True)
class StepCost:
    # by row count: log(step time) less the level of its moment, newest last; their median
    offsets: dict[int, deque[float]] = field(default_factory=dict)
    medians: dict[int, float] = field(default_factory=dict)
    times_seen: dict[int, int] = field(default_factory=dict)
    level: float = 0.0  # log seconds of a step at the anchor's row count
    anchor: int | None = None
    recent_rows: deque[int] = field(default_factory=lambda: deque(maxlen=ANCHOR_SPAN))
    _line_fit: tuple[float, float] | None = None  # until the next observation

    def observe(self, num_rows: int, seconds: float) -> None:
        log_time = math.log(max(seconds, 1e-9))
        if self.anchor is None:
            self.anchor, self.level = num_rows, log_time
        offsets = self.offsets.setdefault(num_rows, deque(maxlen=SHAPE_WINDOW))
        offsets.append(log_time - self.level)
        self.medians[num_rows] = median(offsets)
        self.times_seen[num_rows] = self.times_seen.get(num_rows, 0) + 1
        if num_rows == self.anchor:
            pull = min(max(log_time - self.level, -LEVEL_CLIP), LEVEL_CLIP)
            self.level += LEVEL_RATE * pull
        self.recent_rows.append(num_rows)
        if self.anchor not in self.recent_rows:
            self._move_anchor(Counter(self.recent_rows).most_common(1)[0][0])
        self._line_fit = None

    def _move_anchor(self, num_rows: int) -> None:
        """The level moves to the new anchor's count; every offset by as much the other way."""
        assert self.anchor is not None
        shift = self.medians[num_rows] - self.medians[self.anchor]
        self.level += shift
        for rows, offsets in self.offsets.items():
            for i in range(len(offsets)):
                offsets[i] -= shift
            self.medians[rows] -= shift
        self.anchor = num_rows

    def shape(self, num_rows: int) -> float:
        """A seen count's time over the anchor's (its median step of late over the level)."""
        assert self.anchor is not None
        return math.exp(self.medians[num_rows] - self.medians[self.anchor])

    def seconds(self, num_rows: int) -> float:
        """The step time expected at `num_rows` (1.0 per step before anything is seen)."""
        return self.seconds_from(num_rows, 0)[0]

    def seconds_from(self, first_rows: int, count: int) -> list[float]:
        """`seconds(r)` for r = first_rows .. first_rows + count, in one pass."""
        if self._line_fit is None:
            self._line_fit = self._line()
        a, b = self._line_fit
        floor = max((self._blended(rows, a + b * rows) for rows in self.medians
                     if rows < first_rows), default=0.0)
        times = []
        for rows in range(first_rows, first_rows + count + 1):
            if rows in self.medians:
                time = self._blended(rows, a + b * rows)
                floor = max(floor, time)
            else:
                time = max(a + b * rows, floor)
            times.append(time)
        scale = math.exp(self.level)
        return [time * scale for time in times]

    def _blended(self, rows: int, on_line: float) -> float:
        """A seen count's shape, weighed against the line's by how often it was seen."""
        weight = self.times_seen[rows]
        return (weight * self.shape(rows) + LINE_WEIGHT * on_line) / (weight + LINE_WEIGHT)

    def _line(self) -> tuple[float, float]:
        """Least squares through the seen counts' shapes, each weighed by how often it was
        seen; with fewer than two counts, a line through the one seen (or 1) with the prior
        slope."""
        if len(self.medians) < 2:
            rows = next(iter(self.medians), 1)
            a = 1.0 / (1 + PRIOR_ROW_SHARE * rows)
            return a, a * PRIOR_ROW_SHARE
        points = {rows: self.shape(rows) for rows in self.medians}
        weights = self.times_seen
        total = sum(weights[rows] for rows in points)
        mean_rows = sum(rows * weights[rows] for rows in points) / total
        mean_shape = sum(s * weights[rows] for rows, s in points.items()) / total
        spread = sum(weights[rows] * (rows - mean_rows) ** 2 for rows in points)
        b = sum(weights[rows] * (rows - mean_rows) * (s - mean_shape)
                for rows, s in points.items()) / spread
        b = max(b, 1e-3 * mean_shape)
        return max(mean_shape - b * mean_rows, 0.05 * min(points.values())), b
