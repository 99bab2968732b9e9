"""How a unit of work reaches the database (DESIGN §5, contract §0.3).

One I/O worker per process and database does the database work of every store instance on that
database in that process.  Public coroutines, from any loop or thread, hand it a *unit* (a plain sync
function over a SQLAlchemy ``Connection``) and await a ``concurrent.futures.Future``:

* ``SqliteThreadWorker``: a thread owning one stdlib ``sqlite3`` connection (``isolation_level=None``,
  ``BEGIN IMMEDIATE`` for every writing unit).  One thread hop per call.
* ``AsyncLoopWorker``: a thread running its own event loop that owns an async engine (asyncpg for
  PostgreSQL, aiosqlite for ``sqlite+aiosqlite://``) and, on PostgreSQL, one LISTEN connection.

Both retry transient failures by replaying the whole unit with jittered back-off, and turn a database
that stays unreachable past ``connect_deadline_seconds`` into ``StoreUnavailableError``.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import fcntl
import functools
import hashlib
import json
import logging
import os
import queue
import random
import sqlite3
import threading
import time
import weakref
from collections.abc import Callable, Hashable, Iterator
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar

from sqlalchemy import Connection, Engine, create_engine, event, text
from sqlalchemy.exc import DBAPIError, DisconnectionError, OperationalError
from sqlalchemy.ext.asyncio import AsyncEngine, create_async_engine
from sqlalchemy.pool import StaticPool
from sqlalchemy.util import greenlet_spawn

from lightning_sql.store.sql import fastexec, migrate
from lightning_sql.store.sql.errors import StoreUnavailableError
from lightning_sql.store.sql.urls import DatabaseTarget, mask_url, normalise_url  # noqa: F401

logger = logging.getLogger(__name__)

T = TypeVar("T")

# --- tuning knobs -----------------------------------------------------------------------------
SQLITE_BUSY_TIMEOUT_S = 30.0  # writers of other processes wait inside SQLite before we retry
SQLITE_DATA_VERSION_POLL_S = 0.05  # how fast another process's commit wakes a waiter (contract §2.12)
PG_POOL_SIZE = 10  # concurrent units per process; claims and span writes overlap on PostgreSQL
# No overflow by default: SQLAlchemy closes an overflow connection when it is checked in, so demand
# above the pool size opened and closed a PostgreSQL connection per call (a server process, auth and
# statement preparation each time): 32 concurrent claimers ran at ~1,000 claims/s with 10 + 10 and
# ~2,500 with 10 + 0 here.  Units beyond the pool wait for a connection instead (``pool_timeout``).
PG_MAX_OVERFLOW = 0
PG_LISTEN_RECONNECT_S = 1.0  # how soon a lost LISTEN connection is re-established
# With pool_pre_ping (the default), a connection is pinged on checkout only when it rested in the pool
# longer than this: one that answered a moment ago almost surely still does, and a unit that meets a
# dead one anyway is replayed on a new connection (units are retry-safe), so the ping round trip is
# spent only where it is likely to find something.
PG_PRE_PING_IDLE_S = 1.0
FORK_QUIESCE_TIMEOUT_S = 2.0  # how long fork() waits for an I/O thread to leave SQLite
RETRY_BASE_DELAY_S = 0.01  # first back-off after a transient error; doubles up to the cap
RETRY_MAX_DELAY_S = 1.0
# Group commit on the SQLite writer thread (BENCHMARKS "Levers"): the units already waiting when the
# thread takes one run together in one transaction, each in its own savepoint, up to this many per
# group; 0 or 1 turns it off (one transaction per unit).  Tests monkeypatch it; the environment
# variable is for measurements.
SQLITE_GROUP_COMMIT_MAX = int(os.environ.get("LIGHTNING_SQL_SQLITE_GROUP_COMMIT", "") or 64)
# Read units on a SQLite file run in the calling thread, on a reader connection of that thread (WAL:
# readers never wait for the writer), instead of hopping to the writer thread and back: the two
# cross-thread wake-ups of a hop cost ~270 µs here, more than a point read itself. "0" turns it off
# (every unit hops, as writes do); tests flip ``SqliteThreadWorker.inline_reads``.
SQLITE_INLINE_READS = os.environ.get("LIGHTNING_SQL_SQLITE_INLINE_READS", "1") != "0"
# Write units run in the calling thread too, on the writer connection, at the next turn of the
# caller's event loop (the writes its tasks queued meanwhile in one group commit), when no other
# thread of the process is inside SQLite and nothing waits for the writer thread (``write_soon``);
# otherwise they go to the writer thread. "0" turns it off; tests flip ``SqliteThreadWorker.inline_writes``.
SQLITE_INLINE_WRITES = os.environ.get("LIGHTNING_SQL_SQLITE_INLINE_WRITES", "1") != "0"
# SQLite files: WAL checkpoints (copying committed pages from the WAL into the database file) run
# on a checkpointer thread of the worker, at most every SQLITE_CHECKPOINT_INTERVAL_S while writes
# go on, instead of inside the COMMIT of whichever write crosses SQLite's 1,000-page threshold: a
# checkpoint is C and I/O with the GIL released, so on another core it costs the callers nothing
# (ADR 0005, decision 9).  The committing connection still checkpoints by itself past
# SQLITE_AUTOCHECKPOINT_BACKSTOP_PAGES (the thread fell behind).  "0" turns it off (SQLite's own
# autocheckpoint at 1,000 pages); tests flip ``SqliteThreadWorker.background_checkpoints``.
SQLITE_BACKGROUND_CHECKPOINTS = os.environ.get("LIGHTNING_SQL_SQLITE_BACKGROUND_CHECKPOINT", "1") != "0"
SQLITE_CHECKPOINT_INTERVAL_S = 0.05
SQLITE_AUTOCHECKPOINT_BACKSTOP_PAGES = 16_000  # ~64 MB of WAL at 4 KiB pages
# PostgreSQL: the units of the first event loop that calls a worker (its "home" loop: usually the
# program's main loop, where the algorithm and the runners live) run in that loop, on an engine of
# its own, instead of hopping to the I/O thread and back: the two cross-thread wake-ups and GIL
# hand-overs of a hop cost more client CPU than the statement (ADR 0005, decision 8).  Other loops
# (a heartbeat thread's, a span writer's) go through the I/O thread. "0" turns it off (every unit
# hops); tests flip ``AsyncLoopWorker.home_units``.
PG_HOME_LOOP_UNITS = os.environ.get("LIGHTNING_SQL_PG_HOME_LOOP", "1") != "0"
# A prebuilt read of one statement on the home loop (``query_spans`` without pagination) runs as a
# coroutine on a connection the home engine keeps for it: no greenlet, no pool checkout (ADR 0005
# decision 14).  0 sends every read through its unit (for comparisons).
PG_DIRECT_READS = os.environ.get("LIGHTNING_SQL_PG_DIRECT_READS", "1") != "0"
# A batch of the home loop that is ONE prebuilt statement atomic on its own (a claim, sequence ids,
# spans, attempt updates: ``BatchUnit.plan``) runs the same way, on up to PG_DIRECT_WRITERS
# connections the home engine keeps for it (ADR 0005 decision 15); a batch that finds them all busy
# runs as a unit.  0 sends every batch through its unit (for comparisons).
PG_DIRECT_WRITES = os.environ.get("LIGHTNING_SQL_PG_DIRECT_WRITES", "1") != "0"
PG_DIRECT_WRITERS = 4
NOTIFY_CHANNEL = "lightning_sql_v1"


def notify_channel(schema: str | None) -> str:
    """The LISTEN/NOTIFY channel of the store's tables in ``schema``: ``NOTIFY_CHANNEL`` for the
    default schema, and one channel per named schema, so that stores on other schemas of the same
    database (whose run ids are their own) neither hear nor wake each other.  A name over
    PostgreSQL's 63 bytes is replaced by a digest of the schema."""
    if schema is None:
        return NOTIFY_CHANNEL
    channel = f"{NOTIFY_CHANNEL}:{schema}"
    if len(channel.encode()) > 63:
        channel = f"{NOTIFY_CHANNEL}:{hashlib.sha256(schema.encode()).hexdigest()[:32]}"
    return channel


# PostgreSQL SQLSTATEs that a replay of the whole unit can cure.
_PG_TRANSIENT_SQLSTATES = {
    "40001",  # serialization_failure
    "40P01",  # deadlock_detected
    "55P03",  # lock_not_available
    "57P01",  # admin_shutdown
    "57P02",  # crash_shutdown
    "57P03",  # cannot_connect_now
    "08000",
    "08003",
    "08006",
    "08001",
    "08004",
}
# ...and those no retry can cure: report them at once.
_PG_PERMANENT_SQLSTATES = {
    "28000",  # invalid_authorization_specification
    "28P01",  # invalid_password
    "3D000",  # invalid_catalog_name (unknown database)
}
_PG_DENIED_SQLSTATES = {"42501"}  # insufficient_privilege: a role without write grants


class EncodedJson(str):
    """JSON text already validated and encoded by the store: the engine's serializer passes it through."""

    __slots__ = ()


def _json_serializer(value: Any) -> str:
    if isinstance(value, EncodedJson):
        return value
    return json.dumps(value, separators=(",", ":"), ensure_ascii=False, allow_nan=False)


# --- units and their context ------------------------------------------------------------------


@dataclass
class UnitContext:
    """What a unit sees besides its connection: the dialect and the events it wants announced."""

    conn: Connection
    dialect: str
    events: set[tuple[int, str]] = field(default_factory=set)
    # 0 on the first try; > 0 when the worker replays the unit after a transient error, i.e. when an
    # earlier try may have committed (units skip their replay look-ups on the first try).
    attempt: int = 0
    # Events a statement of the unit already notified (PostgreSQL, dialect.run_writes): the worker
    # sends only the others.
    notified: set[tuple[int, str]] = field(default_factory=set)
    notify_channel: str = NOTIFY_CHANNEL  # PostgreSQL: where they go (``notify_channel(schema)``)
    # PostgreSQL: the unit runs without a transaction (``AsyncLoopWorker``'s ``autocommit``): each
    # statement commits on its own and holds no lock beyond its end.
    autocommit: bool = False

    def announce(self, run_id: int, kind: str) -> None:
        """Record a ``finished``/``queued`` event, delivered once per kind and run after commit."""
        self.events.add((run_id, kind))

    def take_notifications(self) -> list[str]:
        """The NOTIFY payloads of the events not notified yet, in delivery order; they count as sent."""
        pending = sorted(self.events - self.notified)
        self.notified.update(pending)
        return [f"{run_id}:{kind}" for run_id, kind in pending]

    def execute(self, stmt: Any, params: Any = None) -> Any:
        """``conn.execute(stmt, params)``; prebuilt statements go straight to the driver (fastexec)."""
        return fastexec.execute(self.conn, stmt, params)


