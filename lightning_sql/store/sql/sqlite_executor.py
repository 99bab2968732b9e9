"""The SQLite executor (docs/architecture.md §7).

* One **writer thread** owns the writer connection.  It takes every write call that waits, gathers
  the calls of one operation into batches (``executor.gather_batch``) and runs all of them in ONE
  transaction, each batch in a savepoint (group commit): a batch whose statement fails for one
  call's sake is rolled back to its savepoint and its calls run one by one, each getting its own
  outcome.  Nothing is settled before the COMMIT; a COMMIT that fails replays the whole group.
* One **reader thread** runs the reads of a file on a ``query_only`` WAL connection, batched the
  same way, so a long read never holds a caller's event loop and never waits for the writer.
* A **checkpointer thread** moves committed pages from the WAL into the database file (PASSIVE
  checkpoints, which never block the writer), so commits do not pay for checkpoints.
* ``PRAGMA data_version`` is polled for other processes' commits while anyone waits, and a fork gate
  makes ``fork()`` wait until no thread of this process is inside SQLite, whose process-wide
  mutexes a fork would copy locked into the child.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import queue
import sqlite3
import threading
import time
import weakref
from collections.abc import Iterator
from typing import Any

from sqlalchemy import Connection, Engine, create_engine, event
from sqlalchemy.pool import StaticPool

from lightning_sql.store.sql import migrate, sqlite_batches
from lightning_sql.store.sql.errors import StoreUnavailableError, backoff, classify_error, unavailable
from lightning_sql.store.sql.executor import (
    Batch,
    Executor,
    Failure,
    Operation,
    SchemaUnit,
    UnitCall,
    UnitContext,
    batches_of,
    is_write,
    json_serializer,
    run_outcomes,
    settle,
)
from lightning_sql.store.sql.rows import json_deserializer
from lightning_sql.store.sql.urls import DatabaseTarget

logger = logging.getLogger(__name__)

SQLITE_BUSY_TIMEOUT_S = 30.0  # writers of other processes wait inside SQLite before we retry
SQLITE_DATA_VERSION_POLL_S = 0.05  # how fast another process's commit wakes a waiter
SQLITE_GROUP_MAX_CALLS = 256  # calls per group commit: bounds one transaction's length
SQLITE_CHECKPOINT_INTERVAL_S = 0.25  # the checkpointer runs at most this often while commits arrive
# The writer checkpoints by itself only when the checkpointer fell this far behind (pages of 4 KiB).
SQLITE_AUTOCHECKPOINT_BACKSTOP_PAGES = 16_384
FORK_QUIESCE_TIMEOUT_S = 2.0  # how long fork() waits for threads to leave SQLite

_POLL = object()  # queued for the writer thread: poll PRAGMA data_version now
_STOP = object()


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
            conn.execute(f"PRAGMA wal_autocheckpoint={SQLITE_AUTOCHECKPOINT_BACKSTOP_PAGES}")
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



class SqliteExecutor(Executor):
    """See the module doc."""

    # Group commits: committed, and the calls they carried (tests and measurements).
    group_commits = 0
    grouped_calls = 0

    def __init__(self, target: DatabaseTarget, *, schema: str | None, options: dict[str, Any]) -> None:
        super().__init__(target, schema=schema, options=options)
        self._busy_s = float(options.get("busy_timeout", SQLITE_BUSY_TIMEOUT_S))
        self._echo = bool(options.get("echo", False))
        self._writes: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._reads: queue.SimpleQueue[Any] | None = queue.SimpleQueue() if target.path is not None else None
        self._writer_engine: Engine | None = None
        self._writer: Connection | None = None
        self._reader_engine: Engine | None = None
        self._reader: Connection | None = None
        self._data_version: int | None = None
        self._poller: sqlite3.Connection | None = None
        self._committed = threading.Event()  # wakes the checkpointer
        self.gate = _Gate()
        _EXECUTORS.add(self)
        self.hub.on_first_waiter = lambda: self._writes.put(_POLL)
        self._threads = [threading.Thread(target=self._write_forever, name=f"lightning-sql-sqlite[{target.masked}]", daemon=True)]
        if self._reads is not None:
            self._threads.append(
                threading.Thread(target=self._read_forever, name=f"lightning-sql-sqlite-read[{target.masked}]", daemon=True)
            )
            self._threads.append(
                threading.Thread(target=self._checkpoint_forever, name=f"lightning-sql-sqlite-wal[{target.masked}]", daemon=True)
            )
        for thread in self._threads:
            thread.start()

    # --- the interface ----------------------------------------------------------------------

    def submit(self, call: Operation) -> asyncio.Future[Any]:
        loop = asyncio.get_running_loop()
        call.loop = loop
        call.future = fut = loop.create_future()
        if self.closed:
            fut.set_exception(RuntimeError("The store's SQLite executor is closed"))
        elif self._reads is not None and self.schema_ready is not None and not is_write(call):
            self._reads.put(call)
        else:
            self._writes.put(call)
        return fut

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        self._writes.put(_STOP)
        if self._reads is not None:
            self._reads.put(_STOP)
        self._committed.set()
        for thread in self._threads:
            if thread is not threading.current_thread():
                thread.join(FORK_QUIESCE_TIMEOUT_S * 5)

    # --- the writer thread -----------------------------------------------------------------------

    def _write_forever(self) -> None:
        while True:
            try:
                item = self._writes.get(timeout=SQLITE_DATA_VERSION_POLL_S if self.hub.has_waiters else None)
            except queue.Empty:
                self._poll_data_version()
                continue
            calls: list[Operation] = []
            stop = False
            while True:  # only what already waits: never wait for more
                if item is _STOP:
                    stop = True
                elif item is not _POLL:
                    calls.append(item)
                if stop or len(calls) >= SQLITE_GROUP_MAX_CALLS:
                    break
                try:
                    item = self._writes.get_nowait()
                except queue.Empty:
                    break
            schema = [c for c in calls if isinstance(c, UnitCall) and isinstance(c.unit, SchemaUnit)]
            for call in schema:
                self._run_schema(call)
            rest = [c for c in calls if c not in schema] if schema else calls
            if rest:
                self._run_group(rest)
            if self.hub.has_waiters:
                self._poll_data_version()
            if stop:
                break
        with self.gate.inside():
            self._drop_writer()
            if self._poller is not None:
                self._poller.close()

    def _connection(self) -> Connection:
        """The writer connection, kept open between groups."""
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

    def _run_group(self, calls: list[Operation]) -> None:
        """Group commit of ``calls`` (see the module doc), replayed whole after a transient error
        until each call's deadline; settles every call."""
        pending, attempt = calls, 0
        while pending:
            conn: Connection | None = None
            try:
                with self.gate.inside():
                    conn = self._connection()
                    driver = conn.connection.driver_connection
                    assert driver is not None
                    batches = batches_of(pending)
                    with conn.begin():
                        for batch in batches:
                            batch.attempt = attempt
                            self._in_savepoint(conn, driver, batch)
                self.group_commits += 1
                self.grouped_calls += len(pending)
                for batch in batches:
                    self.after_commit(batch.events)
                self._committed.set()
                break
            except (StoreUnavailableError, PermissionError) as exc:
                self._abandon(conn)
                for call in pending:
                    call.outcome = Failure(exc)
                break
            except BaseException as exc:  # noqa: BLE001 - transient, or a failed COMMIT: replay
                self._abandon(conn)
                try:
                    if not self.replayable(exc, attempt):
                        raise
                except BaseException as final:  # noqa: BLE001 - every call reports it
                    for call in pending:
                        call.outcome = Failure(final)
                    break
                pending = self.expired(pending, exc)
                time.sleep(backoff(attempt))
                attempt += 1
        settle(calls)

    def _in_savepoint(self, conn: Connection, driver: Any, batch: Batch) -> None:
        """Run ``batch`` in a savepoint of the group's transaction.  A failure that is the calls'
        own (not transient) is rolled back to the savepoint; several calls then run one by one, so
        each gets its own outcome.  Transient errors propagate: the whole group replays."""
        driver.execute("SAVEPOINT lightning_sql_batch")
        try:
            self._run_batch(conn, driver, batch)
        except BaseException as exc:
            if classify_error(exc) != "fatal" or isinstance(exc, (StoreUnavailableError, PermissionError)):
                raise
            driver.execute("ROLLBACK TO lightning_sql_batch")
            driver.execute("RELEASE lightning_sql_batch")
            if len(batch.calls) == 1:
                batch.calls[0].outcome = Failure(exc)
                return
            for call in batch.calls:
                single = Batch([call], attempt=batch.attempt, events=batch.events)
                self._in_savepoint(conn, driver, single)
            return
        driver.execute("RELEASE lightning_sql_batch")

    def _run_batch(self, conn: Connection, driver: Any, batch: Batch) -> None:
        (head,) = batch.calls if isinstance(batch.calls[0], UnitCall) else (None,)
        if head is not None:
            assert isinstance(head, UnitCall)
            ctx = UnitContext(conn, "sqlite", attempt=batch.attempt)
            head.outcome = head.unit(ctx)
            batch.events.events.update(ctx.events)
            return
        run_outcomes(batch, sqlite_batches.run(driver, batch))

    def _run_schema(self, call: UnitCall) -> None:
        try:
            with self.gate.inside():
                self._ensure_schema(call.unit)  # type: ignore[arg-type]
            call.outcome = None
        except BaseException as exc:  # noqa: BLE001 - handed to the caller
            call.outcome = Failure(exc)
        settle([call])

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

        started = time.monotonic()
        attempt = 0
        while True:
            try:
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
                break
            except StoreUnavailableError:
                raise
            except BaseException as exc:
                if not self.replayable(exc, attempt) or time.monotonic() - started > self._busy_s:
                    raise
                time.sleep(backoff(attempt))
                attempt += 1
        self.schema_ready = (unit.auto_migrate, unit.read_only)

    # --- the reader thread -----------------------------------------------------------------------

    def _read_forever(self) -> None:
        assert self._reads is not None
        while True:
            calls = [self._reads.get()]
            while len(calls) < SQLITE_GROUP_MAX_CALLS:
                try:
                    calls.append(self._reads.get_nowait())
                except queue.Empty:
                    break
            stop = any(call is _STOP for call in calls)
            for batch in batches_of(c for c in calls if c is not _STOP):
                self._read(batch)
                settle(batch.calls)
            if stop:
                break
        with self.gate.inside():
            if self._reader is not None:
                _close_quietly(self._reader)
            if self._reader_engine is not None:
                self._reader_engine.dispose()

    def _reader_connection(self) -> Connection:
        if self._reader is None:
            assert self.target.path is not None
            if self._reader_engine is None:
                self._reader_engine = sqlite_engine(
                    self.target.path, busy_timeout_s=self._busy_s, reader=True, echo=self._echo
                )
            self._reader = self._reader_engine.connect()
        return self._reader

    def _read(self, batch: Batch) -> None:
        """One read batch on the reader connection: a unit in one read transaction (one snapshot),
        a batch's statements in autocommit; replayed after transient errors until the deadline."""
        pending, attempt = batch, 0
        while pending.calls:
            try:
                with self.gate.inside():
                    conn = self._reader_connection()
                    head = pending.calls[0]
                    if isinstance(head, UnitCall):
                        with conn.begin():
                            head.outcome = head.unit(UnitContext(conn, "sqlite", attempt=attempt))
                    else:
                        driver = conn.connection.driver_connection
                        assert driver is not None
                        run_outcomes(pending, sqlite_batches.run(driver, pending))
                return
            except BaseException as exc:  # noqa: BLE001 - outcomes for every caller
                if self._reader is not None and not _rolled_back(self._reader):
                    _close_quietly(self._reader)
                    self._reader = None
                try:
                    # The reader is query_only: a unit that tries to write fails with its own error.
                    replay = "readonly" not in str(exc) and self.replayable(exc, attempt)
                except BaseException as final:  # noqa: BLE001
                    exc, replay = final, False
                if not replay:
                    if len(pending.calls) > 1 and classify_error(exc) == "fatal":
                        for call in pending.calls:
                            self._read(Batch([call]))
                    else:
                        for call in pending.calls:
                            call.outcome = Failure(exc)
                    return
                pending = Batch(self.expired(pending.calls, exc))
                time.sleep(backoff(attempt))
                attempt += 1

    # --- WAL checkpoints and other processes' commits ---------------------------------------------

    def _checkpoint_forever(self) -> None:
        assert self.target.path is not None
        conn: sqlite3.Connection | None = None
        while not self.closed:
            self._committed.wait()
            if self.closed:
                break
            time.sleep(SQLITE_CHECKPOINT_INTERVAL_S)  # let commits accumulate
            self._committed.clear()
            try:
                with self.gate.inside():
                    if conn is None:
                        conn = sqlite3.connect(self.target.path, isolation_level=None, check_same_thread=False)
                    conn.execute("PRAGMA wal_checkpoint(PASSIVE)").fetchall()
            except sqlite3.Error:  # busy or gone: the next commit tries again
                logger.debug("WAL checkpoint failed", exc_info=True)
                if conn is not None:
                    conn.close()
                    conn = None
        if conn is not None:
            with self.gate.inside():
                conn.close()

    def _poll_data_version(self) -> None:
        """Wake every waiter when another connection committed since the last poll.  A file is
        polled on a connection of its own (a read-only store may have no writer); an in-memory
        database, which no other process can write, on the writer connection."""
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
