"""How a call reaches the database: operations, batches, and the interface both executors implement.

A store call hands its executor one *operation*: an instance of an ``Operation`` subclass holding the
call's arguments.  The executor gathers the calls of one operation that wait while its connection is
busy (same ``batch_key``, no shared ``conflicts``, at most ``max_batch``) into a ``Batch`` and runs
them together: the operation's runner in the dialect modules (``sqlite_batches``,
``postgres_batches``) executes the batch as set-based statements, and the operation's ``outcomes``
turns the rows into each caller's own result or error.  A lone call is a batch of one; no timer ever
waits for more.  Off the hot path a call is a ``UnitCall``: a plain sync function over a
``UnitContext`` (a SQLAlchemy ``Connection``), run alone in one transaction.

Everything a batch writes is decided before its first try (ids, *now*, JSON), so it replays after a
transient error until each call's deadline; ``Batch.attempt`` tells a replay to look for what an
earlier try may have committed.  There is one executor per process and database
(``acquire_executor``).  docs/architecture.md §7 describes both executors.
"""

from __future__ import annotations

import asyncio
import atexit
import hashlib
import json
import logging
import os
import threading
import time
from collections.abc import Callable, Hashable, Iterable
from dataclasses import dataclass, field
from typing import Any, ClassVar, TypeVar

from sqlalchemy import Connection

from lightning_sql.store.sql.errors import classify_error, denied, reason, unavailable
from lightning_sql.store.sql.urls import DatabaseTarget
from lightning_sql.store.sql.waits import WaitHub

logger = logging.getLogger(__name__)

T = TypeVar("T")

NOTIFY_CHANNEL = "lightning_sql_v1"
OUTAGE_QUIET_S = 1.5  # an outage ends once no replay has failed for this long
MAX_BATCH_CALLS = 64  # calls of one operation per batch: bounds a statement's parameters and rows


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


class Events:
    """The ``finished``/``queued`` events of a run that a try wants announced: delivered once after
    its commit, to this process's waiters and on PostgreSQL to every process through NOTIFY."""

    def __init__(self) -> None:
        self.events: set[tuple[int, str]] = set()
        # Events whose NOTIFY a statement already sent (PostgreSQL: inside the writing statement).
        self.notified: set[tuple[int, str]] = set()

    def announce(self, run_id: int, kind: str) -> None:
        self.events.add((run_id, kind))

    def take_notifications(self) -> list[str]:
        """The NOTIFY payloads of the events not sent yet, in a stable order; they count as sent."""
        pending = sorted(self.events - self.notified)
        self.notified.update(pending)
        return [f"{run_id}:{kind}" for run_id, kind in pending]


@dataclass
class UnitContext(Events):
    """What a unit sees besides its connection: the dialect, and the events it wants announced."""

    conn: Connection
    dialect: str
    # 0 on the first try; > 0 on a replay after a transient error, when an earlier try may have
    # committed (units skip their replay look-ups on the first try).
    attempt: int = 0
    notify_channel: str = NOTIFY_CHANNEL
    events: set[tuple[int, str]] = field(default_factory=set)
    notified: set[tuple[int, str]] = field(default_factory=set)
    run_id: int | None = None  # the bound run of ``SqlLightningStore.run_sql``

    def execute(self, stmt: Any, params: Any = None) -> Any:
        return self.conn.execute(stmt, params)


Unit = Callable[[UnitContext], T]


