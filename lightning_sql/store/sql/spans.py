"""Units of work for spans and span sequence counters (contract §2.9, §2.10).

Lock order (PostgreSQL): the rollout rows first (in ``rollout_id`` order), then the attempt rows,
then the span inserts; the heartbeat written last only touches rows already locked.  Spans of one
attempt take the same steps as one statement there (``dialect.add_spans_in_one_statement``).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Sequence
from typing import Any

from sqlalchemy import Integer, Text, and_, bindparam, case, func, select, tuple_, update
from sqlalchemy.dialects.postgresql import ARRAY

from lightning_sql.store.sql import dialect as d
from lightning_sql.store.sql import filters as f
from lightning_sql.store.sql import schema as s
from lightning_sql.store.sql.engine import Planned, UnitContext
from lightning_sql.store.sql.rows import deferred_span_from_row, span_read_columns
from lightning_sql.store.sql.statements import cached
from lightning_sql.types import QUEUED_STATUSES, PaginatedResult, Span, check_text
from lightning_sql.types.jsonvalue import encode_json

logger = logging.getLogger("lightning_sql.store")

R = s.rollouts
A = s.attempts
S = s.spans


_LOCKED_ROLLOUT_COLUMNS = (R.c.rollout_id, R.c.status, R.c.span_seq)


def _lock_rollouts(ctx: UnitContext, run_id: int, rollout_ids: Sequence[str]) -> dict[str, Any]:
    ids = sorted(set(rollout_ids))
    stmt = cached(
        ("span_lock_rollouts", ctx.dialect),
        lambda: d.for_update(
            ctx,
            select(R.c.rollout_id, R.c.status, R.c.span_seq, R.c.attempt_count)
            .where(R.c.run_id == bindparam("s_run_id"), R.c.rollout_id.in_(bindparam("s_ids", expanding=True)))
            .order_by(R.c.rollout_id),
        ),
    )
    rows = ctx.execute(stmt, {"s_run_id": run_id, "s_ids": ids}).all()
    return {row.rollout_id: row for row in rows}


def _set_span_seq(ctx: UnitContext, run_id: int, rollout_id: str, value: int) -> None:
    stmt = cached(
        "span_set_counter",
        lambda: update(R)
        .where(R.c.run_id == bindparam("s_run_id"), R.c.rollout_id == bindparam("s_rollout_id"))
        .values(span_seq=bindparam("s_value")),
    )
    ctx.execute(stmt, {"s_run_id": run_id, "s_rollout_id": rollout_id, "s_value": value})


def _counts(pairs: Sequence[tuple[str, str]], into: dict[str, int] | None = None) -> dict[str, int]:
    """How many ids each rollout of ``pairs`` takes (added to ``into``), in order of first use."""
    counts = {} if into is None else into
    for rid, _aid in pairs:
        counts[rid] = counts.get(rid, 0) + 1
    return counts


def _counts_of_calls(calls: Sequence[tuple[float, Sequence[tuple[str, str]]]]) -> dict[str, int]:
    """How many ids each rollout takes over all the calls' pairs, in order of first use."""
    counts: dict[str, int] = {}
    for _now, pairs in calls:
        _counts(pairs, counts)
    return counts


def _bump_one(run_id: int, rollout_id: str, count: int) -> tuple[Any, dict[str, Any]]:
    """The statement (and its parameters) that moves one rollout's span counter by ``count``."""
    params = {"s_run_id": run_id, "s_rollout_id": rollout_id, "s_count": count}
    return cached("span_bump_counter", _bump_counter), params


def _bump_counter() -> Any:
    return (
        update(R)
        .where(R.c.run_id == bindparam("s_run_id"), R.c.rollout_id == bindparam("s_rollout_id"))
        .values(span_seq=R.c.span_seq + bindparam("s_count"))
        .returning(R.c.span_seq)
    )


