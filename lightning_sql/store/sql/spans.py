"""Units of work for spans and span sequence counters (docs/store-contract.md §2.9, §2.10).

Lock order (PostgreSQL): the rollout rows first (in ``rollout_id`` order), then the attempt rows,
then the span inserts; the heartbeat written last only touches rows already locked.
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Sequence
from typing import Any

from sqlalchemy import bindparam, case, func, select, tuple_, update

from lightning_sql.store.sql import dialect as d
from lightning_sql.store.sql import filters as f
from lightning_sql.store.sql import schema as s
from lightning_sql.store.sql.executor import UnitContext
from lightning_sql.store.sql.rows import span_from_row
from lightning_sql.store.sql.statements import cached
from lightning_sql.types import QUEUED_STATUSES, PaginatedResult, Span, check_text
from lightning_sql.types.jsonvalue import MAX_ID_BYTES

logger = logging.getLogger("lightning_sql.store")

R = s.rollouts
A = s.attempts
S = s.spans


_LOCKED_ROLLOUT_COLUMNS = (R.c.rollout_id, R.c.status, R.c.span_seq)
_LOCKED_ATTEMPT_COLUMNS = (A.c.rollout_id, A.c.attempt_id, A.c.sequence_id, A.c.status)


def _rollout_update() -> Any:
    """An UPDATE of the rollout row named by ``s_run_id`` and ``s_rollout_id``."""
    return update(R).where(R.c.run_id == bindparam("s_run_id"), R.c.rollout_id == bindparam("s_rollout_id"))


def _lock_rollouts(ctx: UnitContext, run_id: int, rollout_ids: Sequence[str]) -> dict[str, Any]:
    """The rollout rows, locked in ``rollout_id`` order; raises for the first missing one."""
    ids = sorted(set(rollout_ids))
    stmt = cached(
        ("span_lock_rollouts", ctx.dialect),
        lambda: d.for_update(
            ctx,
            select(*_LOCKED_ROLLOUT_COLUMNS, R.c.attempt_count)
            .where(R.c.run_id == bindparam("s_run_id"), R.c.rollout_id.in_(bindparam("s_ids", expanding=True)))
            .order_by(R.c.rollout_id),
        ),
    )
    rows = ctx.execute(stmt, {"s_run_id": run_id, "s_ids": ids}).all()
    locked = {row.rollout_id: row for row in rows}
    for rid in rollout_ids:
        if rid not in locked:
            raise ValueError(f"Rollout {rid} not found")
    return locked


def _set_span_seq(ctx: UnitContext, run_id: int, rollout_id: str, value: int) -> None:
    stmt = cached("span_set_counter", lambda: _rollout_update().values(span_seq=bindparam("s_value")))
    ctx.execute(stmt, {"s_run_id": run_id, "s_rollout_id": rollout_id, "s_value": value})


def _bump_counter() -> Any:
    return _rollout_update().values(span_seq=R.c.span_seq + bindparam("s_count")).returning(R.c.span_seq)


def reserve_sequence_ids(ctx: UnitContext, run_id: int, pairs: Sequence[tuple[str, str]]) -> list[int]:
    """Reserve one sequence id per (rollout, attempt) pair, handed out in input order.

    Pairs of one rollout (the tracer's case) take ONE statement, atomic on its own (so PostgreSQL
    may run this unit without a transaction: see ``SqlLightningStore.get_many_span_sequence_ids``);
    several rollouts lock them all first, so that an unknown one changes nothing."""
    if not pairs:
        return []
    counts = Counter(rid for rid, _aid in pairs)  # in order of first use
    if len(counts) == 1:
        ((rid, count),) = counts.items()
        params = {"s_run_id": run_id, "s_rollout_id": rid, "s_count": count}
        end = ctx.execute(cached("span_bump_counter", _bump_counter), params).scalar_one_or_none()
        if end is None:
            raise ValueError(f"Rollout {rid} not found")
        return list(range(int(end) - count + 1, int(end) + 1))
    locked = _lock_rollouts(ctx, run_id, list(counts))
    next_value: dict[str, int] = {}
    for rid in sorted(counts):
        start = int(locked[rid].span_seq)
        _set_span_seq(ctx, run_id, rid, start + counts[rid])
        next_value[rid] = start + 1
    out = []
    for rid, _aid in pairs:
        out.append(next_value[rid])
        next_value[rid] += 1
    return out


def add_spans(
    ctx: UnitContext,
    run_id: int,
    now: float,
    spans: Sequence[Span],
    rows: Sequence[dict[str, Any]],
    *,
    allocate: bool = False,
) -> list[Span]:
    """Insert spans, skipping duplicates; heartbeat and promote per (rollout, attempt) group.

    With ``allocate`` (a single ``add_otel_span`` without sequence id) the one span's sequence id is
    reserved here, after validation, so a failure consumes no number.
    """
    if not spans:
        return []
    groups: dict[tuple[str, str], list[int]] = {}
    for index, span in enumerate(spans):
        groups.setdefault((span.rollout_id, span.attempt_id), []).append(index)
    locked, attempt_rows = _lock_groups(ctx, run_id, list(groups))

    if allocate:
        (span,) = spans
        seq = int(locked[span.rollout_id].span_seq) + 1
        span.sequence_id = seq
        rows = [dict(rows[0], sequence_id=seq)]

    # Counters: span_seq = max(span_seq, largest sequence id of the batch) per rollout.
    highest: dict[str, int] = {}
    for span in spans:
        highest[span.rollout_id] = max(highest.get(span.rollout_id, 0), span.sequence_id)
    for rid in sorted(highest):
        if highest[rid] > int(locked[rid].span_seq):
            _set_span_seq(ctx, run_id, rid, highest[rid])

    # Repeats inside the batch are duplicates too; keep the first.
    unique_rows: list[dict[str, Any]] = []
    unique_index: list[int] = []
    seen: set[tuple[str, str, str]] = set()
    for index, (span, row) in enumerate(zip(spans, rows, strict=True)):
        key = (span.rollout_id, span.attempt_id, span.span_id)
        if key in seen:
            _log_duplicate(span)
            continue
        seen.add(key)
        unique_rows.append(row)
        unique_index.append(index)
    inserted_keys = d.insert_new_spans(ctx, unique_rows)
    inserted: list[Span] = []
    touched: set[tuple[str, str]] = set()
    for index in unique_index:
        span = spans[index]
        if (span.rollout_id, span.attempt_id, span.span_id) in inserted_keys:
            inserted.append(span)
            touched.add((span.rollout_id, span.attempt_id))
        else:
            _log_duplicate(span)

    for rid, aid in sorted(touched):
        _heartbeat(ctx, run_id, now, rid, aid, locked[rid], attempt_rows[(rid, aid)])
    # Group order (first seen), input order inside a group.
    order = {key: i for i, key in enumerate(groups)}
    inserted.sort(key=lambda sp: order[(sp.rollout_id, sp.attempt_id)])
    return inserted


def _lock_groups(
    ctx: UnitContext, run_id: int, groups: list[tuple[str, str]]
) -> tuple[dict[str, Any], dict[tuple[str, str], Any]]:
    """The rollout rows, then the attempt rows, of the (rollout, attempt) groups, locked in that
    order; raises for the first missing rollout, then for the first missing attempt."""
    if len(groups) == 1:  # the rollout and its attempt in one statement
        ((rid, aid),) = groups
        rollout_row, attempt_row = d.lock_rollout_and_attempt(ctx, run_id, rid, aid, _LOCKED_ROLLOUT_COLUMNS)
        if rollout_row is None:
            raise ValueError(f"Rollout {rid} not found")
        if attempt_row is None:
            raise ValueError(f"Attempt {aid} not found for rollout {rid}")
        return {rid: rollout_row}, {(rid, aid): attempt_row}
    locked = _lock_rollouts(ctx, run_id, [rid for rid, _ in groups])
    attempt_rows = {(r.rollout_id, r.attempt_id): r for r in _lock_attempts(ctx, run_id, sorted(groups))}
    for rid, aid in groups:
        if (rid, aid) not in attempt_rows:
            raise ValueError(f"Attempt {aid} not found for rollout {rid}")
    return locked, attempt_rows


def _log_duplicate(span: Span) -> None:
    logger.error(
        "Duplicated span added for rollout=%s, attempt=%s, span=%s. Skipping.",
        span.rollout_id,
        span.attempt_id,
        span.span_id,
    )


def _lock_attempts(ctx: UnitContext, run_id: int, pairs: list[tuple[str, str]]) -> list[Any]:
    """The attempt rows of several (rollout, attempt) pairs, locked in key order (one pair takes
    ``dialect.lock_rollout_and_attempt`` with its rollout instead)."""
    return list(
        ctx.execute(
            d.for_update(
                ctx,
                select(*_LOCKED_ATTEMPT_COLUMNS)
                .where(A.c.run_id == run_id, tuple_(A.c.rollout_id, A.c.attempt_id).in_(pairs))
                .order_by(A.c.rollout_id, A.c.attempt_id),
            )
        )
    )


def _heartbeat(ctx: UnitContext, run_id: int, now: float, rid: str, aid: str, rollout: Any, attempt: Any) -> None:
    beat = cached(
        "span_heartbeat",
        lambda: update(A)
        .where(
            A.c.run_id == bindparam("s_run_id"),
            A.c.rollout_id == bindparam("s_rollout_id"),
            A.c.attempt_id == bindparam("s_attempt_id"),
        )
        .values(
            last_heartbeat_time=bindparam("s_now"),
            status=case((A.c.status.in_(("preparing", "unresponsive")), "running"), else_=A.c.status),
        ),
    )
    ctx.execute(beat, {"s_run_id": run_id, "s_rollout_id": rid, "s_attempt_id": aid, "s_now": now})
    if attempt.sequence_id == rollout.attempt_count and rollout.status in ("preparing", *QUEUED_STATUSES):
        promote = cached("span_promote", lambda: _rollout_update().values(status="running", queue_seq=None))
        ctx.execute(promote, {"s_run_id": run_id, "s_rollout_id": rid})


# --- reads --------------------------------------------------------------------------------------

SPAN_FILTER_FIELDS = ("trace_id", "span_id", "parent_id", "name")


def _shape(value: str | None, *, max_bytes: int | None = MAX_ID_BYTES) -> bool | None:
    """None: no filter; True: a bound value; False: a value that cannot be stored (matches nothing).
    Span names have no length limit (they are no index key): ``max_bytes=None`` for them."""
    if value is None:
        return None
    try:
        check_text(value, "value", max_bytes=max_bytes)
    except (TypeError, ValueError):
        return False
    return True


def _limit(field: str) -> int | None:
    return None if field == "name" else MAX_ID_BYTES


def _span_query(ctx: UnitContext, shape: tuple[Any, ...]) -> tuple[Any, Any]:
    """(page statement, count statement) for one query shape, with ``q_*`` placeholders."""
    rid_ok, attempt_mode, exact, contains, logic, sort_by, sort_order, has_limit, has_offset = shape
    run_id: Any = bindparam("q_run_id")
    rollout_id: Any = bindparam("q_rollout_id")
    must = [S.c.run_id == run_id, S.c.rollout_id == rollout_id if rid_ok else f.false()]
    if attempt_mode == "latest":
        latest = (
            select(A.c.attempt_id)
            .where(A.c.run_id == run_id, A.c.rollout_id == rollout_id)
            .order_by(A.c.sequence_id.desc())
            .limit(1)
            .scalar_subquery()
        )
        must.append(S.c.attempt_id == latest)
    elif attempt_mode is not None:
        must.append(S.c.attempt_id == bindparam("q_attempt_id") if attempt_mode else f.false())
    conditions = []
    for name, ok in zip(SPAN_FILTER_FIELDS, exact, strict=True):
        if ok is not None:
            conditions.append(S.c[name] == bindparam(f"q_{name}") if ok else f.false())
    for name, ok in zip(SPAN_FILTER_FIELDS, contains, strict=True):
        if ok is not None:
            conditions.append(d.contains(ctx, S.c[name], bindparam(f"q_{name}_contains")) if ok else f.false())
    where = [*must, f.pool(conditions, logic)]
    order = f.order_by(f.SPAN_SORT, sort_by, sort_order)
    columns = [c for c in S.c if c.name != "run_id"]
    if has_offset and ctx.dialect == "postgresql":
        # PostgreSQL computes the output columns (JSONB as text, out-of-line values fetched) of every
        # row an OFFSET skips: the page's ids come first, from the spans' index, then only its rows.
        # SQLite skips a row before reading its columns.
        ids = select(S.c.id).where(*where).order_by(*order).offset(bindparam("q_offset")).correlate(None)
        if has_limit:
            ids = ids.limit(bindparam("q_limit"))
        page = select(*columns).where(S.c.id.in_(ids)).order_by(*order)
    else:
        page = select(*columns).where(*where).order_by(*order)
        if has_limit:
            page = page.limit(bindparam("q_limit"))
        if has_offset:
            page = page.offset(bindparam("q_offset"))
    count = select(func.count()).select_from(S).where(*where)
    return page, count


def query_spans(
    ctx: UnitContext,
    run_id: int,
    rollout_id: str,
    attempt_id: str | None,
    exact: dict[str, str | None],
    contains: dict[str, str | None],
    filter_logic: str,
    limit: int,
    offset: int,
    sort_by: str | None,
    sort_order: str,
) -> PaginatedResult[Span]:
    """One page of a rollout's spans and the number of matches, through a statement prebuilt per
    query shape (which filters are present, attempt mode, sort, pagination)."""
    if attempt_id is None or attempt_id == "latest":
        attempt_mode: Any = attempt_id
    else:
        attempt_mode = bool(_shape(attempt_id))
    exact_shape = tuple(_shape(exact[name], max_bytes=_limit(name)) for name in SPAN_FILTER_FIELDS)
    contains_shape = tuple(_shape(contains[name], max_bytes=_limit(name)) for name in SPAN_FILTER_FIELDS)
    shape = (
        bool(_shape(rollout_id)),
        attempt_mode,
        exact_shape,
        contains_shape,
        filter_logic,
        sort_by,
        sort_order,
        limit != -1,
        offset != 0,
    )
    page, count = cached(("query_spans", ctx.dialect, shape), lambda: _span_query(ctx, shape))
    params: dict[str, Any] = {"q_run_id": run_id, "q_rollout_id": rollout_id}
    if attempt_mode is True:
        params["q_attempt_id"] = attempt_id
    for name, ok in zip(SPAN_FILTER_FIELDS, exact_shape, strict=True):
        if ok:
            params[f"q_{name}"] = exact[name]
    for name, ok in zip(SPAN_FILTER_FIELDS, contains_shape, strict=True):
        if ok:
            params[f"q_{name}_contains"] = contains[name]
    rows, total = f.fetch_page(ctx, page, count, params, limit, offset)
    return PaginatedResult(items=[span_from_row(r) for r in rows], limit=limit, offset=offset, total=total)