class Operation:
    """One call of a store operation: its arguments (declared by the subclass, a dataclass) and
    where its outcome goes.  The class says how a batch of such calls runs: ``name`` names the
    runner of each dialect module, ``outcomes`` turns the runner's rows into one result or error per
    call, in the batch's order."""

    name: ClassVar[str]
    write: ClassVar[bool] = True
    max_batch: ClassVar[int] = MAX_BATCH_CALLS
    __slots__ = ("future", "loop", "deadline", "outcome")

    run_id: int
    future: asyncio.Future[Any]  # on ``loop``, the caller's
    loop: asyncio.AbstractEventLoop
    deadline: float  # monotonic seconds
    outcome: Any  # the result, or a ``Failure``

    def batch_key(self) -> Hashable:
        """Calls with equal keys may share a batch."""
        return (self.name, self.run_id)

    def conflicts(self) -> tuple[Hashable, ...]:
        """Rows this call decides from and writes: calls that share one never share a batch (its
        statement sees the rows as they were before the batch)."""
        return ()

    @classmethod
    def outcomes(cls, batch: Batch, rows: Any) -> list[Any]:
        """One result per call of ``batch`` (an exception instance: that caller's own error)."""
        raise NotImplementedError


class Failure:
    """A call's own error, as an outcome."""

    __slots__ = ("error",)

    def __init__(self, error: BaseException) -> None:
        self.error = error


@dataclass(eq=False)
class Batch:
    """Calls of one operation that run together, and what their try wants announced."""

    calls: list[Operation]
    attempt: int = 0
    notify_channel: str = NOTIFY_CHANNEL
    events: Events = field(default_factory=Events)
    conflicts: set[Hashable] = field(default_factory=set)

    @property
    def run_id(self) -> int:
        return self.calls[0].run_id

    def announce(self, kind: str) -> None:
        self.events.announce(self.run_id, kind)


def gather_batch(pending: list[Operation], first: int = 0) -> Batch:
    """The batch of ``pending[first]`` with the later calls that may join it, taken out of
    ``pending`` (calls that cannot join keep their place and order)."""
    head = pending.pop(first)
    batch = Batch([head], conflicts=set(head.conflicts()))
    if head.max_batch <= 1:
        return batch
    key = head.batch_key()
    index = first
    while index < len(pending) and len(batch.calls) < head.max_batch:
        call = pending[index]
        if call.max_batch > 1 and call.batch_key() == key:
            mine = call.conflicts()
            if not batch.conflicts.intersection(mine):
                batch.calls.append(pending.pop(index))
                batch.conflicts.update(mine)
                continue
        index += 1
    return batch


def batches_of(calls: Iterable[Operation]) -> list[Batch]:
    """``calls`` (in arrival order) as batches, in the order of their first calls."""
    pending = list(calls)
    out = []
    while pending:
        out.append(gather_batch(pending))
    return out


# Settled calls waiting for their event loop to take them, by loop: a loop is woken once however many
# batches settle calls of it before it runs (one cross-thread wake-up per burst, not per call).
_outboxes: dict[asyncio.AbstractEventLoop, list[Operation]] = {}
_outbox_lock = threading.Lock()


def settle(calls: Iterable[Operation]) -> None:
    """Hand each call its outcome on its caller's event loop."""
    wake = []
    with _outbox_lock:
        for call in calls:
            box = _outboxes.get(call.loop)
            if box is None:
                box = _outboxes[call.loop] = []
                wake.append(call.loop)
            box.append(call)
    for loop in wake:
        try:
            loop.call_soon_threadsafe(_deliver, loop)
        except RuntimeError:  # a closed loop: nobody is left to take them
            with _outbox_lock:
                _outboxes.pop(loop, None)


def _deliver(loop: asyncio.AbstractEventLoop) -> None:
    with _outbox_lock:
        calls = _outboxes.pop(loop, [])
    for call in calls:
        fut = call.future
        if fut.done():
            continue
        outcome = call.outcome
        if isinstance(outcome, Failure):
            fut.set_exception(outcome.error)
        else:
            fut.set_result(outcome)


@dataclass(eq=False, slots=True)
class UnitCall(Operation):
    """A call off the hot path: ``unit`` alone in one transaction (``write``: one that may write;
    ``snapshot``: a read that must see one snapshot across its statements)."""

    name: ClassVar[str] = "unit"
    max_batch: ClassVar[int] = 1
    unit: Callable[[UnitContext], Any]
    writes: bool
    snapshot: bool = False
    run_id: int = 0


