"""Claims of docs/store-contract.md and docs/operations.md that had no test (issue 42, item 11).

Each test names the claim it proves.  PostgreSQL-only claims (the clock offset, SQLSTATE retries,
NOTIFY, lock order, libpq URL options, planner statistics) run on PostgreSQL; the backups run on
both backends.  Nothing is mocked: errors, locks and notifications are the server's own.
"""

from __future__ import annotations

import ast
import asyncio
import time
import uuid
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from typing import Any

import asyncpg
import pytest

from lightning_sql import EnqueueRolloutRequest, RolloutConfig, SqlLightningStore, StoreUnavailableError
from lightning_sql.store.sql.executor import notify_channel
from lightning_sql.store.sql.instance import CLOCK_SYNC_INTERVAL_S
from lightning_sql.store.sql.planner_stats import MIN_CHANGES
from tests.conftest import PG_URL, BackendSpec
from tests.contract.test_spans import make_span
from tests.helpers import FakeClock, pg_execute, pg_fetch

GENEROUS_S = 30.0  # how long a step may take on a busy 2-core machine; never a latency bound


def _dsn(url: str = PG_URL) -> str:
    return url.replace("postgresql+asyncpg://", "postgresql://")


async def _eventually(probe: Any, what: str, timeout: float = GENEROUS_S) -> Any:
    deadline = time.monotonic() + timeout
    while True:
        value = await probe()
        if value:
            return value
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(0.02)


# --- §0.2: the offset to the server's clock is re-measured every CLOCK_SYNC_INTERVAL_S ------------------


@pytest.mark.postgres
async def test_the_clock_offset_is_re_measured_once_the_interval_has_passed(pg_backend: BackendSpec) -> None:
    """store-contract §0.2: "re-measured periodically (a named constant, minutes)".  The local clock is a
    fake that jumps; the store clock follows the jump until the next measurement pulls it back to the
    server's time, which happens on the first call after CLOCK_SYNC_INTERVAL_S of local time, not before."""
    clock = FakeClock(1_000_000_000.0)  # 2001: far from the server's clock, so the offset is large
    store = pg_backend.open(run="r", clock=clock, clock_sync=True)
    try:
        await store.get_run("r")
        assert abs(store.now() - time.time()) < 5.0  # measured: store clock = server clock

        clock.advance(CLOCK_SYNC_INTERVAL_S - 60)  # before the interval: the offset is kept
        await store.get_run("r")
        assert abs(store.now() - (time.time() + CLOCK_SYNC_INTERVAL_S - 60)) < 5.0

        clock.advance(120)  # past the interval: the next call measures again
        assert abs(store.now() - (time.time() + CLOCK_SYNC_INTERVAL_S + 60)) < 5.0  # reading: no I/O
        await store.get_run("r")
        assert abs(store.now() - time.time()) < 5.0

        clock.advance(-3 * CLOCK_SYNC_INTERVAL_S)  # a local clock stepped back by more than the interval
        await store.get_run("r")
        assert abs(store.now() - time.time()) < 5.0
    finally:
        await store.close()
        clock.remove()


# --- §0.3: SQLSTATEs 40001, 40P01 and 57P03 are retried ------------------------------------------------


@asynccontextmanager
async def _failing_inserts(schema: str, sqlstate: str, times: int) -> AsyncIterator[asyncpg.Connection]:
    """The server raises ``sqlstate`` on the first ``times`` inserts into the rollouts table (a trigger;
    a sequence counts the tries, outside every transaction).  Yields a connection to read the count."""
    conn = await asyncpg.connect(_dsn())
    await conn.execute(
        f"""
        CREATE SEQUENCE "{schema}".tries;
        CREATE FUNCTION "{schema}".fail_first() RETURNS trigger LANGUAGE plpgsql AS $$
        BEGIN
            IF nextval('"{schema}".tries') <= {times} THEN
                RAISE EXCEPTION 'injected by the test' USING ERRCODE = '{sqlstate}';
            END IF;
            RETURN NEW;
        END $$;
        CREATE TRIGGER fail_first BEFORE INSERT ON "{schema}".rollouts
            FOR EACH ROW EXECUTE FUNCTION "{schema}".fail_first();
        """
    )
    try:
        yield conn
    finally:
        await conn.execute(
            f'DROP TRIGGER fail_first ON "{schema}".rollouts; DROP FUNCTION "{schema}".fail_first(); '
            f'DROP SEQUENCE "{schema}".tries'
        )
        await conn.close()


