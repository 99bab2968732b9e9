"""SQLite's runners of the batched operations (docs/architecture.md §7).

Each runner takes a batch and the writer's (or the reader's) ``sqlite3`` connection, inside the
transaction the executor began, and returns what its operation's ``outcomes`` reads.  SQLite has
no data-modifying CTEs, but its writers are serialised and a statement costs no round trip: a runner
is a few set-based statements (the batch's keys are ONE parameter, read with ``json_each``), and
the rows a decision comes from are read in the same transaction as the writes.  Statements are
compiled once by SQLAlchemy (``statements.compiled``) and run on the driver connection.
"""

from __future__ import annotations

import sqlite3
from collections.abc import Callable, Hashable
from functools import partial
from typing import Any

from sqlalchemy import Integer, Text, and_, bindparam, case, select, update

from lightning_sql.store.sql import attempts as at
from lightning_sql.store.sql import claims as cl
from lightning_sql.store.sql import dialect as d
from lightning_sql.store.sql import rollouts as ro
from lightning_sql.store.sql import schema as s
from lightning_sql.store.sql import spans as sp
from lightning_sql.store.sql.executor import Batch
from lightning_sql.store.sql.rows import ROLLOUT_COLUMNS, json_deserializer
from lightning_sql.store.sql.statements import compiled, statement_log
from lightning_sql.store.sql.workers import batch_worker_upsert, following

R, A, S = s.rollouts, s.attempts, s.spans
SQLITE = "sqlite"
# JSON columns come back from sqlite3 as text: these names are decoded wherever a runner reads them.
JSON_COLUMNS = frozenset(
    {"input", "metadata", "retry_condition", "attributes", "events", "links", "resource", "extra", "a_metadata"}
)
# Rows per multi-row INSERT: 16 span columns each, well within SQLite's 32,766 bound parameters.  A
# batch's rows go in chunks of powers of two up to this, so that nine statement texts serve every
# batch: compiling one costs far more than running it, and each is compiled once per process.
SPAN_INSERT_CHUNK = 256


class Db:
    """The statements of one runner on one ``sqlite3`` connection."""

    def __init__(self, driver: sqlite3.Connection) -> None:
        self.driver = driver

    def rows(
        self, key: Hashable, build: Callable[[], Any], params: dict[str, Any] | None = None, values: list[Any] | None = None
    ) -> list[dict[str, Any]]:
        """The rows of a statement as dicts, JSON columns decoded: its parameters by name, or with
        ``values`` already in the statement's order."""
        stmt = compiled(SQLITE, None, key, build)
        bound = stmt.positional(params or {}) if values is None else values
        if statement_log.isEnabledFor(10):
            statement_log.debug("%s %r", stmt.sql, bound)
        cursor = self.driver.execute(stmt.sql, bound)
        names = [column[0] for column in cursor.description or ()]
        decoded = [name for name in names if name in JSON_COLUMNS]
        out = []
        for row in cursor:
            item = dict(zip(names, row, strict=True))
            for name in decoded:
                text = item[name]
                # A JSON column has NUMERIC affinity in SQLite: a top-level number comes back as one.
                if isinstance(text, str):
                    item[name] = json_deserializer(text)
            out.append(item)
        return out

    def execute(self, key: Hashable, build: Callable[[], Any], params: list[dict[str, Any]]) -> None:
        """Run a statement once per parameter set."""
        if not params:
            return
        stmt = compiled(SQLITE, None, key, build)
        bound = [stmt.positional(p) for p in params]
        if statement_log.isEnabledFor(10):
            statement_log.debug("%s %r", stmt.sql, bound)
        self.driver.executemany(stmt.sql, bound)


def run(driver: sqlite3.Connection, batch: Batch) -> Any:
    """Run ``batch`` (its operation's runner below) on ``driver``."""
    return RUNNERS[batch.calls[0].name](Db(driver), batch)


def _keys(name: str, columns: list[d.KeyColumn], rows: list[tuple[Any, ...]]) -> dict[str, Any]:
    return d.keys_params(SQLITE, name, columns, rows)


