"""The dashboard's statements: SQLAlchemy Core over the store's documented tables and views.

Every statement filters on ``run_id`` first and reads through an index of ``docs/schema.md``'s table;
aggregates run in the database and pages are bounded by ``LIMIT``, so no page holds a run in memory.

Whole-run figures come from indexes alone: counts per status from ``ix_rollouts_run_id_status``, the
newest rollout from ``ix_rollouts_run_id_create_seq``.  What needs a row's columns (times, rewards,
errors) reads a window of the run's newest rollouts: ``WINDOW`` for the status chart, the recent
throughput and the failures, ``REWARD_WINDOW`` for the reward charts (a final reward is one short
range of ``ix_spans_reward`` per rollout, through ``rollout_summary_v1``).  A window is a range
``create_seq >= threshold`` of ``ix_rollouts_run_id_create_seq``; the thresholds come from one
statement, ``window_positions``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from sqlalchemy import Integer, Select, String, and_, case, cast, func, literal, or_, select
from sqlalchemy.sql.elements import ColumnElement

from lightning_sql.server.dashboard.rendering import NAME_CHARS
from lightning_sql.store.sql.schema import (
    attempts,
    resource_versions,
    resources,
    rollouts,
    runs,
    spans,
    workers,
)
from lightning_sql.store.sql.views import VIEW_TABLES

summary_v = VIEW_TABLES["rollout_summary_v1"]
attempts_v = VIEW_TABLES["attempts_v1"]

IN_FLIGHT = ("queuing", "preparing", "running", "requeuing")
FAILED_ATTEMPT = ("failed", "timeout", "unresponsive")
WINDOW = 5000
REWARD_WINDOW = 2000
COUNT_LIMIT = 10_000
PAGE_SIZE = 50
SPAN_LIMIT = 2000
THROUGHPUT_WINDOW_SECONDS = 600.0

SORTS: dict[str, Any] = {
    "created": rollouts.c.create_seq,
    "start": rollouts.c.start_time,
    "end": rollouts.c.end_time,
    "attempts": rollouts.c.attempt_count,
    "status": rollouts.c.status,
}


def bucket(dialect: str, value: ColumnElement[Any], origin: float, width: float) -> ColumnElement[Any]:
    """The 0-based index of the ``width``-wide interval after ``origin`` that holds ``value``."""
    offset = (value - literal(origin)) / literal(width)
    if dialect == "postgresql":
        return cast(func.floor(offset), Integer)
    return cast(offset, Integer)  # SQLite truncates towards zero; offsets are never negative here


# --- runs ---------------------------------------------------------------------------------------


def _runs_with_activity() -> Select[Any]:
    return select(
        runs.c.run_id,
        runs.c.name,
        runs.c.status,
        runs.c.created_at,
        runs.c.finished_at,
        newest_start(runs.c.run_id).label("newest_start"),
    )


def run_row(run_id: int) -> Select[Any]:
    return _runs_with_activity().where(runs.c.run_id == run_id)


def status_counts(run_id: int | None = None) -> Select[Any]:
    """Rollouts per run and status (an index-only read of ``ix_rollouts_run_id_status``)."""
    stmt = select(rollouts.c.run_id, rollouts.c.status, func.count().label("n")).group_by(
        rollouts.c.run_id, rollouts.c.status
    )
    if run_id is not None:
        stmt = stmt.where(rollouts.c.run_id == run_id)
    return stmt


def newest_start(run_id: Any) -> Any:
    """Enqueue time of the run's newest rollout (``run_id`` a value or a correlated column)."""
    return (
        select(rollouts.c.start_time)
        .where(rollouts.c.run_id == run_id)
        .order_by(rollouts.c.create_seq.desc())
        .limit(1)
        .scalar_subquery()
    )


def run_list_with_activity() -> Select[Any]:
    return _runs_with_activity().order_by(runs.c.run_id.desc())


def worker_heartbeats(run_id: int | None = None) -> Select[Any]:
    """Per run: the workers' latest sign of life (heartbeat, claim, busy or idle report) and their number."""
    stmt = select(
        workers.c.run_id,
        func.max(workers.c.last_heartbeat_time).label("last_heartbeat"),
        func.max(workers.c.last_dequeue_time).label("last_dequeue"),
        func.max(workers.c.last_busy_time).label("last_busy"),
        func.max(workers.c.last_idle_time).label("last_idle"),
        func.count().label("n"),
    ).group_by(workers.c.run_id)
    if run_id is not None:
        stmt = stmt.where(workers.c.run_id == run_id)
    return stmt


# --- one run ------------------------------------------------------------------------------------


def window_positions(run_id: int) -> Select[Any]:
    """``create_seq`` of the run's newest ``WINDOW`` rollouts, newest first (a walk down the index)."""
    return (
        select(rollouts.c.create_seq)
        .where(rollouts.c.run_id == run_id)
        .order_by(rollouts.c.create_seq.desc())
        .limit(WINDOW)
    )