Unit = Callable[[UnitContext], T]


def _same_batch(unit: Any, first: BatchUnit[Any]) -> bool:
    return isinstance(unit, BatchUnit) and unit.key == first.key


class NeedsTransaction(Exception):
    """Raised by a unit run without a transaction (PostgreSQL ``autocommit``) before it writes
    anything, when what it found or was given cannot be done in one statement: the caller runs it
    again in a transaction (``StoreInstance._flush_batch`` for an atomic batch,
    ``SqlLightningStore.update_attempt`` for a call alone)."""


@dataclass(slots=True)
class Planned(Generic[T]):
    """A batch of units as ONE prebuilt statement, atomic on its own (``BatchUnit.plan``): its
    parameters, and how each unit's result comes from its rows: ``results(rows, events)`` raises
    what the batch's unit would (the batch's own error, ``NeedsTransaction``) and adds to
    ``events`` what the unit would announce (``UnitContext.announce``)."""

    stmt: Any
    params: dict[str, Any]
    results: Callable[[list[Any], set[tuple[int, str]]], list[T]]


class BatchUnit(Generic[T]):
    """A write unit that may run together with the units of the same ``key`` queued right after it
    (a SQLite group commit) or issued in the same turn of the caller's event loop (the I/O loop:
    ``StoreInstance._submit_batchable``), as one unit: ``run_batch(ctx, [args, ...])`` gives each
    unit's result, what the units would give run one after the other in that order (concurrent
    claims become one claim of several rollouts).  Alone it is ``run_batch(ctx, [args])``.

    ``plan([args, ...])``, when given, is the batch as one ``Planned`` statement, or None when it
    is not one (then, and off the PostgreSQL home loop, ``run_batch`` runs it): what ``run_batch``
    does on a first try without a transaction, on the home loop's kept connections
    (``_HomeEngine.write``)."""

    __slots__ = ("key", "args", "run_batch", "atomic", "max_batch", "plan")

    def __init__(
        self,
        key: Hashable,
        args: Any,
        run_batch: Callable[[UnitContext, list[Any]], list[T]],
        *,
        atomic: bool = False,
        max_batch: int = 0,
        plan: Callable[[list[Any]], Planned[T] | None] | None = None,
    ) -> None:
        self.key = key
        self.args = args
        self.run_batch = run_batch
        # A batch of these is one atomic statement: on PostgreSQL it runs without a transaction
        # (unless it raises ``NeedsTransaction``: then it runs again in one).
        self.atomic = atomic
        # On the I/O loop a batch takes ``max_batch`` units at most (0: no limit), so that a turn's
        # big batch becomes several, which run side by side on as many connections (the database's
        # work of one statement runs on one core).  SQLite's writer is one connection anyway.
        self.max_batch = max_batch
        self.plan = plan

    def __call__(self, ctx: UnitContext) -> T:
        (result,) = self.run_batch(ctx, [self.args])
        return result


def _sqlstate(exc: BaseException) -> str | None:
    seen: set[int] = set()
    cur: BaseException | None = exc
    while cur is not None and id(cur) not in seen:
        seen.add(id(cur))
        state = getattr(cur, "sqlstate", None) or getattr(cur, "pgcode", None)
        if isinstance(state, str):
            return state
        cur = getattr(cur, "orig", None) or cur.__cause__ or cur.__context__
    return None


def _chain(exc: BaseException) -> list[BaseException]:
    out: list[BaseException] = []
    cur: BaseException | None = exc
    while cur is not None and cur not in out:
        out.append(cur)
        cur = getattr(cur, "orig", None) or cur.__cause__ or cur.__context__
    return out


def classify_error(exc: BaseException) -> str:
    """``"transient"`` (replay the unit), ``"unavailable"`` (give up at once), ``"denied"`` or ``"fatal"``."""
    state = _sqlstate(exc)
    if state in _PG_DENIED_SQLSTATES:
        return "denied"
    if state in _PG_PERMANENT_SQLSTATES:
        return "unavailable"
    if state in _PG_TRANSIENT_SQLSTATES:
        return "transient"
    for item in _chain(exc):
        if isinstance(item, DBAPIError) and item.connection_invalidated:
            return "transient"
        if isinstance(item, (sqlite3.OperationalError, OperationalError)):
            message = str(item).lower()
            if "locked" in message or "busy" in message:
                return "transient"
            if "unable to open database" in message:
                return "unavailable"
        if isinstance(item, (ConnectionError, TimeoutError, OSError)) and not isinstance(
            item, (FileNotFoundError, PermissionError)
        ):
            return "transient"
        name = type(item).__name__
        if name in (
            "ConnectionDoesNotExistError",
            "InterfaceError",
            "CannotConnectNowError",
            "ConnectionFailureError",
            "PostgresConnectionError",
            "InternalClientError",
        ) and "connection" in (str(item).lower() + name.lower()):
            return "transient"
        if name in ("InvalidPasswordError", "InvalidAuthorizationSpecificationError", "InvalidCatalogNameError"):
            return "unavailable"
    return "fatal"


def _backoff(attempt: int) -> float:
    delay = min(RETRY_MAX_DELAY_S, RETRY_BASE_DELAY_S * (2**attempt))
    return delay * (0.5 + random.random())


# --- waking callers' event loops ------------------------------------------------------------

_deferred = threading.local()


@contextlib.contextmanager
def deferred_wakeups() -> Iterator[None]:
    """Within this block, ``wake_loop`` calls of this thread are collected and made once per
    (loop, callback) at its end.  An I/O thread settling a group of units wakes each caller's loop
    once: every ``call_soon_threadsafe`` writes to the loop's self-pipe, and that syscall hands the
    GIL to the woken thread, so one wake-up per unit would also cost a GIL round trip per unit."""
    pending: dict[tuple[int, Any], tuple[asyncio.AbstractEventLoop, Callable[[], None]]] = {}
    _deferred.pending = pending
    try:
        yield
    finally:
        _deferred.pending = None
        for loop, callback in pending.values():
            _call_soon_threadsafe(loop, callback)


def wake_loop(loop: asyncio.AbstractEventLoop, callback: Callable[[], None]) -> None:
    """``loop.call_soon_threadsafe(callback)``, or later inside ``deferred_wakeups()``."""
    pending = getattr(_deferred, "pending", None)
    if pending is not None:
        pending.setdefault((id(loop), callback), (loop, callback))
    else:
        _call_soon_threadsafe(loop, callback)


def _call_soon_threadsafe(loop: asyncio.AbstractEventLoop, callback: Callable[[], None]) -> None:
    try:
        loop.call_soon_threadsafe(callback)
    except RuntimeError:  # the loop is closed: nobody waits there any more
        pass


# --- the wait hub: in-process wake-ups --------------------------------------------------------


class WaitHub:
    """Waiters of this process on one database; woken after commits, notifications and polls."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._waiters: dict[int, set[tuple[asyncio.AbstractEventLoop, asyncio.Event]]] = {}
        # Called (outside the lock) when the first waiter arrives: the SQLite writer thread, which
        # polls for other processes' commits only while someone waits, may be asleep on its queue.
        self.on_first_waiter: Callable[[], None] | None = None

    def register(self, run_id: int) -> tuple[asyncio.AbstractEventLoop, asyncio.Event]:
        entry = (asyncio.get_running_loop(), asyncio.Event())
        with self._lock:
            first = not self._waiters
            self._waiters.setdefault(run_id, set()).add(entry)
        if first and self.on_first_waiter is not None:
            self.on_first_waiter()
        return entry

    def unregister(self, run_id: int, entry: tuple[asyncio.AbstractEventLoop, asyncio.Event]) -> None:
        with self._lock:
            bucket = self._waiters.get(run_id)
            if bucket is not None:
                bucket.discard(entry)
                if not bucket:
                    del self._waiters[run_id]

    @property
    def has_waiters(self) -> bool:
        return bool(self._waiters)

    def wake(self, run_id: int | None = None) -> None:
        """Wake the waiters of one run (or of every run when ``run_id`` is None)."""
        with self._lock:
            if run_id is None:
                entries = [e for bucket in self._waiters.values() for e in bucket]
            else:
                entries = list(self._waiters.get(run_id, ()))
        for loop, ev in entries:
            _call_soon_threadsafe(loop, ev.set)


# --- workers ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class WorkerKey:
    pid: int
    target: str
    schema: str | None
    options: tuple[tuple[str, Any], ...]


class IoWorker:
    """Base of the per-process, per-database I/O workers."""

    # Units (BatchUnit) that ran as part of a committed batch: a counter for tests and measurements.
    batched_units = 0

    def __init__(self, target: DatabaseTarget, *, schema: str | None, options: dict[str, Any]) -> None:
        self.target = target
        self.schema = schema
        self.options = options
        self.hub = WaitHub()
        self.refs = 0
        self.pid = os.getpid()
        self.closed = False
        self._schema_lock = threading.Lock()
        self._schema_ready: tuple[bool, bool] | None = None  # (auto_migrate, read_only) that succeeded

    @property
    def dialect(self) -> str:
        return self.target.dialect

    def submit(self, unit: Unit[T], *, write: bool, deadline_s: float) -> concurrent.futures.Future[T]:
        raise NotImplementedError

    def close(self) -> None:
        raise NotImplementedError

    def _open_migration_lock(self) -> Any:
        """The SQLite sidecar lock file ``<db>.migrate.lock``; a path that cannot be opened means the
        database cannot be either (StoreUnavailableError, at once)."""
        assert self.target.path is not None
        try:
            return open(self.target.path + ".migrate.lock", "a+")  # noqa: SIM115 - closed by the caller
        except OSError as exc:
            raise self._unavailable(exc) from exc

    def _reason(self, exc: BaseException) -> str:
        """The driver's reason, first line only (no SQL text), with any password masked."""
        orig = getattr(exc, "orig", None) or exc
        text_ = str(orig).strip().splitlines()[0] if str(orig).strip() else ""
        reason = f"{type(orig).__name__}: {text_}".replace(str(self.target.url), self.target.masked)
        password = self.target.url.password
        if password:
            reason = reason.replace(str(password), "***")
        return reason

    def _unavailable(self, exc: BaseException) -> StoreUnavailableError:
        return StoreUnavailableError(f"Database {self.target.masked} is unavailable: {self._reason(exc)}")

    def _denied(self, exc: BaseException) -> PermissionError:
        return PermissionError(f"Database {self.target.masked} refused the operation: {self._reason(exc)}")

    def _after_commit(self, ctx: UnitContext) -> None:
        for run_id, _kind in ctx.events:
            self.hub.wake(run_id)