def _ids_of_one_rollout(rid: str, count: int, end: int | None) -> list[int]:
    """The ``count`` ids of one rollout whose counter the bump moved to ``end`` (None: not found)."""
    if end is None:
        raise ValueError(f"Rollout {rid} not found")
    return list(range(int(end) - count + 1, int(end) + 1))


def reserve_sequence_ids(ctx: UnitContext, run_id: int, pairs: Sequence[tuple[str, str]]) -> list[int]:
    """Reserve one sequence id per (rollout, attempt) pair, handed out in input order.

    Pairs of one rollout (the tracer's case) take ONE statement, atomic on its own (so PostgreSQL
    may run this unit without a transaction: see ``SqlLightningStore.get_many_span_sequence_ids``);
    several rollouts lock them all first, so that an unknown one changes nothing."""
    if not pairs:
        return []
    counts = _counts(pairs)
    if len(counts) == 1:
        ((rid, count),) = counts.items()
        end = ctx.execute(*_bump_one(run_id, rid, count)).scalar_one_or_none()
        return _ids_of_one_rollout(rid, count, end)
    locked = _lock_rollouts(ctx, run_id, list(counts))
    for rid in counts:
        if rid not in locked:
            raise ValueError(f"Rollout {rid} not found")
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


def reserve_sequence_ids_batch(
    ctx: UnitContext, run_id: int, calls: Sequence[tuple[float, Sequence[tuple[str, str]]]]
) -> list[list[int]]:
    """``reserve_sequence_ids`` for several calls ``(now, pairs)`` at once, each call's ids: what
    the calls get run one after the other in that order (a rollout's ids in call order, then pair
    order), from ONE statement that moves every rollout's counter by its total, or none when one
    of them is unknown (atomic on its own: PostgreSQL runs a batch without a transaction).  An
    unknown rollout fails the whole batch (whose calls then run alone: only its own call fails).
    One call: ``reserve_sequence_ids``."""
    if len(calls) == 1:
        return [reserve_sequence_ids(ctx, run_id, pairs) for _now, pairs in calls]
    counts = _counts_of_calls(calls)
    return _ids_of_calls(calls, counts, _bump_counters(ctx, run_id, counts))


def _ids_of_calls(
    calls: Sequence[tuple[float, Sequence[tuple[str, str]]]], counts: dict[str, int], ends: dict[str, int]
) -> list[list[int]]:
    """Each call's ids, from the counters' new values ``ends`` (the rollouts' ``counts`` added)."""
    next_value: dict[str, int] = {}
    for rid, count in counts.items():
        if rid not in ends:
            raise ValueError(f"Rollout {rid} not found")
        next_value[rid] = ends[rid] - count + 1
    out = []
    for _now, pairs in calls:
        ids = []
        for rid, _aid in pairs:
            ids.append(next_value[rid])
            next_value[rid] += 1
        out.append(ids)
    return out


def plan_sequence_ids(
    run_id: int, calls: Sequence[tuple[float, Sequence[tuple[str, str]]]]
) -> Planned[list[int]] | None:
    """PostgreSQL: ``reserve_sequence_ids_batch`` as the one statement it runs (``BatchUnit.plan``),
    or None for one call over several rollouts (it locks them, then writes)."""
    if len(calls) == 1:
        counts = _counts(calls[0][1])
        if len(counts) != 1:
            return None
        ((rid, count),) = counts.items()
        stmt, params = _bump_one(run_id, rid, count)
        return Planned(
            stmt, params, lambda rows, _events: [_ids_of_one_rollout(rid, count, rows[0][0] if rows else None)]
        )
    counts = _counts_of_calls(calls)
    stmt, params = _bump_counters_statement(run_id, counts, "postgresql")
    return Planned(
        stmt, params, lambda rows, _events: _ids_of_calls(calls, counts, {row[0]: int(row[1]) for row in rows})
    )


def _bump_counters_statement(run_id: int, counts: dict[str, int], dialect: str) -> tuple[Any, dict[str, Any]]:
    params: dict[str, Any] = {"s_run_id": run_id, "s_n": len(counts)}
    if dialect == "postgresql":
        params.update(s_ids=list(counts), s_counts=list(counts.values()))
        return cached(("span_bump_counters", "postgresql"), _bump_counters_postgres), params
    params["s_counts"] = encode_json(counts, "counts")
    return cached(("span_bump_counters", "sqlite"), _bump_counters_sqlite), params


