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

from collections import namedtuple
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass
from typing import Any

from sqlalchemy import (
    BigInteger,
    ColumnElement,
    Float,
    Integer,
    Select,
    Table,
    Text,
    and_,
    bindparam,
    func,
    literal,
    select,
    true,
    tuple_,
    update,
)
from sqlalchemy import (
    insert as core_insert,
)
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.dialects.postgresql import ARRAY

from lightning_sql.store.sql import schema as s
from lightning_sql.store.sql.executor import EncodedJson, UnitContext
from lightning_sql.store.sql.rows import SPAN_JSON_FIELDS
from lightning_sql.store.sql.statements import cached


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
    """Case-sensitive substring test with no LIKE metacharacters (docs/store-contract.md §2.17)."""
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


_CLAIM_WORKER_COLUMNS = ("status", "last_busy_time", "current_rollout_id", "current_attempt_id", "last_dequeue_time")


def _claim_statement(returning: Sequence[Any], *, with_worker: bool) -> Any:
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
    if not with_worker:
        return stmt
    W = s.workers
    last_claimed = (
        select(
            run_id,
            worker_id,
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


def insert_new_spans(ctx: UnitContext, rows: Sequence[dict[str, Any]]) -> set[tuple[str, str, str]]:
    """Insert span rows (distinct keys) except those already stored; the (rollout, attempt, span) keys
    inserted.  One ``INSERT ... ON CONFLICT DO NOTHING RETURNING`` on both dialects (SQLAlchemy sends
    a list of rows as multi-row statements): concurrent writers decide by the unique key."""
    S = s.spans
    stmt = cached(
        ("span_insert_returning", ctx.dialect),
        lambda: insert(ctx, S).on_conflict_do_nothing().returning(S.c.rollout_id, S.c.attempt_id, S.c.span_id),
    )
    # The JSON columns bind through the engine's serializer, which passes EncodedJson through.
    return {(r[0], r[1], r[2]) for r in ctx.execute(stmt, _json_marked(rows))}


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


def _keys(derived: str, count: Any, **arrays: Any) -> Select[Any]:
    """The keys of a keyed statement: the rows of parallel array parameters (``unnest``), one
    column per keyword, ending in ``LIMIT count``, ``count`` being how many there are ("Keyed
    UPDATEs" above: a generic plan then counts on one key, not ten)."""
    return select(func.unnest(*arrays.values()).table_valued(*arrays).render_derived(name=derived)).limit(count)


def lock_rollout_and_attempt(
    ctx: UnitContext, run_id: int, rollout_id: str, attempt_id: str, columns: Sequence[Any]
) -> tuple[Any, Any]:
    """A rollout row and its attempt (``attempt_id`` or ``"latest"``) in ONE statement, for a write unit.

    Returns (the rollout row with ``columns``, ``attempt_count`` and ``queue_seq``, or None; the
    attempt row, or None).  PostgreSQL locks both, the rollout first: the attempt is a LATERAL
    subquery of the locked rollout row (lock order, docs/store-contract.md §2.17).  SQLite reads both with one
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
_AttemptRow = namedtuple("_AttemptRow", _ATTEMPT_NAMES)  # type: ignore[misc]


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


def attempts_by_sequence(ctx: UnitContext, run_id: int, pairs: Sequence[tuple[str, int]]) -> list[Any]:
    """The attempt rows (``select(attempts)``'s columns) of ``(rollout id, sequence id)`` pairs of
    the run that exist: each rollout's latest attempt, for a page of rollouts read back.

    PostgreSQL: ONE statement for any number of pairs, one look-up per pair by its key (``LATERAL
    ... LIMIT 1`` on the pairs of two array parameters, the module's keyed look-ups).  A row-value
    ``IN`` list, the form SQLite takes, was planned there as a read of every attempt of the run
    with the pairs' sequence id, filtered by an ``OR`` of the ids, whenever the pairs share that id
    (a page of first attempts), a cost that grows with the run.  SQLite: that list, in chunks of 500 pairs
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


_ATTEMPTS_BY_PAIRS_IN = select(s.attempts).where(
    s.attempts.c.run_id == bindparam("la_run_id"),
    tuple_(s.attempts.c.rollout_id, s.attempts.c.sequence_id).in_(bindparam("la_pairs", expanding=True)),
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
    in-flight rollout of the run filtered by the list.  SQLite: that list, which it reads by key."""
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


def run_writes(ctx: UnitContext, writes: Sequence[Write]) -> Any:
    """Run a unit's last writes and return the first row of the first one's RETURNING (or None).

    The writes must touch distinct rows that the unit has locked already (or new rows), and none may
    depend on another's effect: PostgreSQL runs them as ONE statement of data-modifying CTEs (which
    all see the same snapshot), together with the unit's pending notifications, so the unit's
    locks, these writes and COMMIT are its only round trips.  SQLite runs them in order.
    """
    if ctx.dialect != "postgresql":
        first = None
        for index, write in enumerate(writes):
            result = write.execute(ctx)
            if index == 0:
                first = result.first()
        return first
    payloads = ctx.take_notifications()
    key = ("writes_in_one_statement", tuple(write.key for write in writes), bool(payloads))
    stmt = cached(key, lambda: _writes_statement([write.build() for write in writes], notify=bool(payloads)))
    params: dict[str, Any] = {}
    for write in writes:
        params.update(write.params)
    if payloads:
        params["wn_channel"] = ctx.notify_channel
        params["wn_payloads"] = payloads
    return ctx.execute(stmt, params).first()


def _writes_statement(statements: Sequence[Any], *, notify: bool) -> Any:
    """The writes as data-modifying CTEs, returning the first one's rows."""
    first, *others = [statement.cte(f"write_{index}") for index, statement in enumerate(statements)]
    stmt = select(first)
    for cte in others:
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