@dataclass(frozen=True)
class SchemaUnit:
    """Make sure the schema exists and is current; run once per executor before any other call."""

    auto_migrate: bool
    read_only: bool

    def __call__(self, ctx: UnitContext) -> None:  # pragma: no cover - the executors handle it
        raise NotImplementedError


def is_write(call: Operation) -> bool:
    return call.writes if isinstance(call, UnitCall) else call.write


class Executor:
    """Runs the calls of every store instance of this process on one database (see the module doc)."""

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
        self._outage_since = 0.0  # time.time() of the first failed replay of the outage in progress

    @property
    def dialect(self) -> str:
        return self.target.dialect

    def submit(self, call: Operation) -> asyncio.Future[Any]:
        """Queue ``call`` (its ``deadline`` set, in monotonic seconds); the future, on the running
        loop, gets its outcome."""
        raise NotImplementedError

    def close(self) -> None:
        raise NotImplementedError

    def replayable(self, exc: BaseException, attempt: int) -> bool:
        """Whether a try that raised ``exc`` is replayed after a back-off; False for the calls' own
        error.  Raises ``StoreUnavailableError`` for a database that cannot answer and
        ``PermissionError`` for a role that may not do this."""
        kind = classify_error(exc)
        if kind == "unavailable":
            raise unavailable(exc, self.target) from exc
        if kind == "denied":
            raise denied(exc, self.target) from exc
        if kind != "transient":
            return False
        self.note_transient_error(exc, attempt)
        return True

    def expired(self, calls: list[Operation], exc: BaseException) -> list[Operation]:
        """The calls still within their deadline; the others fail with ``StoreUnavailableError``."""
        now = time.monotonic()
        live = []
        for call in calls:
            if now > call.deadline:
                call.outcome = Failure(unavailable(exc, self.target))
            else:
                live.append(call)
        return live

    def note_transient_error(self, exc: BaseException, attempt: int) -> None:
        """Log an outage once, whatever the number of calls, runners and retries it hits.  A try's
        first failure is not one (a pooled connection the server dropped fails once, and the replay
        on a new connection succeeds): an outage is replays failing, and it lasts until none has
        failed for ``OUTAGE_QUIET_S`` (connection slots taken by other processes fail some replays
        and let others through: one outage, not one per success in between)."""
        if attempt < 1:
            return
        now = time.monotonic()
        if self.unavailable_since() is None:
            self._outage_since = time.time()
            name = "PostgreSQL" if self.dialect == "postgresql" else "SQLite"
            logger.warning(
                "%s %s: %s; retrying each call until it answers or its deadline passes",
                name, self.target.masked, reason(exc, self.target),
            )
        self._last_failed_replay = now

    def unavailable_since(self) -> float | None:
        """When (``time.time()``) the outage in progress began; None: no replay failed lately."""
        last = self._last_failed_replay
        return None if last is None or time.monotonic() - last > OUTAGE_QUIET_S else self._outage_since

    def after_commit(self, events: Events) -> None:
        for run_id, _kind in events.events:
            self.hub.wake(run_id)


def run_outcomes(batch: Batch, rows: Any) -> None:
    """Store the outcomes of ``batch`` computed from its runner's ``rows`` on its calls."""
    cls = type(batch.calls[0])
    for call, outcome in zip(batch.calls, cls.outcomes(batch, rows), strict=True):
        call.outcome = Failure(outcome) if isinstance(outcome, BaseException) else outcome


# --- one executor per process and database --------------------------------------------------


def _key(target: DatabaseTarget, schema: str | None, options: dict[str, Any]) -> tuple[Any, ...]:
    return (
        target.dialect,  # sqlite:// and sqlite+aiosqlite:// of one file share the executor
        target.url.render_as_string(hide_password=False),
        schema,
        tuple(sorted((k, repr(v)) for k, v in {**target.options, **options}.items())),  # the URL's too
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
