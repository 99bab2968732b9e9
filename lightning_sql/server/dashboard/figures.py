"""A run's figures from the rows of its page's queries: counts, activity, throughput and the reward
charts' aggregates (over at most ``queries.REWARD_WINDOW`` rows)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from lightning_sql.server.dashboard import charts
from lightning_sql.server.dashboard.queries import IN_FLIGHT

BUCKETS = 40
MIN_AXIS_SECONDS = 60.0

FINISHED = ("succeeded", "failed", "cancelled")


@dataclass
class RunStats:
    """A run's figures: whole-run counts (from the status index) and its latest sign of life."""

    created_at: float
    counts: dict[str, int] = field(default_factory=dict)
    last_activity: float | None = None
    workers: int = 0

    @property
    def total(self) -> int:
        return sum(self.counts.values())

    @property
    def in_flight(self) -> int:
        return sum(n for status, n in self.counts.items() if status in IN_FLIGHT)

    @property
    def finished(self) -> int:
        return sum(n for status, n in self.counts.items() if status in FINISHED)

    @property
    def average_per_minute(self) -> float:
        """Finished rollouts per minute over the run's life so far."""
        if self.last_activity is None or self.last_activity <= self.created_at:
            return 0.0
        return self.finished / ((self.last_activity - self.created_at) / 60.0)


def latest(*values: float | None) -> float | None:
    present = [v for v in values if v is not None]
    return max(present) if present else None


def run_stats(run: Any, count_rows: Any, worker_rows: Any) -> RunStats:
    stats = RunStats(run.created_at, last_activity=latest(run.newest_start, run.finished_at))
    for row in count_rows:
        if row.run_id == run.run_id:
            stats.counts[row.status] = row.n
    for row in worker_rows:
        if row.run_id == run.run_id:
            stats.workers = row.n
            stats.last_activity = latest(
                stats.last_activity, row.last_heartbeat, row.last_dequeue, row.last_busy, row.last_idle
            )
    return stats


@dataclass
class VersionReward:
    resources_id: str | None
    resources_version: int | None
    mean: float
    n: int


def reward_charts(rows: Any) -> tuple[charts.Chart, charts.Chart, list[VersionReward]]:
    """The reward charts of the run page from the reward window's rows (at most ``REWARD_WINDOW``)."""
    if not rows:
        return charts.reward_lines({}, BUCKETS, 0.0, 1.0), charts.version_bars([]), []
    lo = min(row.at for row in rows)
    hi = max(row.at for row in rows)
    width = max(hi - lo, MIN_AXIS_SECONDS) / BUCKETS * (1 + 1e-9)
    sums: dict[tuple[int, str], list[float]] = {}
    by_version: dict[tuple[str | None, int | None], list[float]] = {}
    for row in rows:
        b = min(int((row.at - lo) / width), BUCKETS - 1)
        acc = sums.setdefault((b, row.mode or "none"), [0.0, 0.0])
        acc[0] += row.final_reward
        acc[1] += 1
        acc = by_version.setdefault((row.resources_id, row.resources_version), [0.0, 0.0])
        acc[0] += row.final_reward
        acc[1] += 1
    means = {key: (total / n, int(n)) for key, (total, n) in sums.items()}
    versions = [
        VersionReward(rid, version, total / n, int(n))
        for (rid, version), (total, n) in sorted(
            by_version.items(), key=lambda kv: (kv[0][0] or "", kv[0][1] if kv[0][1] is not None else -1)
        )
    ]
    several_ids = len({v.resources_id for v in versions}) > 1
    bars = [
        (
            (f"{v.resources_id} v{v.resources_version}" if several_ids else f"v{v.resources_version}")
            if v.resources_version is not None
            else "none",
            v.mean,
            v.n,
        )
        for v in versions
    ]
    return charts.reward_lines(means, BUCKETS, lo, width), charts.version_bars(bars), versions
