"""How a unit of work reaches the database: the interface both executors implement.

A *unit* is a plain sync function over a ``UnitContext`` (a SQLAlchemy ``Connection`` and the events
it wants announced), written once for both dialects.  An executor runs it in ONE transaction, replays
it after a transient error until the call's deadline, and settles a ``concurrent.futures.Future``
with its result; there is one executor per process and database (``acquire_executor``).  Units are
replay-safe: ids and "now" are decided before the first try, and ``ctx.attempt`` tells a replay to
look for what an earlier try may have committed.  docs/architecture.md §7 describes both executors.
"""

from __future__ import annotations

import atexit
import concurrent.futures
import hashlib
import json
import logging
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

from sqlalchemy import Connection

from lightning_sql.store.sql.errors import classify_error, denied, reason, unavailable
from lightning_sql.store.sql.urls import DatabaseTarget
from lightning_sql.store.sql.waits import WaitHub

logger = logging.getLogger(__name__)

T = TypeVar("T")

NOTIFY_CHANNEL = "lightning_sql_v1"
OUTAGE_QUIET_S = 1.5  # an outage ends once no replay has failed for this long


def notify_channel(schema: str | None) -> str:
    """The LISTEN/NOTIFY channel of the store's tables in ``schema``: ``NOTIFY_CHANNEL`` for the
    default schema and one channel per named schema, so that stores on other schemas of the same
    database (whose run ids are their own) neither hear nor wake each other.  A name over
    PostgreSQL's 63 bytes is replaced by a digest of the schema."""
    if schema is None:
        return NOTIFY_CHANNEL
    channel = f"{NOTIFY_CHANNEL}:{schema}"
    if len(channel.encode()) > 63:
        channel = f"{NOTIFY_CHANNEL}:{hashlib.sha256(schema.encode()).hexdigest()[:32]}"
    return channel


class EncodedJson(str):
    """JSON text already validated and encoded by the store: the engines' serializer passes it
    through instead of encoding the string again."""

    __slots__ = ()


def json_serializer(value: Any) -> str:
    """The engines' JSON serializer (``create_engine(json_serializer=...)``)."""
    if isinstance(value, EncodedJson):
        return value
    return json.dumps(value, separators=(",", ":"), ensure_ascii=False, allow_nan=False)


@dataclass
class UnitContext:
    """What a unit sees besides its connection: the dialect, and the events it wants announced."""

    conn: Connection
    dialect: str
    # 0 on the first try; > 0 on a replay after a transient error, when an earlier try may have
    # committed (units skip their replay look-ups on the first try).
    attempt: int = 0
    notify_channel: str = NOTIFY_CHANNEL
    events: set[tuple[int, str]] = field(default_factory=set)
    # Events whose NOTIFY a statement of the unit already sent (PostgreSQL, ``dialect.run_writes``).
    notified: set[tuple[int, str]] = field(default_factory=set)

    def announce(self, run_id: int, kind: str) -> None:
        """Record a ``finished``/``queued`` event of a run, delivered once after the commit (to this
        process's waiters, and on PostgreSQL to every process through NOTIFY)."""
        self.events.add((run_id, kind))

    def take_notifications(self) -> list[str]:
        """The NOTIFY payloads of the events not sent yet, in a stable order; they count as sent."""
        pending = sorted(self.events - self.notified)
        self.notified.update(pending)
        return [f"{run_id}:{kind}" for run_id, kind in pending]

    def execute(self, stmt: Any, params: Any = None) -> Any:
        return self.conn.execute(stmt, params)


Unit = Callable[[UnitContext], T]


@dataclass(frozen=True)
class SchemaUnit:
    """Make sure the schema exists and is current; run once per executor before any other unit."""

    auto_migrate: bool
    read_only: bool

    def __call__(self, ctx: UnitContext) -> None:  # pragma: no cover - the executors handle it
        raise NotImplementedError