_POLL = ("poll",)  # queued for the SQLite writer thread: poll PRAGMA data_version now


class SqliteThreadWorker(IoWorker):
    """One writer thread and its stdlib sqlite3 connection; every write unit is one transaction on
    that connection, or one savepoint of a group commit (``SQLITE_GROUP_COMMIT_MAX``), run by the
    thread or, while it is idle, by the caller's own thread (``write_soon``) under the ``busy`` lock.
    Reads of a file run on per-thread reader connections (``read_inline``)."""

    # Group commit counters (tests and measurements): groups committed, units they carried, and
    # groups rolled back and replayed one unit at a time.
    group_commits = 0
    grouped_units = 0
    group_replays = 0

    def __init__(self, target: DatabaseTarget, *, schema: str | None, options: dict[str, Any]) -> None:
        super().__init__(target, schema=schema, options=options)
        self._queue: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._engine: Engine | None = None
        self._conn: Connection | None = None
        self._data_version: int | None = None
        # Held by whoever is inside SQLite on the writer connection (this thread, or a caller's thread
        # running its loop's writes: write_soon); fork() waits for it (see _quiesce_before_fork).
        self.busy = threading.Lock()
        # Inline reads (read_inline): one reader connection per calling thread, and a gate that a
        # fork() closes until no caller is inside SQLite.
        self.inline_reads = SQLITE_INLINE_READS and target.kind != "sqlite-memory"
        self.inline_read_count = 0  # reads that ran inline (tests and measurements)
        self.inline_writes = SQLITE_INLINE_WRITES
        self.inline_write_count = 0  # write units that ran inline (tests and measurements)
        self.inline_groups = 0  # ...of which in groups of two or more
        self._soon: dict[asyncio.AbstractEventLoop, list[Any]] = {}  # write_soon's units per loop
        self._busy_ms = int(float(options.get("busy_timeout", SQLITE_BUSY_TIMEOUT_S)) * 1000)
        self._readers = threading.local()
        # Every thread's reader connection and its engine: a thread that ended has its closed when
        # another thread opens one (no file descriptors left behind by short-lived threads), and
        # every one is closed with the worker.
        self._reader_slots: list[tuple[threading.Thread, Engine, Connection]] = []
        self._reader_lock = threading.Lock()
        self.read_gate = _ReadGate()
        # WAL checkpoints on a thread of their own (see SQLITE_BACKGROUND_CHECKPOINTS): commits set
        # the event; the thread, started at the first one, checkpoints and waits the interval.
        self.background_checkpoints = SQLITE_BACKGROUND_CHECKPOINTS and target.kind == "sqlite"
        self.checkpoints = 0  # background checkpoints run (tests and measurements)
        self._checkpoint_wanted = threading.Event()
        self._checkpoint_stop = threading.Event()
        self._checkpointer: threading.Thread | None = None
        self._checkpointer_lock = threading.Lock()
        _SQLITE_THREAD_WORKERS.add(self)
        self.hub.on_first_waiter = functools.partial(self._queue.put, _POLL)
        self._thread = threading.Thread(
            target=self._main, name=f"lightning-sql-io[{target.masked}]", daemon=True
        )
        self._thread.start()

    def _make_engine(self, *, reader: bool = False) -> Engine:
        """The engine of the writer connection, or with ``reader`` of one inline reader connection:
        no busy wait (a reader that meets a lock hands its unit to the writer thread, which waits and
        retries off the caller's event loop) and ``query_only`` (a read unit that tried to write would
        fail instead of writing outside the writer thread)."""
        busy = 0.0 if reader else float(self.options.get("busy_timeout", SQLITE_BUSY_TIMEOUT_S))
        database = self.target.path or ":memory:"

        def creator() -> sqlite3.Connection:
            conn = sqlite3.connect(database, isolation_level=None, check_same_thread=False, timeout=busy)
            if reader:
                conn.execute("PRAGMA query_only=ON")
            elif self.target.kind != "sqlite-memory":
                conn.execute("PRAGMA journal_mode=WAL")
                if self.background_checkpoints:
                    conn.execute(f"PRAGMA wal_autocheckpoint={int(SQLITE_AUTOCHECKPOINT_BACKSTOP_PAGES)}")
            conn.execute("PRAGMA synchronous=NORMAL")
            conn.execute("PRAGMA foreign_keys=ON")
            conn.execute(f"PRAGMA busy_timeout={int(busy * 1000)}")
            return conn

        engine = create_engine(
            "sqlite://",
            creator=creator,
            poolclass=StaticPool,
            json_serializer=_json_serializer,
            echo=bool(self.options.get("echo", False)),
        )
        return engine

    def submit(self, unit: Unit[T], *, write: bool, deadline_s: float) -> concurrent.futures.Future[T]:
        fut: concurrent.futures.Future[T] = concurrent.futures.Future()
        if self.closed:
            fut.set_exception(RuntimeError("The store's I/O thread is closed"))
            return fut
        self._queue.put((unit, write, deadline_s, fut))
        return fut

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            self._queue.put(None)
            self._close_checkpointer()
            # The reader connections close once no caller is inside one (the gate stays closed:
            # later reads see ``closed`` and go to the queue, which refuses them).
            if self.read_gate.close(FORK_QUIESCE_TIMEOUT_S):
                self._close_readers(lambda _slot: True)

    def read_inline(self, unit: Unit[T]) -> tuple[bool, T | None]:
        """Run the read unit ``unit`` in the calling thread, as one read transaction on this thread's
        reader connection: ``(True, result)``.  ``(False, None)`` when it must go to the writer
        thread instead: inline reads are off, the worker is closed, a fork() is under way, or the try
        met a lock or an error that the writer thread's retries and conversions handle (the failed
        try changed nothing: it only read).  Errors of the unit itself are raised, as by the thread.
        """
        if not self.inline_reads or self.closed or self._schema_ready is None:
            return False, None
        if not self.read_gate.enter():
            return False, None
        try:
            conn = getattr(self._readers, "conn", None)
            try:
                if conn is None:
                    conn = self._open_reader()
                fastexec.control(conn, "BEGIN")
                ctx = UnitContext(conn, "sqlite")
                result = unit(ctx)
                fastexec.control(conn, "COMMIT")
            except BaseException as exc:
                if conn is not None:
                    self._abandon_reader(conn)
                if classify_error(exc) != "fatal" or isinstance(exc, StoreUnavailableError):
                    return False, None
                raise
            self.inline_read_count += 1
            return True, result
        finally:
            self.read_gate.leave()

    def write_soon(self, unit: Unit[T]) -> asyncio.Future[tuple[bool, Any]] | None:
        """Queue the write unit ``unit`` to run in the calling thread at the next turn of the running
        event loop, in one transaction with the other writes that this loop's tasks queue meanwhile
        (group commit in the caller's loop; each unit in its own savepoint, as on the writer thread,
        and one unit alone in a plain transaction).  The future gives ``(True, result)``, raises
        the unit's own error, or gives ``(False, attempt)`` when the unit must go to the writer
        thread instead, with ``ctx.attempt`` at least ``attempt`` there (see ``_flush_soon``).
        None when inline writes are off or cannot run yet (closed, schema not ensured).
        """
        if not self.inline_writes or self.closed or self._schema_ready is None or isinstance(unit, SchemaUnit):
            return None
        loop = asyncio.get_running_loop()
        fut: asyncio.Future[tuple[bool, Any]] = loop.create_future()
        batch = self._soon.get(loop)
        if batch is None:
            drop_closed_loops(self._soon, lambda lp: lp)
            batch = self._soon[loop] = []
            loop.call_soon(self._flush_soon, loop)
        batch.append((unit, fut))
        return fut

    def _flush_soon(self, loop: asyncio.AbstractEventLoop) -> None:
        """Run the writes ``loop`` queued (``write_soon``), when the writer connection is free: no
        other thread of this process inside SQLite (the writer thread, another loop's writes, a
        fork() under way: ``busy`` is held) and no unit waiting for the writer thread (those keep
        their turn), in groups of at most ``SQLITE_GROUP_COMMIT_MAX``.  Otherwise, and from a group
        whose try meets a lock or an error that the writer thread's retries and conversions handle
        (the try was rolled back: it changed nothing), the units are handed to the writer thread.
        The connection waits for no lock here (busy timeout 0 for the whole try), so the caller's
        event loop never sleeps in SQLite's busy handler."""
        items = [(unit, fut) for unit, fut in self._soon.pop(loop, []) if not fut.cancelled()]
        if not items:
            return
        limit = max(SQLITE_GROUP_COMMIT_MAX, 1)  # groups as on the writer thread (1: one unit each)
        settled = 0
        try:
            if not self.closed and self._queue.empty() and self.busy.acquire(blocking=False):
                try:
                    while settled < len(items) and not self.closed:
                        chunk = items[settled : settled + limit]
                        outcomes, attempt = self._write_here([unit for unit, _fut in chunk])
                        if outcomes is None:  # this chunk goes to the thread as a replay, the rest as is
                            for _unit, fut in chunk:
                                fut.set_result((False, attempt))
                            settled += len(chunk)
                            break
                        for (_unit, fut), (ctx, result, exc) in zip(chunk, outcomes, strict=True):
                            if exc is not None:
                                fut.set_exception(exc)
                            else:
                                assert ctx is not None
                                self._after_commit(ctx)
                                fut.set_result((True, result))
                        settled += len(chunk)
                finally:
                    self.busy.release()
                if settled:
                    self._committed()
            for _unit, fut in items[settled:]:
                fut.set_result((False, 0))
        except BaseException as exc:  # noqa: BLE001 - a loop callback: no caller may wait forever
            logger.error("inline SQLite writes failed unexpectedly", exc_info=True)
            for _unit, fut in items:
                if not fut.done():
                    fut.set_exception(exc)

    def _write_here(
        self, units: list[Any]
    ) -> tuple[list[tuple[UnitContext | None, Any, BaseException | None]] | None, int]:
        """One try of ``units`` on the writer connection in the calling thread (``busy`` held):
        each unit's ``(ctx, result, exception)``, or ``(None, attempt)`` to hand them all to the
        writer thread, whose first try then sees ``ctx.attempt == attempt``."""
        try:
            conn = self._connection()
            dbapi_conn = conn.connection.dbapi_connection
            assert dbapi_conn is not None
            dbapi_conn.execute("PRAGMA busy_timeout=0")
        except Exception:  # noqa: BLE001 - the writer thread opens, retries and reports
            self._drop_connection()
            return None, 0
        try:
            if len(units) > 1:
                outcomes, attempt = self._try_group([(unit, True) for unit in units])
                if outcomes is not None:
                    self.inline_groups += 1
                    self.inline_write_count += len(units)
                return list(outcomes) if outcomes is not None else None, attempt
            began = False
            try:
                fastexec.control(conn, "BEGIN IMMEDIATE")
                began = True
                ctx = UnitContext(conn, "sqlite")
                result = units[0](ctx)
                fastexec.control(conn, "COMMIT")
            except BaseException as exc:
                self._abandon(conn)
                if classify_error(exc) != "fatal" or isinstance(exc, StoreUnavailableError):
                    # A failed COMMIT committed nothing once rolled back; the replay still looks
                    # for its own fresh ids first, as a unit retried on the thread does.
                    return None, 1 if began else 0
                self.inline_write_count += 1
                return [(None, None, exc)], 0
            self.inline_write_count += 1
            return [(ctx, result, None)], 0
        finally:
            try:
                dbapi_conn.execute(f"PRAGMA busy_timeout={int(self._busy_ms)}")
            except sqlite3.Error:  # the thread's next unit opens a connection with its timeout
                self._drop_connection()

    def _open_reader(self) -> Connection:
        """This thread's reader connection, new (the readers of threads that ended are closed first)."""
        self._close_readers(lambda slot: not slot[0].is_alive())
        engine = self._make_engine(reader=True)
        try:
            conn = engine.connect()
        except BaseException:
            engine.dispose()
            raise
        with self._reader_lock:
            self._reader_slots.append((threading.current_thread(), engine, conn))
        self._readers.conn = conn
        return conn

    def _close_readers(self, which: Callable[[tuple[threading.Thread, Engine, Connection]], bool]) -> None:
        """Close the reader connections (thread, engine, connection) that ``which`` picks, then
        dispose their engines (in this order: a connection left checked out would keep its pool
        alive through SQLAlchemy's finalizer registry, and with the pool's ``creator`` this worker)."""
        closing: list[tuple[threading.Thread, Engine, Connection]] = []
        keeping: list[tuple[threading.Thread, Engine, Connection]] = []
        with self._reader_lock:
            for slot in self._reader_slots:
                (closing if which(slot) else keeping).append(slot)
            self._reader_slots = keeping
        for _thread, engine, conn in closing:
            _close_quietly(conn, "a SQLite reader connection")
            engine.dispose()

    def _abandon_reader(self, conn: Connection) -> None:
        if not _roll_back(conn):  # a broken reader connection is replaced
            self._readers.conn = None
            _close_quietly(conn, "a SQLite reader connection")
            self._close_readers(lambda slot: slot[2] is conn)

    def ensure_schema_locked(self, conn: Connection, *, auto_migrate: bool, read_only: bool) -> None:
        if self._schema_ready is not None:
            return
        lock_file = None
        try:
            if self.target.path is not None and not read_only:
                lock_file = self._open_migration_lock()
                fcntl.flock(lock_file.fileno(), fcntl.LOCK_EX)
            # Batch migrations rebuild tables: foreign keys go off *before* the transaction
            # (SQLite ignores the pragma inside one) and are checked by migrate.upgrade.
            conn.exec_driver_sql("PRAGMA foreign_keys=OFF")
            try:
                conn.exec_driver_sql("BEGIN" if read_only else "BEGIN IMMEDIATE")
                try:
                    migrate.ensure_schema(
                        conn,
                        schema=None,
                        auto_migrate=auto_migrate,
                        read_only=read_only,
                        url_for_messages=self.target.masked,
                    )
                    conn.commit()
                except BaseException:
                    conn.rollback()
                    raise
            finally:
                conn.exec_driver_sql("PRAGMA foreign_keys=ON")
            self._schema_ready = (auto_migrate, read_only)
        finally:
            if lock_file is not None:
                fcntl.flock(lock_file.fileno(), fcntl.LOCK_UN)
                lock_file.close()

    def _main(self) -> None:
        carried: list[Any] = []  # an item taken while gathering a group that may not join it
        while True:
            if carried:
                item = carried.pop()
            else:
                try:
                    timeout = SQLITE_DATA_VERSION_POLL_S if self.hub.has_waiters else None
                    item = self._queue.get(timeout=timeout)
                except queue.Empty:
                    self._poll_data_version()
                    continue
            if item is None:
                break
            if item is _POLL:  # a waiter arrived: start polling (the queue.get timeout above)
                self._poll_data_version()
                continue
            group = [item]
            limit = SQLITE_GROUP_COMMIT_MAX
            if limit > 1 and not isinstance(item[0], SchemaUnit):
                # Only what is already waiting: a group never waits for more work.
                while len(group) < limit:
                    try:
                        more = self._queue.get_nowait()
                    except queue.Empty:
                        break
                    if more is _POLL:
                        continue
                    if more is None or isinstance(more[0], SchemaUnit):
                        carried.append(more)  # the sentinel and schema units run after the group
                        break
                    group.append(more)
            live = [it for it in group if it[3].set_running_or_notify_cancel()]
            if len(live) == 1:
                self._finish(live[0])
            elif live:
                self._run_group(live)
            if any(it[1] for it in live):
                self._committed()
            if self.hub.has_waiters:
                self._poll_data_version()
        with self.busy:
            self._drop_connection()
            if self._engine is not None:
                self._engine.dispose()

    def _committed(self) -> None:
        """After writes committed on the writer connection: ask for a background checkpoint (the
        checkpointer thread starts at the first call)."""
        if not self.background_checkpoints or self._checkpoint_wanted.is_set():
            return
        if self._checkpointer is None:
            with self._checkpointer_lock:
                if self._checkpointer is None and not self.closed:
                    self._checkpointer = threading.Thread(
                        target=self._checkpoint_forever,
                        name=f"lightning-sql-checkpoint[{self.target.masked}]",
                        daemon=True,
                    )
                    self._checkpointer.start()
        self._checkpoint_wanted.set()

    def _close_checkpointer(self) -> None:
        """End the checkpointer thread and its connection (after a checkpoint under way)."""
        self._checkpoint_stop.set()
        self._checkpoint_wanted.set()  # it sees ``closed`` and ends
        with self._checkpointer_lock:
            thread = self._checkpointer
        if thread is not None and thread is not threading.current_thread():
            thread.join(FORK_QUIESCE_TIMEOUT_S)

    def _checkpoint_forever(self) -> None:
        """The checkpointer thread: a PASSIVE checkpoint (it waits for no reader or writer and
        copies what no reader still needs; the next writer restarts the WAL once all of it is in
        the database) on a connection of its own, whenever commits asked for one, at most every
        ``SQLITE_CHECKPOINT_INTERVAL_S``.  Through the read gate: a fork() waits for it or skips it."""
        conn: sqlite3.Connection | None = None
        try:
            while True:
                self._checkpoint_wanted.wait()
                if self.closed:
                    return
                self._checkpoint_wanted.clear()
                if self.read_gate.enter():
                    try:
                        if conn is None:
                            conn = sqlite3.connect(
                                self.target.path or "", isolation_level=None, check_same_thread=False, timeout=0
                            )
                        conn.execute("PRAGMA wal_checkpoint(PASSIVE)").fetchall()
                        self.checkpoints += 1
                    except sqlite3.Error:  # busy or gone: the next commits ask again (backstop: autocheckpoint)
                        logger.debug("background checkpoint failed", exc_info=True)
                    finally:
                        self.read_gate.leave()
                if self._checkpoint_stop.wait(SQLITE_CHECKPOINT_INTERVAL_S):
                    return
        finally:
            if conn is not None:
                conn.close()

    def _connection(self) -> Connection:
        """The thread's one connection, kept open between units (a checkout per unit costs more
        than most units)."""
        if self._conn is None:
            if self._engine is None:
                self._engine = self._make_engine()
            self._conn = self._engine.connect()
        return self._conn

    def _drop_connection(self) -> None:
        conn, self._conn = self._conn, None
        if conn is not None:
            _close_quietly(conn, "the SQLite connection")

    def _poll_data_version(self) -> None:
        with self.busy:
            self._poll_data_version_unlocked()

    def _poll_data_version_unlocked(self) -> None:
        try:
            conn = self._connection()
            version = conn.exec_driver_sql("PRAGMA data_version").scalar()
            conn.rollback()
        except Exception:  # noqa: BLE001 - a failed poll is retried at the next tick
            logger.debug("data_version poll failed", exc_info=True)
            self._drop_connection()
            return
        if self._data_version is not None and version != self._data_version:
            self.hub.wake(None)
        self._data_version = version

    def _finish(self, item: Any, *, started: float | None = None, attempt: int = 0) -> None:
        """Run one queued unit as its own transaction(s) and settle its (running) future."""
        unit, write, deadline_s, fut = item
        try:
            result = self._run_unit(unit, write, deadline_s, started=started, attempt=attempt)
        except BaseException as exc:  # noqa: BLE001 - handed to the caller
            fut.set_exception(exc)
        else:
            fut.set_result(result)

    def _run_group(self, items: list[Any]) -> None:
        """Group commit: run ``items`` (two or more, none a SchemaUnit) in one transaction.

        Each unit runs in its own savepoint, so a unit that raises is rolled back alone and gets its
        exception while the others commit.  When the group as a whole cannot go on (a transient or
        non-fatal error in a unit, a failed SAVEPOINT/RELEASE/ROLLBACK TO, BEGIN or COMMIT) nothing
        of it is committed: every unit is replayed one by one through ``_run_unit``, which retries,
        converts errors and gives up at the deadline exactly as for a unit that came alone.
        """
        started = time.monotonic()
        with self.busy:  # inside SQLite: a fork() waits
            outcomes, replay_attempt = self._try_group(items)
        if outcomes is None:
            self.group_replays += 1
            for item in items:
                self._finish(item, started=started, attempt=replay_attempt)
            return
        self.group_commits += 1
        self.grouped_units += len(items)
        with deferred_wakeups():  # one wake-up per caller loop for the whole group
            for item, (ctx, result, exc) in zip(items, outcomes, strict=True):
                fut = item[3]
                if exc is None:
                    self._after_commit(ctx)
                    fut.set_result(result)
                else:
                    fut.set_exception(exc)

    def _try_group(
        self, items: list[Any]
    ) -> tuple[list[tuple[UnitContext, Any, BaseException | None]] | None, int]:
        """One try of a group.  Returns each unit's ``(ctx, result, exception)`` once the shared
        COMMIT succeeded, else ``(None, attempt)`` after rolling everything back: the replay starts
        at that ``ctx.attempt``."""
        conn: Connection | None = None
        try:
            conn = self._connection()
            fastexec.control(conn, "BEGIN IMMEDIATE" if any(it[1] for it in items) else "BEGIN")
            # Savepoints straight on the sqlite3 connection (~4 µs, against ~30 µs through
            # SQLAlchemy, which does not track them either way).
            raw = conn.connection.dbapi_connection
            assert raw is not None
        except BaseException:  # noqa: BLE001 - the replay reports it
            self._abandon(conn)
            return None, 0
        outcomes: list[tuple[UnitContext, Any, BaseException | None]] = []
        batched = 0
        index = alone_until = 0  # the units of a batch that failed run alone, each in its savepoint
        while index < len(items):
            unit = items[index][0]
            index += 1
            if isinstance(unit, BatchUnit) and index > alone_until:
                first = index - 1
                while index < len(items) and _same_batch(items[index][0], unit):
                    index += 1
                if index - first > 1:
                    done = self._try_batch(conn, raw, [item[0] for item in items[first:index]])
                    if done is None:
                        return None, 0
                    if done:
                        outcomes.extend(done)
                        batched += len(done)
                        continue
                    alone_until, index = index, first + 1
            ctx = UnitContext(conn, "sqlite", attempt=0)
            try:
                raw.execute("SAVEPOINT lightning_sql_unit")
                try:
                    result = unit(ctx)
                except BaseException as exc:  # noqa: BLE001 - kept for this unit only
                    # Only an error that a replay could not change stays with its unit; transient,
                    # unavailable and denied errors go through _run_unit (retries, conversions).
                    if classify_error(exc) != "fatal" or isinstance(exc, StoreUnavailableError):
                        self._abandon(conn)
                        return None, 0
                    raw.execute("ROLLBACK TO lightning_sql_unit")
                    raw.execute("RELEASE lightning_sql_unit")
                    outcomes.append((ctx, None, exc))
                    continue
                raw.execute("RELEASE lightning_sql_unit")
            except BaseException:  # noqa: BLE001 - a savepoint statement failed: the replay decides
                self._abandon(conn)
                return None, 0
            outcomes.append((ctx, result, None))
        try:
            fastexec.control(conn, "COMMIT")
        except BaseException:  # noqa: BLE001 - the replay reports it
            self._abandon(conn)
            # A failed SQLite COMMIT that we rolled back committed nothing, so attempt 0 would do;
            # the replay still starts at 1, as a unit alone retries after a failed commit: its
            # look-ups for its own fresh ids only cost a query and cover an ambiguous I/O error.
            return None, 1
        self.batched_units += batched
        return outcomes, 0

    def _try_batch(
        self, conn: Connection, raw: Any, batch: list[BatchUnit[Any]]
    ) -> list[tuple[UnitContext, Any, BaseException | None]] | None:
        """Run ``batch`` (units of one key, two or more) as one unit in one savepoint of a group's
        try: their outcomes; [] after rolling the savepoint back when it raised an error that stays
        with a unit (they then run one by one, each in its own savepoint, so each gets its own
        outcome); None when the whole try must be given up (the connection is rolled back)."""
        ctx = UnitContext(conn, "sqlite", attempt=0)
        try:
            raw.execute("SAVEPOINT lightning_sql_unit")
            try:
                results = batch[0].run_batch(ctx, [unit.args for unit in batch])
                if len(results) != len(batch):
                    raise RuntimeError(f"a batch of {len(batch)} units gave {len(results)} results")
            except BaseException as exc:  # noqa: BLE001 - the units run again one by one
                if classify_error(exc) != "fatal" or isinstance(exc, StoreUnavailableError):
                    self._abandon(conn)
                    return None
                raw.execute("ROLLBACK TO lightning_sql_unit")
                raw.execute("RELEASE lightning_sql_unit")
                return []
            raw.execute("RELEASE lightning_sql_unit")
        except BaseException:  # noqa: BLE001 - a savepoint statement failed: the replay decides
            self._abandon(conn)
            return None
        # The batch's events are announced once, with its first unit; the others have none of their own.
        return [
            (ctx if i == 0 else UnitContext(conn, "sqlite"), result, None) for i, result in enumerate(results)
        ]

    def _abandon(self, conn: Connection | None) -> None:
        """Roll the connection's transaction back; a connection that cannot is replaced.

        After a failed ``conn.commit()`` SQLAlchemy considers the transaction over and its
        ``rollback()`` does nothing, yet SQLite may keep the transaction open (a COMMIT that got
        SQLITE_BUSY or hit a deferred constraint): the driver connection is rolled back directly then,
        or the next BEGIN would fail with "cannot start a transaction within a transaction".
        """
        if conn is not None and not _roll_back(conn):  # a broken connection is replaced
            self._drop_connection()

    def _run_unit(
        self, unit: Unit[T], write: bool, deadline_s: float, *, started: float | None = None, attempt: int = 0
    ) -> T:
        """Run a unit as its own transaction, replaying it after transient errors until
        ``deadline_s`` past ``started`` (now by default); the first try sees ``ctx.attempt ==
        attempt``."""
        if started is None:
            started = time.monotonic()
        while True:
            try:
                with self.busy:  # inside SQLite: a fork() waits (released during back-off sleeps)
                    return self._try_unit(unit, write, attempt)
            except StoreUnavailableError:
                raise  # already decided: no retry
            except BaseException as exc:
                kind = classify_error(exc)
                if kind == "unavailable":
                    raise self._unavailable(exc) from exc
                if kind == "denied":
                    raise self._denied(exc) from exc
                if kind != "transient":
                    raise
                if time.monotonic() - started > deadline_s:
                    raise self._unavailable(exc) from exc
                time.sleep(_backoff(attempt))
                attempt += 1

    def _try_unit(self, unit: Unit[T], write: bool, attempt: int) -> T:
        """One try of a unit: one transaction on the thread's connection."""
        conn = self._connection()
        if isinstance(unit, SchemaUnit):
            self.ensure_schema_locked(conn, auto_migrate=unit.auto_migrate, read_only=unit.read_only)
            return None  # type: ignore[return-value]
        fastexec.control(conn, "BEGIN IMMEDIATE" if write else "BEGIN")
        ctx = UnitContext(conn, "sqlite", attempt=attempt)
        try:
            result = unit(ctx)
            fastexec.control(conn, "COMMIT")
        except BaseException:
            self._abandon(conn)
            raise
        self._after_commit(ctx)
        return result


