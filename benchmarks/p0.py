"""P0: the physical limit of this machine, re-measured in every run, for a claim (W4) and for a
span read-back (W6).

Claim: the statements a store claim issues (pick the lowest queued row, mark it ``preparing`` and
return it, insert its attempt, upsert the worker), run through the raw driver on the store's own
tables and indexes:

* PostgreSQL: an asyncpg loop on 8 connections, one transaction per claim, ``FOR UPDATE SKIP LOCKED``;
* SQLite: the stdlib ``sqlite3`` driver doing the same in one writer thread, ``BEGIN IMMEDIATE``.

Read-back: the SELECT of ``query_spans(rid, "latest")`` (a rollout's spans of its latest attempt,
in ``sequence_id`` order) through the raw driver, one rollout after the other as W6 calls it, with
the five JSON columns decoded by the parser the store uses and no models built: asyncpg on one
connection (a prepared statement; JSONB arrives as text), ``sqlite3`` in the calling thread.

The queue and the spans are written through the store (not timed), so the rows, indexes and JSON
are identical.
"""

from __future__ import annotations

import asyncio
import sqlite3
import threading
import time
import uuid
from typing import Any

from pydantic_core import from_json

P0_PG_CONNECTIONS = 8


# The head of the claimable queue in claim order, as the store's claim reads it through the partial
# index ix_rollouts_queue (revision 0005: priority, then queue order; rollouts in back-off elsewhere).
PG_PICK = (
    "SELECT rollout_id FROM rollouts WHERE run_id = $1 AND queue_seq IS NOT NULL AND not_before IS NULL "
    "ORDER BY priority DESC, queue_seq LIMIT 1 FOR UPDATE SKIP LOCKED"
)
PG_MARK = (
    "UPDATE rollouts SET status = 'preparing', queue_seq = NULL, attempt_count = attempt_count + 1 "
    "WHERE run_id = $1 AND rollout_id = ANY($2::text[]) RETURNING "
    "rollout_id, input, mode, resources_id, resources_version, status, timeout_seconds, "
    "unresponsive_seconds, max_attempts, retry_condition, metadata, idempotency_key, start_time, "
    "end_time, create_seq, attempt_count"
)
PG_ATTEMPT = (
    "INSERT INTO attempts (run_id, rollout_id, attempt_id, sequence_id, status, worker_id, start_time) "
    "VALUES ($1, $2, $3, $4, 'preparing', $5, $6)"
)
PG_WORKER = (
    "INSERT INTO workers (run_id, worker_id, status, last_busy_time, current_rollout_id, current_attempt_id, "
    "last_dequeue_time, create_seq) VALUES ($1, $2, 'busy', $3, $4, $5, $3, nextval('lightning_sql_position_seq')) "
    "ON CONFLICT (run_id, worker_id) DO UPDATE SET status = excluded.status, last_busy_time = excluded.last_busy_time, "
    "current_rollout_id = excluded.current_rollout_id, current_attempt_id = excluded.current_attempt_id, "
    "last_dequeue_time = excluded.last_dequeue_time"
)

SQLITE_PICK = (
    "SELECT rollout_id FROM rollouts WHERE run_id = ? AND queue_seq IS NOT NULL AND not_before IS NULL "
    "ORDER BY priority DESC, queue_seq LIMIT 1"
)
SQLITE_MARK = (
    "UPDATE rollouts SET status = 'preparing', queue_seq = NULL, attempt_count = attempt_count + 1 "
    "WHERE run_id = ? AND rollout_id IN (?) RETURNING "
    "rollout_id, input, mode, resources_id, resources_version, status, timeout_seconds, "
    "unresponsive_seconds, max_attempts, retry_condition, metadata, idempotency_key, start_time, "
    "end_time, create_seq, attempt_count"
)
SQLITE_ATTEMPT = PG_ATTEMPT.replace("$1, $2, $3, $4", "?, ?, ?, ?").replace("$5, $6", "?, ?")
SQLITE_POSITION = "UPDATE runs SET seq = seq + 1 WHERE run_id = ? RETURNING seq"
SQLITE_WORKER = (
    "INSERT INTO workers (run_id, worker_id, status, last_busy_time, current_rollout_id, current_attempt_id, "
    "last_dequeue_time, create_seq) VALUES (?, ?, 'busy', ?, ?, ?, ?, ?) "
    "ON CONFLICT (run_id, worker_id) DO UPDATE SET status = excluded.status, last_busy_time = excluded.last_busy_time, "
    "current_rollout_id = excluded.current_rollout_id, current_attempt_id = excluded.current_attempt_id, "
    "last_dequeue_time = excluded.last_dequeue_time"
)


PG_READBACK = (
    "SELECT rollout_id, attempt_id, sequence_id, trace_id, span_id, parent_id, name, status_code, "
    "start_time, end_time, attributes, events, links, resource, extra "
    "FROM spans WHERE run_id = $1 AND rollout_id = $2 AND attempt_id = "
    "(SELECT attempt_id FROM attempts WHERE run_id = $1 AND rollout_id = $2 ORDER BY sequence_id DESC LIMIT 1) "
    "ORDER BY sequence_id"
)
SQLITE_READBACK = PG_READBACK.replace("$1", "?1").replace("$2", "?2")
SPAN_SEQUENCE_COLUMN = 2
SPAN_JSON_COLUMNS = range(10, 15)  # attributes .. extra


def _decoded(rows: Any) -> list[int]:
    """Decode a read-back's JSON columns (as a caller of the raw driver must to use them); the
    rows' sequence ids, for the checks."""
    for row in rows:
        for index in SPAN_JSON_COLUMNS:
            value = row[index]
            if value is not None:
                from_json(value)
    return [row[SPAN_SEQUENCE_COLUMN] for row in rows]


