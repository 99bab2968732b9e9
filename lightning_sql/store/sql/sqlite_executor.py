"""The SQLite executor (docs/architecture.md §7): one writer thread with group commit, WAL readers in
the callers' threads, ``PRAGMA data_version`` polling for other processes' commits, and a fork gate:
``fork()`` waits until no thread of this process is inside SQLite, whose process-wide mutexes a fork
would copy locked into the child.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import logging
import os
import queue
import sqlite3
import threading
import time
import weakref
from collections.abc import Iterator
from typing import Any, TypeVar

from sqlalchemy import Connection, Engine, create_engine, event
from sqlalchemy.pool import StaticPool

from lightning_sql.store.sql import migrate
from lightning_sql.store.sql.errors import StoreUnavailableError, backoff, classify_error, unavailable
from lightning_sql.store.sql.executor import Executor, SchemaUnit, Unit, UnitContext, json_serializer
from lightning_sql.store.sql.rows import json_deserializer
from lightning_sql.store.sql.urls import DatabaseTarget

logger = logging.getLogger(__name__)

T = TypeVar("T")

SQLITE_BUSY_TIMEOUT_S = 30.0  # writers of other processes wait inside SQLite before we retry
SQLITE_DATA_VERSION_POLL_S = 0.05  # how fast another process's commit wakes a waiter
SQLITE_GROUP_COMMIT_MAX = 64  # write units per group commit: bounds one transaction's length
FORK_QUIESCE_TIMEOUT_S = 2.0  # how long fork() waits for threads to leave SQLite

_POLL = ("poll",)  # queued for the writer thread: poll PRAGMA data_version now


def sqlite_engine(
    database: str, *, busy_timeout_s: float = SQLITE_BUSY_TIMEOUT_S, reader: bool = False, echo: bool = False
) -> Engine:
    """An engine of ONE SQLite connection set up the store's way: WAL, ``synchronous=NORMAL``,
    foreign keys on, a busy timeout, and transactions begun explicitly (``BEGIN IMMEDIATE`` for a
    writer, so that a writing transaction never upgrades its lock half-way; ``BEGIN`` for a
    ``reader``, whose connection is also ``query_only``).  The store, the migrations' environment
    and the CLI all open SQLite through this function."""
    memory = database in ("", ":memory:")

    def connect() -> sqlite3.Connection:
        conn = sqlite3.connect(
            database or ":memory:", isolation_level=None, check_same_thread=False, timeout=busy_timeout_s
        )
        if reader:
            conn.execute("PRAGMA query_only=ON")
        elif not memory:
            conn.execute("PRAGMA journal_mode=WAL")
        conn.execute("PRAGMA synchronous=NORMAL")
        conn.execute("PRAGMA foreign_keys=ON")
        return conn

    engine = create_engine(
        "sqlite://",
        creator=connect,
        poolclass=StaticPool,
        json_serializer=json_serializer,
        json_deserializer=json_deserializer,
        echo=echo,
    )
    begin = "BEGIN" if reader else "BEGIN IMMEDIATE"

    @event.listens_for(engine, "begin")
    def _begin(conn: Connection) -> None:
        # pysqlite runs with isolation_level=None (no implicit transactions): SQLAlchemy's
        # documented recipe is to emit BEGIN here ourselves.
        conn.exec_driver_sql(begin)

    return engine


@contextlib.contextmanager
def migration_transaction(conn: Connection, path: str | None) -> Iterator[None]:
    """One ``BEGIN IMMEDIATE`` transaction on ``conn`` for a migration: under the exclusive file lock
    ``<path>.migrate.lock`` (other processes re-check the version after taking it), with foreign
    keys off before it begins (SQLite ignores the pragma inside a transaction; batch revisions
    rebuild tables and check the keys themselves) and back on after."""
    lock: Any = migrate.migration_file_lock(path) if path is not None else contextlib.nullcontext()
    with lock:
        driver = conn.connection.driver_connection  # through SQLAlchemy the pragma would begin a transaction
        assert driver is not None
        driver.execute("PRAGMA foreign_keys=OFF")
        try:
            with conn.begin():
                yield
        finally:
            driver.execute("PRAGMA foreign_keys=ON")


@contextlib.contextmanager
def sqlite_connection(
    path: str, *, migrating: bool, busy_timeout_s: float = SQLITE_BUSY_TIMEOUT_S
) -> Iterator[Connection]:
    """A connection of its own to the SQLite file ``path`` in one transaction, committed at the end:
    a ``migration_transaction`` when ``migrating``, else a read-only one.  For the CLI and the
    migrations' environment (the store itself keeps its connections in its executor)."""
    engine = sqlite_engine(path, busy_timeout_s=busy_timeout_s, reader=not migrating)
    try:
        with engine.connect() as conn:
            if migrating:
                with migration_transaction(conn, path):
                    yield conn
            else:
                with conn.begin():
                    yield conn
    finally:
        engine.dispose()