def drop_closed_loops(queued: dict[Any, Any], loop_of: Callable[[Any], asyncio.AbstractEventLoop]) -> None:
    """Forget the entries of ``queued`` (units queued for a flush at a loop's next turn) whose loop
    closed before that turn ran: nobody can wait for them any more, and they would keep the loop
    and their futures alive.  Called when a loop queues its first unit of a turn."""
    for key in list(queued):
        if loop_of(key).is_closed():
            queued.pop(key, None)


def _close_quietly(conn: Connection, what: str) -> None:
    """Close ``conn``, which is being thrown away: a failure is only logged."""
    try:
        conn.close()
    except Exception:  # noqa: BLE001 - it is being thrown away
        logger.debug("closing %s failed", what, exc_info=True)


def _roll_back(conn: Connection) -> bool:
    """Roll a SQLite connection's transaction back, the driver's too (see ``_abandon``); False when
    the connection cannot, i.e. is broken."""
    try:
        conn.rollback()
        raw = conn.connection.dbapi_connection
        if raw is not None and getattr(raw, "in_transaction", False):
            raw.rollback()
    except BaseException:  # noqa: BLE001 - reported as "broken"
        return False
    return True


@dataclass(frozen=True)
class SchemaUnit:
    """Marker unit: make sure the schema exists and is current (run once per worker)."""

    auto_migrate: bool
    read_only: bool

    def __call__(self, ctx: UnitContext) -> None:  # pragma: no cover - handled by the workers
        raise NotImplementedError