async def _tries(conn: asyncpg.Connection, schema: str) -> int:
    return int(await conn.fetchval(f'SELECT last_value FROM "{schema}".tries'))


@pytest.mark.postgres
@pytest.mark.parametrize("sqlstate", ["40001", "40P01", "57P03"])
async def test_a_transient_sqlstate_raised_by_the_server_is_replayed(pg_backend: BackendSpec, sqlstate: str) -> None:
    """store-contract §0.3: serialization failure 40001, deadlock 40P01 and cannot-connect-now 57P03 are
    retried by replaying the unit.  The server raises each twice; the third try commits, once."""
    assert pg_backend.schema is not None
    store = pg_backend.open(run="r", clock_sync=False)
    try:
        await store.get_run("r")  # the schema exists
        async with _failing_inserts(pg_backend.schema, sqlstate, times=2) as conn:
            rollout = await store.enqueue_rollout(input={"k": sqlstate})
            assert await _tries(conn, pg_backend.schema) == 3
        assert [r.rollout_id for r in await store.query_rollouts()] == [rollout.rollout_id]
    finally:
        await store.close()


@pytest.mark.postgres
async def test_an_error_of_the_call_itself_is_not_replayed(pg_backend: BackendSpec) -> None:
    """The control of the test above: a SQLSTATE that no replay cures (check_violation) reaches the caller
    after one try, so counting tries separates the classes."""
    assert pg_backend.schema is not None
    store = pg_backend.open(run="r", clock_sync=False)
    try:
        await store.get_run("r")
        async with _failing_inserts(pg_backend.schema, "23514", times=1) as conn:
            with pytest.raises(Exception) as raised:
                await store.enqueue_rollout(input={})
            assert not isinstance(raised.value, StoreUnavailableError)
            assert "injected by the test" in str(raised.value)
            assert await _tries(conn, pg_backend.schema) == 1
    finally:
        await store.close()


@pytest.mark.postgres
async def test_a_real_deadlock_with_the_store_is_replayed(pg_backend: BackendSpec) -> None:
    """architecture §4: "A deadlock that happens anyway (40P01) is transient and replayed".  Another session
    holds an attempt row; the store's span write locks the rollout rows, then waits for that attempt;
    the session then asks for one of the store's rollout rows: a real deadlock.  The store's backend
    waited first and detects it (the session's deadlock_timeout is longer), so the store's transaction
    is the victim; the session gets its lock, and the store's call still succeeds, written once."""
    schema = pg_backend.schema
    assert schema is not None
    store = pg_backend.open(run="r", clock_sync=False)
    try:
        started = [await store.start_rollout(input={"i": i}) for i in range(3)]
        ids = sorted((s.rollout_id, s.attempt.attempt_id) for s in started)
        (a, aid_a), (m, aid_m), (z, aid_z) = ids
        other = await asyncpg.connect(_dsn())
        try:
            await other.execute("SET deadlock_timeout = '20s'")
            tx = other.transaction()
            await tx.start()
            await other.execute(f'SELECT 1 FROM "{schema}".attempts WHERE rollout_id = $1 FOR UPDATE', m)
            write = asyncio.ensure_future(
                store.add_many_spans([make_span(z, aid_z, 1), make_span(m, aid_m, 1), make_span(a, aid_a, 1)])
            )
            try:
                await _store_waits_for_a_lock(other)
                # The store holds every rollout row of its batch (rollouts first): asking for z deadlocks.
                await asyncio.wait_for(
                    other.execute(f'SELECT 1 FROM "{schema}".rollouts WHERE rollout_id = $1 FOR UPDATE', z),
                    GENEROUS_S,
                )
                replaying = not write.done()  # the replay waits for the attempt row again
            finally:
                await tx.rollback()
                written = await asyncio.wait_for(write, GENEROUS_S)
            assert replaying
        finally:
            await other.close()
        assert len(written) == 3
        for rid, aid in ids:
            assert [s.sequence_id for s in await store.query_spans(rid, aid)] == [1]
    finally:
        await store.close()