def _bump_counters(ctx: UnitContext, run_id: int, counts: dict[str, int]) -> dict[str, int]:
    """Add ``counts[rid]`` to each rollout's span counter in one statement, only when every one of
    them exists: their new values, or {} (nothing changed) when one is unknown."""
    stmt, params = _bump_counters_statement(run_id, counts, ctx.dialect)
    return {row[0]: int(row[1]) for row in ctx.execute(stmt, params)}


def _bump_counters_postgres() -> Any:
    """``_bump_from`` on PostgreSQL, with the rollouts found through a MATERIALIZED CTE of their
    keys ("Keyed UPDATEs" in ``dialect``'s docstring): with ``run_id = :run_id`` on the target, the
    planner scanned the run's rollouts for every batch of a run it believed small."""
    given = (
        func.unnest(bindparam("s_ids", type_=ARRAY(s.IdText())), bindparam("s_counts", type_=ARRAY(Integer)))
        .table_valued("rid", "n")
        .render_derived(name="given")
    )
    keys = (
        select(bindparam("s_run_id", type_=Integer).label("run_id"), given.c.rid, given.c.n)
        .limit(bindparam("s_n", type_=Integer))  # every key: "Keyed UPDATEs" again
        .cte("keys")
        .prefix_with("MATERIALIZED")
    )
    found = R.alias("found")
    all_found = (
        select(func.count())
        .select_from(keys.join(found, and_(found.c.run_id == keys.c.run_id, found.c.rollout_id == keys.c.rid)))
        .scalar_subquery()
    )
    return (
        update(R)
        .where(R.c.run_id == keys.c.run_id, R.c.rollout_id == keys.c.rid, all_found == bindparam("s_n"))
        .values(span_seq=R.c.span_seq + keys.c.n)
        .returning(R.c.rollout_id, R.c.span_seq)
    )


def _bump_counters_sqlite() -> Any:
    def amounts(name: str) -> Any:
        table = func.json_each(bindparam("s_counts", type_=Text)).table_valued("key", "value").alias(name)
        return table, table.c.key, table.c.value

    return _bump_from(amounts)


def _bump_from(amounts: Any) -> Any:
    """UPDATE every rollout that ``amounts(name)`` (a table of rollout ids and amounts: ``(table,
    id column, amount column)``) names by its amount, when all of them exist.  Each rollout is found
    by its key (``IN``, and its amount by a correlated look-up).  SQLite's form: on PostgreSQL the
    planner may read the run for it (``_bump_counters_postgres``)."""
    _moving, moving_id, _amount = amounts("moving")
    _by, by_id, by_amount = amounts("amount")
    _wanted, wanted_id, _n = amounts("wanted")
    found = R.alias("found")
    all_found = (
        select(func.count())
        .select_from(found)
        .where(found.c.run_id == bindparam("s_run_id"), found.c.rollout_id.in_(select(wanted_id)))
        .scalar_subquery()
    )
    amount = select(by_amount).where(by_id == R.c.rollout_id).scalar_subquery()
    return (
        update(R)
        .where(
            R.c.run_id == bindparam("s_run_id"),
            R.c.rollout_id.in_(select(moving_id)),
            all_found == bindparam("s_n"),
        )
        .values(span_seq=R.c.span_seq + amount)
        .returning(R.c.rollout_id, R.c.span_seq)
    )


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
    if not allocate and d.ingests_spans_in_one_statement(ctx) and one_group(spans):
        return _add_one_group(ctx, run_id, now, spans, rows)
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
    inserted_keys = d.insert_new_spans(ctx, run_id, unique_rows)
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