_RUN = bindparam("run_id", type_=Integer)


# --- claims ---------------------------------------------------------------------------------------


def _pick() -> Any:
    limit = bindparam("limit", type_=Integer)
    ready, due = cl.queue_heads(_RUN, limit, bindparam("now", type_=s.EpochSeconds), lock=False)
    return cl.queue_order(ready.subquery("ready"), due.subquery("due"), limit)


_IDS = [("rollout_id", Text())]


def _mark() -> Any:
    ids = d.keys_source(SQLITE, "ids", _IDS)
    return (
        update(R)
        .where(R.c.run_id == _RUN, R.c.rollout_id.in_(select(ids.c.rollout_id)))
        .values(status="preparing", queue_seq=None, attempt_count=R.c.attempt_count + 1)
        .returning(*ROLLOUT_COLUMNS, R.c.attempt_count)
    )


def _insert_attempt() -> Any:
    return A.insert().values(
        run_id=_RUN,
        rollout_id=bindparam("rollout_id"),
        attempt_id=bindparam("attempt_id"),
        sequence_id=bindparam("sequence_id"),
        status="preparing",
        worker_id=bindparam("worker_id"),
        start_time=bindparam("now"),
    )


def claim(db: Db, batch: Batch) -> list[dict[str, Any]]:
    run_id = batch.run_id
    calls: list[cl.Claim] = list(batch.calls)  # type: ignore[arg-type]
    rows: list[dict[str, Any]] = []
    if batch.attempt > 0:  # a replay finds what an earlier try claimed, and those calls are done
        ids = [(aid,) for call in calls for aid in call.attempt_ids]
        params = {"run_id": run_id, **_keys("ids", cl.ATTEMPT_IDS, ids)}
        rows = db.rows("sqlite_claim_replayed", lambda: cl.replayed_statement(SQLITE), params)
        done = {row["attempt_id"] for row in rows}
        calls = [call for call in calls if not done.intersection(call.attempt_ids)]
    slots = [(call, aid) for call in calls for aid in call.attempt_ids]
    now = max((call.now for call in calls), default=0.0)
    pick = {"run_id": run_id, "limit": len(slots), "now": now}
    picked = [row["rollout_id"] for row in db.rows("sqlite_claim_pick", _pick, pick)] if slots else []
    claimed_by: dict[int, list[dict[str, Any]]] = {}
    if picked:
        marked = db.rows("sqlite_claim_mark", _mark, {"run_id": run_id, **_keys("ids", _IDS, [(rid,) for rid in picked])})
        by_id = {row["rollout_id"]: row for row in marked}
        inserts = []
        for (call, attempt_id), rid in zip(slots, picked, strict=False):  # the queue may hold fewer
            row = {**by_id[rid], "attempt_id": attempt_id}
            rows.append(row)
            claimed_by.setdefault(id(call), []).append(row)
            inserts.append(
                {
                    "run_id": run_id,
                    "rollout_id": rid,
                    "attempt_id": attempt_id,
                    "sequence_id": row["attempt_count"],
                    "worker_id": call.worker_id,
                    "now": call.now,
                }
            )
        db.execute("sqlite_claim_attempts", _insert_attempt, inserts)
    workers = []
    for call in calls:
        mine = claimed_by.get(id(call), [])
        effect = call.worker_effect(len(mine))
        if effect is None:
            continue
        last = mine[-1] if mine else None
        workers.append(
            {
                "w_run_id": run_id,
                "w_worker_id": call.worker_id,
                "w_status": effect,
                "w_last_busy_time": call.now if last else None,
                "w_last_idle_time": None if last else call.now,
                "w_last_dequeue_time": call.now,
                "w_current_rollout_id": last["rollout_id"] if last else None,
                "w_current_attempt_id": last["attempt_id"] if last else None,
            }
        )
    db.execute("sqlite_claim_workers", lambda: batch_worker_upsert(SQLITE, "claimed", None), workers)
    return rows


# --- span sequence ids ------------------------------------------------------------------------------

_TOTALS = [("rollout_id", Text()), ("count", Integer())]