def _settle_from_task(fut: concurrent.futures.Future[Any], task: asyncio.Task[Any]) -> None:
    """Copy a finished task's outcome to the caller's future (as ``run_coroutine_threadsafe`` does)."""
    if task.cancelled():
        fut.cancel()
    if not fut.set_running_or_notify_cancel():
        return
    exc = task.exception()
    if exc is not None:
        fut.set_exception(exc)
    else:
        fut.set_result(task.result())


def _ping_idle_connections(engine: Engine) -> None:
    """``pool_pre_ping`` for connections that rested in the pool over ``PG_PRE_PING_IDLE_S``.

    The ping is the dialect's own (one round trip on asyncpg); a connection that fails it is
    discarded and the pool checks out another (SQLAlchemy's pessimistic disconnect handling)."""

    @event.listens_for(engine, "connect")
    @event.listens_for(engine, "checkin")
    def _rested_since(_dbapi_conn: Any, record: Any) -> None:
        if record is not None:
            record.info["lightning_sql_checkin"] = time.monotonic()

    @event.listens_for(engine, "checkout")
    def _ping_if_idle(dbapi_conn: Any, record: Any, _proxy: Any) -> None:
        since = record.info.get("lightning_sql_checkin")
        if since is not None and time.monotonic() - since < PG_PRE_PING_IDLE_S:
            return
        try:
            alive = engine.dialect.do_ping(dbapi_conn)
        except Exception as exc:  # noqa: BLE001 - any failure means "not alive"
            raise DisconnectionError(f"pre-ping failed: {type(exc).__name__}") from exc
        if not alive:
            raise DisconnectionError("pre-ping failed")


