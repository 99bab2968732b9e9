"""What the server reads about the whole database, not one run: which run holds a rollout, whether a
run exists, and the rollout counts of the runs with recent activity (the ``/metrics`` gauges).

A ``SqlLightningStore`` is bound to one run; these reads span runs, so they are SQLAlchemy Core
statements over the documented tables (``docs/schema.md``), run on the server's read-only engine
(``readonly.py``).  Each reads through an index: a rollout id is looked up run by run in the rollouts'
primary key ``(run_id, rollout_id)``, counts per status come from ``ix_rollouts_run_id_status``.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from sqlalchemy import and_, func, select

from lightning_sql.server.readonly import Database
from lightning_sql.store.sql.schema import rollouts, runs, workers

# Rollout id -> run name pairs remembered (a rollout never changes run; an exporter sends the same
# rollout's spans many times).
KNOWN_ROLLOUTS = 4096
# Distinct rollout ids looked up in one statement.
LOOKUP_CHUNK = 500
# /metrics covers the runs with activity (a rollout enqueued, a worker's report, the run created or
# finished) in this window, the most recent first, at most this many.
GAUGE_WINDOW_S = 24 * 3600.0
MAX_GAUGE_RUNS = 100


@dataclass(frozen=True)
class RunCounts:
    name: str
    counts: dict[str, int]


class Catalog:
    """Reads across runs, on the server's read-only engine."""

    def __init__(self, db: Database) -> None:
        self.db = db
        self._runs_of: OrderedDict[str, tuple[str, ...]] = OrderedDict()

    async def runs_of_rollouts(self, rollout_ids: Sequence[str]) -> dict[str, tuple[str, ...]]:
        """The names of the runs holding each rollout id (empty for an unknown one)."""
        found: dict[str, tuple[str, ...]] = {}
        missing = []
        for rollout_id in dict.fromkeys(rollout_ids):
            known = self._runs_of.get(rollout_id)
            if known is None:
                missing.append(rollout_id)
            else:
                self._runs_of.move_to_end(rollout_id)
                found[rollout_id] = known
        for start in range(0, len(missing), LOOKUP_CHUNK):
            chunk = missing[start : start + LOOKUP_CHUNK]
            stmt = (
                select(rollouts.c.rollout_id, runs.c.name)
                .select_from(runs.join(rollouts, and_(rollouts.c.run_id == runs.c.run_id, rollouts.c.rollout_id.in_(chunk))))
                .order_by(runs.c.run_id)
            )
            names: dict[str, list[str]] = {rollout_id: [] for rollout_id in chunk}
            for row in await self.db.rows(stmt):
                names[row.rollout_id].append(row.name)
            for rollout_id, holders in names.items():
                found[rollout_id] = tuple(holders)
                if holders:  # an unknown rollout may be created later: only a found one is remembered
                    self._remember(rollout_id, tuple(holders))
        return found

    def _remember(self, rollout_id: str, holders: tuple[str, ...]) -> None:
        self._runs_of[rollout_id] = holders
        while len(self._runs_of) > KNOWN_ROLLOUTS:
            self._runs_of.popitem(last=False)

    async def run_exists(self, name: str) -> bool:
        rows = await self.db.rows(select(runs.c.run_id).where(runs.c.name == name))
        return bool(rows)

    async def active_run_counts(self, now: float) -> list[RunCounts]:
        """Rollouts by status of the runs with activity since ``now - GAUGE_WINDOW_S`` (newest first,
        at most ``MAX_GAUGE_RUNS``)."""
        newest = (
            select(rollouts.c.start_time)
            .where(rollouts.c.run_id == runs.c.run_id)
            .order_by(rollouts.c.create_seq.desc())
            .limit(1)
            .scalar_subquery()
        )
        run_rows, worker_rows = await self.db.many(
            select(runs.c.run_id, runs.c.name, runs.c.created_at, runs.c.finished_at, newest.label("newest")),
            select(
                workers.c.run_id,
                func.max(workers.c.last_heartbeat_time).label("heartbeat"),
                func.max(workers.c.last_dequeue_time).label("dequeue"),
                func.max(workers.c.last_busy_time).label("busy"),
                func.max(workers.c.last_idle_time).label("idle"),
            ).group_by(workers.c.run_id),
        )
        seen = {row.run_id: _latest(row.heartbeat, row.dequeue, row.busy, row.idle) for row in worker_rows}
        horizon = now - GAUGE_WINDOW_S
        active: list[tuple[float, int, str]] = []
        for row in run_rows:
            last = _latest(row.created_at, row.finished_at, row.newest, seen.get(row.run_id))
            if last is not None and last >= horizon:
                active.append((last, row.run_id, row.name))
        active.sort(reverse=True)
        chosen = {run_id: name for _last, run_id, name in active[:MAX_GAUGE_RUNS]}
        if not chosen:
            return []
        count_rows = await self.db.rows(
            select(rollouts.c.run_id, rollouts.c.status, func.count().label("n"))
            .where(rollouts.c.run_id.in_(list(chosen)))
            .group_by(rollouts.c.run_id, rollouts.c.status)
        )
        counts: dict[int, dict[str, int]] = {run_id: {} for run_id in chosen}
        for row in count_rows:
            counts[row.run_id][row.status] = int(row.n)
        return [RunCounts(chosen[run_id], counts[run_id]) for run_id in chosen]


def _latest(*times: Any) -> float | None:
    values = [float(t) for t in times if t is not None]
    return max(values) if values else None
