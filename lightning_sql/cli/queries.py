"""The CLI's read model: every statement the commands run (all reads, and the batched span delete
of ``gc``), built with SQLAlchemy Core.

Statements read through :class:`~lightning_sql.analysis.AnalysisDatabase` (one short read
transaction each).  Listings that may be long (``spans``) are read in keyset pages, and select only
the columns that are printed.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any

from sqlalchemy import Select, delete, func, select

from lightning_sql.store.sql import dialect as d
from lightning_sql.store.sql import schema as s
from lightning_sql.store.sql.views import VIEW_TABLES

FINISHED_STATUSES = ("succeeded", "failed", "cancelled")

ROLLOUT_SORTS = {
    "start": "start_time",
    "end": "end_time",
    "duration": "duration_seconds",
    "reward": "final_reward",
    "attempts": "attempts",
    "id": "rollout_id",
}

# Spans read per page by `spans`: one short read transaction each, a few MB at most in flight.
SPAN_PAGE_ROWS = 2_000
# What `spans` prints without --json, and what --json adds.
SPAN_TABLE_COLUMNS = ("rollout_id", "attempt_id", "sequence_id", "span_id", "parent_id", "name", "status_code")
SPAN_JSON_COLUMNS = (*SPAN_TABLE_COLUMNS, "start_time", "end_time", "attributes")


def records(columns: Sequence[str], rows: Sequence[tuple[Any, ...]]) -> list[dict[str, Any]]:
    return [dict(zip(columns, row, strict=True)) for row in rows]


# --- status --------------------------------------------------------------------------------------------


def finished_rollout_counts(run_id: int, window_start: float) -> Select:  # type: ignore[type-arg]
    """Finished rollouts: (ended since ``window_start``, first start, last end, ended at all)."""
    ro = s.rollouts
    return select(
        func.count().filter(ro.c.end_time >= window_start),
        func.min(ro.c.start_time),
        func.max(ro.c.end_time),
        func.count().filter(ro.c.end_time.isnot(None)),
    ).where(ro.c.run_id == run_id, ro.c.status.in_(FINISHED_STATUSES))


def workers_of_run(run_id: int) -> Select[Any]:
    wk = s.workers
    return (
        select(wk.c.worker_id, wk.c.status, wk.c.current_rollout_id, wk.c.last_heartbeat_time)
        .where(wk.c.run_id == run_id)
        .order_by(wk.c.create_seq)
    )


# --- rollouts, show -------------------------------------------------------------------------------------


def rollouts_of_run(
    run_id: int,
    *,
    statuses: Sequence[str] = (),
    mode: str | None = None,
    worker: str | None = None,
    resources_version: int | None = None,
    sort: str = "start",
    desc: bool = False,
    limit: int = 0,
) -> Select[Any]:
    """Rows of ``rollout_summary_v1``, filtered and sorted (NULLs last either way); ``limit`` 0 = all."""
    view = VIEW_TABLES["rollout_summary_v1"]
    stmt = select(view).where(view.c.run_id == run_id)
    if statuses:
        stmt = stmt.where(view.c.status.in_(statuses))
    if mode:
        stmt = stmt.where(view.c.mode == mode)
    if worker:
        stmt = stmt.where(view.c.latest_worker_id == worker)
    if resources_version is not None:
        stmt = stmt.where(view.c.resources_version == resources_version)
    key = view.c[ROLLOUT_SORTS[sort]]
    stmt = stmt.order_by(key.is_(None), key.desc() if desc else key.asc(), view.c.rollout_id)
    return stmt.limit(limit) if limit else stmt


def rollout_summary(run_id: int, rollout_id: str) -> Select[Any]:
    """The rollout's ``rollout_summary_v1`` row with its queue fields (``priority``, ``not_before``)."""
    view, r = VIEW_TABLES["rollout_summary_v1"], s.rollouts
    return (
        select(view, r.c.priority, r.c.not_before)
        .join(r, (r.c.run_id == view.c.run_id) & (r.c.rollout_id == view.c.rollout_id))
        .where(view.c.run_id == run_id, view.c.rollout_id == rollout_id)
    )