async def pg_readback_loop(dsn: str, schema: str, run_id: int, rollout_ids: list[str]) -> dict[str, Any]:
    """Read back each rollout's latest spans, one after the other, on one asyncpg connection."""
    import asyncpg

    conn = await asyncpg.connect(dsn, server_settings={"search_path": schema})
    try:
        statement = await conn.prepare(PG_READBACK)
        sequences: dict[str, list[int]] = {}
        started = time.perf_counter()
        for rid in rollout_ids:
            sequences[rid] = _decoded(await statement.fetch(run_id, rid))
        elapsed = time.perf_counter() - started
    finally:
        await conn.close()
    return {"sequences": sequences, "elapsed": elapsed}


def sqlite_readback_loop(path: str, run_id: int, rollout_ids: list[str]) -> dict[str, Any]:
    """Read back each rollout's latest spans, one after the other, in the calling thread."""
    conn = sqlite3.connect(path, isolation_level=None, check_same_thread=False)
    try:
        sequences: dict[str, list[int]] = {}
        started = time.perf_counter()
        for rid in rollout_ids:
            sequences[rid] = _decoded(conn.execute(SQLITE_READBACK, (run_id, rid)).fetchall())
        elapsed = time.perf_counter() - started
    finally:
        conn.close()
    return {"sequences": sequences, "elapsed": elapsed}


def _attempt_id() -> str:
    return "at-" + uuid.uuid4().hex[:12]


async def pg_claim_loop(dsn: str, schema: str, run_id: int, connections: int = P0_PG_CONNECTIONS) -> dict[str, Any]:
    """Claim until the queue is empty on ``connections`` asyncpg connections; claimed ids and latencies."""
    import asyncpg

    conns = [
        await asyncpg.connect(dsn, server_settings={"search_path": schema}) for _ in range(connections)
    ]
    claimed: list[str] = []
    latencies: list[float] = []

    async def claimer(conn: Any, worker_id: str) -> None:
        while True:
            t0 = time.perf_counter()
            async with conn.transaction():
                picked = await conn.fetch(PG_PICK, run_id)
                if not picked:
                    return
                ids = [r[0] for r in picked]
                rows = await conn.fetch(PG_MARK, run_id, ids)
                now = time.time()
                aid = _attempt_id()
                for row in rows:
                    await conn.execute(PG_ATTEMPT, run_id, row["rollout_id"], aid, row["attempt_count"], worker_id, now)
                await conn.execute(PG_WORKER, run_id, worker_id, now, rows[-1]["rollout_id"], aid)
            latencies.append(time.perf_counter() - t0)
            claimed.extend(ids)

    try:
        started = time.perf_counter()
        await asyncio.gather(*(claimer(c, f"p0-worker-{i}") for i, c in enumerate(conns)))
        elapsed = time.perf_counter() - started
    finally:
        for c in conns:
            await c.close()
    return {"claimed": claimed, "latencies": latencies, "elapsed": elapsed}


def sqlite_claim_loop(path: str, run_id: int, workers: int = 8) -> dict[str, Any]:
    """Claim until the queue is empty in one writer thread (stdlib sqlite3), cycling worker ids."""
    conn = sqlite3.connect(path, isolation_level=None, check_same_thread=False)
    conn.execute("PRAGMA journal_mode=WAL")
    conn.execute("PRAGMA synchronous=NORMAL")
    conn.execute("PRAGMA foreign_keys=ON")
    conn.execute("PRAGMA busy_timeout=30000")
    claimed: list[str] = []
    latencies: list[float] = []
    n = 0
    started = time.perf_counter()
    try:
        while True:
            t0 = time.perf_counter()
            worker_id = f"p0-worker-{n % workers}"
            n += 1
            conn.execute("BEGIN IMMEDIATE")
            try:
                picked = conn.execute(SQLITE_PICK, (run_id,)).fetchall()
                if not picked:
                    conn.execute("COMMIT")
                    break
                rid = picked[0][0]
                rows = conn.execute(SQLITE_MARK, (run_id, rid)).fetchall()
                now = time.time()
                aid = _attempt_id()
                for row in rows:
                    conn.execute(SQLITE_ATTEMPT, (run_id, row[0], aid, row[-1], worker_id, now))
                (pos,) = conn.execute(SQLITE_POSITION, (run_id,)).fetchone()
                conn.execute(SQLITE_WORKER, (run_id, worker_id, now, rid, aid, now, pos))
                conn.execute("COMMIT")
            except BaseException:
                conn.execute("ROLLBACK")
                raise
            latencies.append(time.perf_counter() - t0)
            claimed.append(rid)
        elapsed = time.perf_counter() - started
    finally:
        conn.close()
    return {"claimed": claimed, "latencies": latencies, "elapsed": elapsed}


async def sqlite_claim_loop_async(path: str, run_id: int) -> dict[str, Any]:
    result: dict[str, Any] = {}

    def run() -> None:
        result.update(sqlite_claim_loop(path, run_id))

    thread = threading.Thread(target=run, name="p0-sqlite-writer")
    thread.start()
    await asyncio.to_thread(thread.join)
    if not result:
        raise RuntimeError("P0 sqlite loop failed")
    return result


async def run_id_of(target: Any) -> int:
    """The numeric run id of a SqlLightningStore target (P0 addresses the rows directly)."""
    store = target.store
    await store.statistics()
    run_id = store._run_id  # the store binds its run on first use
    assert isinstance(run_id, int)
    return run_id