def _existing() -> Any:
    ids = d.keys_source(SQLITE, "ids", _IDS)
    return select(R.c.rollout_id).where(R.c.run_id == _RUN, R.c.rollout_id.in_(select(ids.c.rollout_id)))


def _bump() -> Any:
    totals = d.keys_source(SQLITE, "t", _TOTALS)
    bump = d.keyed_update(SQLITE, R, totals, ("rollout_id",), lambda key: {"span_seq": R.c.span_seq + key("count")})
    return bump.returning(R.c.rollout_id, R.c.span_seq)


def reserve_sequence_ids(db: Db, batch: Batch) -> tuple[dict[str, int], set[str]]:
    keys = sp.ReserveSequenceIds.keys(batch)
    wanted = sorted({rid for _n, rid, _count in keys})
    params = {"run_id": batch.run_id, **_keys("ids", _IDS, [(rid,) for rid in wanted])}
    existing = {row["rollout_id"] for row in db.rows("sqlite_rollouts_exist", _existing, params)}
    missing = set(wanted) - existing
    bad = {n for n, rid, _count in keys if rid in missing}
    totals: dict[str, int] = {}
    for n, rid, count in keys:
        if n not in bad:
            totals[rid] = totals.get(rid, 0) + count
    ends: dict[str, int] = {}
    if totals:
        params = {"run_id": batch.run_id, **_keys("t", _TOTALS, sorted(totals.items()))}
        ends = {row["rollout_id"]: row["span_seq"] for row in db.rows("sqlite_span_seq_bump", _bump, params)}
    return ends, missing


# --- span inserts -----------------------------------------------------------------------------------


def _group_check() -> Any:
    g = d.keys_source(SQLITE, "g", sp.GROUP_KEYS)
    return select(
        g.c.call,
        g.c.rollout_id,
        g.c.attempt_id,
        R.c.rollout_id.label("found_rollout"),
        R.c.span_seq,
        A.c.attempt_id.label("found_attempt"),
        A.c.sequence_id,
    ).select_from(
        g.outerjoin(R, and_(R.c.run_id == _RUN, R.c.rollout_id == g.c.rollout_id)).outerjoin(
            A, and_(A.c.run_id == _RUN, A.c.rollout_id == g.c.rollout_id, A.c.attempt_id == g.c.attempt_id)
        )
    )


_SPAN_VALUE_COLUMNS = [c.name for c in S.c if c.name not in ("id", "run_id")]


def _span_insert(rows: int) -> Any:
    """A multi-row INSERT of ``rows`` spans, skipping the keys already stored; its parameters are
    ``<column>_<i>``, row by row in column order (``add_spans`` binds them in that order)."""
    names = ("run_id", *_SPAN_VALUE_COLUMNS)
    values: list[dict[str, Any]] = [{name: bindparam(f"{name}_{i}") for name in names} for i in range(rows)]
    return (
        d.insert(SQLITE, S)
        .values(values)
        .on_conflict_do_nothing()
        .returning(S.c.rollout_id, S.c.attempt_id, S.c.span_id, S.c.sequence_id)
    )


def _heartbeat() -> Any:
    return sp.heartbeat(SQLITE, d.keys_source(SQLITE, "t", sp.TOUCHED_KEYS))


def _counters() -> Any:
    return sp.counters(SQLITE, d.keys_source(SQLITE, "c", sp.COUNTER_KEYS))


