"""Charts as geometry for inline SVG: the server computes every shape, the templates draw them.

Each shape carries the numbers it shows (``label``/``value``), so a page's figures are readable by a
test or a screen reader without parsing coordinates.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from lightning_sql.server.dashboard.rendering import fmt_tick

WIDTH = 720.0
HEIGHT = 220.0
HALF_WIDTH = 480.0
PAD_LEFT = 48.0
PAD_RIGHT = 12.0
PAD_TOP = 12.0
PAD_BOTTOM = 28.0

STATUS_ORDER = ("queuing", "preparing", "running", "requeuing", "succeeded", "failed", "cancelled")
MODE_ORDER = ("train", "val", "test", "none")


@dataclass
class Rect:
    x: float
    y: float
    w: float
    h: float
    cls: str
    label: str
    value: float


@dataclass
class Series:
    name: str
    points: list[tuple[float, float, float, int]]  # x, y, value, count

    @property
    def path(self) -> str:
        return " ".join(f"{'M' if i == 0 else 'L'}{x:.1f},{y:.1f}" for i, (x, y, _v, _n) in enumerate(self.points))


@dataclass
class Chart:
    """One chart: its frame, tick labels and shapes."""

    kind: str
    title: str
    rects: list[Rect] = field(default_factory=list)
    series: list[Series] = field(default_factory=list)
    y_ticks: list[tuple[float, str]] = field(default_factory=list)
    x_ticks: list[tuple[float, str, str]] = field(default_factory=list)
    legend: list[str] = field(default_factory=list)
    empty: bool = True
    width: float = WIDTH
    height: float = HEIGHT

    @property
    def plot_bottom(self) -> float:
        return self.height - PAD_BOTTOM

    @property
    def plot_left(self) -> float:
        return PAD_LEFT

    @property
    def plot_right(self) -> float:
        return self.width - PAD_RIGHT


def _nice_max(value: float) -> float:
    if value <= 0:
        return 1.0
    magnitude = 10 ** (len(str(int(value))) - 1)
    for step in (1, 1.2, 1.5, 2, 2.5, 3, 4, 5, 6, 8, 10):
        if value <= step * magnitude:
            return float(step * magnitude)
    return float(10 * magnitude)


def _fmt(value: float) -> str:
    return f"{value:g}" if abs(value) >= 0.01 or value == 0 else f"{value:.2e}"


def _y_ticks(lo: float, hi: float, top: float, bottom: float, n: int = 4) -> list[tuple[float, str]]:
    span = (hi - lo) or 1.0
    return [(bottom - (bottom - top) * i / n, _fmt(round(lo + span * i / n, 6))) for i in range(n + 1)]


def _x_ticks(origin: float, width: float, buckets: int, chart_width: float) -> list[tuple[float, str, str]]:
    """(x, label, text-anchor) of five time ticks; the outer ones anchored inside the plot."""
    plot_w = chart_width - PAD_LEFT - PAD_RIGHT
    ticks = []
    for i in range(0, buckets + 1, max(1, buckets // 4)):
        x = PAD_LEFT + plot_w * i / buckets
        anchor = "start" if i == 0 else ("end" if i == buckets else "middle")
        ticks.append((x, fmt_tick(origin + width * i, width * buckets), anchor))
    return ticks


def order_statuses(statuses: set[str]) -> list[str]:
    known = [s for s in STATUS_ORDER if s in statuses]
    return known + sorted(statuses - set(STATUS_ORDER))


def stacked_status_bars(
    counts: Mapping[tuple[int, str], int], buckets: int, origin: float, width: float
) -> Chart:
    """Rollouts per time interval, each bar split by status (bottom to top in ``STATUS_ORDER``)."""
    chart = Chart("stacked", "Rollouts by status over time")
    if not counts:
        return chart
    statuses = order_statuses({s for _b, s in counts})
    totals = [sum(counts.get((b, s), 0) for s in statuses) for b in range(buckets)]
    top = _nice_max(max(totals))
    plot_w = WIDTH - PAD_LEFT - PAD_RIGHT
    plot_h = HEIGHT - PAD_TOP - PAD_BOTTOM
    bar_w = plot_w / buckets
    for b in range(buckets):
        y = HEIGHT - PAD_BOTTOM
        for s in statuses:
            n = counts.get((b, s), 0)
            if not n:
                continue
            h = plot_h * n / top
            y -= h
            chart.rects.append(
                Rect(PAD_LEFT + b * bar_w + 0.5, y, max(bar_w - 1.0, 0.5), h, f"s-{s}", s, float(n))
            )
    chart.legend = statuses
    chart.y_ticks = _y_ticks(0, top, PAD_TOP, HEIGHT - PAD_BOTTOM)
    chart.x_ticks = _x_ticks(origin, width, buckets, chart.width)
    chart.empty = False
    return chart


def reward_lines(
    means: Mapping[tuple[int, str], tuple[float, int]], buckets: int, origin: float, width: float
) -> Chart:
    """Mean final reward per interval, one line per mode."""
    chart = Chart("lines", "Mean reward per mode over time", width=HALF_WIDTH)
    if not means:
        return chart
    values = [m for m, _n in means.values()]
    lo, hi = min(0.0, min(values)), max(values)
    if hi <= lo:
        hi = lo + 1.0
    hi = _nice_max(hi) if lo == 0 else hi
    plot_w = chart.width - PAD_LEFT - PAD_RIGHT
    plot_h = HEIGHT - PAD_TOP - PAD_BOTTOM
    modes = [m for m in MODE_ORDER if any(k[1] == m for k in means)]
    modes += sorted({k[1] for k in means} - set(modes))
    for mode in modes:
        points = []
        for b in range(buckets):
            if (b, mode) in means:
                mean, n = means[(b, mode)]
                x = PAD_LEFT + plot_w * (b + 0.5) / buckets
                y = HEIGHT - PAD_BOTTOM - plot_h * (mean - lo) / (hi - lo)
                points.append((x, y, mean, n))
        chart.series.append(Series(mode, points))
    chart.legend = modes
    chart.y_ticks = _y_ticks(lo, hi, PAD_TOP, HEIGHT - PAD_BOTTOM)
    chart.x_ticks = _x_ticks(origin, width, buckets, chart.width)
    chart.empty = False
    return chart


def version_bars(rows: Sequence[tuple[str, float, int]]) -> Chart:
    """Mean final reward per resources version (``label``, mean, count)."""
    chart = Chart("bars", "Mean reward per resources version", width=HALF_WIDTH)
    if not rows:
        return chart
    lo = min(0.0, min(m for _l, m, _n in rows))
    hi = max(m for _l, m, _n in rows)
    hi = _nice_max(hi) if hi > 0 else 1.0
    plot_w = chart.width - PAD_LEFT - PAD_RIGHT
    plot_h = HEIGHT - PAD_TOP - PAD_BOTTOM
    bar_w = plot_w / len(rows)
    zero = HEIGHT - PAD_BOTTOM - plot_h * (0 - lo) / (hi - lo)
    for i, (label, mean, _n) in enumerate(rows):
        y = HEIGHT - PAD_BOTTOM - plot_h * (mean - lo) / (hi - lo)
        top, h = (y, zero - y) if y <= zero else (zero, y - zero)
        chart.rects.append(Rect(PAD_LEFT + i * bar_w + 2, top, max(bar_w - 4, 1.0), max(h, 0.5), "bar", label, mean))
    chart.y_ticks = _y_ticks(lo, hi, PAD_TOP, HEIGHT - PAD_BOTTOM)
    chart.x_ticks = [(PAD_LEFT + (i + 0.5) * bar_w, label, "middle") for i, (label, _m, _n) in enumerate(rows)] if len(rows) <= 16 else []
    chart.empty = False
    return chart


@dataclass
class Lane:
    """One row of a timeline or waterfall: offset and length as fractions of the whole span."""

    key: str
    label: str
    cls: str
    left: float
    width: float
    start: float | None
    end: float | None
    depth: int = 0
    open_ended: bool = False


def lanes(items: Sequence[tuple[str, str, str, float | None, float | None, int]], now: float) -> tuple[list[Lane], float, float]:
    """Place (key, label, class, start, end, depth) items on a common time axis; an item without an
    end runs to the latest time seen (or ``now`` when that is later)."""
    starts = [s for _k, _l, _c, s, _e, _d in items if s is not None]
    if not starts:  # nothing to place in time: every item, without a bar
        return [Lane(k, label, c, 0.0, 0.0, s, e, d, e is None) for k, label, c, s, e, d in items], 0.0, 0.0
    t0 = min(starts)
    ends = [e for _k, _l, _c, _s, e, _d in items if e is not None]
    t1 = max([*ends, *starts])
    if any(e is None for *_x, e, _d in items):
        t1 = max(t1, min(now, t1 + 3600.0)) if now > t1 else t1
    total = (t1 - t0) or 1.0
    out = []
    for key, label, cls, start, end, depth in items:
        s = start if start is not None else t0
        e = end if end is not None else t1
        out.append(
            Lane(key, label, cls, (s - t0) / total, max((e - s) / total, 0.002), start, end, depth, end is None)
        )
    return out, t0, t1 - t0