class AsyncLoopWorker(IoWorker):
    """A thread running its own event loop that owns an async engine (asyncpg or aiosqlite).

    On PostgreSQL the pool's connections rest in autocommit mode, which makes the checkout's
    pre-ping one round trip (asyncpg wraps it in BEGIN/ROLLBACK otherwise), and a unit asks for what
    it needs when it starts (a per-connection setting: no statement is sent for it):

    * ``write=True``: one transaction at the server's default isolation (READ COMMITTED);
    * ``write=False, autocommit=True``: no transaction at all, i.e. no BEGIN/COMMIT round trips.
      Under READ COMMITTED every statement takes its own snapshot anyway, so such a unit sees what
      it would have seen in a transaction; it must not rely on row locks, ``SET LOCAL``/
      ``set_config(..., true)`` or on writing atomically (the store's read units do none of these);
    * ``write=False, snapshot=True``: one REPEATABLE READ READ ONLY transaction (the checker);
    * ``write=False`` alone: one transaction, as for writes (callers that submit their own units);
    * ``write=True, autocommit=True``: no transaction either, for a write unit each of whose
      statements is atomic and replay-safe on its own (the claim: one statement of CTEs), which
      saves the BEGIN and COMMIT round trips.

    On aiosqlite every unit is one transaction (``BEGIN IMMEDIATE`` for writes) whatever the flags.
    """

    # How a PostgreSQL unit runs (see above).
    _PG_TRANSACTION = "transaction"
    _PG_AUTOCOMMIT = "autocommit"
    _PG_SNAPSHOT = "snapshot"
    # Every event of a unit in one statement (one round trip), delivered by the COMMIT in this order.
    _PG_NOTIFY = text(
        "SELECT pg_notify(:channel, e.payload) FROM unnest(CAST(:payloads AS TEXT[])) WITH ORDINALITY AS e(payload, n) "
        "ORDER BY e.n"
    )

    def __init__(self, target: DatabaseTarget, *, schema: str | None, options: dict[str, Any]) -> None:
        super().__init__(target, schema=schema, options=options)
        self.notify_channel = notify_channel(schema)
        self._loop = asyncio.new_event_loop()
        self._engine: AsyncEngine | None = None
        self._serial: asyncio.Lock | None = None  # aiosqlite: one writer at a time
        self._listener: Any = None
        self._listener_task: asyncio.Task[None] | None = None
        self._schema_alock: asyncio.Lock | None = None
        self._poll_task: asyncio.Task[None] | None = None
        self._inbox: list[Any] = []  # submitted units not started yet (submit / _start_submitted)
        self._inbox_lock = threading.Lock()
        self._running: set[asyncio.Task[Any]] = set()  # the loop keeps only weak references to tasks
        # Batchable units (BatchUnit) that callers' loops gathered for their next turn, by (caller's
        # loop, unit key): see StoreInstance._submit_batchable.
        self.batches: dict[tuple[asyncio.AbstractEventLoop, Hashable], list[Any]] = {}
        # PostgreSQL: the home loop and its engine (``run_here``), with the driver connections that
        # engine opened (to end them when the loop is gone before the engine was disposed).
        self.home_units = PG_HOME_LOOP_UNITS and target.kind == "postgresql"
        self._home: _HomeEngine | None = None
        self._home_lock = threading.Lock()
        self._thread = threading.Thread(
            target=self._main, name=f"lightning-sql-io[{target.masked}]", daemon=True
        )
        self._thread.start()

    def _main(self) -> None:
        asyncio.set_event_loop(self._loop)
        self._loop.run_forever()

    async def _poll_data_version(self) -> None:
        """aiosqlite: while someone waits, notice other processes' commits (``PRAGMA data_version``)."""
        last: int | None = None
        while not self.closed:
            await asyncio.sleep(SQLITE_DATA_VERSION_POLL_S)
            if not self.hub.has_waiters or self._engine is None or self._serial is None:
                last = None
                continue
            try:
                async with self._serial, self._engine.connect() as aconn:
                    version = (await aconn.exec_driver_sql("PRAGMA data_version")).scalar()
                    await aconn.rollback()
            except Exception:  # noqa: BLE001 - retried at the next tick
                logger.debug("data_version poll failed", exc_info=True)
                continue
            if last is not None and version != last:
                self.hub.wake(None)
            last = version

    def _make_engine(self, *, pool_size: int | None = None) -> AsyncEngine:
        """The worker's engine; ``pool_size`` (PostgreSQL) in place of the option's (the home
        engine's pool of one for direct reads, ``_HomeEngine.read``)."""
        opts = dict(self.options)
        echo = bool(opts.pop("echo", False))
        if self.target.kind == "postgresql":
            size = opts.pop("pool_size", PG_POOL_SIZE)
            kwargs: dict[str, Any] = {
                "pool_size": size if pool_size is None else pool_size,
                "max_overflow": opts.pop("max_overflow", PG_MAX_OVERFLOW),
            }
            pre_ping = bool(opts.pop("pool_pre_ping", True))
            for key in ("pool_timeout", "pool_recycle", "connect_args"):
                if key in opts:
                    kwargs[key] = opts.pop(key)
            # Connections rest in autocommit: a unit that wants a transaction says so (_once).
            engine = create_async_engine(
                self.target.url,
                json_serializer=_json_serializer,
                json_deserializer=fastexec.loads_json,
                echo=echo,
                isolation_level="AUTOCOMMIT",
                **kwargs,
            )
            if pre_ping:
                _ping_idle_connections(engine.sync_engine)
            if self.schema is not None:
                engine = engine.execution_options(schema_translate_map={None: self.schema})
            return engine
        busy = float(opts.pop("busy_timeout", SQLITE_BUSY_TIMEOUT_S))
        engine = create_async_engine(
            self.target.url,
            json_serializer=_json_serializer,
            echo=echo,
            poolclass=StaticPool,
            connect_args={"timeout": busy, "isolation_level": None},
        )

        @event.listens_for(engine.sync_engine, "connect")
        def _pragmas(dbapi_conn: Any, _record: Any) -> None:
            cur = dbapi_conn.cursor()
            cur.execute("PRAGMA journal_mode=WAL")
            cur.execute("PRAGMA synchronous=NORMAL")
            cur.execute("PRAGMA foreign_keys=ON")
            cur.execute(f"PRAGMA busy_timeout={int(busy * 1000)}")
            cur.close()

        return engine

    def submit(
        self,
        unit: Unit[T],
        *,
        write: bool,
        deadline_s: float,
        autocommit: bool = False,
        snapshot: bool = False,
    ) -> concurrent.futures.Future[T]:
        """Run ``unit`` on the loop; ``snapshot`` only for reads (see the class doc)."""
        isolation = self._isolation(write, autocommit, snapshot)
        if self.closed:
            fut: concurrent.futures.Future[T] = concurrent.futures.Future()
            fut.set_exception(RuntimeError("The store's I/O thread is closed"))
            return fut
        fut = concurrent.futures.Future()
        with self._inbox_lock:
            self._inbox.append((unit, write, deadline_s, isolation, fut))
            first = len(self._inbox) == 1
        if first:
            # One wake-up of the loop per burst of submissions (each is a self-pipe write and a GIL
            # hand-over); the units of a burst start together in _start_submitted.
            try:
                self._loop.call_soon_threadsafe(self._start_submitted)
            except RuntimeError as exc:  # the loop is closed: fail what waits in the inbox
                with self._inbox_lock:
                    items, self._inbox = self._inbox, []
                for item in items:
                    item[4].set_exception(RuntimeError(f"The store's I/O thread is closed ({exc})"))
        return fut

    def _isolation(self, write: bool, autocommit: bool, snapshot: bool) -> str | None:
        """How a PostgreSQL unit runs (the class doc); None on aiosqlite."""
        if write and snapshot:
            raise ValueError("a snapshot is for read units (write=False)")
        if autocommit and snapshot:
            raise ValueError("a snapshot is a transaction: autocommit and snapshot exclude each other")
        if self.target.kind != "postgresql":
            return None
        return self._PG_AUTOCOMMIT if autocommit else self._PG_SNAPSHOT if snapshot else self._PG_TRANSACTION

    def run_here(
        self,
        unit: Unit[T],
        *,
        write: bool,
        deadline_s: float,
        autocommit: bool = False,
        snapshot: bool = False,
    ) -> asyncio.Task[T] | None:
        """``submit`` for a caller on the worker's home loop (PostgreSQL): the unit runs as a task of
        the caller's loop on the home engine, exactly as it would on the I/O loop (same transaction
        modes, retries and deadline); None when the unit must go through ``submit`` (another loop,
        no schema check yet, the worker closed, ``home_units`` off)."""
        if not self.home_units or self.closed or self._schema_ready is None or isinstance(unit, SchemaUnit):
            return None
        loop = asyncio.get_running_loop()
        home = self._home
        if home is None or home.loop is not loop:
            home = self._adopt_home(loop)
            if home is None:
                return None
        isolation = self._isolation(write, autocommit, snapshot)
        return self.hold(loop.create_task(self._run_unit(unit, write, deadline_s, isolation, home.engine)))

    def hold(self, task: asyncio.Task[T]) -> asyncio.Task[T]:
        """``task``, referenced until it is done (a loop keeps only weak references to tasks)."""
        self._running.add(task)
        task.add_done_callback(self._running.discard)
        return task

    def _adopt_home(self, loop: asyncio.AbstractEventLoop) -> _HomeEngine | None:
        """The home engine for ``loop`` if it is (or now becomes) the home loop: the first loop to
        ask, or the next one once the home loop is closed (its connections are then ended)."""
        if loop is self._loop:
            return None
        with self._home_lock:
            home = self._home
            if home is not None and home.loop is loop:
                return home
            if home is not None and not home.loop.is_closed():
                return None  # another loop's home
            if home is not None:
                home.terminate()
            engine = self._make_engine()
            postgres = self.target.kind == "postgresql"
            reader = self._make_engine(pool_size=1) if PG_DIRECT_READS and postgres else None
            writer = self._make_engine(pool_size=PG_DIRECT_WRITERS) if PG_DIRECT_WRITES and postgres else None
            self._home = home = _HomeEngine(
                loop, engine, reader, writer, ping_after_rest=bool(self.options.get("pool_pre_ping", True))
            )
            for each in (engine, reader, writer):
                if each is not None:
                    event.listen(each.sync_engine, "connect", lambda _dbapi_conn, record: home.opened.add(record))
            return home

    def direct_reads_here(self) -> _HomeEngine | None:
        """The home engine when the calling loop is the worker's home loop and it reads directly
        (``_HomeEngine.read``); None otherwise (the caller runs its unit)."""
        home = self._home
        if home is None or home.reader is None or not self.home_units or self.closed:
            return None
        return home if home.loop is asyncio.get_running_loop() else None

    def direct_writes_here(self) -> _HomeEngine | None:
        """The home engine when the calling loop is the worker's home loop and it writes directly
        (``_HomeEngine.write``); None otherwise (the batch runs as a unit)."""
        home = self._home
        if home is None or home.writer is None or not self.home_units or self.closed:
            return None
        return home if home.loop is asyncio.get_running_loop() else None

    def engine_for_this_loop(self) -> Engine | None:
        """The (sync) engine that runs the calling loop's units: the home engine on the home loop,
        else the I/O thread's (for listeners that must see a caller's statements)."""
        home = self._home
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            loop = None
        if home is not None and home.loop is loop:
            return home.engine.sync_engine
        return None if self._engine is None else self._engine.sync_engine

    async def release_home(self) -> None:
        """Dispose of the home engine, politely, when called on the home loop by the worker's last
        holder (``StoreInstance.close``): ``close`` could only end its connections from there."""
        home = self._home
        if home is None or self.refs > 1 or home.loop is not asyncio.get_running_loop():
            return
        with self._home_lock:
            if self._home is home:
                self._home = None
        try:
            await home.dispose()
        except Exception:  # noqa: BLE001 - best effort at shutdown
            logger.debug("home engine dispose failed", exc_info=True)
            home.terminate()

    def _close_home(self) -> None:
        with self._home_lock:
            home, self._home = self._home, None
        if home is None:
            return
        loop = home.loop
        try:
            this_thread_runs_it = asyncio.get_running_loop() is loop
        except RuntimeError:
            this_thread_runs_it = False
        if loop.is_closed() or this_thread_runs_it:
            home.terminate()  # no loop to close them in, or this thread runs it and cannot wait
            return
        try:
            asyncio.run_coroutine_threadsafe(home.dispose(), loop).result(timeout=5)
        except Exception:  # noqa: BLE001 - the loop stopped or is stuck: end them here
            logger.debug("home engine dispose failed", exc_info=True)
            home.terminate()

    def _start_submitted(self) -> None:
        with self._inbox_lock:
            items, self._inbox = self._inbox, []
        for unit, write, deadline_s, isolation, fut in items:
            if fut.cancelled():
                continue
            task = self.hold(self._loop.create_task(self._run_unit(unit, write, deadline_s, isolation)))
            task.add_done_callback(functools.partial(_settle_from_task, fut))

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        self._close_home()

        async def shutdown() -> None:
            for task in (self._listener_task, self._poll_task):
                if task is not None:
                    task.cancel()
            if self._listener is not None:
                try:
                    await self._listener.close(timeout=2)
                except Exception:  # noqa: BLE001
                    pass
            if self._engine is not None:
                await self._engine.dispose()

        try:
            asyncio.run_coroutine_threadsafe(shutdown(), self._loop).result(timeout=5)
        except Exception:  # noqa: BLE001 - best effort at shutdown
            logger.debug("I/O worker shutdown failed", exc_info=True)
        self._loop.call_soon_threadsafe(self._loop.stop)

    async def _ensure_schema(self, unit: SchemaUnit) -> None:
        if self._schema_alock is None:
            self._schema_alock = asyncio.Lock()
        async with self._schema_alock:
            if self._schema_ready is not None:
                return
            assert self._engine is not None
            if self.target.kind == "aiosqlite" and self.target.path is not None and not unit.read_only:
                lock_file = self._open_migration_lock()
                await asyncio.to_thread(fcntl.flock, lock_file.fileno(), fcntl.LOCK_EX)
            else:
                lock_file = None
            try:
                async with self._engine.connect() as aconn:
                    if self.target.kind == "postgresql":
                        # One transaction (the pool's connections rest in autocommit): the migration
                        # lock is transaction-scoped and the DDL commits as a whole.
                        await aconn.execution_options(isolation_level=self._pg_default_isolation())
                    if self.target.kind == "aiosqlite":
                        await aconn.exec_driver_sql("PRAGMA foreign_keys=OFF")
                        await aconn.exec_driver_sql("BEGIN" if unit.read_only else "BEGIN IMMEDIATE")
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
                    if self.target.kind == "aiosqlite":
                        await aconn.exec_driver_sql("PRAGMA foreign_keys=ON")
                        await aconn.commit()
            except BaseException:
                if self._engine is not None and self.target.kind == "aiosqlite":
                    # The StaticPool connection is reused: never leave foreign keys off on it.
                    await self._engine.dispose()
                raise
            finally:
                if lock_file is not None:
                    fcntl.flock(lock_file.fileno(), fcntl.LOCK_UN)
                    lock_file.close()
            self._schema_ready = (unit.auto_migrate, unit.read_only)
            if self.target.kind == "postgresql":
                self._listener_task = asyncio.get_running_loop().create_task(self._listen_forever())

    async def _run_unit(
        self,
        unit: Unit[T],
        write: bool,
        deadline_s: float,
        isolation: str | None = None,
        engine: AsyncEngine | None = None,
    ) -> T:
        if self._engine is None and engine is None:
            self._engine = self._make_engine()
            if self.target.kind == "aiosqlite":
                self._serial = asyncio.Lock()
                self._poll_task = asyncio.get_running_loop().create_task(self._poll_data_version())
        started = time.monotonic()
        attempt = 0
        while True:
            try:
                if isinstance(unit, SchemaUnit):
                    await self._ensure_schema(unit)
                    return None  # type: ignore[return-value]
                if self._serial is not None:
                    async with self._serial:
                        return await self._once(unit, write, attempt, isolation)
                return await self._once(unit, write, attempt, isolation, engine)
            except asyncio.CancelledError:
                raise
            except StoreUnavailableError:
                raise  # already decided: no retry
            except BaseException as exc:
                kind = classify_error(exc)
                if kind == "unavailable":
                    raise self._unavailable(exc) from exc
                if kind == "denied":
                    raise self._denied(exc) from exc
                if kind != "transient":
                    raise
                if time.monotonic() - started > deadline_s:
                    raise self._unavailable(exc) from exc
                await asyncio.sleep(_backoff(attempt))
                attempt += 1

    def _pg_default_isolation(self, engine: AsyncEngine | None = None) -> str:
        """The server's default isolation level (read by the engine at its first connection)."""
        engine = engine or self._engine
        assert engine is not None
        return engine.dialect.default_isolation_level or "READ COMMITTED"

    async def _once(
        self,
        unit: Unit[T],
        write: bool,
        attempt: int = 0,
        isolation: str | None = None,
        engine: AsyncEngine | None = None,
    ) -> T:
        """One run of ``unit`` on ``engine`` (the I/O loop's unless given: the home engine)."""
        engine = engine or self._engine
        assert engine is not None
        sync_engine = engine.sync_engine
        dialect = self.dialect
        aiosqlite = self.target.kind == "aiosqlite"
        holder: dict[str, UnitContext] = {}

        def whole() -> T:
            # The checkout, the unit, the commit and the check-in in ONE greenlet: SQLAlchemy's
            # AsyncConnection would spawn one per step (connect, run_sync, commit, close).
            with sync_engine.connect() as conn:
                # PostgreSQL: per-connection settings that asyncpg applies at its BEGIN (no round
                # trip of their own; the pool puts the connection back in autocommit on return).
                if isolation == self._PG_TRANSACTION:
                    conn.execution_options(isolation_level=self._pg_default_isolation(engine))
                elif isolation == self._PG_SNAPSHOT:
                    conn.execution_options(isolation_level="REPEATABLE READ", postgresql_readonly=True)
                elif aiosqlite:
                    conn.exec_driver_sql("BEGIN IMMEDIATE" if write else "BEGIN")
                ctx = UnitContext(
                    conn,
                    dialect,
                    attempt=attempt,
                    notify_channel=self.notify_channel,
                    autocommit=isolation == self._PG_AUTOCOMMIT,
                )
                holder["ctx"] = ctx
                try:
                    result = unit(ctx)
                    payloads = ctx.take_notifications() if dialect == "postgresql" else []
                    if payloads:
                        # One statement for all of the unit's events, delivered by the COMMIT.
                        conn.execute(self._PG_NOTIFY, {"channel": self.notify_channel, "payloads": payloads})
                    conn.commit()
                except BaseException:
                    try:
                        conn.rollback()
                    except Exception:  # noqa: BLE001 - the unit's own error is the one to report
                        logger.debug("rollback after a failed unit failed", exc_info=True)
                    raise
                return result

        result = await greenlet_spawn(whole)
        self._after_commit(holder["ctx"])
        return result

    # --- LISTEN/NOTIFY ------------------------------------------------------------------------

    async def _listen_forever(self) -> None:
        import asyncpg

        dsn = self.target.url.set(drivername="postgresql").render_as_string(hide_password=False)
        while not self.closed:
            try:
                conn = await asyncpg.connect(dsn)
                self._listener = conn

                def on_notify(_conn: Any, _pid: int, _channel: str, payload: str) -> None:
                    run_part = payload.split(":", 1)[0]
                    try:
                        self.hub.wake(int(run_part))
                    except ValueError:
                        self.hub.wake(None)

                await conn.add_listener(self.notify_channel, on_notify)
                self.hub.wake(None)  # (re)connected: every waiter re-reads
                while not conn.is_closed() and not self.closed:
                    await asyncio.sleep(PG_LISTEN_RECONNECT_S)
                    try:
                        await conn.execute("SELECT 1")
                    except Exception:  # noqa: BLE001
                        break
            except asyncio.CancelledError:
                return
            except Exception:  # noqa: BLE001 - the polling fallback covers the gap
                logger.debug("LISTEN connection failed; retrying", exc_info=True)
            finally:
                if self._listener is not None:
                    try:
                        self._listener.terminate()
                    except Exception:  # noqa: BLE001
                        pass
                    self._listener = None
            await asyncio.sleep(PG_LISTEN_RECONNECT_S)