# Adds of spans of one attempt each (``add_span``, ``add_many_spans``) issued in the same turn of a
# loop run as one call (``add_spans_batch``, ADR 0005 decisions 10 and 13); "0" turns it off (each
# call its own unit: on PostgreSQL one statement).
SPAN_BATCHES = os.environ.get("LIGHTNING_SQL_SPAN_BATCHES", "1") != "0"
# The calls of one batch of span adds on the I/O loop (``BatchUnit.max_batch``): the calls of a turn
# past it form another batch, which PostgreSQL runs beside the first on another connection.
BATCH_MAX_SPANS = 64


def add_spans_batch(
    ctx: UnitContext, run_id: int, calls: Sequence[tuple[float, tuple[Sequence[Span], Sequence[dict[str, Any]]]]]
) -> list[list[Span]]:
    """``add_spans`` for several calls ``(now, (spans, rows))`` at once, the spans of each call of
    one (rollout, attempt) (``one_group``): each call's inserted spans, what the calls run one after
    the other in that order return (a span key repeated across calls is the first one's; the later
    ones are duplicates).  On PostgreSQL ONE statement for them all
    (``dialect.add_spans_of_many_attempts_in_one_statement``), atomic on its own; it changes nothing
    when one of the rollouts or attempts is missing, and the batch then raises, so that its calls run
    alone and only the faulty one fails.  Elsewhere the calls one after the other."""
    _stamp_run(run_id, calls)
    if len(calls) == 1 or not d.ingests_spans_in_one_statement(ctx):
        return [add_spans(ctx, run_id, now, spans, rows) for now, (spans, rows) in calls]
    now, unique_rows = _batch_rows(calls)
    outcome = d.add_spans_of_many_attempts_in_one_statement(ctx, run_id, now, unique_rows)
    return _inserted_of_calls(calls, outcome)


def plan_spans(
    run_id: int, calls: Sequence[tuple[float, tuple[Sequence[Span], Sequence[dict[str, Any]]]]]
) -> Planned[list[Span]] | None:
    """PostgreSQL: ``add_spans_batch`` as the one statement it runs (``BatchUnit.plan``): a call
    alone, ``_add_one_group``'s."""
    _stamp_run(run_id, calls)
    if len(calls) == 1:
        ((now, (spans, rows)),) = calls
        first = spans[0]
        stmt, params = d.span_ingest_statement(run_id, now, first.rollout_id, first.attempt_id, _group_rows(spans, rows))
        return Planned(stmt, params, lambda result, _events: [_inserted_of_group(spans, d.span_ingest_outcome(result))])
    now, unique_rows = _batch_rows(calls)
    stmt, params = d.span_ingest_many_statement(run_id, now, unique_rows)
    return Planned(stmt, params, lambda result, _events: _inserted_of_calls(calls, d.span_ingest_many_outcome(result)))


def _stamp_run(run_id: int, calls: Sequence[tuple[float, tuple[Sequence[Span], Sequence[dict[str, Any]]]]]) -> None:
    """Set the run id of the calls' rows (encoded before the run was known)."""
    for _now, (_spans, rows) in calls:
        if rows[0]["run_id"] != run_id:
            for row in rows:
                row["run_id"] = run_id


def _batch_rows(
    calls: Sequence[tuple[float, tuple[Sequence[Span], Sequence[dict[str, Any]]]]],
) -> tuple[float, list[dict[str, Any]]]:
    """The batch's heartbeat time (its latest call's) and its rows, a span key's first only."""
    unique_rows: list[dict[str, Any]] = []
    seen: set[tuple[str, str, str]] = set()
    for _now, (spans, rows) in calls:
        for span, row in zip(spans, rows, strict=True):
            key = (span.rollout_id, span.attempt_id, span.span_id)
            if key not in seen:
                seen.add(key)
                unique_rows.append(row)
    return max(now for now, _args in calls), unique_rows