def add_spans(db: Db, batch: Batch) -> sp.SpanInsert:
    run_id = batch.run_id
    calls: list[sp.AddSpans] = batch.calls  # type: ignore[assignment]
    groups = sp.group_keys(batch)
    checks = db.rows("sqlite_span_groups", _group_check, {"run_id": run_id, **_keys("g", sp.GROUP_KEYS, groups)})
    result = sp.SpanInsert()
    counter: dict[str, int] = {}  # each rollout's span_seq
    attempt_seq: dict[tuple[str, str], int] = {}
    for row in checks:
        key = (row["rollout_id"], row["attempt_id"])
        result.found[key] = (row["found_rollout"] is not None, row["found_attempt"] is not None)
        if row["found_rollout"] is not None:
            counter[row["rollout_id"]] = row["span_seq"]
        if row["found_attempt"] is not None:
            attempt_seq[key] = row["sequence_id"]
    bad = {n for n, call in enumerate(calls, 1) if call.error(result.found) is not None}
    rows = [row for _n, row in sp.insert_rows(batch, bad)]
    if calls[0].allocate:
        rows = [{**row, "sequence_id": counter[row["rollout_id"]] + 1} for row in rows]
    start = 0
    while start < len(rows):
        size = min(SPAN_INSERT_CHUNK, 1 << ((len(rows) - start).bit_length() - 1))
        chunk = rows[start : start + size]
        start += size
        # In the statement's order: row by row, run_id then the value columns (_span_insert).
        values = [value for row in chunk for value in (run_id, *(row[name] for name in _SPAN_VALUE_COLUMNS))]
        for stored in db.rows(("sqlite_span_insert", size), partial(_span_insert, size), values=values):
            result.inserted[(stored["rollout_id"], stored["attempt_id"], stored["span_id"])] = stored["sequence_id"]
    # Each rollout's new counter, and each (rollout, attempt) that inserted a span: its heartbeat at
    # the latest now of its calls, and the highest such attempt's sequence id (the promotion).
    highest: dict[str, int] = {}
    for row in rows:
        highest[row["rollout_id"]] = max(highest.get(row["rollout_id"], 0), row["sequence_id"])
    touched: dict[tuple[str, str], float] = {}
    inserted_groups = {(rid, aid) for rid, aid, _span_id in result.inserted}
    for n, rid, aid, seq, now in groups:
        if n not in bad:
            highest[rid] = max(highest.get(rid, 0), seq)
            if (rid, aid) in inserted_groups:
                touched[(rid, aid)] = max(touched.get((rid, aid), now), now)
    if touched:
        beats = [(rid, aid, now) for (rid, aid), now in sorted(touched.items())]
        db.execute("sqlite_span_heartbeat", _heartbeat, [{"run_id": run_id, **_keys("t", sp.TOUCHED_KEYS, beats)}])
    touched_seq: dict[str, int] = {}
    for rid, aid in touched:
        touched_seq[rid] = max(touched_seq.get(rid, 0), attempt_seq[(rid, aid)])
    if highest:
        new = [(rid, seq, touched_seq.get(rid, 0)) for rid, seq in sorted(highest.items())]
        db.execute("sqlite_span_counters", _counters, [{"run_id": run_id, **_keys("c", sp.COUNTER_KEYS, new)}])
    return result


# --- attempt updates --------------------------------------------------------------------------------


def _decided() -> Any:
    keys = d.keys_source(SQLITE, "u", at.UPDATE_KEYS)
    return at.decided(SQLITE, keys, R, A, keys.c.run_id, tables=True)


_WRITTEN = (("status", "status"), ("worker_id", "worker"), ("last_heartbeat_time", "hb"), ("metadata", "meta"))


def _write_attempt() -> Any:
    """The update of one attempt: the columns its call gives (``set_*``), and its ``end_time``."""
    values: dict[str, Any] = {
        column: case((bindparam(f"set_{short}", type_=Integer) == 1, bindparam(f"v_{short}")), else_=A.c[column])
        for column, short in _WRITTEN
    }
    values["end_time"] = bindparam("v_end_time")
    return (
        update(A)
        .where(A.c.run_id == _RUN, A.c.rollout_id == bindparam("k_rollout_id"), A.c.attempt_id == bindparam("k_attempt_id"))
        .values(values)
    )


def _write_rollout() -> Any:
    set_queue = bindparam("set_queue", type_=Integer) == 1
    return (
        update(R)
        .where(R.c.run_id == _RUN, R.c.rollout_id == bindparam("k_rollout_id"))
        .values(
            status=bindparam("v_status"),
            end_time=bindparam("v_end_time"),
            not_before=bindparam("v_not_before"),
            queue_seq=case((set_queue, bindparam("v_queue_seq")), else_=R.c.queue_seq),
        )
    )