class _HomeEngine:
    """A worker's engine on its home loop (``AsyncLoopWorker.run_here``) and the pool entries of the
    connections it opened, to end them when nothing can close them politely any more."""

    def __init__(
        self,
        loop: asyncio.AbstractEventLoop,
        engine: AsyncEngine,
        reader: AsyncEngine | None = None,
        writer: AsyncEngine | None = None,
        *,
        ping_after_rest: bool = True,
    ) -> None:
        self.loop = loop
        self.engine = engine
        self.opened: weakref.WeakSet[Any] = weakref.WeakSet()
        # Direct reads (``read``): a pool of one connection of their own (the units' pool and its
        # warm connections are left alone), kept checked out between reads, one read at a time.
        self.reader = reader
        self.ping_after_rest = ping_after_rest
        self._pinned: Connection | None = None
        self._pinned_used = 0.0  # time.monotonic() of its last statement
        self._reading = False
        # Direct writes (``write``): a pool of PG_DIRECT_WRITERS connections of their own, kept
        # checked out; the idle ones wait in ``_writers`` with the time of their last statement.
        self.writer = writer
        self._writers: list[tuple[Connection, float]] = []
        self._writing: set[Connection] = set()
        self._disposed = False

    async def read(self, stmt: Any, params: dict[str, Any]) -> list[Any] | None:
        """The rows of one prebuilt read statement, run as a coroutine of the home loop on the
        connection this engine keeps for it (``fastexec.fetch_prebuilt``: no greenlet, no pool
        checkout, no ``Connection`` per call); the connection rests in autocommit, so the statement
        sees what the read's unit would (one statement, its own snapshot).  None when it cannot or
        did not run (another read holds the connection, either engine has ``echo`` or event
        listeners, the statement needs SQLAlchemy, or any error, after which the connection is
        given up): the caller then runs the read's unit, which
        checks out a connection as every unit does, and whose errors, retries and deadline are the
        read's.  As a checkout does, a connection that rested over ``PG_PRE_PING_IDLE_S`` is
        pinged first (unless ``pool_pre_ping=False``).  It runs in the caller's task: a caller
        cancelled during the statement gives the connection up (it may be mid-protocol)."""
        units = self.engine.sync_engine
        if self._reading or self.reader is None or units.echo or units._has_events:
            return None  # listeners of the units' engine see every statement (decision 5)
        self._reading = True
        conn = self._pinned
        try:
            if conn is None:
                conn = self._pinned = await self._connect()
            else:
                await self._ping_if_rested(conn, self._pinned_used)
            rows = await fastexec.fetch_prebuilt(conn, stmt, params)
            if rows is not None:
                self._pinned_used = time.monotonic()
            return rows
        except Exception:  # noqa: BLE001 - the unit runs the read again and reports its own outcome
            logger.debug("direct read failed; its unit runs it", exc_info=True)
            self._drop(conn)
            return None
        except BaseException:
            # The caller was cancelled (the read runs in its task): the connection may be left
            # mid-protocol, so no other statement follows on it; the next read keeps another.
            self._drop(conn)
            raise
        finally:
            self._reading = False
            if conn is not None and self._pinned is not conn and not conn.invalidated and not conn.closed:
                self._drop(conn)  # released while it read: the pool it came from is disposed

    async def write(self, stmt: Any, params: dict[str, Any]) -> list[Any] | None:
        """The rows of one prebuilt write statement that is atomic on its own (it commits as it
        ends: the connections rest in autocommit), run as a coroutine of the home loop on one of
        the connections this engine keeps for it (``fastexec.fetch_prebuilt``).  None, with
        nothing sent, when it cannot run so: every kept connection busy and their pool full,
        either engine with ``echo`` or event listeners, a statement that needs SQLAlchemy, or a
        connection that could not be opened or that failed the ping after a rest (it is given up).
        An error once the statement was sent is raised, the connection given up: the statement
        may have committed before it (the caller replays the batch as a unit)."""
        units = self.engine.sync_engine
        if self.writer is None or self._disposed or units.echo or units._has_events:
            return None
        conn: Connection | None = None
        try:
            if self._writers:
                conn, used = self._writers.pop()
                self._writing.add(conn)
                await self._ping_if_rested(conn, used)
            elif len(self._writing) < PG_DIRECT_WRITERS:
                conn = await self._connect(self.writer)
                self._writing.add(conn)
            else:
                return None
        except Exception:  # noqa: BLE001 - nothing was sent: the batch runs as a unit
            logger.debug("no connection for a direct write; its unit runs it", exc_info=True)
            self._drop_writer(conn)
            return None
        except BaseException:
            self._drop_writer(conn)
            raise
        try:
            rows = await fastexec.fetch_prebuilt(conn, stmt, params)
        except BaseException:
            self._drop_writer(conn)
            raise
        self._writing.discard(conn)
        if self._disposed or conn.invalidated or conn.closed:
            self._drop_writer(conn)  # disposed of while it wrote
        else:
            self._writers.append((conn, time.monotonic()))
        return rows

    async def _ping_if_rested(self, conn: Connection, used: float) -> None:
        """Ping a kept connection whose last statement ran ``PG_PRE_PING_IDLE_S`` or more ago (at
        ``used``, ``time.monotonic()``), as a checkout would (unless ``pool_pre_ping=False``)."""
        if self.ping_after_rest and time.monotonic() - used >= PG_PRE_PING_IDLE_S:
            await conn.connection.dbapi_connection._async_ping()  # type: ignore[union-attr]

    def _drop_writer(self, conn: Connection | None) -> None:
        if conn is not None:
            self._writing.discard(conn)
            self._drop(conn)

    async def _connect(self, engine: AsyncEngine | None = None) -> Connection:
        """A new connection to keep (the reader's unless ``engine``); a caller cancelled while it
        opens leaves it to open and gives it up then (the pool's slot is freed, nothing is left
        checked out)."""
        engine = engine or self.reader
        assert engine is not None
        opening = asyncio.ensure_future(greenlet_spawn(engine.sync_engine.connect))
        try:
            return await asyncio.shield(opening)
        except asyncio.CancelledError:
            opening.add_done_callback(self._drop_opened)
            raise

    def _drop_opened(self, opening: asyncio.Future[Connection]) -> None:
        if not opening.cancelled() and opening.exception() is None:
            self._drop(opening.result())

    def _drop(self, conn: Connection | None) -> None:
        """Give up ``conn`` at once: its socket closed (asyncpg's ``terminate``, nothing awaited) and
        its pool slot freed; the next read keeps another."""
        if self._pinned is conn:
            self._pinned = None
        if conn is None:
            return
        try:
            conn.invalidate()
            conn.close()
        except Exception:  # noqa: BLE001 - already gone
            logger.debug("dropping the direct-read connection failed", exc_info=True)

    async def dispose(self) -> None:
        """Close every connection politely, on this engine's loop: the kept ones back to their pools
        first (``dispose`` closes only what a pool holds), unless a read or a write has one (it
        closes it as it ends)."""
        conn, self._pinned = self._pinned, None
        self._disposed = True  # a write under way drops its connection when it ends
        kept = [conn] if conn is not None and not self._reading else []
        kept += [each for each, _used in self._writers]
        self._writers.clear()
        for each in kept:
            try:
                await greenlet_spawn(each.close)
            except Exception:  # noqa: BLE001 - disposed below either way
                logger.debug("returning a direct connection failed", exc_info=True)
        for engine in (self.reader, self.writer):
            if engine is not None:
                await engine.dispose()
        await self.engine.dispose()

    def terminate(self) -> None:
        """End every connection at once (asyncpg's ``terminate``: the socket is closed, no round
        trip), for a loop that is closed or that this thread runs and cannot wait for; the kept
        connection is handed back to its pool as it is ended (else the collector would find it
        checked out)."""
        self._drop(self._pinned)
        self._disposed = True
        for conn in [each for each, _used in self._writers] + list(self._writing):
            self._drop(conn)
        self._writers.clear()
        self._writing.clear()
        for record in list(self.opened):
            dbapi_conn = record.dbapi_connection
            if dbapi_conn is None:
                continue  # closed already
            try:
                dbapi_conn.terminate()
            except Exception:  # noqa: BLE001 - already gone
                pass
        self.opened.clear()