# --- §2.17: PostgreSQL's lock order for add_many_spans and get_many_span_sequence_ids ------------------


async def _store_waits_for_a_lock(other: asyncpg.Connection) -> None:
    """Until a backend of this database other than ``other`` waits for a row lock ``other`` holds."""

    async def waiting() -> bool:
        pids = await other.fetchval(
            "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() AND wait_event_type = 'Lock' "
            "AND $1 = ANY(pg_blocking_pids(pid))",
            other.get_server_pid(),
        )
        return bool(pids)

    await _eventually(waiting, "the store's statement to wait for the test's lock")


async def _locked(conn: asyncpg.Connection, schema: str, table: str, rollout_id: str) -> bool:
    """Whether another transaction holds ``table``'s rows of ``rollout_id`` (FOR UPDATE NOWAIT fails)."""
    try:
        async with conn.transaction():
            await conn.execute(f'SELECT 1 FROM "{schema}".{table} WHERE rollout_id = $1 FOR UPDATE NOWAIT', rollout_id)
    except asyncpg.LockNotAvailableError:
        return True
    return False


LOCK_ORDER_ROLLOUTS = 24  # enough that the planner's own row order (a hash, a join) is not the ids' order


@pytest.mark.postgres
@pytest.mark.parametrize(
    ("operation", "held"),  # a sequence-id reservation locks no attempt row
    [("add_many_spans", "rollouts"), ("add_many_spans", "attempts"), ("get_many_span_sequence_ids", "rollouts")],
)
async def test_span_writes_lock_rollouts_in_id_order_then_attempts(
    pg_backend: BackendSpec, operation: str, held: str
) -> None:
    """store-contract §2.17: a writing unit locks the rollout rows first, in rollout_id order whatever
    the input order (add_many_spans, get_many_span_sequence_ids), then the attempts.  The test holds the
    middle rollout's row (or attempt row), calls with the ids shuffled, and while the store waits looks
    at which rows it holds: with the middle rollout held, exactly the rollouts before it; with the middle
    attempt held, every rollout row of the batch, and exactly the attempts before it."""
    schema = pg_backend.schema
    assert schema is not None
    store = pg_backend.open(run="r", clock_sync=False)
    try:
        started = [await store.start_rollout(input={"i": i}) for i in range(LOCK_ORDER_ROLLOUTS)]
        pairs = sorted((s.rollout_id, s.attempt.attempt_id) for s in started)
        middle = LOCK_ORDER_ROLLOUTS // 2
        held_id = pairs[middle][0]
        before = {rid for rid, _ in pairs[:middle]}
        given = pairs[::-1][::2] + pairs[::-1][1::2]  # neither sorted nor reversed
        holder, probe = await asyncpg.connect(_dsn()), await asyncpg.connect(_dsn())
        others = [rid for rid, _ in pairs if rid != held_id]
        try:
            tx = holder.transaction()
            await tx.start()
            await holder.execute(f'SELECT 1 FROM "{schema}".{held} WHERE rollout_id = $1 FOR UPDATE', held_id)
            if operation == "add_many_spans":
                call = store.add_many_spans([make_span(rid, aid, 1) for rid, aid in given])
            else:
                call = store.get_many_span_sequence_ids(given)
            pending = asyncio.ensure_future(call)
            try:
                await _store_waits_for_a_lock(holder)
                rollouts = {rid for rid in others if await _locked(probe, schema, "rollouts", rid)}
                attempts = {rid for rid in others if await _locked(probe, schema, "attempts", rid)}
            finally:  # whatever was seen, the store's call ends before the test looks at it
                await tx.rollback()
                await asyncio.wait_for(pending, GENEROUS_S)
        finally:
            await holder.close()
            await probe.close()
        if held == "rollouts":
            assert rollouts == before, "rollout rows must be locked in rollout_id order"
        else:
            assert rollouts == set(others), "every rollout row is locked before any attempt row"
            assert attempts == before, "attempt rows must be locked in (rollout_id, attempt_id) order"
    finally:
        await store.close()


# --- §2.12: NOTIFY once per event kind per transaction ---------------------------------------------------