class _Gate:
    """Counts the threads inside SQLite; ``close`` waits until none is and keeps new ones out."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._inside = 0
        self._closed = False

    @contextlib.contextmanager
    def inside(self) -> Iterator[None]:
        with self._cond:
            while self._closed:
                self._cond.wait()
            self._inside += 1
        try:
            yield
        finally:
            with self._cond:
                self._inside -= 1
                self._cond.notify_all()

    def close(self, timeout: float) -> None:
        with self._cond:
            self._closed = True
            self._cond.wait_for(lambda: self._inside == 0, timeout)

    def open(self) -> None:
        with self._cond:
            self._closed = False
            self._cond.notify_all()


class _HandOver(Exception):
    """A read in the caller's thread met a lock or a transient error: the writer thread takes it."""


class SqliteExecutor(Executor):
    """See the module doc."""

    # Group commits: committed, units they carried, and groups replayed one unit at a time.
    group_commits = 0
    grouped_units = 0
    group_replays = 0

    def __init__(self, target: DatabaseTarget, *, schema: str | None, options: dict[str, Any]) -> None:
        super().__init__(target, schema=schema, options=options)
        self._busy_s = float(options.get("busy_timeout", SQLITE_BUSY_TIMEOUT_S))
        self._echo = bool(options.get("echo", False))
        self._queue: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._writer_engine: Engine | None = None
        self._writer: Connection | None = None
        self._data_version: int | None = None
        self._poller: sqlite3.Connection | None = None
        self._readers = threading.local()
        self._reader_slots: list[tuple[threading.Thread, Engine, Connection]] = []
        self._reader_lock = threading.Lock()
        self.gate = _Gate()
        _EXECUTORS.add(self)
        self.hub.on_first_waiter = lambda: self._queue.put(_POLL)
        self._thread = threading.Thread(
            target=self._main, name=f"lightning-sql-sqlite[{target.masked}]", daemon=True
        )
        self._thread.start()

    # --- the interface ----------------------------------------------------------------------

    def submit(
        self, unit: Unit[T], *, write: bool, deadline_s: float, snapshot: bool = False
    ) -> concurrent.futures.Future[T]:
        fut: concurrent.futures.Future[T] = concurrent.futures.Future()
        if self.closed:
            fut.set_exception(RuntimeError("The store's SQLite executor is closed"))
            return fut
        if not write and self.schema_ready is not None and self.target.kind != "sqlite-memory":
            try:
                fut.set_result(self._read_here(unit))
                return fut
            except _HandOver:
                pass
            except BaseException as exc:  # noqa: BLE001 - the unit's own error, for its caller
                fut.set_exception(exc)
                return fut
        self._queue.put((unit, write, deadline_s, fut))
        return fut

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        self._queue.put(None)
        if self._thread is not threading.current_thread():
            self._thread.join(FORK_QUIESCE_TIMEOUT_S * 5)
        self._close_readers(lambda _slot: True)

    # --- reads in the caller's thread ----------------------------------------------------------

    def _read_here(self, unit: Unit[T]) -> T:
        with self.gate.inside():
            conn = getattr(self._readers, "conn", None)
            try:
                if conn is None:
                    conn = self._open_reader()
                with conn.begin():
                    return unit(UnitContext(conn, "sqlite"))
            except BaseException as exc:
                if conn is not None and not _rolled_back(conn):
                    self._drop_reader(conn)
                # A read-only reader refusing a write is the unit's own error; anything else that
                # is not goes to the writer thread, which waits, retries and reports.
                if classify_error(exc) != "fatal" and "readonly" not in str(exc):
                    raise _HandOver() from exc
                raise

    def _open_reader(self) -> Connection:
        """This thread's reader connection (those of threads that ended are closed first)."""
        self._close_readers(lambda slot: not slot[0].is_alive())
        assert self.target.path is not None
        engine = sqlite_engine(self.target.path, busy_timeout_s=0.0, reader=True, echo=self._echo)
        try:
            conn = engine.connect()
        except BaseException:
            engine.dispose()
            raise
        with self._reader_lock:
            self._reader_slots.append((threading.current_thread(), engine, conn))
        self._readers.conn = conn
        return conn

    def _drop_reader(self, conn: Connection) -> None:
        self._readers.conn = None
        self._close_readers(lambda slot: slot[2] is conn)

    def _close_readers(self, which: Any) -> None:
        with self._reader_lock:
            closing = [slot for slot in self._reader_slots if which(slot)]
            self._reader_slots = [slot for slot in self._reader_slots if not which(slot)]
        for _thread, engine, conn in closing:
            _close_quietly(conn)
            engine.dispose()

    # --- the writer thread -----------------------------------------------------------------------

    def _main(self) -> None:
        carried: list[Any] = []  # an item taken while gathering a group that may not join it
        while True:
            if carried:
                item = carried.pop()
            else:
                try:
                    item = self._queue.get(
                        timeout=SQLITE_DATA_VERSION_POLL_S if self.hub.has_waiters else None
                    )
                except queue.Empty:
                    self._poll_data_version()
                    continue
            if item is None:
                break
            if item is _POLL:
                self._poll_data_version()
                continue
            group = [item]
            if not isinstance(item[0], SchemaUnit):
                while len(group) < SQLITE_GROUP_COMMIT_MAX:  # only what already waits: never wait for more
                    try:
                        more = self._queue.get_nowait()
                    except queue.Empty:
                        break
                    if more is _POLL:
                        continue
                    if more is None or isinstance(more[0], SchemaUnit):
                        carried.append(more)
                        break
                    group.append(more)
            live = [it for it in group if it[3].set_running_or_notify_cancel()]
            if len(live) == 1:
                self._finish(live[0])
            elif live:
                self._run_group(live)
            if self.hub.has_waiters:
                self._poll_data_version()
        with self.gate.inside():
            self._drop_writer()
            if self._poller is not None:
                self._poller.close()

    def _connection(self) -> Connection:
        """The writer connection, kept open between units."""
        if self._writer is None:
            if self._writer_engine is None:
                self._writer_engine = sqlite_engine(
                    self.target.path or ":memory:", busy_timeout_s=self._busy_s, echo=self._echo
                )
            self._writer = self._writer_engine.connect()
        return self._writer

    def _drop_writer(self) -> None:
        conn, self._writer = self._writer, None
        if conn is not None:
            _close_quietly(conn)
        if self._writer_engine is not None and self.closed:
            self._writer_engine.dispose()

    def _abandon(self, conn: Connection | None) -> None:
        """Roll back; a connection that cannot roll back is replaced."""
        if conn is not None and not _rolled_back(conn):
            self._drop_writer()

    def _poll_data_version(self) -> None:
        """Wake every waiter when another connection committed since the last poll.  A file is
        polled on a reader connection of its own (a read-only store may have no writer); an
        in-memory database, which no other process can write, on the writer connection."""
        try:
            with self.gate.inside():
                if self.target.path is None:
                    driver = self._connection().connection.driver_connection
                else:
                    if self._poller is None:
                        self._poller = sqlite3.connect(self.target.path, isolation_level=None, check_same_thread=False)
                        self._poller.execute("PRAGMA query_only=ON")
                    driver = self._poller
                assert driver is not None
                version = driver.execute("PRAGMA data_version").fetchone()[0]
        except Exception:  # noqa: BLE001 - a failed poll is retried at the next tick
            logger.debug("data_version poll failed", exc_info=True)
            if self._poller is not None:
                self._poller.close()
                self._poller = None
            return
        if self._data_version is not None and version != self._data_version:
            self.hub.wake(None)
        self._data_version = version

    def _finish(self, item: Any, *, started: float | None = None, attempt: int = 0) -> None:
        unit, write, deadline_s, fut = item
        try:
            result = self._run_unit(unit, write, deadline_s, started=started, attempt=attempt)
        except BaseException as exc:  # noqa: BLE001 - handed to the caller
            fut.set_exception(exc)
        else:
            fut.set_result(result)

    def _run_unit(
        self, unit: Unit[T], write: bool, deadline_s: float, *, started: float | None = None, attempt: int = 0
    ) -> T:
        """Run a unit in its own transaction, replayed after transient errors until the deadline."""
        started = time.monotonic() if started is None else started
        while True:
            try:
                with self.gate.inside():
                    return self._try_unit(unit, attempt)
            except StoreUnavailableError:
                raise
            except BaseException as exc:
                if not self.replayable(exc, started, deadline_s, attempt):
                    raise
                time.sleep(backoff(attempt))
                attempt += 1

    def _try_unit(self, unit: Unit[T], attempt: int) -> T:
        if isinstance(unit, SchemaUnit):
            self._ensure_schema(unit)
            return None  # type: ignore[return-value]
        conn = self._connection()
        ctx = UnitContext(conn, "sqlite", attempt=attempt)
        try:
            with conn.begin():
                result = unit(ctx)
        except BaseException:
            self._abandon(conn)
            raise
        self.after_commit(ctx)
        return result

    def _run_group(self, items: list[Any]) -> None:
        """Group commit of two or more write units: one transaction, a savepoint per unit.  A unit
        whose own error is final is rolled back to its savepoint and gets its error; any other
        failure (transient, the COMMIT) rolls the whole group back and replays it unit by unit."""
        started = time.monotonic()
        outcomes: list[tuple[UnitContext, Any, BaseException | None]] = []
        replay_attempt = 0
        conn: Connection | None = None
        try:
            with self.gate.inside():
                conn = self._connection()
                with conn.begin():
                    # Savepoints on the driver connection: SQLAlchemy's begin_nested() costs more than
                    # most units, and nothing here needs it to track them.
                    driver = conn.connection.driver_connection
                    assert driver is not None
                    for unit, _write, _deadline, _fut in items:
                        ctx = UnitContext(conn, "sqlite")
                        driver.execute("SAVEPOINT lightning_sql_unit")
                        try:
                            result = unit(ctx)
                        except Exception as exc:
                            if classify_error(exc) != "fatal" or isinstance(exc, StoreUnavailableError):
                                raise
                            driver.execute("ROLLBACK TO lightning_sql_unit")
                            driver.execute("RELEASE lightning_sql_unit")
                            outcomes.append((ctx, None, exc))
                            continue
                        driver.execute("RELEASE lightning_sql_unit")
                        outcomes.append((ctx, result, None))
                    replay_attempt = 1  # past this point only the COMMIT can fail
        except BaseException:  # noqa: BLE001 - every unit is replayed alone and reports for itself
            self._abandon(conn)
            self.group_replays += 1
            for item in items:
                self._finish(item, started=started, attempt=replay_attempt)
            return
        self.group_commits += 1
        self.grouped_units += len(items)
        for item, (ctx, result, error) in zip(items, outcomes, strict=True):
            if error is None:
                self.after_commit(ctx)
                item[3].set_result(result)
            else:
                item[3].set_exception(error)

    def _ensure_schema(self, unit: SchemaUnit) -> None:
        if self.schema_ready is not None:
            return

        def ensure(conn: Connection) -> None:
            migrate.ensure_schema(
                conn,
                schema=None,
                auto_migrate=unit.auto_migrate,
                read_only=unit.read_only,
                url_for_messages=self.target.masked,
            )

        if unit.read_only and self.target.path is not None:
            # A read-only store may sit on a read-only file: it checks on a reader connection.
            with sqlite_connection(self.target.path, migrating=False, busy_timeout_s=self._busy_s) as conn:
                ensure(conn)
        else:
            conn = self._connection()
            try:
                with migration_transaction(conn, self.target.path):
                    ensure(conn)
            except OSError as exc:  # the lock file: its folder is missing or read-only
                self._abandon(conn)
                raise unavailable(exc, self.target) from exc
            except BaseException:
                self._abandon(conn)
                raise
        self.schema_ready = (unit.auto_migrate, unit.read_only)


