"""The ONLY place where SQLite and PostgreSQL differ: upserts, row locks, positions, substring tests.

Every other module builds dialect-neutral SQLAlchemy Core and asks this module for the pieces that
cannot be neutral.

Keyed UPDATEs on PostgreSQL.  A statement that updates several rows it names by key joins the
target to a MATERIALIZED CTE carrying the whole key, ``run_id`` included (``target.run_id =
keys.run_id AND target.rollout_id = keys.rollout_id``), never to ``target.run_id = :run_id`` plus a
join on the id alone.  With the constant, the planner may read the run's rows through any index
that starts with ``run_id`` and filter them, and it takes that plan whenever it believes the run
small: always for a new run in a table analysed before the run existed, and for every run while a
table has no statistics (``run_id`` is never sampled, migration 0003: it assumes 0.5% of the
table).  Through the CTE it sees no condition on the target of its own: its only choices are a
look-up per key or a scan of the whole table, which it costs by the table's real size.  The CTE of
the keys ends in ``LIMIT :n``, ``n`` being the number of keys it holds (so it drops none): a generic
plan cannot know the length of an array parameter and counts on 10 keys, for which a scan of a
table of a few thousand rows looks cheaper than the look-ups; with the LIMIT it counts on one.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass
from typing import Any

from sqlalchemy import (
    BigInteger,
    Boolean,
    ColumnElement,
    Float,
    Integer,
    Select,
    Table,
    Text,
    and_,
    bindparam,
    case,
    cast,
    exists,
    func,
    literal,
    or_,
    select,
    true,
    tuple_,
    union_all,
    update,
)
from sqlalchemy import (
    insert as core_insert,
)
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.dialects.postgresql import ARRAY, JSONB, array_agg

from lightning_sql.store.sql import schema as s
from lightning_sql.store.sql.engine import EncodedJson, UnitContext
from lightning_sql.store.sql.fastexec import make_row_class
from lightning_sql.store.sql.rows import SPAN_JSON_FIELDS
from lightning_sql.store.sql.statements import cached, prebuilt
from lightning_sql.types import FINISHED_STATUSES, QUEUED_STATUSES


def insert(ctx: UnitContext | str, table: Table) -> Any:
    """An INSERT that supports ``on_conflict_do_nothing`` / ``on_conflict_do_update`` on both dialects."""
    dialect = ctx if isinstance(ctx, str) else ctx.dialect
    if dialect == "postgresql":
        return postgresql.insert(table)
    return sqlite.insert(table)


def next_create_seq(dialect: str, table: Table, run_id: Any) -> Any:
    """An expression giving a fresh insertion position for one new row of ``table`` in a prebuilt
    statement: the position sequence on PostgreSQL; on SQLite (writers serialised) the run's
    highest ``create_seq`` + 1, an index lookup."""
    if dialect == "postgresql":
        return s.position_seq.next_value()
    return (
        select(func.coalesce(func.max(table.c.create_seq), 0) + 1).where(table.c.run_id == run_id).scalar_subquery()
    )


def for_update(ctx: UnitContext, stmt: Select[Any], *, skip_locked: bool = False) -> Select[Any]:
    """Lock the selected rows on PostgreSQL; SQLite's ``BEGIN IMMEDIATE`` already serialises writers."""
    if ctx.dialect == "postgresql":
        return stmt.with_for_update(skip_locked=skip_locked)
    return stmt


def contains(ctx: UnitContext, column: Any, needle: Any) -> ColumnElement[bool]:
    """Case-sensitive substring test with no LIKE metacharacters (contract §2.17)."""
    if ctx.dialect == "postgresql":
        return func.strpos(column, needle) > 0
    return func.instr(column, needle) > 0


def allocate_positions(ctx: UnitContext, run_id: int, count: int) -> list[int]:
    """``count`` increasing positions (create/touch/queue order) for the run, inside the unit.

    PostgreSQL draws them from one database-wide sequence (no lock on a per-run row, so concurrent
    writers never queue behind each other); SQLite bumps ``runs.seq`` (writers are serialised
    anyway).  Either way every run sees strictly increasing values.
    """
    if count <= 0:
        return []
    if ctx.dialect == "postgresql":
        rows = ctx.execute(
            select(s.position_seq.next_value()).select_from(func.generate_series(1, count))
        ).scalars()
        return sorted(int(v) for v in rows)
    end = ctx.execute(
        update(s.runs).where(s.runs.c.run_id == run_id).values(seq=s.runs.c.seq + count).returning(s.runs.c.seq)
    ).scalar_one()
    return list(range(int(end) - count + 1, int(end) + 1))


def server_epoch(ctx: UnitContext) -> Any:
    """The database server's clock in epoch seconds (only for measuring the clock offset, §0.2)."""
    return select(func.extract("epoch", func.clock_timestamp()))


# Rollout columns the one-statement enqueue binds as arrays, one element per new rollout (the run,
# the status and the times are the same for every row).
_ENQUEUE_ARRAY_COLUMNS: tuple[tuple[str, Any], ...] = (
    ("rollout_id", Text),
    ("input", Text),
    ("mode", Text),
    ("resources_id", Text),
    ("resources_version", Integer),
    ("timeout_seconds", postgresql.DOUBLE_PRECISION),
    ("unresponsive_seconds", postgresql.DOUBLE_PRECISION),
    ("max_attempts", Integer),
    ("retry_condition", Text),
    ("metadata", Text),
    ("idempotency_key", Text),
    ("queue_seq", postgresql.BIGINT),
)
_ENQUEUE_JSON_COLUMNS = frozenset({"input", "retry_condition", "metadata"})


def inserts_rollouts_in_one_statement(ctx: UnitContext) -> bool:
    """New rollouts are one INSERT of arrays (``insert_rollouts_in_one_statement``): PostgreSQL,
    where the row-by-row form (an INSERT ... RETURNING per row) costs a round trip per rollout."""
    return ctx.dialect == "postgresql"


def _rollout_insert_statement() -> Any:
    R = s.rollouts
    given = (
        func.unnest(*(bindparam(f"ri_{name}", type_=ARRAY(type_)) for name, type_ in _ENQUEUE_ARRAY_COLUMNS))
        .table_valued(*(name for name, _ in _ENQUEUE_ARRAY_COLUMNS))
        .render_derived(name="given")
    )
    values = [
        cast(given.c[name], JSONB) if name in _ENQUEUE_JSON_COLUMNS else given.c[name]
        for name, _ in _ENQUEUE_ARRAY_COLUMNS
    ]
    now = bindparam("ri_now", type_=Float(precision=53))
    return (
        postgresql.insert(R)
        .from_select(
            [
                *(name for name, _ in _ENQUEUE_ARRAY_COLUMNS),
                "run_id",
                "status",
                "start_time",
                "end_time",
                "create_seq",
            ],
            select(
                *values,
                bindparam("ri_run_id", type_=Integer),
                literal("queuing", Text),
                now,
                cast(None, Float(precision=53)),
                given.c.queue_seq,  # a new rollout's insertion position is its queue position
            ).select_from(given),
        )
        .on_conflict_do_nothing()
        .returning(R.c.rollout_id)
    )


def insert_rollouts_in_one_statement(
    ctx: UnitContext, run_id: int, now: float, rows: Sequence[dict[str, Any]]
) -> set[str]:
    """PostgreSQL: insert the ``queuing`` rollouts ``rows`` (``rollouts.enqueue``'s values: every
    column of ``_ENQUEUE_ARRAY_COLUMNS``, ``create_seq`` equal to ``queue_seq``) in ONE statement,
    skipping those whose id or idempotency key exists; the ids inserted."""
    assert inserts_rollouts_in_one_statement(ctx)
    stmt = cached("rollout_insert_one_statement", _rollout_insert_statement)
    params: dict[str, Any] = {"ri_run_id": run_id, "ri_now": now}
    for name, _type in _ENQUEUE_ARRAY_COLUMNS:
        params[f"ri_{name}"] = [row[name] for row in rows]
    return {row[0] for row in ctx.execute(stmt, params)}