def _inserted_of_calls(
    calls: Sequence[tuple[float, tuple[Sequence[Span], Sequence[dict[str, Any]]]]],
    outcome: tuple[bool, set[tuple[str, str, str]]],
) -> list[list[Span]]:
    """Each call's inserted spans, from the batch statement's outcome (found, keys inserted)."""
    found, inserted_keys = outcome
    if not found:
        raise ValueError("a rollout or attempt of the batch is missing: its calls run alone")
    out: list[list[Span]] = []
    for _now, (spans, _rows) in calls:
        inserted: list[Span] = []
        for span in spans:
            key = (span.rollout_id, span.attempt_id, span.span_id)
            if key in inserted_keys:
                inserted_keys.discard(key)  # a later repeat of the key is a duplicate
                inserted.append(span)
            else:
                _log_duplicate(span)
        out.append(inserted)
    return out


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
    for rid, _aid in groups:
        if rid not in locked:
            raise ValueError(f"Rollout {rid} not found")
    attempt_rows = {(r.rollout_id, r.attempt_id): r for r in _lock_attempts(ctx, run_id, sorted(groups))}
    for rid, aid in groups:
        if (rid, aid) not in attempt_rows:
            raise ValueError(f"Attempt {aid} not found for rollout {rid}")
    return locked, attempt_rows


def one_group(spans: Sequence[Span]) -> bool:
    """All spans belong to one (rollout, attempt): PostgreSQL ingests them in one statement."""
    first = spans[0]
    return all(span.rollout_id == first.rollout_id and span.attempt_id == first.attempt_id for span in spans)


def _add_one_group(
    ctx: UnitContext, run_id: int, now: float, spans: Sequence[Span], rows: Sequence[dict[str, Any]]
) -> list[Span]:
    """``add_spans`` for one (rollout, attempt) as one statement (``dialect.add_spans_in_one_statement``,
    PostgreSQL).  Same outcome as the plain steps: the same errors (and nothing written), the same
    duplicates skipped and logged, the inserted spans in input order."""
    first = spans[0]
    outcome = d.add_spans_in_one_statement(
        ctx, run_id, now, first.rollout_id, first.attempt_id, _group_rows(spans, rows)
    )
    return _inserted_of_group(spans, outcome)


