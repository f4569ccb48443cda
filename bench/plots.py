"""PNG plots of benchmark runs: latency CDFs, throughput and concurrency over time."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
from matplotlib.figure import Figure

from bench.metrics import RequestRecord, concurrency_steps

if TYPE_CHECKING:
    from matplotlib.axes import Axes

    from bench.run_result import RunResult

MIN_BIN_S = 0.05
TIME_BINS = 60


def plot_run(result: RunResult, out_dir: Path) -> list[Path]:
    """One run: ttft_cdf, itl_cdf, throughput, concurrency (and step_time when served)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    done = [record for record in result.records if record.success]
    label = _run_label(result)
    paths = [
        _cdf(out_dir / "ttft_cdf.png", "Time to first token", {label: _ttfts(done)}),
        _cdf(out_dir / "itl_cdf.png", "Inter-token latency", {label: _itls(done)}),
        _over_time(out_dir / "throughput.png", "Output tokens/s", {label: result},
                   _throughput_series),
        _over_time(out_dir / "concurrency.png", "Requests in flight", {label: result},
                   _concurrency_series),
    ]
    if result.step_time is not None and result.step_time.count:
        paths.append(_step_time(out_dir / "step_time.png", result))
    return paths


def plot_comparison(runs: Sequence[tuple[str, int, RunResult]], out_dir: Path) -> list[Path]:
    """Runs as (target, concurrency, result): overlaid CDFs and throughput per concurrency,
    and output throughput and TTFT p99 against concurrency."""
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = []
    for level in sorted({concurrency for _, concurrency, _ in runs}):
        at_level = {target: result for target, c, result in runs if c == level}
        done = {target: [r for r in result.records if r.success]
                for target, result in at_level.items()}
        paths.append(_cdf(out_dir / f"ttft_cdf_c{level}.png",
                          f"Time to first token, concurrency {level}",
                          {t: _ttfts(records) for t, records in done.items()}))
        paths.append(_cdf(out_dir / f"itl_cdf_c{level}.png",
                          f"Inter-token latency, concurrency {level}",
                          {t: _itls(records) for t, records in done.items()}))
        paths.append(_over_time(out_dir / f"throughput_c{level}.png",
                                f"Output tokens/s, concurrency {level}", at_level,
                                _throughput_series))
    paths.append(_scaling(out_dir / "scaling.png", runs))
    return paths


def _run_label(result: RunResult) -> str:
    concurrency = result.config.max_concurrency
    return f"concurrency {concurrency}" if concurrency else "unbounded concurrency"


def _ttfts(records: list[RequestRecord]) -> list[float]:
    return [record.ttft * 1000 for record in records if record.ttft is not None]


def _itls(records: list[RequestRecord]) -> list[float]:
    return [gap * 1000 for record in records for gap in record.itls]


def _cdf(path: Path, title: str, series: dict[str, list[float]]) -> Path:
    figure, axes = _figure(figsize=(7, 4.5))
    for label, values in series.items():
        if values:
            ordered = np.sort(values)
            axes.step(ordered, np.arange(1, len(ordered) + 1) / len(ordered), where="post",
                      label=label)
    axes.set(title=title, xlabel="milliseconds", ylabel="fraction of samples", ylim=(0, 1.02))
    if any(min(values, default=1) > 0 for values in series.values() if values):
        axes.set_xscale("log")
    return _save(figure, axes, path)


def _throughput_series(result: RunResult) -> tuple[np.ndarray, np.ndarray]:
    done = [record for record in result.records if record.success and record.chunk_times]
    width = max(MIN_BIN_S, result.metrics.duration_s / TIME_BINS)
    edges = np.arange(0.0, result.metrics.duration_s + width, width)
    times = [t - result.origin for record in done for t in record.chunk_times]
    # A chunk may carry several tokens: spread each answer's count over its chunks.
    weights = [record.output_tokens / len(record.chunk_times)
               for record in done for _ in record.chunk_times]
    counts, _ = np.histogram(times, bins=edges, weights=weights)
    return edges[:-1], counts / width


def _concurrency_series(result: RunResult) -> tuple[np.ndarray, np.ndarray]:
    steps = concurrency_steps(result.records)
    times = np.array([0.0] + [time - result.origin for time, _ in steps])
    levels = np.array([0] + [level for _, level in steps])
    return times, levels


Series = Callable[["RunResult"], tuple[np.ndarray, np.ndarray]]


def _over_time(path: Path, title: str, results: dict[str, RunResult], series: Series) -> Path:
    figure, axes = _figure(figsize=(7, 4.5))
    for label, result in results.items():
        x, y = series(result)
        axes.step(x, y, where="post", label=label)
    axes.set(title=title, xlabel="seconds since start", ylim=(0, None))
    return _save(figure, axes, path)


def _step_time(path: Path, result: RunResult) -> Path:
    view = result.step_time
    figure, axes = _figure(figsize=(7, 4.5))
    labels = [f"≤{bound * 1000:g}" if np.isfinite(bound) else "more"
              for bound, _ in view.buckets]
    axes.bar(range(len(labels)),
             [count for _, count in view.buckets], tick_label=labels)
    axes.tick_params(axis="x", labelrotation=45)
    axes.set(title=f"Engine step time ({view.count} steps)", xlabel="milliseconds",
             ylabel="steps")
    return _save(figure, axes, path)


def _scaling(path: Path, runs: Sequence[tuple[str, int, RunResult]]) -> Path:
    figure, (throughput, ttft) = _figure(1, 2, figsize=(11, 4.5))
    for target in dict.fromkeys(target for target, _, _ in runs):
        points = sorted((c, r.metrics) for t, c, r in runs if t == target)
        levels = [c for c, _ in points]
        throughput.plot(levels, [m.output_throughput for _, m in points], marker="o",
                        label=target)
        ttft.plot(levels, [m.ttft_ms.p99 or np.nan for _, m in points], marker="o",
                  label=target)
    throughput.set(title="Output throughput", xlabel="concurrency", ylabel="tokens/s")
    ttft.set(title="TTFT p99", xlabel="concurrency", ylabel="milliseconds")
    for axes in (throughput, ttft):
        axes.set_xscale("log", base=2)
    return _save(figure, (throughput, ttft), path)


def _figure(rows: int = 1, columns: int = 1, figsize: tuple[float, float] = (7, 4.5)):
    # A bare Figure draws with Agg and keeps no global pyplot state.
    figure = Figure(figsize=figsize)
    return figure, figure.subplots(rows, columns)


def _save(figure: Figure, axes: Axes | tuple[Axes, ...], path: Path) -> Path:
    for each in axes if isinstance(axes, tuple) else (axes,):
        each.grid(alpha=0.3)
        if each.get_legend_handles_labels()[0]:
            each.legend()
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    return path