def claim_in_one_statement(
    ctx: UnitContext, run_id: int, now: float, attempt_ids: Sequence[str], worker_id: str | None, returning: Sequence[Any]
) -> list[Any] | None:
    """PostgreSQL: pick, mark and attempt up to ``len(attempt_ids)`` queued rollouts in ONE round trip.

    One statement of data-modifying CTEs: the lowest ``queue_seq`` rows (``FOR UPDATE SKIP
    LOCKED``) become ``preparing`` and leave the queue, and each gets its attempt, the i-th picked
    rollout the i-th attempt id; with a (non-empty) ``worker_id`` the worker row is upserted busy on
    the last claimed attempt, as ``workers.sync_worker(..., claim=True)`` does.  Rows come back in
    queue order with the ``returning`` columns of the rollout plus ``attempt_count`` (= the attempt's
    ``sequence_id``) and ``attempt_id``.  Being one statement, it is atomic without a transaction.
    Returns None on SQLite, where writers are serialised and a statement costs no round trip: the
    caller runs the plain steps.
    """
    if ctx.dialect != "postgresql":
        return None
    columns = tuple(c.name for c in returning)
    stmt = cached(
        ("claim_one_statement", columns, bool(worker_id)),
        lambda: _claim_statement(returning, with_worker=bool(worker_id)),
    )
    params = {
        "claim_run_id": run_id,
        "claim_limit": len(attempt_ids),
        "claim_now": now,
        "claim_worker_id": worker_id,
        "claim_attempt_ids": list(attempt_ids),
    }
    return list(ctx.execute(stmt, params).all())


@dataclass(frozen=True)
class ClaimingCall:
    """A call of a batch of claims whose worker row the claim statement writes
    (``claim_many_statement``): its worker, its ``now``, and the 1-based positions of its
    first and last attempt ids among the batch's (``last = first - 1`` for a call of none)."""

    worker_id: str
    now: float
    first: int
    last: int


def claim_many_statement(
    run_id: int,
    attempt_ids: Sequence[str],
    worker_ids: Sequence[str | None],
    nows: Sequence[float],
    returning: Sequence[Any],
    workers: Sequence[ClaimingCall] | None = None,
) -> tuple[Any, dict[str, Any]]:
    """PostgreSQL: the statement (and its parameters) of ``claim_in_one_statement`` for the
    attempts of several calls, each attempt with its own worker id and start time (the i-th picked
    rollout gets the i-th attempt).  Rows in queue order, as there.  Without ``workers`` it leaves
    the worker rows to the caller (who writes them in call order); with them the statement writes them too, what ``rollouts._worker_write`` does
    for each call: busy on its last claimed rollout (an empty worker id: nothing), or idle when it
    claimed none.  The workers must be distinct (one statement writes a row once)."""
    columns = tuple(c.name for c in returning)
    stmt = cached(
        ("claim_many_one_statement", columns, workers is not None),
        lambda: _claim_statement(returning, with_worker=False, per_attempt=True, with_workers=workers is not None),
    )
    params: dict[str, Any] = {
        "claim_run_id": run_id,
        "claim_limit": len(attempt_ids),
        "claim_attempt_ids": list(attempt_ids),
        "claim_worker_ids": list(worker_ids),
        "claim_nows": list(nows),
    }
    if workers is not None:
        assert len({call.worker_id for call in workers}) == len(workers), "one write per worker row"
        params["cw_worker_ids"] = [call.worker_id for call in workers]
        params["cw_nows"] = [call.now for call in workers]
        params["cw_firsts"] = [call.first for call in workers]
        params["cw_lasts"] = [call.last for call in workers]
    return stmt, params


# The worker columns a claim sets (workers._BUSY_CLAIM); an existing row keeps every other column.
_CLAIM_WORKER_COLUMNS = ("status", "last_busy_time", "current_rollout_id", "current_attempt_id", "last_dequeue_time")


def _claim_statement(
    returning: Sequence[Any], *, with_worker: bool, per_attempt: bool = False, with_workers: bool = False
) -> Any:
    R, A = s.rollouts, s.attempts
    run_id = bindparam("claim_run_id", type_=Integer)
    picked = (
        select(R.c.run_id, R.c.rollout_id, R.c.queue_seq)
        .where(R.c.run_id == run_id, R.c.queue_seq.isnot(None))
        .order_by(R.c.queue_seq)
        .limit(bindparam("claim_limit", type_=Integer))
        .with_for_update(skip_locked=True)
        .cte("picked")
        .prefix_with("MATERIALIZED")  # the claimed rows' keys ("Keyed UPDATEs")
    )
    claimed = (
        update(R)
        .where(R.c.run_id == picked.c.run_id, R.c.rollout_id == picked.c.rollout_id)
        .values(status="preparing", queue_seq=None, attempt_count=R.c.attempt_count + 1)
        .returning(*returning, R.c.attempt_count, picked.c.queue_seq.label("picked_seq"))
        .cte("claimed")
    )
    ranked = select(claimed, func.row_number().over(order_by=claimed.c.picked_seq).label("pos")).cte("ranked")
    if per_attempt:  # each attempt its worker and start time: parallel arrays
        ids = (
            func.unnest(
                bindparam("claim_attempt_ids", type_=postgresql.ARRAY(Text)),
                bindparam("claim_worker_ids", type_=postgresql.ARRAY(Text)),
                bindparam("claim_nows", type_=postgresql.ARRAY(Float(precision=53))),
            )
            .table_valued("attempt_id", "worker_id", "now", with_ordinality="pos")
            .render_derived(name="ids")
        )
        worker_id, now = ids.c.worker_id, ids.c.now
    else:
        ids = (
            func.unnest(bindparam("claim_attempt_ids", type_=postgresql.ARRAY(Text)))
            .table_valued("attempt_id", with_ordinality="pos")
            .render_derived(name="ids")
        )
        worker_id = bindparam("claim_worker_id", type_=Text)
        now = bindparam("claim_now", type_=Float(precision=53))
    attempt_rows = select(
        run_id,
        ranked.c.rollout_id,
        ids.c.attempt_id,
        ranked.c.attempt_count,
        literal("preparing", Text),
        worker_id,
        now,
    ).select_from(ranked.join(ids, ids.c.pos == ranked.c.pos))
    inserted = (
        core_insert(A)
        .from_select(
            ["run_id", "rollout_id", "attempt_id", "sequence_id", "status", "worker_id", "start_time"], attempt_rows
        )
        .returning(A.c.rollout_id, A.c.attempt_id)
        .cte("inserted")
    )
    stmt = (
        select(ranked, inserted.c.attempt_id)
        .join_from(ranked, inserted, inserted.c.rollout_id == ranked.c.rollout_id)
        .order_by(ranked.c.pos)
    )
    if with_workers:
        return stmt.add_cte(_claiming_workers_upsert(run_id, ranked, inserted))
    if not with_worker:
        return stmt
    W = s.workers
    now = bindparam("claim_now", type_=Float(precision=53))
    last_claimed = (
        select(
            run_id,
            bindparam("claim_worker_id", type_=Text),
            s.position_seq.next_value(),
            literal("busy", Text),
            now,
            ranked.c.rollout_id,
            inserted.c.attempt_id,
            now,
        )
        .join_from(ranked, inserted, inserted.c.rollout_id == ranked.c.rollout_id)
        .order_by(ranked.c.pos.desc())
        .limit(1)
    )
    upsert = postgresql.insert(W).from_select(["run_id", "worker_id", "create_seq", *_CLAIM_WORKER_COLUMNS], last_claimed)
    upsert = upsert.on_conflict_do_update(
        index_elements=[W.c.run_id, W.c.worker_id], set_={col: upsert.excluded[col] for col in _CLAIM_WORKER_COLUMNS}
    )
    # A data-modifying CTE runs to completion whether or not the outer query reads it.
    return stmt.add_cte(upsert.returning(W.c.worker_id).cte("worker_sync"))


