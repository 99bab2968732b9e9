"""PostgreSQL's runners of the batched operations (docs/architecture.md §7).

Each batch is ONE statement, sent without BEGIN/COMMIT (a statement is atomic on its own): the
batch's keys are array parameters (``dialect.keys_source``), the rows it decides from are locked in
MATERIALIZED CTEs (rollouts first, in ``rollout_id`` order, then attempts: the store's lock order),
and its writes are data-modifying CTEs, with ``pg_notify`` for the events it causes, so a batch is
one round trip.  Statements are compiled once by SQLAlchemy per schema
(``statements.compiled``) and run on asyncpg, whose connection decodes JSON with the engine's codec.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Hashable
from typing import Any

from sqlalchemy import (
    Integer,
    Text,
    and_,
    bindparam,
    case,
    cast,
    func,
    literal,
    null,
    or_,
    select,
    true,
    update,
)
from sqlalchemy import insert as core_insert
from sqlalchemy.dialects.postgresql import JSONB, distinct_on

from lightning_sql.store.sql import attempts as at
from lightning_sql.store.sql import claims as cl
from lightning_sql.store.sql import dialect as d
from lightning_sql.store.sql import rollouts as ro
from lightning_sql.store.sql import schema as s
from lightning_sql.store.sql import spans as sp
from lightning_sql.store.sql.executor import Batch
from lightning_sql.store.sql.rows import ROLLOUT_COLUMNS
from lightning_sql.store.sql.statements import compiled, statement_log
from lightning_sql.store.sql.workers import batch_worker_upsert

R, A, S, W = s.rollouts, s.attempts, s.spans, s.workers
PG = "postgresql"
_RUN = bindparam("run_id", type_=Integer)


class Db:
    """The statements of one runner on one asyncpg connection, with the tables in ``schema``."""

    def __init__(self, conn: Any, schema: str | None, notify_channel: str) -> None:
        self.conn = conn
        self.schema = schema
        self.notify_channel = notify_channel

    async def rows(self, key: Hashable, build: Callable[[], Any], params: dict[str, Any]) -> list[Any]:
        stmt = compiled(PG, self.schema, key, build)
        args = stmt.positional(params)
        if statement_log.isEnabledFor(10):
            statement_log.debug("%s %r", stmt.sql, args)
        return list(await self.conn.fetch(stmt.sql, *args))


def run(conn: Any, schema: str | None, notify_channel: str, batch: Batch) -> Awaitable[Any]:
    """Run ``batch`` (its operation's runner below) on the asyncpg connection ``conn``."""
    return RUNNERS[batch.calls[0].name](Db(conn, schema, notify_channel), batch)


def _keys(name: str, columns: list[d.KeyColumn], rows: list[tuple[Any, ...]]) -> dict[str, Any]:
    return d.keys_params(PG, name, columns, rows)


def _notify(events: Any) -> Any:
    """A column that sends ``pg_notify(channel, payload)`` for each row of ``events`` (a select of
    one ``payload`` column) and counts them: a volatile output of a subquery is never pruned."""
    sent = select(func.pg_notify(bindparam("channel", type_=Text), events.c.payload).label("sent")).subquery("sent")
    return select(func.count()).select_from(sent).scalar_subquery().label("notified")


def _payload(run_id: Any, kind: str) -> Any:
    return func.concat(run_id, literal(f":{kind}", Text)).label("payload")


def _locked_rollouts(keys: Any, *columns: Any, name: str = "locked_rollouts") -> Any:
    """The rollout rows of the batch's ``keys`` (``run_id``, ``rollout_id``), locked in ``rollout_id``
    order, the first step of the store's lock order: a MATERIALIZED CTE of ``columns``."""
    return (
        select(*columns)
        .select_from(keys)
        .join(R, and_(R.c.run_id == keys.c.run_id, R.c.rollout_id == keys.c.rollout_id))
        .order_by(R.c.rollout_id)
        .with_for_update(of=R)
        .cte(name)
        .prefix_with("MATERIALIZED")
    )


# --- claims ---------------------------------------------------------------------------------------

SLOT_KEYS: list[d.KeyColumn] = [("attempt_id", Text()), ("call", Integer()), ("worker_id", Text()), ("now", s.EpochSeconds)]
CALL_KEYS: list[d.KeyColumn] = [("call", Integer()), ("worker_id", Text()), ("now", s.EpochSeconds)]


def _claim_statement() -> Any:
    slots = d.keys_source(PG, "s", SLOT_KEYS)
    calls = d.keys_source(PG, "c", CALL_KEYS)
    limit = bindparam("s__count", type_=Integer)
    ready, due = cl.queue_heads(_RUN, limit, bindparam("now", type_=s.EpochSeconds), lock=True)
    ready, due = ready.cte("ready").prefix_with("MATERIALIZED"), due.cte("due").prefix_with("MATERIALIZED")
    # The claimed rows' keys ("Keyed UPDATEs"); a locked candidate not taken is free at the end.
    picked = cl.queue_order(ready, due, limit).cte("picked").prefix_with("MATERIALIZED")
    claimed = (
        update(R)
        .where(R.c.run_id == picked.c.run_id, R.c.rollout_id == picked.c.rollout_id)
        .values(status="preparing", queue_seq=None, attempt_count=R.c.attempt_count + 1)
        .returning(
            *ROLLOUT_COLUMNS, R.c.attempt_count, picked.c.priority.label("picked_priority"), picked.c.queue_seq.label("picked_seq")
        )
        .cte("claimed")
    )
    order = (claimed.c.picked_priority.desc(), claimed.c.picked_seq)
    ranked = select(claimed, func.row_number().over(order_by=order).label("pos")).cte("ranked")
    assigned = (
        select(ranked, slots.c.attempt_id, slots.c.call, slots.c.worker_id, slots.c.now)
        .select_from(ranked.join(slots, slots.c.n == ranked.c.pos))
        .cte("assigned")
    )
    inserted = core_insert(A).from_select(
        ["run_id", "rollout_id", "attempt_id", "sequence_id", "status", "worker_id", "start_time"],
        select(
            _RUN,
            assigned.c.rollout_id,
            assigned.c.attempt_id,
            assigned.c.attempt_count,
            literal("preparing", Text),
            assigned.c.worker_id,
            assigned.c.now,
        ),
    )
    # Each call's worker: busy on its last claim, or idle when it claimed nothing (claims.Claim).
    last = (
        select(assigned.c.call, assigned.c.rollout_id, assigned.c.attempt_id)
        .ext(distinct_on(assigned.c.call))
        .order_by(assigned.c.call, assigned.c.pos.desc())
        .cte("last_claims")
    )
    busy = last.c.call.isnot(None)
    worker_rows = (
        select(
            _RUN.label("run_id"),
            calls.c.worker_id,
            case((busy, "busy"), else_="idle").label("status"),
            case((busy, calls.c.now), else_=null()).label("last_busy_time"),
            case((busy, null()), else_=calls.c.now).label("last_idle_time"),
            calls.c.now.label("last_dequeue_time"),
            last.c.rollout_id.label("current_rollout_id"),
            last.c.attempt_id.label("current_attempt_id"),
        )
        .select_from(calls.outerjoin(last, last.c.call == calls.c.call))
        .where(or_(~busy, calls.c.worker_id != ""))
    )
    upsert = batch_worker_upsert(PG, "claimed", worker_rows)
    return (
        select(*(assigned.c[c.name] for c in ROLLOUT_COLUMNS), assigned.c.attempt_count, assigned.c.attempt_id)
        .add_cte(inserted.returning(A.c.attempt_id).cte("inserted"))
        .add_cte(upsert.returning(W.c.worker_id).cte("worker_sync"))
        .order_by(assigned.c.pos)
    )


async def claim(db: Db, batch: Batch) -> list[Any]:
    run_id = batch.run_id
    calls: list[tuple[int, cl.Claim]] = list(enumerate(batch.calls, 1))  # type: ignore[arg-type]
    rows: list[Any] = []
    if batch.attempt > 0:  # a replay finds what an earlier try claimed, and those calls are done
        ids = [(aid,) for _n, call in calls for aid in call.attempt_ids]
        params = {"run_id": run_id, **_keys("ids", cl.ATTEMPT_IDS, ids)}
        rows = await db.rows("pg_claim_replayed", lambda: cl.replayed_statement(PG), params)
        done = {row["attempt_id"] for row in rows}
        calls = [(n, call) for n, call in calls if not done.intersection(call.attempt_ids)]
    slot_rows = [(aid, n, call.worker_id, call.now) for n, call in calls for aid in call.attempt_ids]
    worker_calls = [(n, call.worker_id, call.now) for n, call in calls if call.worker_id is not None]
    if not slot_rows and not worker_calls:
        return rows
    now = max(call.now for _n, call in calls)
    params = {"run_id": run_id, "now": now, **_keys("s", SLOT_KEYS, slot_rows), **_keys("c", CALL_KEYS, worker_calls)}
    return rows + await db.rows("pg_claim", _claim_statement, params)


# --- span sequence ids ------------------------------------------------------------------------------


def _reserve_statement() -> Any:
    w = d.keys_source(PG, "w", sp.RESERVE_KEYS)
    locked = _locked_rollouts(w, R.c.rollout_id, name="locked")
    missing = select(w.c.call, w.c.rollout_id).where(w.c.rollout_id.not_in(select(locked.c.rollout_id))).cte("missing")
    totals = (
        select(w.c.rollout_id, func.sum(w.c.count).label("total"))
        .where(w.c.call.not_in(select(missing.c.call)))
        .group_by(w.c.rollout_id)
        .cte("totals")
    )
    bumped = (
        update(R)
        .where(R.c.run_id == _RUN, R.c.rollout_id == totals.c.rollout_id)
        .values(span_seq=R.c.span_seq + totals.c.total)
        .returning(R.c.rollout_id, R.c.span_seq)
        .cte("bumped")
    )
    return select(bumped.c.rollout_id, bumped.c.span_seq, literal(0, Integer).label("missing")).union_all(
        select(missing.c.rollout_id, literal(None, Integer).label("span_seq"), literal(1, Integer).label("missing"))
    )


async def reserve_sequence_ids(db: Db, batch: Batch) -> tuple[dict[str, int], set[str]]:
    params = {"run_id": batch.run_id, **_keys("w", sp.RESERVE_KEYS, sp.ReserveSequenceIds.keys(batch))}
    rows = await db.rows("pg_reserve_sequence_ids", _reserve_statement, params)
    ends = {row["rollout_id"]: row["span_seq"] for row in rows if not row["missing"]}
    return ends, {row["rollout_id"] for row in rows if row["missing"]}


# --- span inserts -----------------------------------------------------------------------------------

_SPAN_VALUE_COLUMNS = [c.name for c in S.c if c.name not in ("id", "run_id")]
SPAN_ROW_KEYS: list[d.KeyColumn] = [
    ("call", Integer()),
    *((name, Text() if isinstance(S.c[name].type, s.JsonValue) else S.c[name].type) for name in _SPAN_VALUE_COLUMNS),
]


def _span_statement(allocate: bool) -> Any:
    g = d.keys_source(PG, "g", sp.GROUP_KEYS)
    rows = d.keys_source(PG, "p", SPAN_ROW_KEYS)
    # The batch's rollouts, each once (a key per rollout: "Keyed UPDATEs" in dialect.py).
    rollouts = (
        select(g.c.run_id, g.c.rollout_id)
        .distinct()
        .limit(bindparam("g__count", type_=Integer))
        .cte("batch_rollouts")
        .prefix_with("MATERIALIZED")
    )
    locked_r = _locked_rollouts(rollouts, R.c.rollout_id, R.c.span_seq, R.c.attempt_count)
    locked_a = (
        select(A.c.rollout_id, A.c.attempt_id, A.c.sequence_id)
        .select_from(g)
        .join(A, and_(A.c.run_id == g.c.run_id, A.c.rollout_id == g.c.rollout_id, A.c.attempt_id == g.c.attempt_id))
        .order_by(A.c.rollout_id, A.c.attempt_id)
        .with_for_update(of=A)
        .cte("locked_attempts")
        .prefix_with("MATERIALIZED")
    )
    checks = (
        select(
            g.c.call,
            g.c.rollout_id,
            g.c.attempt_id,
            g.c.highest,
            g.c.now,
            locked_r.c.rollout_id.label("found_rollout"),
            locked_a.c.attempt_id.label("found_attempt"),
            locked_a.c.sequence_id,
        )
        .select_from(
            g.outerjoin(locked_r, locked_r.c.rollout_id == g.c.rollout_id).outerjoin(
                locked_a, and_(locked_a.c.rollout_id == g.c.rollout_id, locked_a.c.attempt_id == g.c.attempt_id)
            )
        )
        .cte("checks")
    )
    bad = select(checks.c.call).where(or_(checks.c.found_rollout.is_(None), checks.c.found_attempt.is_(None)))
    ok_groups = select(checks).where(checks.c.call.not_in(bad)).cte("ok_groups")
    # The rows of the calls that did not fail, in input order: a key's first occurrence is inserted,
    # a later one meets it in the unique index and is skipped (ON CONFLICT DO NOTHING).
    given = select(rows).where(rows.c.call.not_in(bad)).subquery("given")
    sequence = locked_r.c.span_seq + 1 if allocate else given.c.sequence_id
    values = [
        _RUN,
        *(
            sequence
            if name == "sequence_id"
            else cast(given.c[name], JSONB)
            if isinstance(S.c[name].type, s.JsonValue)
            else given.c[name]
            for name in _SPAN_VALUE_COLUMNS
        ),
    ]
    inserted = (
        d.insert(PG, S)
        .from_select(
            ["run_id", *_SPAN_VALUE_COLUMNS],
            select(*values)
            .select_from(given.join(locked_r, locked_r.c.rollout_id == given.c.rollout_id))
            .order_by(given.c.n),
        )
        .on_conflict_do_nothing()
        .returning(S.c.rollout_id, S.c.attempt_id, S.c.span_id, S.c.sequence_id)
        .cte("inserted")
    )
    touched = (
        select(
            _RUN.label("run_id"),
            ok_groups.c.rollout_id,
            ok_groups.c.attempt_id,
            func.max(ok_groups.c.now).label("now"),
            func.max(ok_groups.c.sequence_id).label("seq"),
        )
        .where(
            select(true())
            .where(inserted.c.rollout_id == ok_groups.c.rollout_id, inserted.c.attempt_id == ok_groups.c.attempt_id)
            .exists()
        )
        .group_by(ok_groups.c.rollout_id, ok_groups.c.attempt_id)
        .cte("touched")
    )
    highest = func.max(locked_r.c.span_seq + 1) if allocate else func.max(ok_groups.c.highest)
    new = (
        select(
            _RUN.label("run_id"),
            ok_groups.c.rollout_id,
            highest.label("highest"),
            func.coalesce(select(func.max(touched.c.seq)).where(touched.c.rollout_id == ok_groups.c.rollout_id).scalar_subquery(), 0).label(
                "touched_seq"
            ),
        )
        .select_from(ok_groups.join(locked_r, locked_r.c.rollout_id == ok_groups.c.rollout_id))
        .group_by(ok_groups.c.rollout_id)
        .cte("new_counters")
    )
    beat = sp.heartbeat(PG, touched).returning(A.c.attempt_id).cte("heartbeats")
    counters = sp.counters(PG, new).returning(R.c.rollout_id).cte("counters")
    found = select(
        literal("c", Text).label("kind"),
        checks.c.rollout_id,
        checks.c.attempt_id,
        checks.c.found_rollout.isnot(None).label("rollout_found"),
        checks.c.found_attempt.isnot(None).label("attempt_found"),
        literal(None, Text).label("span_id"),
        literal(None, Integer).label("sequence_id"),
    )
    stored = select(
        literal("i", Text),
        inserted.c.rollout_id,
        inserted.c.attempt_id,
        literal(True),
        literal(True),
        inserted.c.span_id,
        inserted.c.sequence_id,
    )
    return found.union_all(stored).add_cte(beat).add_cte(counters)


async def add_spans(db: Db, batch: Batch) -> sp.SpanInsert:
    rows = []
    for n, call in enumerate(batch.calls, 1):
        for row in call.rows:  # type: ignore[attr-defined]
            rows.append((n, *(row[name] for name in _SPAN_VALUE_COLUMNS)))
    params = {
        "run_id": batch.run_id,
        **_keys("g", sp.GROUP_KEYS, sp.group_keys(batch)),
        **_keys("p", SPAN_ROW_KEYS, rows),
    }
    allocate = bool(batch.calls[0].allocate)  # type: ignore[attr-defined]
    result = sp.SpanInsert()
    for row in await db.rows(("pg_add_spans", allocate), lambda: _span_statement(allocate), params):
        if row["kind"] == "c":
            result.found[(row["rollout_id"], row["attempt_id"])] = (row["rollout_found"], row["attempt_found"])
        else:
            result.inserted[(row["rollout_id"], row["attempt_id"], row["span_id"])] = row["sequence_id"]
    return result


# --- attempt updates --------------------------------------------------------------------------------


def _update_statement() -> Any:
    keys = d.keys_source(PG, "u", at.UPDATE_KEYS)
    locked_r = _locked_rollouts(keys, *(R.c[name] for name in at.DECISION_ROLLOUT_COLUMNS))
    locked_a = (
        select(A)
        .select_from(keys)
        .join(locked_r, locked_r.c.rollout_id == keys.c.rollout_id)
        .join(A, and_(A.c.run_id == keys.c.run_id, A.c.rollout_id == keys.c.rollout_id, at.attempt_match(keys, locked_r, A)))
        .order_by(A.c.rollout_id, A.c.attempt_id)
        .with_for_update(of=A)
        .cte("locked_attempts")
        .prefix_with("MATERIALIZED")
    )
    dec = at.decided(PG, keys, locked_r, locked_a, _RUN, tables=False).cte("decided")
    written = {name: dec.c[name] for name in ("status", "worker_id", "last_heartbeat_time", "metadata", "end_time")}
    attempts_written = (
        update(A)
        .where(A.c.run_id == _RUN, A.c.rollout_id == dec.c.rollout_id, A.c.attempt_id == dec.c.attempt_id, dec.c.changed == 1)
        .values(written)
        .returning(A.c.attempt_id)
        .cte("attempts_written")
    )
    queue_seq = case(
        (dec.c.new_position == 1, s.position_seq.next_value()), (dec.c.leaves_queue == 1, null()), else_=R.c.queue_seq
    )
    rollouts_written = (
        update(R)
        .where(R.c.run_id == _RUN, R.c.rollout_id == dec.c.rollout_id, dec.c.rollout_changes == 1, dec.c.attempt_id.isnot(None))
        .values(status=dec.c.rollout_status, end_time=dec.c.rollout_end_time, not_before=dec.c.rollout_not_before, queue_seq=queue_seq)
        .returning(R.c.rollout_id, dec.c.finished, dec.c.enters_queue)
        .cte("rollouts_written")
    )
    busy = dec.c.worker_status == "busy"
    worker_rows = (
        select(
            _RUN.label("run_id"),
            dec.c.worker_id,
            dec.c.worker_status.label("status"),
            case((busy, dec.c.now), else_=null()).label("last_busy_time"),
            case((busy, null()), else_=dec.c.now).label("last_idle_time"),
            literal(None, s.EpochSeconds).label("last_dequeue_time"),
            case((busy, dec.c.rollout_id), else_=null()).label("current_rollout_id"),
            case((busy, dec.c.attempt_id), else_=null()).label("current_attempt_id"),
        )
        .where(dec.c.worker_sync == 1, dec.c.attempt_id.isnot(None))
        .ext(distinct_on(dec.c.worker_id))
        .order_by(dec.c.worker_id, dec.c.n.desc())  # several calls of one worker: the last one's write
    )
    workers_written = batch_worker_upsert(PG, "follow", worker_rows).returning(W.c.worker_id).cte("workers_written")
    events = select(_payload(_RUN, "finished")).where(
        select(true()).select_from(rollouts_written).where(rollouts_written.c.finished == 1).exists()
    ).union_all(
        select(_payload(_RUN, "queued")).where(
            select(true()).select_from(rollouts_written).where(rollouts_written.c.enters_queue == 1).exists()
        )
    ).subquery("events")
    return (
        select(dec, _notify(events))
        .add_cte(attempts_written)
        .add_cte(workers_written)
        .order_by(dec.c.n)
    )


async def update_attempts(db: Db, batch: Batch) -> list[Any]:
    keys = [call.key_row() for call in batch.calls]  # type: ignore[attr-defined]
    params = {"run_id": batch.run_id, "channel": db.notify_channel, **_keys("u", at.UPDATE_KEYS, keys)}
    rows = await db.rows("pg_update_attempts", _update_statement, params)
    for row in rows:  # announced in this process; the statement notified the others
        if row["attempt_id"] is not None and row["finished"]:
            batch.announce("finished")
        if row["attempt_id"] is not None and row["enters_queue"]:
            batch.announce("queued")
    batch.events.notified.update(batch.events.events)
    return rows


# --- reads ----------------------------------------------------------------------------------------


async def read_spans(db: Db, batch: Batch) -> tuple[list[Any], int | None]:
    params, key, paged = sp.read_params(PG, batch)
    rows: list[Any] = []
    if batch.calls[0].limit != 0:  # type: ignore[attr-defined]
        rows = await db.rows(("pg_read_spans", key), lambda: sp.read_statements(PG, *key)[0], params)
    if not paged:
        return rows, None
    counted = await db.rows(("pg_count_spans", key), lambda: sp.read_statements(PG, *key)[1], params)
    return rows, int(counted[0]["total"])


async def read_rollouts(db: Db, batch: Batch) -> list[Any]:
    params, single = ro.read_rollout_params(PG, batch)
    return await db.rows(("pg_read_rollout", single), lambda: ro.read_rollout_statement(PG, single), params)


RUNNERS: dict[str, Callable[[Db, Batch], Awaitable[Any]]] = {
    "claim": claim,
    "reserve_sequence_ids": reserve_sequence_ids,
    "add_spans": add_spans,
    "update_attempt": update_attempts,
    "query_spans": read_spans,
    "read_rollout": read_rollouts,
}
