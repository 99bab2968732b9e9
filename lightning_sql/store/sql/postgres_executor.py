"""The PostgreSQL executor (docs/architecture.md §7).

One I/O thread per process and database runs an event loop that owns a SQLAlchemy ``AsyncEngine``
on asyncpg with at most ``pool_size`` pooled connections and one LISTEN connection.  Calls from any
thread reach the loop through one queue (one cross-thread wake-up per burst, not per call) and wait
in arrival order.  ``pool_size`` *lanes* run them: a free lane takes the oldest waiting call with
the calls of its operation that wait too (``executor.gather_batch``), and runs the batch on the
connection it holds while there is work.  A batch is one statement on the asyncpg connection
(``postgres_batches``), in autocommit: one round trip.  A unit runs through
``AsyncConnection.run_sync`` in one transaction (READ COMMITTED for a write, REPEATABLE READ READ
ONLY for a snapshot read), its events sent with ``pg_notify`` inside it.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import threading
import time
import uuid
from typing import Any

from sqlalchemy import Connection, event, make_url, text
from sqlalchemy.exc import DisconnectionError
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine, create_async_engine

from lightning_sql.store.sql import migrate, postgres_batches
from lightning_sql.store.sql.errors import StoreUnavailableError, backoff, classify_error
from lightning_sql.store.sql.executor import (
    Batch,
    Executor,
    Failure,
    Operation,
    SchemaUnit,
    UnitCall,
    UnitContext,
    gather_batch,
    is_write,
    json_serializer,
    notify_channel,
    run_outcomes,
    settle,
)
from lightning_sql.store.sql.rows import json_deserializer
from lightning_sql.store.sql.urls import DatabaseTarget

logger = logging.getLogger(__name__)

PG_POOL_SIZE = 4  # connections (lanes) per process; the budget is pool_size + 1 (LISTEN)
PG_LISTEN_RECONNECT_S = 1.0  # how soon a lost LISTEN connection is tried again
PG_POLL_INTERVAL_S = 0.2  # listen=False: how often waiters re-read
# A pooled connection is pinged on checkout only when it rested longer than this: one that answered
# a moment ago almost surely still does, and a unit that meets a dead one is replayed anyway.
PG_PRE_PING_IDLE_S = 1.0
CLOSE_TIMEOUT_S = 5.0

_NOTIFY = text(
    "SELECT pg_notify(:channel, e.payload) FROM unnest(CAST(:payloads AS TEXT[])) WITH ORDINALITY AS e(payload, n) "
    "ORDER BY e.n"
)


class PostgresExecutor(Executor):
    """See the module doc."""

    def __init__(self, target: DatabaseTarget, *, schema: str | None, options: dict[str, Any]) -> None:
        super().__init__(target, schema=schema, options=options)
        opts = {**target.options, **options}
        self.pool_size = int(opts.get("pool_size", PG_POOL_SIZE))  # checked by the store and normalise_url
        self.listen = bool(opts.get("listen", True))
        self._listen_url = opts.get("listen_url")
        # LISTEN elsewhere (listen_url) or not at all: the URL goes through a transaction pooler such
        # as PgBouncer in transaction mode, where a server connection serves one transaction only.
        self.pooled = self._listen_url is not None or not self.listen
        self.notify_channel = notify_channel(schema)
        self._loop = asyncio.new_event_loop()
        self._engine: AsyncEngine | None = None
        self._incoming: collections.deque[Operation] = collections.deque()  # from any thread
        self._intake_scheduled = False
        self._pending: list[Operation] = []  # the loop's: calls in arrival order
        self._work: asyncio.Event | None = None
        self._listener: Any = None
        self._background: set[asyncio.Task[Any]] = set()
        self._held: set[AsyncConnection] = set()  # the lanes' connections
        self._refusals = 0  # connections refused in a row while other lanes held one
        self._drivers: dict[AsyncConnection, Any] = {}  # their asyncpg connections
        self._thread = threading.Thread(target=self._loop.run_forever, name=f"lightning-sql-pg[{target.masked}]", daemon=True)
        self._thread.start()

    # --- the interface ----------------------------------------------------------------------

    def submit(self, call: Operation) -> asyncio.Future[Any]:
        loop = asyncio.get_running_loop()
        call.loop = loop
        call.future = fut = loop.create_future()
        if self.closed:
            fut.set_exception(RuntimeError("The store's PostgreSQL executor is closed"))
            return fut
        self._incoming.append(call)
        # One wake-up of the I/O loop per burst: whoever finds none scheduled schedules one (the
        # intake clears the flag before it drains, so a call appended meanwhile is never missed).
        if not self._intake_scheduled:
            self._intake_scheduled = True
            self._loop.call_soon_threadsafe(self._intake)
        return fut

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True

        async def shutdown() -> None:
            tasks = list(self._background)
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            for conn in list(self._held):
                await self._release(conn)
            if self._listener is not None:
                try:
                    await self._listener.close(timeout=2)
                except Exception:  # noqa: BLE001 - it is being thrown away
                    self._listener.terminate()
            if self._engine is not None:
                await self._engine.dispose()

        if threading.current_thread() is self._thread:  # pragma: no cover - units never close stores
            self._loop.call_soon(self._loop.stop)
            return
        try:
            asyncio.run_coroutine_threadsafe(shutdown(), self._loop).result(timeout=CLOSE_TIMEOUT_S)
        except Exception:  # noqa: BLE001 - best effort at shutdown
            logger.debug("PostgreSQL executor shutdown failed", exc_info=True)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(CLOSE_TIMEOUT_S)
        if not self._thread.is_alive():
            self._loop.close()

    # --- the lanes ----------------------------------------------------------------------------

    def _intake(self) -> None:
        self._intake_scheduled = False
        while self._incoming:
            self._pending.append(self._incoming.popleft())
        if self._work is None:
            self._start()
        assert self._work is not None
        self._work.set()

    def _start(self) -> None:
        self._engine = self._make_engine()
        self._work = asyncio.Event()
        for _ in range(self.pool_size):
            self._spawn(self._lane())

    def _spawn(self, coro: Any) -> None:
        task = self._loop.create_task(coro)
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def _lane(self) -> None:
        """Run batches while calls wait, on one connection the lane keeps (the pool's ``pool_size``
        connections are the lanes': a lane that meets a broken one takes a new one)."""
        assert self._work is not None and self._engine is not None
        conn: AsyncConnection | None = None
        while not self.closed:
            if not self._pending:
                self._work.clear()
                await self._work.wait()
                continue
            batch = gather_batch(self._pending)
            if conn is None and self._held:
                conn, handed_back = await self._connect_or_hand_back(batch)
                if handed_back:
                    continue
            conn = await self._execute(conn, batch)
            settle(batch.calls)
            if conn is not None:
                self._held.add(conn)

    async def _connect_or_hand_back(self, batch: Batch) -> tuple[AsyncConnection | None, bool]:
        """A connection for a lane that has none while other lanes hold one.  When the server refuses
        it for now (a role's or the server's connection limit, which may allow no more than the
        others hold), the batch goes back to the front of the queue for a lane that has a
        connection, and this lane waits a back-off before it takes work again (``True``: handed
        back).  Any other failure is left to ``_execute``, which connects again and reports it."""
        assert self._engine is not None and self._work is not None
        try:
            conn = await self._engine.connect()
        except asyncio.CancelledError:
            raise
        except BaseException as exc:  # noqa: BLE001 - refused: the calls go back, none fails here
            if classify_error(exc) != "transient":
                return None, False
            self._pending[:0] = batch.calls
            self._work.set()
            await asyncio.sleep(backoff(self._refusals))
            self._refusals = min(self._refusals + 1, 8)
            return None, True
        self._refusals = 0
        return conn, False

    async def _release(self, conn: AsyncConnection) -> None:
        self._drivers.pop(conn, None)
        try:
            await conn.close()
        except Exception:  # noqa: BLE001 - the pool replaces it
            logger.debug("returning a connection to the pool failed", exc_info=True)

    async def _execute(self, conn: AsyncConnection | None, batch: Batch) -> AsyncConnection | None:
        """Run ``batch``, replayed after transient errors until each call's deadline; every call gets
        its outcome.  Returns the connection to keep using (None: it was dropped)."""
        assert self._engine is not None
        attempt = 0
        while batch.calls:
            batch.attempt = attempt
            try:
                if conn is None:
                    conn = await self._engine.connect()
                await self._once(conn, batch)
                self.after_commit(batch.events)
                return conn
            except asyncio.CancelledError:
                raise
            except BaseException as exc:  # noqa: BLE001 - outcomes for every caller
                if conn is not None and (classify_error(exc) == "transient" or conn.invalidated):
                    # Its connection may be broken in a way the driver does not report as a
                    # disconnect: the pool opens a new one rather than hand this one out again.
                    self._held.discard(conn)
                    await self._drop(conn)
                    conn = None
                try:
                    replay = not isinstance(exc, StoreUnavailableError) and self.replayable(exc, attempt)
                except BaseException as final:  # noqa: BLE001 - unavailable or denied: final for all
                    exc, replay = final, False
                if not replay:
                    if len(batch.calls) > 1 and classify_error(exc) == "fatal":
                        for call in batch.calls:  # the calls' own errors: each runs alone
                            conn = await self._execute(conn, Batch([call], notify_channel=self.notify_channel))
                        return conn
                    for call in batch.calls:
                        call.outcome = Failure(exc)
                    return conn
                batch = Batch(self.expired(batch.calls, exc), notify_channel=self.notify_channel)
                await asyncio.sleep(backoff(attempt))
                attempt += 1
        return conn

    async def _drop(self, conn: AsyncConnection) -> None:
        self._drivers.pop(conn, None)
        try:
            await conn.invalidate()
            await conn.close()
        except Exception:  # noqa: BLE001 - it is being thrown away
            logger.debug("dropping a broken connection failed", exc_info=True)

    async def _once(self, conn: AsyncConnection, batch: Batch) -> None:
        head = batch.calls[0]
        if isinstance(head, UnitCall):
            if isinstance(head.unit, SchemaUnit):
                await self._ensure_schema(conn, head.unit)
                head.outcome = None
            else:
                head.outcome = await self._unit(conn, head, batch)
            return
        raw = self._drivers.get(conn)
        if raw is None:  # looked up once per connection: each look-up is a greenlet switch
            raw = self._drivers[conn] = (await conn.get_raw_connection()).driver_connection
        assert raw is not None
        if self.pooled:
            # Behind a transaction pooler a statement's parse and execution must share a transaction.
            async with raw.transaction():
                rows = await postgres_batches.run(raw, self.schema, self.notify_channel, batch)
        else:
            rows = await postgres_batches.run(raw, self.schema, self.notify_channel, batch)
        run_outcomes(batch, rows)

    async def _unit(self, conn: AsyncConnection, call: UnitCall, batch: Batch) -> Any:
        """``call.unit`` in one transaction on ``conn`` (autocommit again afterwards)."""
        write = is_write(call)

        def whole(sync_conn: Connection) -> Any:
            ctx = UnitContext(sync_conn, "postgresql", attempt=batch.attempt, notify_channel=self.notify_channel)
            try:
                result = call.unit(ctx)
                payloads = ctx.take_notifications() if write else []
                if payloads:
                    sync_conn.execute(_NOTIFY, {"channel": self.notify_channel, "payloads": payloads})
                sync_conn.commit()
            except BaseException:
                try:
                    sync_conn.rollback()
                except Exception:  # noqa: BLE001 - the unit's own error is the one to report
                    logger.debug("rollback after a failed unit failed", exc_info=True)
                raise
            batch.events.events.update(ctx.events)
            return result

        if write or (self.pooled and not call.snapshot):
            await conn.execution_options(isolation_level="READ COMMITTED")
        elif call.snapshot:
            await conn.execution_options(isolation_level="REPEATABLE READ", postgresql_readonly=True)
        try:
            return await conn.run_sync(whole)
        finally:
            if not conn.invalidated:
                await conn.execution_options(isolation_level="AUTOCOMMIT", postgresql_readonly=False)

    def _make_engine(self) -> AsyncEngine:
        opts = dict(self.options)
        kwargs: dict[str, Any] = {}
        if "pool_recycle" in opts:
            kwargs["pool_recycle"] = opts["pool_recycle"]
        # The URL's own (connect_timeout, application_name: urls.normalise_url), then the store's.
        connect_args = {**self.target.options.get("connect_args", {}), **opts.get("connect_args", {})}
        if connect_args:
            kwargs["connect_args"] = connect_args
        url = self.target.url
        if self.pooled:
            # Behind a transaction pooler a statement prepared in one transaction may not exist in
            # the next: no statement caches, a fresh name for each prepared statement, and every
            # unit in a transaction (SQLAlchemy's documented set-up for PgBouncer).
            url = url.update_query_dict({"prepared_statement_cache_size": "0"})
            kwargs["connect_args"] = {
                "statement_cache_size": 0,
                "prepared_statement_name_func": _statement_name,
                **kwargs.get("connect_args", {}),
            }
        engine = create_async_engine(
            url,
            json_serializer=json_serializer,
            json_deserializer=json_deserializer,
            echo=bool(opts.get("echo", False)),
            isolation_level="AUTOCOMMIT",  # a batch is one statement; units ask for a transaction
            pool_size=self.pool_size,
            max_overflow=0,
            **kwargs,
        )
        if opts.get("pool_pre_ping", True):
            _ping_rested_connections(engine)
        if self.schema is not None:
            engine = engine.execution_options(schema_translate_map={None: self.schema})
        return engine

    async def _ensure_schema(self, conn: AsyncConnection, unit: SchemaUnit) -> None:
        if self.schema_ready is not None:
            return
        # One transaction: the migration lock is transaction-scoped and the DDL commits whole.
        await conn.execution_options(isolation_level="READ COMMITTED")
        try:
            await conn.run_sync(
                lambda sync_conn: migrate.ensure_schema(
                    sync_conn,
                    schema=self.schema,
                    auto_migrate=unit.auto_migrate,
                    read_only=unit.read_only,
                    url_for_messages=self.target.masked,
                )
            )
            await conn.commit()
        except BaseException:
            await conn.rollback()
            raise
        finally:
            if not conn.invalidated:
                await conn.execution_options(isolation_level="AUTOCOMMIT")
        if self.schema_ready is not None:
            return
        self.schema_ready = (unit.auto_migrate, unit.read_only)
        self._spawn(self._listen_forever() if self.listen else self._poll_forever())

    # --- wake-ups -----------------------------------------------------------------------------

    async def _poll_forever(self) -> None:
        while not self.closed:
            await asyncio.sleep(PG_POLL_INTERVAL_S)
            if self.hub.has_waiters:
                self.hub.wake(None)

    def _listen_dsn(self) -> str:
        url = make_url(self._listen_url) if self._listen_url else self.target.url
        url = url.set(drivername="postgresql").difference_update_query(["pool_size"])
        return url.render_as_string(hide_password=False)

    async def _listen_forever(self) -> None:
        import asyncpg

        dsn = self._listen_dsn()
        while not self.closed:
            try:
                conn = await asyncpg.connect(dsn)
                self._listener = conn

                def on_notify(_conn: Any, _pid: int, _channel: str, payload: str) -> None:
                    try:
                        self.hub.wake(int(payload.split(":", 1)[0]))
                    except ValueError:
                        self.hub.wake(None)

                await conn.add_listener(self.notify_channel, on_notify)
                self.hub.wake(None)  # (re)connected: every waiter re-reads what it may have missed
                while not conn.is_closed() and not self.closed:
                    await asyncio.sleep(PG_LISTEN_RECONNECT_S)
                    await conn.execute("SELECT 1")
            except asyncio.CancelledError:
                return
            except Exception:  # noqa: BLE001 - waits re-read on their own meanwhile
                logger.debug("LISTEN connection failed; retrying", exc_info=True)
            finally:
                if self._listener is not None:
                    self._listener.terminate()
                    self._listener = None
            await asyncio.sleep(PG_LISTEN_RECONNECT_S)


def _statement_name() -> str:
    return f"__lightning_sql_{uuid.uuid4().hex}__"


def _ping_rested_connections(engine: AsyncEngine) -> None:
    """``pool_pre_ping`` for connections that rested in the pool over ``PG_PRE_PING_IDLE_S``, through
    the pool's public events and the dialect's ``do_ping``: a connection that fails it is discarded
    and the pool checks out another (SQLAlchemy's pessimistic disconnect handling)."""
    sync_engine = engine.sync_engine

    @event.listens_for(sync_engine, "connect")
    @event.listens_for(sync_engine, "checkin")
    def _rested_since(_dbapi_conn: Any, record: Any) -> None:
        if record is not None:
            record.info["lightning_sql_checkin"] = time.monotonic()

    @event.listens_for(sync_engine, "checkout")
    def _ping_if_rested(dbapi_conn: Any, record: Any, _proxy: Any) -> None:
        since = record.info.get("lightning_sql_checkin")
        if since is not None and time.monotonic() - since < PG_PRE_PING_IDLE_S:
            return
        try:
            alive = sync_engine.dialect.do_ping(dbapi_conn)
        except Exception as exc:  # noqa: BLE001 - any failure means "not alive"
            raise DisconnectionError(f"pre-ping failed: {type(exc).__name__}") from exc
        if not alive:
            raise DisconnectionError("pre-ping failed")