def _positions() -> Any:
    count = bindparam("count", type_=Integer)
    return update(s.runs).where(s.runs.c.run_id == _RUN).values(seq=s.runs.c.seq + count).returning(s.runs.c.seq)


def update_attempts(db: Db, batch: Batch) -> list[dict[str, Any]]:
    run_id = batch.run_id
    calls: list[at.UpdateAttempt] = batch.calls  # type: ignore[assignment]
    keys = [call.key_row() for call in calls]
    rows = db.rows("sqlite_attempt_decided", _decided, {"run_id": run_id, **_keys("u", at.UPDATE_KEYS, keys)})
    attempt_writes, rollout_writes, workers = [], [], []
    changes = [row for row in rows if row["attempt_id"] is not None and row["rollout_changes"]]
    positions = iter(_allocate(db, run_id, sum(row["new_position"] for row in changes)))
    for row in rows:
        if row["attempt_id"] is None:
            continue
        call = calls[row["n"] - 1]
        key = {"run_id": run_id, "k_rollout_id": row["rollout_id"]}
        if row["changed"]:
            written: dict[str, Any] = {}
            for column, short in _WRITTEN:
                given = column in call.changes
                written[f"set_{short}"] = int(given)
                written[f"v_{short}"] = call.changes[column] if given else None
            attempt_writes.append({**key, "k_attempt_id": row["attempt_id"], "v_end_time": row["end_time"], **written})
        if row["rollout_changes"]:
            moves = bool(row["new_position"] or row["leaves_queue"])
            rollout_writes.append(
                {
                    **key,
                    "v_status": row["rollout_status"],
                    "v_end_time": row["rollout_end_time"],
                    "v_not_before": row["rollout_not_before"],
                    "set_queue": int(moves),
                    "v_queue_seq": next(positions) if row["new_position"] else None,
                }
            )
            if row["finished"]:
                batch.announce("finished")
            if row["enters_queue"]:
                batch.announce("queued")
        if row["worker_sync"]:
            workers.append(following(run_id, row["worker_id"], row["status"], row["now"], row["rollout_id"], row["attempt_id"]))
    db.execute("sqlite_attempt_write", _write_attempt, attempt_writes)
    db.execute("sqlite_attempt_rollout", _write_rollout, rollout_writes)
    db.execute("sqlite_attempt_workers", lambda: batch_worker_upsert(SQLITE, "follow", None), workers)
    return rows


def _allocate(db: Db, run_id: int, count: int) -> list[int]:
    """``count`` fresh queue positions of the run (``runs.seq``; writers are serialised)."""
    if count <= 0:
        return []
    end = db.rows("sqlite_positions", _positions, {"run_id": run_id, "count": count})[0]["seq"]
    return list(range(int(end) - count + 1, int(end) + 1))


# --- reads ----------------------------------------------------------------------------------------


def read_spans(db: Db, batch: Batch) -> tuple[list[Any], int | None]:
    params, key, paged = sp.read_params(SQLITE, batch)
    rows: list[Any] = []
    if batch.calls[0].limit != 0:  # type: ignore[attr-defined]
        rows = db.rows(("sqlite_read_spans", key), lambda: sp.read_statements(SQLITE, *key)[0], params)
    if not paged:
        return rows, None
    counted = db.rows(("sqlite_count_spans", key), lambda: sp.read_statements(SQLITE, *key)[1], params)
    return rows, int(counted[0]["total"])


def read_rollouts(db: Db, batch: Batch) -> list[Any]:
    params, single = ro.read_rollout_params(SQLITE, batch)
    return db.rows(("sqlite_read_rollout", single), lambda: ro.read_rollout_statement(SQLITE, single), params)


RUNNERS: dict[str, Callable[[Db, Batch], Any]] = {
    "claim": claim,
    "reserve_sequence_ids": reserve_sequence_ids,
    "add_spans": add_spans,
    "update_attempt": update_attempts,
    "query_spans": read_spans,
    "read_rollout": read_rollouts,
}
