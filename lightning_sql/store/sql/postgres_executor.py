"""The PostgreSQL executor (docs/architecture.md §7): one I/O thread per process and database, running
an event loop that owns a SQLAlchemy ``AsyncEngine`` on asyncpg with at most ``pool_size`` pooled
connections (units wait for one in FIFO order) and one LISTEN connection.  A unit is one transaction
run through ``AsyncConnection.run_sync``; reads run in autocommit, a ``snapshot`` read in one
REPEATABLE READ READ ONLY transaction; a write's events go out with ``pg_notify`` inside its
transaction, so the COMMIT delivers them.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import threading
import time
import uuid
from typing import Any, TypeVar

from sqlalchemy import Connection, event, make_url, text
from sqlalchemy.exc import DisconnectionError
from sqlalchemy.ext.asyncio import AsyncEngine, create_async_engine

from lightning_sql.store.sql import migrate
from lightning_sql.store.sql.errors import StoreUnavailableError, backoff, classify_error
from lightning_sql.store.sql.executor import (
    Executor,
    SchemaUnit,
    Unit,
    UnitContext,
    json_serializer,
    notify_channel,
)
from lightning_sql.store.sql.rows import json_deserializer
from lightning_sql.store.sql.urls import DatabaseTarget

logger = logging.getLogger(__name__)

T = TypeVar("T")

PG_POOL_SIZE = 4  # connections per process for units; the budget is pool_size + 1 (LISTEN)
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
        self._slots: asyncio.Semaphore | None = None
        self._schema_lock: asyncio.Lock | None = None
        self._listener: Any = None
        self._background: set[asyncio.Task[Any]] = set()
        self._thread = threading.Thread(target=self._loop.run_forever, name=f"lightning-sql-pg[{target.masked}]", daemon=True)
        self._thread.start()

    # --- the interface ----------------------------------------------------------------------

    def submit(
        self, unit: Unit[T], *, write: bool, deadline_s: float, snapshot: bool = False
    ) -> concurrent.futures.Future[T]:
        if self.closed:
            fut: concurrent.futures.Future[T] = concurrent.futures.Future()
            fut.set_exception(RuntimeError("The store's PostgreSQL executor is closed"))
            return fut
        return asyncio.run_coroutine_threadsafe(self._run(unit, write, deadline_s, snapshot), self._loop)

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True

        async def shutdown() -> None:
            for task in list(self._background):
                task.cancel()
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

    # --- running units ----------------------------------------------------------------------

    def _start_engine(self) -> AsyncEngine:
        if self._engine is None:
            self._engine = self._make_engine()
            self._slots = asyncio.Semaphore(self.pool_size)
            self._schema_lock = asyncio.Lock()
        return self._engine

    def _make_engine(self) -> AsyncEngine:
        opts = dict(self.options)
        kwargs: dict[str, Any] = {}
        for key in ("pool_recycle", "connect_args"):
            if key in opts:
                kwargs[key] = opts[key]
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
            isolation_level="AUTOCOMMIT",  # reads need no transaction; writes ask for one
            pool_size=self.pool_size,
            max_overflow=0,
            **kwargs,
        )
        if opts.get("pool_pre_ping", True):
            _ping_rested_connections(engine)
        if self.schema is not None:
            engine = engine.execution_options(schema_translate_map={None: self.schema})
        return engine

    async def _run(self, unit: Unit[T], write: bool, deadline_s: float, snapshot: bool) -> T:
        engine = self._start_engine()
        assert self._slots is not None
        started = time.monotonic()
        attempt = 0
        while True:
            try:
                if isinstance(unit, SchemaUnit):
                    await self._ensure_schema(engine, unit)
                    return None  # type: ignore[return-value]
                await self._take_slot(started + deadline_s)
                try:
                    result = await self._once(engine, unit, write, snapshot, attempt)
                finally:
                    self._slots.release()
                return result
            except asyncio.CancelledError:
                raise
            except StoreUnavailableError:
                raise
            except BaseException as exc:
                if not self.replayable(exc, started, deadline_s, attempt):
                    raise
                await asyncio.sleep(backoff(attempt))
                attempt += 1

    async def _take_slot(self, deadline: float) -> None:
        """A turn on one of the pool's connections; the wait counts against the unit's deadline (a
        pool held by units that the database keeps waiting means the database is not answering)."""
        assert self._slots is not None
        try:
            await asyncio.wait_for(self._slots.acquire(), timeout=max(deadline - time.monotonic(), 0.0))
        except TimeoutError:
            raise StoreUnavailableError(
                f"Database {self.target.masked} is unavailable: none of the {self.pool_size} pooled "
                "connections became free before the call's deadline (connect_deadline_seconds)"
            ) from None

    async def _once(self, engine: AsyncEngine, unit: Unit[T], write: bool, snapshot: bool, attempt: int) -> T:
        ctx_holder: list[UnitContext] = []

        def whole(conn: Connection) -> T:
            ctx = UnitContext(conn, "postgresql", attempt=attempt, notify_channel=self.notify_channel)
            ctx_holder.append(ctx)
            try:
                result = unit(ctx)
                payloads = ctx.take_notifications() if write else []
                if payloads:
                    conn.execute(_NOTIFY, {"channel": self.notify_channel, "payloads": payloads})
                conn.commit()
            except BaseException:
                try:
                    conn.rollback()
                except Exception:  # noqa: BLE001 - the unit's own error is the one to report
                    logger.debug("rollback after a failed unit failed", exc_info=True)
                raise
            return result

        async with engine.connect() as aconn:
            if write or (self.pooled and not snapshot):
                await aconn.execution_options(isolation_level="READ COMMITTED")
            elif snapshot:
                await aconn.execution_options(isolation_level="REPEATABLE READ", postgresql_readonly=True)
            try:
                result = await aconn.run_sync(whole)
            except Exception as exc:
                if classify_error(exc) == "transient":
                    # Its connection may be broken in a way the driver does not report as a
                    # disconnect: the pool opens a new one rather than hand this one out again.
                    await aconn.invalidate()
                raise
        self.after_commit(ctx_holder[0])
        return result

    async def _ensure_schema(self, engine: AsyncEngine, unit: SchemaUnit) -> None:
        assert self._schema_lock is not None
        async with self._schema_lock:
            if self.schema_ready is not None:
                return
            async with engine.connect() as aconn:
                # One transaction: the migration lock is transaction-scoped and the DDL commits whole.
                await aconn.execution_options(isolation_level="READ COMMITTED")
                await aconn.run_sync(
                    lambda conn: migrate.ensure_schema(
                        conn,
                        schema=self.schema,
                        auto_migrate=unit.auto_migrate,
                        read_only=unit.read_only,
                        url_for_messages=self.target.masked,
                    )
                )
                await aconn.commit()
            self.schema_ready = (unit.auto_migrate, unit.read_only)
            loop = asyncio.get_running_loop()
            waker = self._listen_forever() if self.listen else self._poll_forever()
            task = loop.create_task(waker)
            self._background.add(task)
            task.add_done_callback(self._background.discard)

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