def _claiming_workers_upsert(run_id: Any, ranked: Any, inserted: Any) -> Any:
    """The worker rows of a batch of claims (``ClaimingCall``, arrays ``cw_*``), one upsert in
    call order: busy on the call's last claimed rollout (``workers.sync_worker(..., claim=True)``),
    or idle when it claimed none (``workers.idle_on_empty_queue``: an idle worker keeps its
    ``last_idle_time``); an existing row keeps every column that write does not set."""
    W = s.workers
    calls = (
        func.unnest(
            bindparam("cw_worker_ids", type_=ARRAY(Text)),
            bindparam("cw_nows", type_=ARRAY(Float(precision=53))),
            bindparam("cw_firsts", type_=ARRAY(Integer)),
            bindparam("cw_lasts", type_=ARRAY(Integer)),
        )
        .table_valued("worker_id", "now", "first", "last", with_ordinality="n")
        .render_derived(name="calls")
    )
    claimed_count = select(func.count()).select_from(inserted).scalar_subquery()
    nothing = cast(None, Float(precision=53))
    no_id = cast(None, Text)
    busy = (
        select(
            calls.c.n,
            calls.c.worker_id,
            literal("busy", Text).label("status"),
            calls.c.now.label("last_busy_time"),
            ranked.c.rollout_id.label("current_rollout_id"),
            inserted.c.attempt_id.label("current_attempt_id"),
            calls.c.now.label("last_dequeue_time"),
            nothing.label("last_idle_time"),
        )
        .select_from(calls)
        .join(ranked, ranked.c.pos == func.least(calls.c.last, claimed_count))
        .join(inserted, inserted.c.rollout_id == ranked.c.rollout_id)
        .where(calls.c.worker_id != "", calls.c.first <= calls.c.last, calls.c.first <= claimed_count)
    )
    idle = select(
        calls.c.n,
        calls.c.worker_id,
        literal("idle", Text),
        nothing,
        no_id,
        no_id,
        calls.c.now,
        calls.c.now,
    ).where(or_(calls.c.first > calls.c.last, calls.c.first > claimed_count))
    written = union_all(busy, idle).subquery("written")
    in_order = select(written).order_by(written.c.n).subquery("in_order")  # call order, as the transaction writes
    columns = ["status", "last_busy_time", "current_rollout_id", "current_attempt_id", "last_dequeue_time", "last_idle_time"]
    upsert = postgresql.insert(W).from_select(
        ["run_id", "worker_id", "create_seq", *columns],
        select(run_id, in_order.c.worker_id, s.position_seq.next_value(), *(in_order.c[col] for col in columns)),
    )
    excluded = upsert.excluded
    is_busy = excluded.status == "busy"
    upsert = upsert.on_conflict_do_update(
        index_elements=[W.c.run_id, W.c.worker_id],
        set_={
            "status": excluded.status,
            "last_dequeue_time": excluded.last_dequeue_time,
            "last_busy_time": case((is_busy, excluded.last_busy_time), else_=W.c.last_busy_time),
            "current_rollout_id": case((is_busy, excluded.current_rollout_id), else_=W.c.current_rollout_id),
            "current_attempt_id": case((is_busy, excluded.current_attempt_id), else_=W.c.current_attempt_id),
            "last_idle_time": case(
                (or_(is_busy, W.c.status == "idle"), W.c.last_idle_time), else_=excluded.last_idle_time
            ),
        },
    )
    # A data-modifying CTE runs to completion whether or not the outer query reads it.
    return upsert.returning(W.c.worker_id).cte("workers_synced")


def insert_new_spans(
    ctx: UnitContext, run_id: int, rows: Sequence[dict[str, Any]]
) -> set[tuple[str, str, str]]:
    """Insert span rows (distinct keys) except those already stored; the (rollout, attempt, span) keys
    inserted.

    PostgreSQL: one ``INSERT ... ON CONFLICT DO NOTHING RETURNING`` (concurrent writers decide by
    the unique key).  SQLite runs an insert with ``RETURNING`` once per row; for more than two rows,
    since its writers are serialised (``BEGIN IMMEDIATE``), one look-up of the span ids already
    stored per (rollout, attempt) and one ``executemany`` of the others give the same answer.
    """
    keys = [(row["rollout_id"], row["attempt_id"], row["span_id"]) for row in rows]
    S = s.spans
    rows = _json_marked(rows)  # the statements below bind the JSON columns through the serializer
    if ctx.dialect == "postgresql" or len(rows) <= 2:  # SQLite: a row or two are as cheap this way
        stmt = cached(
            ("span_insert_returning", ctx.dialect),
            lambda: insert(ctx, S)
            .on_conflict_do_nothing()
            .returning(S.c.rollout_id, S.c.attempt_id, S.c.span_id),
        )
        return {(r[0], r[1], r[2]) for r in ctx.execute(stmt, list(rows))}
    stored = cached(
        "span_ids_stored",
        lambda: select(S.c.span_id).where(
            S.c.run_id == bindparam("sk_run_id"),
            S.c.rollout_id == bindparam("sk_rollout_id"),
            S.c.attempt_id == bindparam("sk_attempt_id"),
            S.c.span_id.in_(bindparam("sk_span_ids", expanding=True)),
        ),
    )
    by_group: dict[tuple[str, str], list[str]] = {}
    for rid, aid, sid in keys:
        by_group.setdefault((rid, aid), []).append(sid)
    existing: set[tuple[str, str, str]] = set()
    for (rid, aid), span_ids in by_group.items():
        for start in range(0, len(span_ids), 500):  # within SQLite's limit on bound variables
            params = {
                "sk_run_id": run_id,
                "sk_rollout_id": rid,
                "sk_attempt_id": aid,
                "sk_span_ids": span_ids[start : start + 500],
            }
            existing.update((rid, aid, r[0]) for r in ctx.execute(stored, params))
    new_rows = [row for row, key in zip(rows, keys, strict=True) if key not in existing]
    if new_rows:
        ctx.execute(cached("span_insert_sqlite", lambda: sqlite.insert(S).on_conflict_do_nothing()), new_rows)
    return {key for key in keys if key not in existing}