def in_window(threshold: int | None) -> list[ColumnElement[bool]]:
    return [] if threshold is None else [rollouts.c.create_seq >= threshold]


def window_bounds(run_id: int, threshold: int | None) -> Select[Any]:
    return select(
        func.min(rollouts.c.start_time), func.max(rollouts.c.start_time), func.max(rollouts.c.end_time)
    ).where(rollouts.c.run_id == run_id, *in_window(threshold))


def window_overview(
    dialect: str, run_id: int, threshold: int | None, since: float, origin: float, width: float
) -> Select[Any]:
    """Per enqueue-time interval and status, over the window: the count, and how many finished
    since ``since``."""
    b = bucket(dialect, rollouts.c.start_time, origin, width).label("b")
    return (
        select(
            b,
            rollouts.c.status,
            func.count().label("n"),
            func.sum(case((rollouts.c.end_time >= since, 1), else_=0)).label("recent"),
        )
        .where(rollouts.c.run_id == run_id, *in_window(threshold))
        .group_by(b, rollouts.c.status)
    )


def reward_window(run_id: int, threshold: int | None) -> Select[Any]:
    """Mode, resources, time and final reward of the window's rollouts that have one."""
    window = select(rollouts.c.rollout_id).where(rollouts.c.run_id == run_id, *in_window(threshold))
    return select(
        summary_v.c.mode,
        summary_v.c.resources_id,
        summary_v.c.resources_version,
        func.coalesce(summary_v.c.end_time, summary_v.c.start_time).label("at"),
        summary_v.c.final_reward,
    ).where(
        summary_v.c.run_id == run_id,
        summary_v.c.rollout_id.in_(window.scalar_subquery()),
        summary_v.c.final_reward.isnot(None),
    )


def failures(run_id: int, threshold: int | None, per_kind: int = 3) -> Select[Any]:
    """Failed attempts of the window's rollouts grouped by error type (the agent's ``error.type``,
    else ``(status)``) in one pass: each kind's count and latest examples."""
    kind = func.coalesce(attempts_v.c.error_type, literal("(") + attempts_v.c.status + literal(")"))
    ranked = (
        select(
            kind.label("kind"),
            attempts_v.c.rollout_id,
            attempts_v.c.attempt_id,
            attempts_v.c.error_message,
            attempts_v.c.end_time,
            func.row_number()
            .over(partition_by=kind, order_by=(attempts_v.c.end_time.desc(), attempts_v.c.attempt_id))
            .label("rank"),
            func.count().over(partition_by=kind).label("n"),
        )
        .where(
            attempts_v.c.run_id == run_id,
            attempts_v.c.status.in_(FAILED_ATTEMPT),
            attempts_v.c.rollout_id.in_(
                select(rollouts.c.rollout_id).where(rollouts.c.run_id == run_id, *in_window(threshold)).scalar_subquery()
            ),
        )
        .subquery()
    )
    return select(ranked).where(ranked.c.rank <= per_kind).order_by(ranked.c.n.desc(), ranked.c.kind, ranked.c.rank)


def worker_list(run_id: int, limit: int = 200) -> Select[Any]:
    return (
        select(
            workers.c.worker_id,
            workers.c.status,
            workers.c.last_heartbeat_time,
            workers.c.last_dequeue_time,
            workers.c.last_busy_time,
            workers.c.last_idle_time,
            workers.c.current_rollout_id,
            workers.c.current_attempt_id,
            workers.c.heartbeat_stats,
        )
        .where(workers.c.run_id == run_id)
        .order_by(workers.c.create_seq)
        .limit(limit)
    )


# --- rollouts table -----------------------------------------------------------------------------


@dataclass(frozen=True)
class RolloutFilter:
    status: str = ""
    mode: str = ""
    version: int | None = None
    text: str = ""
    sort: str = "created"
    descending: bool = True
    page: int = 1

    def conditions(self, dialect: str, run_id: int) -> list[ColumnElement[bool]]:
        where: list[ColumnElement[bool]] = [rollouts.c.run_id == run_id]
        if self.status:
            where.append(rollouts.c.status == self.status)
        if self.mode == "none":
            where.append(rollouts.c.mode.is_(None))
        elif self.mode:
            where.append(rollouts.c.mode == self.mode)
        if self.version is not None:
            where.append(rollouts.c.resources_version == self.version)
        if self.text:
            needle = literal(self.text, String)
            input_text = cast(rollouts.c.input, String)
            if dialect == "postgresql":
                hits = [func.strpos(rollouts.c.rollout_id, needle) > 0, func.strpos(input_text, needle) > 0]
            else:
                hits = [func.instr(rollouts.c.rollout_id, needle) > 0, func.instr(input_text, needle) > 0]
            where.append(or_(*hits))
        return where