def attempts_of_rollout(run_id: int, rollout_id: str) -> Select[Any]:
    """``attempts_v1`` rows of the rollout with the attempt's stored ``metadata`` (its error)."""
    view, at = VIEW_TABLES["attempts_v1"], s.attempts
    return (
        select(view, at.c.metadata)
        .join(
            at,
            (at.c.run_id == view.c.run_id)
            & (at.c.rollout_id == view.c.rollout_id)
            & (at.c.attempt_id == view.c.attempt_id),
        )
        .where(view.c.run_id == run_id, view.c.rollout_id == rollout_id)
        .order_by(view.c.attempt_number)
    )


def spans_of_attempt(run_id: int, rollout_id: str, attempt_id: str, limit: int) -> Select[Any]:
    """The attempt's first ``limit`` spans (0 = all) in sequence order."""
    sp = s.spans
    stmt = (
        select(
            sp.c.attempt_id, sp.c.sequence_id, sp.c.span_id, sp.c.parent_id, sp.c.name, sp.c.status_code,
            sp.c.start_time, sp.c.end_time, sp.c.attributes,
        )
        .where(sp.c.run_id == run_id, sp.c.rollout_id == rollout_id, sp.c.attempt_id == attempt_id)
        .order_by(sp.c.sequence_id, sp.c.start_time, sp.c.id)
    )
    return stmt.limit(limit) if limit else stmt


def span_count_of_attempt(run_id: int, rollout_id: str, attempt_id: str) -> Select[Any]:
    sp = s.spans
    return select(func.count()).where(
        sp.c.run_id == run_id, sp.c.rollout_id == rollout_id, sp.c.attempt_id == attempt_id
    )


# --- spans ------------------------------------------------------------------------------------------------


def iter_span_pages(
    database: Any,
    run_id: int,
    columns: Sequence[str],
    *,
    rollout_id: str | None = None,
    attempt_id: str | None = None,
    name_contains: str | None = None,
    limit: int = 0,
    page_rows: int | None = None,
) -> Iterator[list[dict[str, Any]]]:
    """The run's spans in insertion order, ``page_rows`` at a time, each page its own read transaction.

    Only ``columns`` are read; ``limit`` 0 means all; ``page_rows`` defaults to ``SPAN_PAGE_ROWS``.
    """
    page_rows = page_rows or SPAN_PAGE_ROWS
    sp = s.spans
    selected = [sp.c.id, *(sp.c[c] for c in columns)]
    after: int | None = None
    remaining = limit or None
    while remaining is None or remaining > 0:
        size = page_rows if remaining is None else min(page_rows, remaining)

        def unit(ctx: Any, after: int | None = after, size: int = size) -> list[tuple[Any, ...]]:
            stmt = select(*selected).where(sp.c.run_id == run_id)
            if rollout_id:
                stmt = stmt.where(sp.c.rollout_id == rollout_id)
            if attempt_id:
                stmt = stmt.where(sp.c.attempt_id == attempt_id)
            if name_contains:
                stmt = stmt.where(d.contains(ctx, sp.c.name, name_contains))
            if after is not None:
                stmt = stmt.where(sp.c.id > after)
            return [tuple(row) for row in ctx.conn.execute(stmt.order_by(sp.c.id).limit(size))]

        rows = database.read(unit)
        if rows:
            yield [dict(zip(columns, row[1:], strict=True)) for row in rows]
        if len(rows) < size:
            return
        after = rows[-1][0]
        if remaining is not None:
            remaining -= len(rows)


# --- gc ---------------------------------------------------------------------------------------------------


def count_spans_before(run_ids: Sequence[int], cutoff: float) -> Select[Any]:
    sp = s.spans
    return select(func.count()).select_from(sp).where(sp.c.run_id.in_(run_ids), sp.c.start_time < cutoff)


def delete_spans_before(ctx: Any, run_ids: Sequence[int], cutoff: float, batch: int) -> int:
    """Delete up to ``batch`` of the oldest-inserted spans that started before ``cutoff``; the count."""
    sp = s.spans
    ids = [
        row[0]
        for row in ctx.conn.execute(
            select(sp.c.id).where(sp.c.run_id.in_(run_ids), sp.c.start_time < cutoff).order_by(sp.c.id).limit(batch)
        )
    ]
    if not ids:
        return 0
    ctx.conn.execute(delete(sp).where(sp.c.id.in_(ids)))
    return len(ids)