def _group_rows(spans: Sequence[Span], rows: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """The rows of one group's spans, a span id's first only (repeats in a batch are duplicates too)."""
    unique_rows: list[dict[str, Any]] = []
    seen: set[str] = set()
    for span, row in zip(spans, rows, strict=True):
        if span.span_id not in seen:
            seen.add(span.span_id)
            unique_rows.append(row)
    return unique_rows


def _inserted_of_group(spans: Sequence[Span], outcome: tuple[bool, bool, set[str]]) -> list[Span]:
    """One group's inserted spans in input order, from its statement's outcome (rollout found,
    attempt found, the span ids inserted); raises for a missing rollout or attempt."""
    rollout_found, attempt_found, inserted_ids = outcome
    first = spans[0]
    if not rollout_found:
        raise ValueError(f"Rollout {first.rollout_id} not found")
    if not attempt_found:
        raise ValueError(f"Attempt {first.attempt_id} not found for rollout {first.rollout_id}")
    inserted: list[Span] = []
    for span in spans:
        if span.span_id in inserted_ids:
            inserted_ids.discard(span.span_id)  # a later repeat of the id is a duplicate
            inserted.append(span)
        else:
            _log_duplicate(span)
    return inserted


def _log_duplicate(span: Span) -> None:
    logger.error(
        "Duplicated span added for rollout=%s, attempt=%s, span=%s. Skipping.",
        span.rollout_id,
        span.attempt_id,
        span.span_id,
    )


def _lock_attempts(ctx: UnitContext, run_id: int, pairs: list[tuple[str, str]]) -> list[Any]:
    if len(pairs) == 1:
        stmt = cached(
            ("span_lock_attempt", ctx.dialect),
            lambda: d.for_update(
                ctx,
                select(A.c.rollout_id, A.c.attempt_id, A.c.sequence_id, A.c.status).where(
                    A.c.run_id == bindparam("s_run_id"),
                    A.c.rollout_id == bindparam("s_rollout_id"),
                    A.c.attempt_id == bindparam("s_attempt_id"),
                ),
            ),
        )
        ((rid, aid),) = pairs
        return list(ctx.execute(stmt, {"s_run_id": run_id, "s_rollout_id": rid, "s_attempt_id": aid}))
    return list(
        ctx.execute(
            d.for_update(
                ctx,
                select(A.c.rollout_id, A.c.attempt_id, A.c.sequence_id, A.c.status)
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
        promote = cached(
            "span_promote",
            lambda: update(R)
            .where(R.c.run_id == bindparam("s_run_id"), R.c.rollout_id == bindparam("s_rollout_id"))
            .values(status="running", queue_seq=None),
        )
        ctx.execute(promote, {"s_run_id": run_id, "s_rollout_id": rid})


# --- reads --------------------------------------------------------------------------------------

SPAN_FILTER_FIELDS = ("trace_id", "span_id", "parent_id", "name")


def _shape(value: str | None) -> bool | None:
    """None: no filter; True: a bound value; False: a value that cannot be stored (matches nothing)."""
    if value is None:
        return None
    try:
        check_text(value, "value")
    except (TypeError, ValueError):
        return False
    return True


def _span_query(ctx: Any, shape: tuple[Any, ...]) -> tuple[Any, Any]:
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
    columns = span_read_columns(ctx.dialect)  # the JSON columns as text, decoded by each span on first use
    if has_offset and ctx.dialect == "postgresql":
        # PostgreSQL computes the output columns (JSONB as text, out-of-line values fetched) of every
        # row an OFFSET skips: the page's ids come first, from the spans' index, then only its rows
        # (a page of 10 at offset 5,000 of a 10,000-span trace: 24 ms -> 1.2 ms on the server;
        # docs/performance.md, twenty-sixth pass).  SQLite skips a row before reading its columns.
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
    page, count, params = span_page(
        ctx.dialect, run_id, rollout_id, attempt_id, exact, contains, filter_logic, limit, offset, sort_by, sort_order
    )
    rows, total = f.fetch_page(ctx, page, count, params, limit, offset)
    return page_of_spans(rows, limit, offset, total)


def page_of_spans(rows: Sequence[Any], limit: int, offset: int, total: int) -> PaginatedResult[Span]:
    """``query_spans``' result from the page statement's rows (each span decodes on first use)."""
    return PaginatedResult(items=[deferred_span_from_row(r) for r in rows], limit=limit, offset=offset, total=total)


class _Dialect:
    """What the statement builders read of a unit's context: its dialect's name."""

    __slots__ = ("dialect",)

    def __init__(self, dialect: str) -> None:
        self.dialect = dialect


def span_page(
    dialect: str,
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
) -> tuple[Any, Any, dict[str, Any]]:
    """``query_spans``' page and count statements, prebuilt per query shape, and the parameters of
    this call (``q_limit`` / ``q_offset`` are ``filters.fetch_page``'s to bind).  Without pagination
    the page statement alone answers the call (the total is its number of rows)."""
    if attempt_id is None or attempt_id == "latest":
        attempt_mode: Any = attempt_id
    else:
        attempt_mode = bool(_shape(attempt_id))
    exact_shape = tuple(_shape(exact[name]) for name in SPAN_FILTER_FIELDS)
    contains_shape = tuple(_shape(contains[name]) for name in SPAN_FILTER_FIELDS)
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
    page, count = cached(("query_spans", dialect, shape), lambda: _span_query(_Dialect(dialect), shape))
    params: dict[str, Any] = {"q_run_id": run_id, "q_rollout_id": rollout_id}
    if attempt_mode is True:
        params["q_attempt_id"] = attempt_id
    for name, ok in zip(SPAN_FILTER_FIELDS, exact_shape, strict=True):
        if ok:
            params[f"q_{name}"] = exact[name]
    for name, ok in zip(SPAN_FILTER_FIELDS, contains_shape, strict=True):
        if ok:
            params[f"q_{name}_contains"] = contains[name]
    return page, count, params