# --- the per-process registry -----------------------------------------------------------------

_registry_lock = threading.Lock()
_registry: dict[WorkerKey, IoWorker] = {}


def acquire_worker(target: DatabaseTarget, *, schema: str | None, options: dict[str, Any]) -> IoWorker:
    """The I/O worker of this process for ``target`` (created on first use; refcounted)."""
    pid = os.getpid()
    with _registry_lock:
        if target.kind != "sqlite-memory":
            key = WorkerKey(pid, str(target.url), schema, tuple(sorted((k, repr(v)) for k, v in options.items())))
            worker = _registry.get(key)
            if worker is not None and not worker.closed:
                worker.refs += 1
                return worker
        worker_cls = AsyncLoopWorker if target.kind in ("postgresql", "aiosqlite") else SqliteThreadWorker
        worker = worker_cls(target, schema=schema, options=options)
        worker.refs = 1
        if target.kind != "sqlite-memory":
            _registry[key] = worker
        return worker


def release_worker(worker: IoWorker) -> None:
    """Drop one reference; the last one closes the worker's thread and connections."""
    with _registry_lock:
        worker.refs -= 1
        if worker.refs > 0:
            return
        for key, value in list(_registry.items()):
            if value is worker:
                del _registry[key]
    if worker.pid == os.getpid():
        worker.close()


def _close_all() -> None:
    with _registry_lock:
        workers = [w for w in _registry.values() if w.pid == os.getpid()]
        _registry.clear()
    for worker in workers:
        worker.close()


class _ReadGate:
    """Counts the callers inside SQLite on inline reader connections; ``close`` (before a fork)
    turns new ones away (they hand their unit to the writer thread) and waits for the others."""

    def __init__(self) -> None:
        self._cond = threading.Condition(threading.Lock())
        self._inside = 0
        self._closed = False

    def enter(self) -> bool:
        with self._cond:
            if self._closed:
                return False
            self._inside += 1
            return True

    def leave(self) -> None:
        with self._cond:
            self._inside -= 1
            if self._inside == 0:
                self._cond.notify_all()

    def close(self, timeout: float) -> bool:
        with self._cond:
            self._closed = True
            return self._cond.wait_for(lambda: self._inside == 0, timeout)

    def open(self) -> None:
        with self._cond:
            self._closed = False


_held_across_fork: list[threading.Lock] = []
_gates_closed_for_fork: list[_ReadGate] = []
_SQLITE_THREAD_WORKERS: weakref.WeakSet[SqliteThreadWorker] = weakref.WeakSet()


def _quiesce_before_fork() -> None:
    # SQLite keeps process-wide C mutexes (e.g. the unix VFS's inode-list lock).  A fork() while an
    # I/O thread is inside SQLite copies them locked, and the child's first connection to any file
    # then blocks forever.  So fork waits until no SQLite I/O thread of this process is inside SQLite
    # (units are short), and lets them go on right after.
    pid = os.getpid()
    workers = [w for w in list(_SQLITE_THREAD_WORKERS) if w.pid == pid]
    for worker in sorted(workers, key=id):
        if worker.busy.acquire(timeout=FORK_QUIESCE_TIMEOUT_S):
            _held_across_fork.append(worker.busy)
        # else: a unit inside SQLite for that long is waiting for another process's lock in the
        # busy handler (a sleep that holds no process-wide mutex): fork anyway rather than stall.
        # Inline readers do not wait for locks (no busy timeout): their reads are short.
        _gates_closed_for_fork.append(worker.read_gate)
        worker.read_gate.close(FORK_QUIESCE_TIMEOUT_S)


def _resume_after_fork_in_parent() -> None:
    while _held_across_fork:
        _held_across_fork.pop().release()
    while _gates_closed_for_fork:
        _gates_closed_for_fork.pop().open()


def _after_fork_in_child() -> None:
    # Inherited threads do not exist in the child and the connections belong to the parent: forget
    # them without closing them (the busy locks copied held go with them).
    global _registry_lock
    _held_across_fork.clear()
    _gates_closed_for_fork.clear()
    _registry_lock = threading.Lock()
    _registry.clear()


os.register_at_fork(
    before=_quiesce_before_fork,
    after_in_parent=_resume_after_fork_in_parent,
    after_in_child=_after_fork_in_child,
)

import atexit  # noqa: E402

atexit.register(_close_all)