def _close_quietly(conn: Connection) -> None:
    try:
        conn.close()
    except Exception:  # noqa: BLE001 - it is being thrown away
        logger.debug("closing a SQLite connection failed", exc_info=True)


def _rolled_back(conn: Connection) -> bool:
    """Roll the connection back, the driver's transaction too: after a failed COMMIT SQLAlchemy
    considers the transaction over while SQLite may keep it open.  False when it cannot (broken)."""
    try:
        conn.rollback()
        raw = conn.connection.dbapi_connection
        if raw is not None and getattr(raw, "in_transaction", False):
            raw.rollback()
    except BaseException:  # noqa: BLE001 - reported as "broken"
        return False
    return True


# --- fork(): wait until no thread of this process is inside SQLite ---------------------------

_EXECUTORS: weakref.WeakSet[SqliteExecutor] = weakref.WeakSet()
_closed_for_fork: list[_Gate] = []


def _before_fork() -> None:
    for executor in list(_EXECUTORS):
        if not executor.closed:
            executor.gate.close(FORK_QUIESCE_TIMEOUT_S)
            _closed_for_fork.append(executor.gate)


def _after_fork_in_parent() -> None:
    while _closed_for_fork:
        _closed_for_fork.pop().open()


def _after_fork_in_child() -> None:
    _closed_for_fork.clear()
    _EXECUTORS.clear()


os.register_at_fork(
    before=_before_fork, after_in_parent=_after_fork_in_parent, after_in_child=_after_fork_in_child
)