@pytest.mark.postgres
async def test_one_notification_per_event_kind_per_transaction(pg_backend: BackendSpec, caplog: Any) -> None:
    """store-contract §2.12: "at most once per event kind per transaction (coalesced: a sweep that fails
    100 rollouts sends one)".  A LISTEN on a connection of the test's own counts what arrives: an enqueue
    of 30 rollouts sends one `queued`; a sweep that times out 20 attempts, 10 of them retried, sends one
    `finished` and one `queued`; a read sends nothing.  PostgreSQL itself folds identical payloads of one
    transaction into one, so the sweep's side is also read from what the store sends: its statements as
    SQLAlchemy logs them (the store's ``echo`` option), one ``pg_notify`` with one payload per kind."""
    schema = pg_backend.schema
    assert schema is not None
    clock = FakeClock(1_800_000_000.0)
    store = pg_backend.open(run="r", clock=clock, clock_sync=False, scan_debounce_seconds=0, echo=True)
    received: list[str] = []
    listener = await asyncpg.connect(_dsn())
    try:
        await store.query_rollouts()  # the run exists
        run_id = int((await pg_fetch(PG_URL, f'SELECT run_id FROM "{schema}".runs WHERE name = $1', "r"))[0][0])
        await listener.add_listener(notify_channel(schema), lambda *args: received.append(args[3]))

        async def settle(expected: Sequence[str]) -> list[str]:
            await _eventually(lambda: _true(len(received) >= len(expected)), f"notifications {expected}")
            await asyncio.sleep(0.5)  # a moment more: anything extra arrives too
            got = sorted(received)
            received.clear()
            return got

        await store.enqueue_many_rollouts([EnqueueRolloutRequest(input={"i": i}) for i in range(30)])
        assert await settle([f"{run_id}:queued"]) == [f"{run_id}:queued"]

        once = RolloutConfig(timeout_seconds=10, max_attempts=1)
        retried = RolloutConfig(timeout_seconds=10, max_attempts=2, retry_condition=["timeout"])
        for config in [once] * 10 + [retried] * 10:
            await store.start_rollout(input={}, config=config)
        await asyncio.sleep(0.5)
        received.clear()  # what starting them sent is not this test's business
        clock.advance(11)
        caplog.set_level("INFO", logger="sqlalchemy.engine.Engine")
        caplog.clear()
        assert await store.sweep() == 20
        assert await settle(["finished", "queued"]) == [f"{run_id}:finished", f"{run_id}:queued"]
        messages = [r.getMessage() for r in caplog.records if r.name == "sqlalchemy.engine.Engine"]
        sent = [
            ast.literal_eval(messages[i + 1].split("] ", 1)[1])[1]  # (channel, payloads) follow the statement
            for i, message in enumerate(messages)
            if "pg_notify" in message and i + 1 < len(messages)
        ]
        assert sent == [[f"{run_id}:finished", f"{run_id}:queued"]], messages

        await store.query_rollouts()  # a read: nothing
        await asyncio.sleep(0.5)
        assert received == []
    finally:
        await listener.close()
        await store.close()
        clock.remove()


async def _true(value: bool) -> bool:
    return value


# --- §4: libpq URL options ----------------------------------------------------------------------------


@pytest.mark.postgres
async def test_sslmode_is_translated_for_asyncpg(pg_backend: BackendSpec) -> None:
    """store-contract §4: libpq's sslmode, which asyncpg does not take, is translated (asyncpg's ssl):
    passed through as it is, asyncpg would refuse it as an unknown argument.  The shared test server
    runs without SSL, so sslmode=disable connects and sslmode=require is refused by the server, clearly."""
    schema = pg_backend.schema
    assert schema is not None
    assert (await pg_fetch(PG_URL, "SHOW ssl"))[0][0] == "off", "this test expects a server without SSL"
    store = SqlLightningStore(f"{PG_URL}?sslmode=disable", schema=schema, run="r", clock_sync=False)
    refused = SqlLightningStore(
        f"{PG_URL}?sslmode=require", schema=schema, run="r", clock_sync=False, connect_deadline_seconds=3
    )
    try:
        assert await store.get_run("r") is None  # connected: the run is not created by a read
        with pytest.raises(StoreUnavailableError, match="rejected SSL upgrade"):
            await refused.get_run("r")
    finally:
        await store.close()
        await refused.close()