def rollout_page(dialect: str, run_id: int, f: RolloutFilter) -> Select[Any]:
    column = SORTS[f.sort]
    order = [column.desc() if f.descending else column.asc()]
    if f.sort == "end":
        # Unfinished rollouts (no end time) come last either way, on both backends.  Only here: on
        # the NOT NULL columns the clause would keep PostgreSQL from reading the index in order.
        order = [order[0].nulls_last()]
    if f.sort != "created":
        order.append(rollouts.c.create_seq.desc() if f.descending else rollouts.c.create_seq.asc())
    page = (
        select(rollouts.c.rollout_id, rollouts.c.create_seq)
        .where(and_(*f.conditions(dialect, run_id)))
        .order_by(*order)
        .limit(PAGE_SIZE)
        .offset((f.page - 1) * PAGE_SIZE)
    )
    return page


def rollout_count(dialect: str, run_id: int, f: RolloutFilter) -> Select[Any]:
    """How many rollouts match, counted up to ``COUNT_LIMIT + 1`` (the page says "more than")."""
    matching = select(rollouts.c.rollout_id).where(and_(*f.conditions(dialect, run_id))).limit(COUNT_LIMIT + 1)
    return select(func.count()).select_from(matching.subquery())


def summaries(run_id: int, rollout_ids: list[str]) -> Select[Any]:
    return select(summary_v).where(summary_v.c.run_id == run_id, summary_v.c.rollout_id.in_(rollout_ids))


def inputs(run_id: int, rollout_ids: list[str]) -> Select[Any]:
    return select(rollouts.c.rollout_id, rollouts.c.input).where(
        rollouts.c.run_id == run_id, rollouts.c.rollout_id.in_(rollout_ids)
    )


def version_choices(run_id: int) -> Select[Any]:
    """Resources versions for the filter menu, from the (small) version history."""
    return (
        select(resource_versions.c.version)
        .where(resource_versions.c.run_id == run_id)
        .group_by(resource_versions.c.version)
        .order_by(resource_versions.c.version)
        .limit(500)
    )


# --- one rollout --------------------------------------------------------------------------------


def rollout_row(run_id: int, rollout_id: str) -> Select[Any]:
    return select(rollouts).where(rollouts.c.run_id == run_id, rollouts.c.rollout_id == rollout_id)


def final_reward(run_id: int, rollout_id: str) -> Select[Any]:
    return select(summary_v.c.final_reward).where(
        summary_v.c.run_id == run_id, summary_v.c.rollout_id == rollout_id
    )


def attempt_rows(run_id: int, rollout_id: str) -> Select[Any]:
    return (
        select(attempts)
        .where(attempts.c.run_id == run_id, attempts.c.rollout_id == rollout_id)
        .order_by(attempts.c.sequence_id)
    )


SPAN_COLUMNS = (
    spans.c.id,
    spans.c.sequence_id,
    spans.c.trace_id,
    spans.c.span_id,
    spans.c.parent_id,
    func.substr(spans.c.name, 1, NAME_CHARS + 1).label("name"),  # the page shows NAME_CHARS
    spans.c.status_code,
    spans.c.start_time,
    spans.c.end_time,
    spans.c.attributes,
)


def span_rows(run_id: int, rollout_id: str, attempt_id: str) -> Select[Any]:
    return (
        select(*SPAN_COLUMNS)
        .where(spans.c.run_id == run_id, spans.c.rollout_id == rollout_id, spans.c.attempt_id == attempt_id)
        .order_by(spans.c.sequence_id, spans.c.id)
        .limit(SPAN_LIMIT + 1)
    )


def span_detail(run_id: int, span_pk: int) -> Select[Any]:
    return select(spans).where(spans.c.id == span_pk, spans.c.run_id == run_id)


# --- resources ----------------------------------------------------------------------------------


def resource_ids(run_id: int, limit: int = 200) -> Select[Any]:
    return (
        select(resources.c.resources_id, resources.c.version, resources.c.update_time, resources.c.create_time)
        .where(resources.c.run_id == run_id)
        .order_by(resources.c.touch_seq.desc())
        .limit(limit)
    )


def resource_history(run_id: int, resources_id: str, limit: int = 500) -> Select[Any]:
    return (
        select(resource_versions.c.version, resource_versions.c.time)
        .where(resource_versions.c.run_id == run_id, resource_versions.c.resources_id == resources_id)
        .order_by(resource_versions.c.version.desc())
        .limit(limit)
    )


def resource_version(run_id: int, resources_id: str, version: int) -> Select[Any]:
    return select(resource_versions.c.resources, resource_versions.c.time).where(
        resource_versions.c.run_id == run_id,
        resource_versions.c.resources_id == resources_id,
        resource_versions.c.version == version,
    )