class Executor:
    """Runs units on one database for every store instance of this process (see the module doc)."""

    def __init__(self, target: DatabaseTarget, *, schema: str | None, options: dict[str, Any]) -> None:
        self.target = target
        self.schema = schema
        self.options = options
        self.hub = WaitHub()
        self.refs = 0
        self.pid = os.getpid()
        self.closed = False
        self.schema_ready: tuple[bool, bool] | None = None  # (auto_migrate, read_only) that succeeded
        self._last_failed_replay: float | None = None

    @property
    def dialect(self) -> str:
        return self.target.dialect

    def submit(
        self, unit: Unit[T], *, write: bool, deadline_s: float, snapshot: bool = False
    ) -> concurrent.futures.Future[T]:
        """Run ``unit`` in one transaction (``write``: one that may write; ``snapshot``: a read
        that must see one snapshot across its statements) and settle the future with its result."""
        raise NotImplementedError

    def close(self) -> None:
        raise NotImplementedError

    def replayable(self, exc: BaseException, started: float, deadline_s: float, attempt: int) -> bool:
        """Whether a unit that raised ``exc`` on try ``attempt`` is replayed after a back-off; False
        for its own error (the caller re-raises it).  Raises ``StoreUnavailableError`` for a
        database that cannot answer (now, or not before the deadline) and ``PermissionError`` for a
        role that may not do this."""
        kind = classify_error(exc)
        if kind == "unavailable":
            raise unavailable(exc, self.target) from exc
        if kind == "denied":
            raise denied(exc, self.target) from exc
        if kind != "transient":
            return False
        if time.monotonic() - started > deadline_s:
            raise unavailable(exc, self.target) from exc
        self.note_transient_error(exc, attempt)
        return True

    def note_transient_error(self, exc: BaseException, attempt: int) -> None:
        """Log an outage once, whatever the number of units, runners and retries it hits.  A unit's
        first failure is not one (a pooled connection the server dropped fails once, and the replay
        on a new connection succeeds): an outage is replays failing, and it lasts until none has
        failed for ``OUTAGE_QUIET_S`` (connection slots taken by other processes fail some replays
        and let others through: one outage, not one per success in between)."""
        if attempt < 1:
            return
        now = time.monotonic()
        if self._last_failed_replay is None or now - self._last_failed_replay > OUTAGE_QUIET_S:
            name = "PostgreSQL" if self.dialect == "postgresql" else "SQLite"
            logger.warning("%s %s: %s; retrying until it answers", name, self.target.masked, reason(exc, self.target))
        self._last_failed_replay = now

    def after_commit(self, ctx: UnitContext) -> None:
        for run_id, _kind in ctx.events:
            self.hub.wake(run_id)


# --- one executor per process and database --------------------------------------------------


def _key(target: DatabaseTarget, schema: str | None, options: dict[str, Any]) -> tuple[Any, ...]:
    return (
        target.dialect,  # sqlite:// and sqlite+aiosqlite:// of one file share the executor
        target.url.render_as_string(hide_password=False),
        schema,
        tuple(sorted((k, repr(v)) for k, v in options.items())),
    )


_executors: dict[tuple[Any, ...], Executor] = {}
_executors_lock = threading.Lock()


def acquire_executor(target: DatabaseTarget, *, schema: str | None, options: dict[str, Any]) -> Executor:
    """This process's executor for the database (started on first use), with one more holder.  An
    in-memory SQLite database belongs to its store instance alone: it is never shared."""
    from lightning_sql.store.sql.postgres_executor import PostgresExecutor
    from lightning_sql.store.sql.sqlite_executor import SqliteExecutor

    cls: type[Executor] = PostgresExecutor if target.dialect == "postgresql" else SqliteExecutor
    if target.kind == "sqlite-memory":
        executor = cls(target, schema=schema, options=options)
        executor.refs = 1
        return executor
    key = _key(target, schema, options)
    with _executors_lock:
        shared = _executors.get(key)
        if shared is None or shared.closed:
            shared = _executors[key] = cls(target, schema=schema, options=options)
        shared.refs += 1
        return shared


def release_executor(executor: Executor) -> None:
    """One holder fewer; the last one closes the executor."""
    with _executors_lock:
        executor.refs -= 1
        if executor.refs > 0:
            return
        for key, value in list(_executors.items()):
            if value is executor:
                del _executors[key]
    if executor.pid == os.getpid():
        executor.close()


def _close_all() -> None:
    with _executors_lock:
        executors = list(_executors.values())
        _executors.clear()
    for executor in executors:
        if executor.pid == os.getpid():
            executor.close()


def _forget_executors_in_child() -> None:
    # A forked child inherits the parent's executors but not their threads: it starts its own, and
    # never touches (or closes) the parent's connections.
    global _executors_lock
    _executors_lock = threading.Lock()
    _executors.clear()


os.register_at_fork(after_in_child=_forget_executors_in_child)
atexit.register(_close_all)