@pytest.mark.postgres
async def test_connect_timeout_is_translated_for_asyncpg(pg_backend: BackendSpec) -> None:
    store = SqlLightningStore(f"{PG_URL}?connect_timeout=7", schema=pg_backend.schema, run="r", clock_sync=False)
    try:
        assert await store.get_run("r") is None
    finally:
        await store.close()


@pytest.mark.postgres
async def test_application_name_reaches_the_server(pg_backend: BackendSpec) -> None:
    name = f"lsql_{uuid.uuid4().hex[:8]}"
    store = SqlLightningStore(f"{PG_URL}?application_name={name}", schema=pg_backend.schema, run="r", clock_sync=False)
    try:
        await store.query_rollouts()
        rows = await pg_fetch(PG_URL, "SELECT count(*) FROM pg_stat_activity WHERE application_name = $1", name)
        assert rows[0][0] >= 1
    finally:
        await store.close()


# --- operations.md "Planner statistics": only the tables the role owns ---------------------------------


@pytest.mark.postgres
async def test_a_store_analyses_only_the_tables_its_role_owns(pg_backend: BackendSpec, caplog: Any) -> None:
    """operations.md: the store "analyses only tables its role owns".  A least-privilege writer (every
    grant of operations.md, owning nothing) meets a rollouts table that is due and analyses nothing and
    claims to have analysed nothing; the owner's store then analyses it."""
    schema = pg_backend.schema
    assert schema is not None
    writer = f"lsql_writer_{uuid.uuid4().hex[:8]}"
    owner = pg_backend.open(run="r", clock_sync=False, scan_debounce_seconds=0, analyze_check_seconds=0)
    try:
        await owner.get_run("r")
        await pg_execute(
            PG_URL,
            # autovacuum's own ANALYZE would make the table not due before the owner's store looks
            f'ALTER TABLE "{schema}".rollouts SET (autovacuum_enabled = false); '
            f"CREATE ROLE {writer} LOGIN; GRANT USAGE ON SCHEMA \"{schema}\" TO {writer}; "
            f'GRANT SELECT, INSERT, UPDATE, DELETE ON ALL TABLES IN SCHEMA "{schema}" TO {writer}; '
            f'GRANT USAGE, SELECT, UPDATE ON ALL SEQUENCES IN SCHEMA "{schema}" TO {writer}',
        )
        as_writer = SqlLightningStore(
            PG_URL.replace("postgres@", f"{writer}@", 1),
            schema=schema,
            run="r",
            auto_migrate=False,
            clock_sync=False,
            scan_debounce_seconds=0,
            analyze_check_seconds=0,
        )
        try:
            n = MIN_CHANGES + 100
            await as_writer.enqueue_many_rollouts([EnqueueRolloutRequest(input={"i": i}) for i in range(n)])

            async def due() -> bool:
                rows = await pg_fetch(
                    PG_URL,
                    "SELECT n_mod_since_analyze FROM pg_stat_user_tables WHERE schemaname = $1 AND relname = 'rollouts'",
                    schema,
                )
                return bool(rows) and rows[0][0] >= n

            await _eventually(due, "the server to report the inserts")
            caplog.set_level("DEBUG", logger="lightning_sql.store.sql.store")
            caplog.clear()
            assert await as_writer.dequeue_rollout(worker_id="w") is not None  # its lazy sweep looks
            assert await _analyses(schema) == 0
            assert not [r for r in caplog.records if "Analysed" in r.getMessage()]
            assert not [r for r in caplog.records if r.levelname == "WARNING"]
        finally:
            await as_writer.close()
        assert await owner.dequeue_rollout(worker_id="w") is not None
        assert await _analyses(schema) == 1
        assert [r for r in caplog.records if "Analysed rollouts" in r.getMessage()]
    finally:
        await owner.close()
        await pg_execute(PG_URL, f"DROP OWNED BY {writer}; DROP ROLE IF EXISTS {writer}")


async def _analyses(schema: str) -> int:
    rows = await pg_fetch(
        PG_URL,
        "SELECT analyze_count FROM pg_stat_user_tables WHERE schemaname = $1 AND relname = 'rollouts'",
        schema,
    )
    return int(rows[0][0])