def _json_marked(rows: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """Span rows (``rows.span_values``: JSON texts as plain ``str``) with their JSON texts marked
    as encoded (``EncodedJson``), for a statement whose JSON columns take the engine's serializer
    (which would encode a plain ``str`` again, as a JSON string)."""
    marked = []
    for row in rows:
        row = row.copy()
        for name in SPAN_JSON_FIELDS:
            text = row[name]
            if text is not None:
                row[name] = EncodedJson(text)
        marked.append(row)
    return marked


# Span columns the one-statement ingest binds as arrays (run, rollout and attempt are scalars).
_SPAN_ARRAY_COLUMNS: tuple[tuple[str, Any], ...] = (
    ("sequence_id", postgresql.BIGINT),
    ("trace_id", Text),
    ("span_id", Text),
    ("parent_id", Text),
    ("name", Text),
    ("status_code", Text),
    ("start_time", postgresql.DOUBLE_PRECISION),
    ("end_time", postgresql.DOUBLE_PRECISION),
    ("attributes", Text),
    ("events", Text),
    ("links", Text),
    ("resource", Text),
    ("extra", Text),
)
_SPAN_JSON_COLUMNS = frozenset(SPAN_JSON_FIELDS)
# Rollout statuses a span promotes to ``running`` (spans._heartbeat: preparing and the queued ones).
_PROMOTED_STATUSES = ("preparing", *QUEUED_STATUSES)


def _keys(derived: str, count: Any, **arrays: Any) -> Select[Any]:
    """The keys of a keyed statement: the rows of parallel array parameters (``unnest``), one
    column per keyword, ending in ``LIMIT count``, ``count`` being how many there are ("Keyed
    UPDATEs" above: a generic plan then counts on one key, not ten)."""
    return select(func.unnest(*arrays.values()).table_valued(*arrays).render_derived(name=derived)).limit(count)


def ingests_spans_in_one_statement(ctx: UnitContext) -> bool:
    """Spans of one attempt are one statement (``add_spans_in_one_statement``): PostgreSQL only.
    SQLite has no data-modifying CTEs, and a statement there costs no round trip."""
    return ctx.dialect == "postgresql"


def add_spans_in_one_statement(
    ctx: UnitContext,
    run_id: int,
    now: float,
    rollout_id: str,
    attempt_id: str,
    rows: Sequence[dict[str, Any]],
) -> tuple[bool, bool, set[str]]:
    """PostgreSQL: ``spans.add_spans`` for spans of ONE (rollout, attempt) in one round trip.

    One statement of CTEs, in the lock order of contract §2.17: lock the rollout row, then (only if
    it exists) the attempt row, then insert the spans (only if both exist; duplicates skipped), then
    heartbeat the attempt and bump the rollout's span counter / promote it to ``running`` (rows
    already locked).  Being one statement, it is atomic without a transaction, and it changes
    nothing when the rollout or the attempt is missing.  Returns (rollout found, attempt found, the
    span ids inserted).
    """
    assert ingests_spans_in_one_statement(ctx)
    stmt, params = span_ingest_statement(run_id, now, rollout_id, attempt_id, rows)
    return span_ingest_outcome(ctx.execute(stmt, params).all())


def span_ingest_statement(
    run_id: int, now: float, rollout_id: str, attempt_id: str, rows: Sequence[dict[str, Any]]
) -> tuple[Any, dict[str, Any]]:
    """``add_spans_in_one_statement``'s statement and parameters."""
    stmt = cached("span_ingest_one_statement", _span_ingest_statement)
    params: dict[str, Any] = {
        "si_run_id": run_id,
        "si_rollout_id": rollout_id,
        "si_attempt_id": attempt_id,
        "si_now": now,
        "si_highest": max(row["sequence_id"] for row in rows),
    }
    for name, _type in _SPAN_ARRAY_COLUMNS:
        params[f"si_{name}"] = [row[name] for row in rows]
    return stmt, params


def span_ingest_outcome(rows: Sequence[Any]) -> tuple[bool, bool, set[str]]:
    """``add_spans_in_one_statement``'s outcome from its statement's row."""
    (row,) = rows
    return bool(row.rollout_found), bool(row.attempt_found), set(row.inserted or ())


def _one_of(column: Any, values: Sequence[str]) -> Any:
    """``column IN (values)`` with fixed parameters (an IN of literals compiles per execution)."""
    return or_(*(column == literal(value, Text) for value in values))


def _span_ingest_statement() -> Any:
    R, A, S = s.rollouts, s.attempts, s.spans
    run_id = bindparam("si_run_id", type_=Integer)
    rollout_id = bindparam("si_rollout_id", type_=Text)
    attempt_id = bindparam("si_attempt_id", type_=Text)
    now = bindparam("si_now", type_=Float(precision=53))
    locked_rollout = (
        select(R.c.rollout_id)
        .where(R.c.run_id == run_id, R.c.rollout_id == rollout_id)
        .with_for_update()
        .cte("locked_rollout")
    )
    locked_attempt = (
        select(A.c.sequence_id)
        .where(
            A.c.run_id == run_id,
            A.c.rollout_id == rollout_id,
            A.c.attempt_id == attempt_id,
            exists(select(locked_rollout.c.rollout_id)),  # the rollout row is locked first
        )
        .with_for_update()
        .cte("locked_attempt")
    )
    arrays = [bindparam(f"si_{name}", type_=ARRAY(type_)) for name, type_ in _SPAN_ARRAY_COLUMNS]
    given = (
        func.unnest(*arrays)
        .table_valued(*(name for name, _ in _SPAN_ARRAY_COLUMNS))
        .render_derived(name="given")
    )
    values = [
        cast(given.c[name], JSONB) if name in _SPAN_JSON_COLUMNS else given.c[name]
        for name, _ in _SPAN_ARRAY_COLUMNS
    ]
    inserted = (
        postgresql.insert(S)
        .from_select(
            ["run_id", "rollout_id", "attempt_id", *(name for name, _ in _SPAN_ARRAY_COLUMNS)],
            select(run_id, rollout_id, attempt_id, *values)
            .select_from(given)
            .where(exists(select(locked_attempt.c.sequence_id))),
        )
        .on_conflict_do_nothing()
        .returning(S.c.span_id)
        .cte("inserted")
    )
    any_inserted = exists(select(inserted.c.span_id))
    heartbeat = (
        update(A)
        .where(A.c.run_id == run_id, A.c.rollout_id == rollout_id, A.c.attempt_id == attempt_id, any_inserted)
        .values(
            last_heartbeat_time=now,
            status=case((_one_of(A.c.status, ("preparing", "unresponsive")), "running"), else_=A.c.status),
        )
        .returning(A.c.attempt_id)
        .cte("heartbeat")
    )
    highest = bindparam("si_highest", type_=postgresql.BIGINT)
    # The latest attempt's spans promote a claimed or queued rollout (spans._heartbeat).
    promote = and_(
        any_inserted,
        R.c.attempt_count == select(locked_attempt.c.sequence_id).scalar_subquery(),
        _one_of(R.c.status, _PROMOTED_STATUSES),
    )
    counters = (
        update(R)
        .where(
            R.c.run_id == run_id,
            R.c.rollout_id == rollout_id,
            exists(select(locked_attempt.c.sequence_id)),
            or_(R.c.span_seq < highest, promote),
        )
        .values(
            span_seq=func.greatest(R.c.span_seq, highest),
            status=case((promote, "running"), else_=R.c.status),
            queue_seq=case((promote, None), else_=R.c.queue_seq),
        )
        .returning(R.c.rollout_id)
        .cte("counters")
    )
    found_rollout = exists(select(locked_rollout.c.rollout_id))
    found_attempt = exists(select(locked_attempt.c.sequence_id))
    return (
        select(
            found_rollout.label("rollout_found"),
            found_attempt.label("attempt_found"),
            select(array_agg(inserted.c.span_id)).scalar_subquery().label("inserted"),
        )
        .add_cte(heartbeat)
        .add_cte(counters)
    )


def add_spans_of_many_attempts_in_one_statement(
    ctx: UnitContext, run_id: int, now: float, rows: Sequence[dict[str, Any]]
) -> tuple[bool, set[tuple[str, str, str]]]:
    """PostgreSQL: ``add_spans_in_one_statement`` for spans of SEVERAL (rollout, attempt) groups
    (distinct span keys), in one round trip, all or nothing: the rollout rows are locked in
    ``rollout_id`` order, then the attempt rows in (rollout, attempt) order (contract §2.17), and
    only when every rollout and every attempt exists are the spans inserted (duplicates skipped),
    the attempts that got spans heartbeaten and the rollouts' span counters bumped / promoted, as
    the groups' statements run one after the other would (the heartbeat at ``now``).  Returns
    (every group found, the (rollout, attempt, span) keys inserted); nothing changed unless the
    first is true.
    """
    assert ingests_spans_in_one_statement(ctx)
    stmt, params = span_ingest_many_statement(run_id, now, rows)
    return span_ingest_many_outcome(ctx.execute(stmt, params).all())


def span_ingest_many_statement(run_id: int, now: float, rows: Sequence[dict[str, Any]]) -> tuple[Any, dict[str, Any]]:
    """``add_spans_of_many_attempts_in_one_statement``'s statement and parameters."""
    stmt = cached("span_ingest_many_attempts", _span_ingest_many_statement)
    groups = list(dict.fromkeys((row["rollout_id"], row["attempt_id"]) for row in rows))
    params: dict[str, Any] = {
        "sm_run_id": run_id,
        "sm_now": now,
        "sm_group_rollout_ids": [rid for rid, _aid in groups],
        "sm_group_attempt_ids": [aid for _rid, aid in groups],
        "sm_rollouts": len({rid for rid, _aid in groups}),
        "sm_groups": len(groups),
        "sm_rollout_id": [row["rollout_id"] for row in rows],
        "sm_attempt_id": [row["attempt_id"] for row in rows],
    }
    for name, _type in _SPAN_ARRAY_COLUMNS:
        params[f"sm_{name}"] = [row[name] for row in rows]
    return stmt, params


def span_ingest_many_outcome(result: Sequence[Any]) -> tuple[bool, set[tuple[str, str, str]]]:
    """``add_spans_of_many_attempts_in_one_statement``'s outcome from its statement's rows (one per
    span inserted, or one of NULLs)."""
    if not result[0].found:
        return False, set()
    return True, {(r.rollout_id, r.attempt_id, r.span_id) for r in result if r.span_id is not None}


def _span_ingest_many_statement() -> Any:
    R, A, S = s.rollouts, s.attempts, s.spans
    run_id = bindparam("sm_run_id", type_=Integer)
    now = bindparam("sm_now", type_=Float(precision=53))
    wanted = _keys(
        "pairs",
        bindparam("sm_groups", type_=Integer),
        rollout_id=bindparam("sm_group_rollout_ids", type_=ARRAY(Text)),
        attempt_id=bindparam("sm_group_attempt_ids", type_=ARRAY(Text)),
    ).cte("wanted")
    # Each row is locked through its key, in lock order: a LATERAL look-up per wanted row (its LIMIT
    # keeps the planner from turning it into a join, which on a table without statistics it plans
    # as a scan of the run's rows).  The ids sort as the id columns do (COLLATE "C": IdText), not in
    # the database's default collation, so that every statement locks rollouts in one order.
    wanted_id = wanted.c.rollout_id.collate("C").label("rollout_id")
    rollout_ids = select(wanted_id).distinct().order_by(wanted_id).subquery("rollout_ids")
    rollout = (
        select(R.c.run_id, R.c.rollout_id, R.c.attempt_count)
        .where(R.c.run_id == run_id, R.c.rollout_id == rollout_ids.c.rollout_id)
        .limit(1)
        .with_for_update()
        .lateral("rollout")
    )
    # The UPDATEs below find their rows through these keys ("Keyed UPDATEs", the module's docstring).
    locked_rollouts = (
        select(rollout.c.run_id, rollout.c.rollout_id, rollout.c.attempt_count)
        .select_from(rollout_ids.join(rollout, true()))
        .cte("locked_rollouts")
        .prefix_with("MATERIALIZED")
    )
    rollouts_found = select(func.count()).select_from(locked_rollouts).scalar_subquery() == bindparam(
        "sm_rollouts", type_=Integer
    )
    pairs = (
        select(wanted.c.rollout_id, wanted.c.attempt_id)
        .where(rollouts_found)  # the rollout rows are locked first (and all exist)
        .order_by(wanted.c.rollout_id.collate("C"), wanted.c.attempt_id.collate("C"))
        .subquery("pairs")
    )
    attempt = (
        select(A.c.run_id, A.c.rollout_id, A.c.attempt_id, A.c.sequence_id)
        .where(A.c.run_id == run_id, A.c.rollout_id == pairs.c.rollout_id, A.c.attempt_id == pairs.c.attempt_id)
        .limit(1)
        .with_for_update()
        .lateral("attempt")
    )
    locked_attempts = (
        select(attempt.c.run_id, attempt.c.rollout_id, attempt.c.attempt_id, attempt.c.sequence_id)
        .select_from(pairs.join(attempt, true()))
        .cte("locked_attempts")
        .prefix_with("MATERIALIZED")
    )
    found = select(func.count()).select_from(locked_attempts).scalar_subquery() == bindparam(
        "sm_groups", type_=Integer
    )
    columns = [("rollout_id", Text), ("attempt_id", Text), *_SPAN_ARRAY_COLUMNS]
    given = (
        select(
            func.unnest(*(bindparam(f"sm_{name}", type_=ARRAY(type_)) for name, type_ in columns))
            .table_valued(*(name for name, _ in columns))
            .render_derived(name="given")
        )
        .cte("given")
    )
    values = [cast(given.c[name], JSONB) if name in _SPAN_JSON_COLUMNS else given.c[name] for name, _ in columns]
    inserted = (
        postgresql.insert(S)
        .from_select(["run_id", *(name for name, _ in columns)], select(run_id, *values).where(found))
        .on_conflict_do_nothing()
        .returning(S.c.rollout_id, S.c.attempt_id, S.c.span_id)
        .cte("inserted")
    )
    got_spans = tuple_(locked_attempts.c.rollout_id, locked_attempts.c.attempt_id).in_(
        select(inserted.c.rollout_id, inserted.c.attempt_id)
    )
    heartbeat = (
        update(A)
        .where(
            A.c.run_id == locked_attempts.c.run_id,
            A.c.rollout_id == locked_attempts.c.rollout_id,
            A.c.attempt_id == locked_attempts.c.attempt_id,
            got_spans,
        )
        .values(
            last_heartbeat_time=now,
            status=case((_one_of(A.c.status, ("preparing", "unresponsive")), "running"), else_=A.c.status),
        )
        .returning(A.c.attempt_id)
        .cte("heartbeat")
    )
    highest = (
        select(given.c.rollout_id, func.max(given.c.sequence_id).label("highest"))
        .group_by(given.c.rollout_id)
        .subquery("highest")
    )
    # The latest attempt's spans promote a claimed or queued rollout (spans._heartbeat).
    latest_got_spans = exists(
        select(inserted.c.span_id)
        .select_from(
            inserted.join(
                locked_attempts,
                and_(
                    locked_attempts.c.rollout_id == inserted.c.rollout_id,
                    locked_attempts.c.attempt_id == inserted.c.attempt_id,
                ),
            )
        )
        .where(inserted.c.rollout_id == R.c.rollout_id, locked_attempts.c.sequence_id == R.c.attempt_count)
    )
    promote = and_(latest_got_spans, _one_of(R.c.status, _PROMOTED_STATUSES))
    counters = (
        update(R)
        .where(
            R.c.run_id == locked_rollouts.c.run_id,
            R.c.rollout_id == locked_rollouts.c.rollout_id,
            highest.c.rollout_id == locked_rollouts.c.rollout_id,
            found,
            or_(R.c.span_seq < highest.c.highest, promote),
        )
        .values(
            span_seq=func.greatest(R.c.span_seq, highest.c.highest),
            status=case((promote, "running"), else_=R.c.status),
            queue_seq=case((promote, None), else_=R.c.queue_seq),
        )
        .returning(R.c.rollout_id)
        .cte("counters")
    )
    one = select(literal(1).label("one")).subquery("one")  # a row even when nothing was inserted
    return (
        select(found.label("found"), inserted.c.rollout_id, inserted.c.attempt_id, inserted.c.span_id)
        .select_from(one.outerjoin(inserted, true()))
        .add_cte(heartbeat)
        .add_cte(counters)
    )


def lock_rollout_and_attempt(
    ctx: UnitContext, run_id: int, rollout_id: str, attempt_id: str, columns: Sequence[Any]
) -> tuple[Any, Any]:
    """A rollout row and its attempt (``attempt_id`` or ``"latest"``) in ONE statement, for a write unit.

    Returns (the rollout row with ``columns``, ``attempt_count`` and ``queue_seq``, or None; the
    attempt row, or None).  PostgreSQL locks both, the rollout first: the attempt is a LATERAL
    subquery of the locked rollout row (lock order, contract §2.17).  SQLite reads both with one
    join (``BEGIN IMMEDIATE`` already serialises writers).
    """
    latest = attempt_id == "latest"
    names = tuple(c.name for c in columns)
    stmt = cached(
        ("lock_rollout_and_attempt", ctx.dialect, names, latest),
        lambda: _lock_pair_statement(ctx.dialect, columns, latest=latest),
    )
    params: dict[str, Any] = {"lp_run_id": run_id, "lp_rollout_id": rollout_id}
    if not latest:
        params["lp_attempt_id"] = attempt_id
    row = ctx.execute(stmt, params).first()
    if row is None:
        return None, None
    attempt = row[-len(_ATTEMPT_NAMES) :]  # the attempt's columns come last
    if attempt[_ATTEMPT_ID_AT] is None:
        return row, None
    return row, _AttemptRow(*attempt)


_ATTEMPT_NAMES = tuple(c.name for c in s.attempts.c if c.name != "run_id")
_ATTEMPT_ID_AT = _ATTEMPT_NAMES.index("attempt_id")
_AttemptRow = make_row_class(_ATTEMPT_NAMES)


def _lock_pair_statement(dialect: str, columns: Sequence[Any], *, latest: bool) -> Any:
    R, A = s.rollouts, s.attempts
    run_id = bindparam("lp_run_id", type_=Integer)
    rollout_id = bindparam("lp_rollout_id", type_=Text)
    attempt_id = bindparam("lp_attempt_id", type_=Text)
    if dialect != "postgresql":
        which = A.c.sequence_id == R.c.attempt_count if latest else A.c.attempt_id == attempt_id
        joined = R.outerjoin(A, and_(A.c.run_id == R.c.run_id, A.c.rollout_id == R.c.rollout_id, which))
        attempt_columns = [A.c[name].label(f"a_{name}") for name in _ATTEMPT_NAMES]
        return (
            select(*columns, R.c.attempt_count, R.c.queue_seq, *attempt_columns)
            .select_from(joined)
            .where(R.c.run_id == run_id, R.c.rollout_id == rollout_id)
        )
    locked = (
        select(*columns, R.c.attempt_count, R.c.queue_seq)
        .where(R.c.run_id == run_id, R.c.rollout_id == rollout_id)
        .with_for_update()
        .cte("locked_rollout")
    )
    which = A.c.sequence_id == locked.c.attempt_count if latest else A.c.attempt_id == attempt_id
    attempt = (
        select(A)
        .where(A.c.run_id == run_id, A.c.rollout_id == locked.c.rollout_id, which)
        .with_for_update()
        .lateral("locked_attempt")
    )
    return select(locked, *(attempt.c[name].label(f"a_{name}") for name in _ATTEMPT_NAMES)).select_from(
        locked.outerjoin(attempt, true())
    )


def lock_rollouts_and_attempts(
    ctx: UnitContext, run_id: int, pairs: Sequence[tuple[str, str]], columns: Sequence[Any]
) -> dict[str, tuple[Any, Any]]:
    """``lock_rollout_and_attempt`` for several rollouts at once (PostgreSQL only), in ONE statement:
    ``pairs`` are ``(rollout_id, attempt_id or "latest")`` of distinct rollouts.  Returns, for each
    rollout found, (its row, its attempt row or None).  The rollouts are locked in ``rollout_id``
    order (two such statements never wait for each other in a cycle), each attempt after its
    rollout."""
    assert ctx.dialect == "postgresql"
    names = tuple(c.name for c in columns)
    stmt = cached(("lock_rollouts_and_attempts", names), lambda: _lock_pairs_statement(columns))
    params = {
        "lm_run_id": run_id,
        "lm_rollout_ids": [rid for rid, _aid in pairs],
        "lm_attempt_ids": [None if aid == "latest" else aid for _rid, aid in pairs],
    }
    out: dict[str, tuple[Any, Any]] = {}
    width = len(_ATTEMPT_NAMES)
    for row in ctx.execute(stmt, params):
        attempt = row[-width:]
        out[row.rollout_id] = (row, None if attempt[_ATTEMPT_ID_AT] is None else _AttemptRow(*attempt))
    return out


def _lock_pairs_statement(columns: Sequence[Any]) -> Any:
    R, A = s.rollouts, s.attempts
    run_id = bindparam("lm_run_id", type_=Integer)
    wanted = (
        func.unnest(bindparam("lm_rollout_ids", type_=ARRAY(Text)), bindparam("lm_attempt_ids", type_=ARRAY(Text)))
        .table_valued("rollout_id", "attempt_id")
        .render_derived(name="wanted")
    )
    # One look-up per rollout by its key (no `= ANY` on the run's rows: ADR 0007), in the order of
    # the span batch's locks (`_span_ingest_many_statement`), each attempt after its rollout.
    ordered = (
        select(wanted.c.rollout_id.collate("C").label("rollout_id"), wanted.c.attempt_id)
        .order_by(wanted.c.rollout_id.collate("C"))
        .subquery("ordered")
    )
    rollout = (
        select(*columns, R.c.attempt_count, R.c.queue_seq)
        .where(R.c.run_id == run_id, R.c.rollout_id == ordered.c.rollout_id)
        .limit(1)
        .with_for_update()
        .lateral("locked_rollout")
    )
    which = or_(
        and_(ordered.c.attempt_id.is_(None), A.c.sequence_id == rollout.c.attempt_count),
        A.c.attempt_id == ordered.c.attempt_id,
    )
    attempt = (
        select(A)
        .where(A.c.run_id == run_id, A.c.rollout_id == rollout.c.rollout_id, which)
        .limit(1)
        .with_for_update()
        .lateral("locked_attempt")
    )
    joined = ordered.join(rollout, true()).outerjoin(attempt, true())
    return select(
        *(rollout.c[c.name] for c in columns),
        rollout.c.attempt_count,
        rollout.c.queue_seq,
        *(attempt.c[name].label(f"a_{name}") for name in _ATTEMPT_NAMES),
    ).select_from(joined)


def attempts_by_sequence(ctx: UnitContext, run_id: int, pairs: Sequence[tuple[str, int]]) -> list[Any]:
    """The attempt rows (``select(attempts)``'s columns) of ``(rollout id, sequence id)`` pairs of
    the run that exist: each rollout's latest attempt, for a page of rollouts read back.

    PostgreSQL: ONE statement for any number of pairs, one look-up per pair by its key (``LATERAL
    ... LIMIT 1`` on the pairs of two array parameters, the module's keyed look-ups).  A row-value
    ``IN`` list, the form SQLite takes, was planned there as a read of every attempt of the run
    with the pairs' sequence id, filtered by an ``OR`` of the ids, whenever the pairs share that id
    (a page of first attempts): ~160 ms per 500 pairs in a run of 30,000 attempts, growing with
    the run (docs/performance.md, twenty-third pass).  SQLite: that list, in chunks of 500 pairs
    (within its bound-parameter limit), which it reads by key."""
    if not pairs:
        return []
    if ctx.dialect == "postgresql":
        params = {
            "la_run_id": run_id,
            "la_rollout_ids": [rid for rid, _seq in pairs],
            "la_sequence_ids": [seq for _rid, seq in pairs],
            "la_pairs": len(pairs),
        }
        return list(ctx.execute(cached("attempts_by_sequence", _attempts_by_sequence_statement), params))
    rows: list[Any] = []
    for start in range(0, len(pairs), 500):
        chunk = pairs[start : start + 500]
        rows.extend(ctx.execute(_ATTEMPTS_BY_PAIRS_IN, {"la_run_id": run_id, "la_pairs": chunk}))
    return rows


_ATTEMPTS_BY_PAIRS_IN = prebuilt(
    select(s.attempts).where(
        s.attempts.c.run_id == bindparam("la_run_id"),
        tuple_(s.attempts.c.rollout_id, s.attempts.c.sequence_id).in_(bindparam("la_pairs", expanding=True)),
    )
)


def _attempts_by_sequence_statement() -> Any:
    A = s.attempts
    wanted = _keys(
        "pairs",
        bindparam("la_pairs", type_=Integer),
        rollout_id=bindparam("la_rollout_ids", type_=ARRAY(Text)),
        sequence_id=bindparam("la_sequence_ids", type_=ARRAY(BigInteger)),
    ).subquery("wanted")
    attempt = (
        select(A)
        .where(
            A.c.run_id == bindparam("la_run_id", type_=Integer),
            A.c.rollout_id == wanted.c.rollout_id,
            A.c.sequence_id == wanted.c.sequence_id,
        )
        .limit(1)
        .lateral("attempt")
    )
    return select(*(attempt.c[c.name] for c in A.c)).select_from(wanted.join(attempt, true()))


def named_attempts(ctx: UnitContext, keys: Sequence[tuple[int, str, str]]) -> ColumnElement[bool]:
    """A condition on ``attempts`` that holds for the rows of these ``(run_id, rollout_id,
    attempt_id)`` keys, for a statement that changes them (the sweeper's re-check).  PostgreSQL: a
    join to a MATERIALIZED CTE of the keys ending in ``LIMIT n`` ("Keyed UPDATEs" above); as a
    row-value ``IN`` list, whose keys share ``run_id``, the re-check was planned as a walk of every
    in-flight rollout of the run filtered by the list (docs/performance.md, twenty-third pass).
    SQLite: that list, which it reads by key."""
    A = s.attempts
    if ctx.dialect != "postgresql":
        return tuple_(A.c.run_id, A.c.rollout_id, A.c.attempt_id).in_(list(keys))
    named = (
        _keys(
            "given",
            len(keys),
            run_id=bindparam(None, [run for run, _rid, _aid in keys], type_=ARRAY(Integer)),
            rollout_id=bindparam(None, [rid for _run, rid, _aid in keys], type_=ARRAY(Text)),
            attempt_id=bindparam(None, [aid for _run, _rid, aid in keys], type_=ARRAY(Text)),
        )
        .cte("named_attempts")
        .prefix_with("MATERIALIZED")
    )
    return and_(
        A.c.run_id == named.c.run_id, A.c.rollout_id == named.c.rollout_id, A.c.attempt_id == named.c.attempt_id
    )


def update_attempt_statement(
    run_id: int,
    rollout_id: str,
    attempt_id: str,
    attempt_values: dict[str, Any],
    rollout_values: dict[str, Any],
    worker_values: dict[str, Any],
    channel: str,
) -> tuple[Any, dict[str, Any]]:
    """One ``update_attempt`` whose rollout status follows its attempt's one to one (PostgreSQL, a
    unit without a transaction): ONE statement locks the rollout, then its attempt ``attempt_id``
    (as ``lock_rollout_and_attempt``), and writes, from what it locked:

    * ``attempt_values`` into the attempt;
    * ``rollout_values`` (``status``, and ``end_time`` when that status is a finished one) into the
      rollout when the attempt is its latest, the rollout is neither cancelled nor in that status
      already; a queued rollout leaves the queue (``queue_seq`` NULL), and a finished one is
      notified (``<run_id>:finished``);
    * ``worker_values`` into the row of the attempt's worker, when it has one (an upsert).

    Its statement and parameters (``channel``: the NOTIFY channel of the store's schema,
    ``UnitContext.notify_channel``); ``update_attempt_outcome`` reads its rows."""
    finished = "end_time" in rollout_values
    key = ("update_attempt_in_one_statement", tuple(attempt_values), finished, tuple(worker_values))
    stmt = cached(key, lambda: _update_attempt_statement(tuple(attempt_values), finished, tuple(worker_values)))
    params: dict[str, Any] = {"lp_run_id": run_id, "lp_rollout_id": rollout_id, "lp_attempt_id": attempt_id}
    params.update({f"oa_{col}": value for col, value in attempt_values.items()})
    params.update({f"or_{col}": value for col, value in rollout_values.items()})
    params.update({f"ow_{col}": value for col, value in worker_values.items()})
    if finished:
        params["on_channel"] = channel
        params["on_payload"] = f"{run_id}:finished"
    return stmt, params


def update_attempt_outcome(rows: Sequence[Any]) -> tuple[Any, bool] | None:
    """``update_attempt_statement``'s outcome from its rows: (the attempt's row as written, whether
    the rollout's row was written), or None, having written nothing, when the rollout or the
    attempt does not exist."""
    if not rows:
        return None
    return rows[0], bool(rows[0].rollout_written)


def _update_attempt_statement(attempt_cols: tuple[str, ...], finished: bool, worker_cols: tuple[str, ...]) -> Any:
    R, A, W = s.rollouts, s.attempts, s.workers
    run_id = bindparam("lp_run_id", type_=Integer)
    pair = _lock_pair_statement("postgresql", [R.c.rollout_id, R.c.status], latest=False).cte("locked_pair")
    write_attempt = (
        update(A)
        .where(A.c.run_id == run_id, A.c.rollout_id == pair.c.rollout_id, A.c.attempt_id == pair.c.a_attempt_id)
        .values({col: bindparam(f"oa_{col}") for col in attempt_cols})
        .returning(*A.c)
        .cte("write_attempt")
    )
    new_status = bindparam("or_status", type_=Text)
    rollout_set: dict[str, Any] = {
        "status": new_status,
        "queue_seq": case((_one_of(pair.c.status, QUEUED_STATUSES), None), else_=R.c.queue_seq),
    }
    if finished:
        rollout_set["end_time"] = bindparam("or_end_time", type_=Float)
    write_rollout = (
        update(R)
        .where(
            R.c.run_id == run_id,
            R.c.rollout_id == pair.c.rollout_id,
            pair.c.a_sequence_id == pair.c.attempt_count,
            pair.c.status != "cancelled",
            pair.c.status != new_status,
        )
        .values(rollout_set)
        .returning(R.c.rollout_id)
        .cte("write_rollout")
    )
    worker = insert("postgresql", W).from_select(
        ["run_id", "worker_id", "create_seq", *worker_cols],
        select(
            run_id,
            pair.c.a_worker_id,
            next_create_seq("postgresql", W, run_id),
            *(bindparam(f"ow_{col}", type_=W.c[col].type) for col in worker_cols),
        ).where(pair.c.a_worker_id != ""),  # no worker (NULL) or upstream's falsy one: no row
    )
    write_worker = worker.on_conflict_do_update(
        index_elements=[W.c.run_id, W.c.worker_id], set_={col: worker.excluded[col] for col in worker_cols}
    ).cte("write_worker")
    written = select(func.count()).select_from(write_rollout).scalar_subquery().label("rollout_written")
    stmt = select(write_attempt, written).add_cte(write_worker)
    if finished:
        # A volatile output of a subquery is never pruned: the notification goes out with the write.
        sent = select(
            func.pg_notify(bindparam("on_channel", type_=Text), bindparam("on_payload", type_=Text)).label("sent")
        ).select_from(write_rollout).subquery("sent")
        stmt = stmt.add_columns(select(func.count()).select_from(sent).scalar_subquery().label("notified"))
    return stmt


@dataclass(frozen=True)
class OneStatementUpdate:
    """A call of ``update_attempts_statement``: its rollout and concrete attempt, its ``now``,
    the status it sets (``rollouts.fits_one_statement``) and, when it sets them, the heartbeat and
    the metadata (encoded JSON, or None)."""

    rollout_id: str
    attempt_id: str
    now: float
    status: str
    heartbeat: tuple[bool, float | None] = (False, None)
    metadata: tuple[bool, str | None] = (False, None)


def update_attempts_statement(
    run_id: int, calls: Sequence[OneStatementUpdate], channel: str
) -> tuple[Any, dict[str, Any]]:
    """PostgreSQL: ``update_attempt_statement`` for calls of distinct rollouts at once, in
    ONE statement (a batch without a transaction): it locks their rollouts in ``rollout_id`` order,
    each attempt after its rollout (as ``lock_rollouts_and_attempts``), and writes what the form of
    one call writes, for each call with its own values: its attempt, its rollout (its latest
    attempt's, neither cancelled nor in that status already), its attempt's worker's row, and one
    ``<run_id>:finished`` notification when a rollout finished.  Its statement and parameters
    (``channel``: as ``update_attempt_statement``'s); ``update_attempts_outcome`` reads its rows."""
    stmt = cached("update_attempts_in_one_statement", _update_attempts_statement)
    params: dict[str, Any] = {
        "ua_run_id": run_id,
        "ua_count": len(calls),
        "ua_rollout_id": [call.rollout_id for call in calls],
        "ua_attempt_id": [call.attempt_id for call in calls],
        "ua_now": [call.now for call in calls],
        "ua_status": [call.status for call in calls],
        "ua_heartbeat_given": [call.heartbeat[0] for call in calls],
        "ua_heartbeat": [call.heartbeat[1] for call in calls],
        "ua_metadata_given": [call.metadata[0] for call in calls],
        "ua_metadata": [call.metadata[1] for call in calls],
        "ua_channel": channel,
        "ua_payload": f"{run_id}:finished",
    }
    return stmt, params


def update_attempts_outcome(rows: Sequence[Any], count: int) -> list[tuple[Any, bool]] | None:
    """``update_attempts_statement``'s outcome from its rows (``count`` calls): each call's (attempt
    row as written, whether its rollout row was written), in call order; or None, having written
    nothing, when a rollout or an attempt does not exist or two of the attempts have one worker
    (whose row the calls write in call order, merged: the transaction does that)."""
    if len(rows) < count:
        return None
    return [(row, bool(row.rollout_written)) for row in rows]


def _update_attempts_statement() -> Any:
    R, A, W = s.rollouts, s.attempts, s.workers
    run_id = bindparam("ua_run_id", type_=Integer)
    arrays = (
        ("rollout_id", Text),
        ("attempt_id", Text),
        ("now", Float(precision=53)),
        ("status", Text),
        ("heartbeat_given", Boolean),
        ("heartbeat", Float(precision=53)),
        ("metadata_given", Boolean),
        ("metadata", Text),
    )
    wanted = (
        func.unnest(*(bindparam(f"ua_{name}", type_=ARRAY(type_)) for name, type_ in arrays))
        .table_valued(*(name for name, _ in arrays), with_ordinality="n")
        .render_derived(name="wanted")
    )
    # Locks in the order of the other batch forms (``_lock_pairs_statement``): rollouts by id, each
    # attempt after its rollout, each one look-up by its key.
    # The ids in the collation of the key columns (``IdText``), so that the key indexes serve them.
    ordered = (
        select(
            wanted.c.rollout_id.collate("C").label("rollout_id"),
            wanted.c.attempt_id.collate("C").label("attempt_id"),
            *(wanted.c[n] for n, _ in arrays[2:]),
            wanted.c.n,
        )
        .order_by(wanted.c.rollout_id.collate("C"))
        .subquery("ordered")
    )
    rollout = (
        select(R.c.run_id, R.c.rollout_id, R.c.status, R.c.attempt_count)
        .where(R.c.run_id == run_id, R.c.rollout_id == ordered.c.rollout_id)
        .limit(1)
        .with_for_update()
        .lateral("locked_rollout")
    )
    attempt = (
        select(A.c.sequence_id, A.c.worker_id)
        .where(A.c.run_id == run_id, A.c.rollout_id == rollout.c.rollout_id, A.c.attempt_id == ordered.c.attempt_id)
        .limit(1)
        .with_for_update()
        .lateral("locked_attempt")
    )
    locked = (
        select(
            ordered,
            rollout.c.run_id,
            rollout.c.status.label("r_status"),
            rollout.c.attempt_count,
            attempt.c.sequence_id.label("a_sequence_id"),
            attempt.c.worker_id.label("a_worker_id"),
        )
        .select_from(ordered.join(rollout, true()).join(attempt, true()))
        .limit(bindparam("ua_count", type_=Integer))  # none dropped; for the planner ("Keyed UPDATEs")
        .cte("locked")
        .prefix_with("MATERIALIZED")  # the rows' keys ("Keyed UPDATEs")
    )
    found = select(func.count()).select_from(locked).scalar_subquery() == bindparam("ua_count", type_=Integer)
    named = locked.c.a_worker_id != ""  # no worker (NULL) or upstream's falsy one: no row
    shared = (
        select(func.count(locked.c.a_worker_id) - func.count(func.distinct(locked.c.a_worker_id)))
        .where(named)
        .scalar_subquery()
    )
    ok = and_(found, shared == 0)
    finished = _one_of(locked.c.status, FINISHED_STATUSES)
    write_attempts = (
        update(A)
        .where(
            A.c.run_id == locked.c.run_id,
            A.c.rollout_id == locked.c.rollout_id,
            A.c.attempt_id == locked.c.attempt_id,
            ok,
        )
        .values(
            status=locked.c.status,
            last_heartbeat_time=case((locked.c.heartbeat_given, locked.c.heartbeat), else_=A.c.last_heartbeat_time),
            metadata=case((locked.c.metadata_given, cast(locked.c.metadata, JSONB)), else_=A.c.metadata),
            end_time=case((finished, locked.c.now), else_=A.c.end_time),
        )
        .returning(*A.c, locked.c.n)
        .cte("write_attempts")
    )
    write_rollouts = (
        update(R)
        .where(
            R.c.run_id == locked.c.run_id,
            R.c.rollout_id == locked.c.rollout_id,
            locked.c.a_sequence_id == locked.c.attempt_count,
            locked.c.r_status != "cancelled",
            locked.c.r_status != locked.c.status,
            ok,
        )
        .values(
            status=locked.c.status,
            queue_seq=case((_one_of(locked.c.r_status, QUEUED_STATUSES), None), else_=R.c.queue_seq),
            end_time=case((finished, locked.c.now), else_=R.c.end_time),
        )
        .returning(locked.c.n, finished.label("finished"))
        .cte("write_rollouts")
    )
    # The worker rows in call order (``workers.worker_following``): idle on a finished attempt, busy
    # on one that runs; an existing row keeps the time column the other case sets.
    worker_rows = (
        select(
            locked.c.n,
            locked.c.a_worker_id,
            case((finished, "idle"), else_="busy").label("status"),
            case((finished, None), else_=locked.c.now).label("last_busy_time"),
            case((finished, locked.c.now), else_=None).label("last_idle_time"),
            case((finished, None), else_=locked.c.rollout_id).label("current_rollout_id"),
            case((finished, None), else_=locked.c.attempt_id).label("current_attempt_id"),
        )
        .where(named, ok)
        .order_by(locked.c.n)
        .subquery("worker_rows")
    )
    columns = ("status", "last_busy_time", "last_idle_time", "current_rollout_id", "current_attempt_id")
    upsert = insert("postgresql", W).from_select(
        ["run_id", "worker_id", "create_seq", *columns],
        select(run_id, worker_rows.c.a_worker_id, s.position_seq.next_value(), *(worker_rows.c[c] for c in columns)),
    )
    excluded = upsert.excluded
    write_workers = upsert.on_conflict_do_update(
        index_elements=[W.c.run_id, W.c.worker_id],
        set_={
            "status": excluded.status,
            "current_rollout_id": excluded.current_rollout_id,
            "current_attempt_id": excluded.current_attempt_id,
            "last_busy_time": case((excluded.status == "busy", excluded.last_busy_time), else_=W.c.last_busy_time),
            "last_idle_time": case((excluded.status == "idle", excluded.last_idle_time), else_=W.c.last_idle_time),
        },
    ).cte("write_workers")
    # A volatile output of a subquery is never pruned: the notification goes out with the writes.
    sent = (
        select(func.pg_notify(bindparam("ua_channel", type_=Text), bindparam("ua_payload", type_=Text)).label("sent"))
        .where(exists(select(write_rollouts.c.n).where(write_rollouts.c.finished)))
        .subquery("sent")
    )
    rollout_written = exists(select(write_rollouts.c.n).where(write_rollouts.c.n == write_attempts.c.n))
    return (
        select(
            write_attempts,
            rollout_written.label("rollout_written"),
            select(func.count()).select_from(sent).scalar_subquery().label("notified"),
        )
        .order_by(write_attempts.c.n)
        .add_cte(write_workers)
    )


@dataclass(frozen=True)
class Write:
    """One prebuilt write statement (``build()``, cached under ``key``) and its parameters.  Writes that
    go together must name their parameters apart (a prefix per statement)."""

    key: Hashable
    build: Callable[[], Any]
    params: dict[str, Any]

    def execute(self, ctx: UnitContext) -> Any:
        """Run this write alone."""
        return ctx.execute(cached(self.key, self.build), self.params)


def run_in_order(ctx: UnitContext, writes: Sequence[Write]) -> None:
    """Run ``writes`` one after the other, each seeing the ones before it; consecutive writes of one
    statement go to the driver as one ``executemany`` (which runs them in order too)."""
    start = 0
    while start < len(writes):
        end = start + 1
        while end < len(writes) and writes[end].key == writes[start].key:
            end += 1
        if end - start == 1:
            writes[start].execute(ctx)
        else:
            first = writes[start]
            ctx.execute(cached(first.key, first.build), [write.params for write in writes[start:end]])
        start = end


def run_writes(ctx: UnitContext, writes: Sequence[Write]) -> Any:
    """Run a unit's last writes and return the first row of the first one's RETURNING (or None).

    The writes must touch distinct rows that the unit has locked already (or new rows), and none may
    depend on another's effect: PostgreSQL runs them as ONE statement of data-modifying CTEs (which
    all see the same snapshot), together with the unit's pending notifications, so the unit's
    locks, these writes and COMMIT are its only round trips.  SQLite runs them in order.
    """
    rows = run_writes_rows(ctx, writes, (0,))
    return rows[0] if rows else None


def run_writes_rows(ctx: UnitContext, writes: Sequence[Write], rows_of: Sequence[int]) -> list[Any]:
    """``run_writes``, returning the rows of the RETURNING of each write listed in ``rows_of`` (their
    indices in ``writes``; one row each): the first row of each on SQLite, all of them on PostgreSQL,
    in no set order there."""
    if ctx.dialect != "postgresql":
        rows = []
        wanted = set(rows_of)
        for index, write in enumerate(writes):
            result = write.execute(ctx)
            if index in wanted:
                row = result.first()
                if row is not None:
                    rows.append(row)
        return rows
    payloads = ctx.take_notifications()
    returned = tuple(rows_of)
    key = ("writes_in_one_statement", tuple(write.key for write in writes), returned, bool(payloads))
    stmt = cached(key, lambda: _writes_statement([write.build() for write in writes], returned, notify=bool(payloads)))
    params: dict[str, Any] = {}
    for write in writes:
        params.update(write.params)
    if payloads:
        params["wn_channel"] = ctx.notify_channel
        params["wn_payloads"] = payloads
    return list(ctx.execute(stmt, params))


def _writes_statement(statements: Sequence[Any], returned: tuple[int, ...], *, notify: bool) -> Any:
    ctes = [statement.cte(f"write_{index}") for index, statement in enumerate(statements)]
    if len(returned) == 1:
        stmt = select(ctes[returned[0]])
    else:
        stmt = select(union_all(*(select(ctes[index]) for index in returned)).subquery("written"))
    for index, cte in enumerate(ctes):
        if index not in returned:
            # A data-modifying CTE runs to completion whether or not the outer query reads it.
            stmt = stmt.add_cte(cte)
    if notify:
        events = (
            func.unnest(bindparam("wn_payloads", type_=ARRAY(Text)))
            .table_valued("payload", with_ordinality="n")
            .render_derived(name="events")
        )
        # A volatile output of a subquery is never pruned: every pg_notify runs, in order.
        sent = (
            select(func.pg_notify(bindparam("wn_channel", type_=Text), events.c.payload).label("sent"))
            .order_by(events.c.n)
            .subquery("sent")
        )
        stmt = stmt.add_columns(select(func.count()).select_from(sent).scalar_subquery().label("notified"))
    return stmt
