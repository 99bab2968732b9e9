"""Per-instance plumbing of ``SqlLightningStore`` (contract §0, §2.15, §4).

Everything an instance holds besides the contract's methods: its options and their validation, the
run it is bound to, the store clock, the hand-off of units to the process's I/O worker (with
cancellation), the lazy sweeper's debounce, waiters released by ``close()``, pickling and fork
handling.  Durable state lives in the database; this is the little that lives in the instance.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import operator
import os
import threading
import time
import weakref
from collections.abc import Callable, Hashable
from datetime import datetime
from typing import Any, Self, TypeVar

from sqlalchemy import URL

from lightning_sql.store.sql import dialect as d
from lightning_sql.store.sql import planner_stats, sweeper
from lightning_sql.store.sql import runs as run_units
from lightning_sql.store.sql import schema as s
from lightning_sql.store.sql.engine import (
    AsyncLoopWorker,
    BatchUnit,
    DatabaseTarget,
    IoWorker,
    NeedsTransaction,
    Planned,
    SchemaUnit,
    SqliteThreadWorker,
    UnitContext,
    acquire_worker,
    drop_closed_loops,
    normalise_url,
    notify_channel,
    release_worker,
    wake_loop,
)
from lightning_sql.store.sql.errors import StoreUnavailableError
from lightning_sql.store.sql.rows import encoded
from lightning_sql.types import LightningStoreCapabilities, RolloutConfig, check_text, generate_id

logger = logging.getLogger("lightning_sql.store.sql.store")

T = TypeVar("T")

# How often an instance re-measures its offset to the PostgreSQL server's clock (§0.2).
CLOCK_SYNC_INTERVAL_S = 300.0
_SQLITE_ENGINE_OPTIONS = {"busy_timeout", "echo"}
_PG_ENGINE_OPTIONS = {"pool_size", "max_overflow", "pool_timeout", "pool_recycle", "pool_pre_ping", "connect_args", "echo"}


# Every live instance of this process, so that a forked child can reset their per-process state.
_INSTANCES: weakref.WeakSet[StoreInstance] = weakref.WeakSet()


def _reset_instances_after_fork() -> None:
    # Runs in the child right after fork(), single-threaded: locks held by the parent's other threads
    # and flags of the parent's in-flight calls (a lazy sweep, waits) do not belong to the child.
    global _relays_lock
    _relays_lock = threading.Lock()
    _relays.clear()
    for instance in list(_INSTANCES):
        instance._sweep_lock = threading.Lock()
        instance._attach_lock = threading.Lock()
        instance._sweeping = False
        instance._waits = set()


os.register_at_fork(after_in_child=_reset_instances_after_fork)


class _Relay:
    """Hands finished units from I/O threads to one event loop, one wake-up per burst.

    ``asyncio.wrap_future`` costs a ``call_soon_threadsafe`` (a self-pipe write and an epoll wake-up)
    per finished unit; when the I/O thread finishes a group of units, one wake-up delivers them all.
    """

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self.lock = threading.Lock()
        self.pending: list[tuple[concurrent.futures.Future[Any], asyncio.Future[Any]]] = []

    def push(self, cfut: concurrent.futures.Future[Any], afut: asyncio.Future[Any]) -> None:
        with self.lock:
            self.pending.append((cfut, afut))
            first = len(self.pending) == 1
        if first:
            wake_loop(self.loop, self.flush)

    def flush(self) -> None:
        with self.lock:
            items, self.pending = self.pending, []
        for cfut, afut in items:
            if afut.done():
                continue
            if cfut.cancelled():
                afut.cancel()
                continue
            exc = cfut.exception()
            if exc is not None:
                afut.set_exception(exc)
            else:
                afut.set_result(cfut.result())


_relays: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, _Relay] = weakref.WeakKeyDictionary()
_relays_lock = threading.Lock()


def _relay(cfut: concurrent.futures.Future[T]) -> asyncio.Future[T]:
    """An asyncio future of the running loop that completes with ``cfut`` (see ``_Relay``)."""
    loop = asyncio.get_running_loop()
    relay = _relays.get(loop)
    if relay is None:
        with _relays_lock:
            relay = _relays.setdefault(loop, _Relay(loop))
    afut: asyncio.Future[T] = loop.create_future()
    cfut.add_done_callback(lambda done: relay.push(done, afut))
    return afut


async def _outcome(afut: asyncio.Future[T]) -> T:
    """The result of a unit that was handed over; a cancelled caller still lets it complete or roll
    back as a whole, then re-raises."""
    try:
        return await asyncio.shield(afut)
    except asyncio.CancelledError:
        while not afut.done():
            try:
                await asyncio.shield(afut)
            except asyncio.CancelledError:
                continue
            except BaseException:  # noqa: BLE001 - the caller is cancelled anyway
                break
        raise


def _settle(source: asyncio.Future[T], target: asyncio.Future[T]) -> None:
    """Complete ``target`` as ``source`` completes."""

    def copy(done: asyncio.Future[T]) -> None:
        if target.done():
            return
        if done.cancelled():
            target.cancel()
        elif done.exception() is not None:
            target.set_exception(done.exception())  # type: ignore[arg-type]
        else:
            target.set_result(done.result())

    source.add_done_callback(copy)


def _replaying(unit: Callable[[UnitContext], T], attempt: int) -> Callable[[UnitContext], T]:
    """``unit`` seeing ``ctx.attempt`` at least ``attempt`` (a replay after a try that may have run)."""
    if attempt == 0:
        return unit

    def replay(ctx: UnitContext) -> T:
        ctx.attempt = max(ctx.attempt, attempt)
        return unit(ctx)

    return replay


def _generated_run_name() -> str:
    return f"run-{datetime.now().strftime('%Y%m%d-%H%M%S')}-{generate_id(4)}"


# Batch functions bound to a run that an instance keeps (``_bind_batch``): the store passes module
# functions and plans of its own, a handful per run; past this (many runs) it starts over.
_BATCH_CALLS_KEPT = 64


def _bind_batch(
    run_batch: Callable[[UnitContext, int, list[Any]], list[Any]],
    run_id: int,
    plan: Callable[[int, list[Any]], Any] | None,
) -> tuple[Hashable, Callable[[UnitContext, list[Any]], list[Any]], Callable[[list[Any]], Any] | None]:
    """A ``BatchUnit``'s key, batch function and plan for ``run_batch`` and ``plan`` of one run,
    made once and kept by the instance: a call's unit then holds no closures of its own (a call in
    flight is fewer objects for the collector's young collections to walk)."""
    return (
        (run_batch, run_id),
        lambda ctx, many: run_batch(ctx, run_id, many),
        None if plan is None else lambda many: plan(run_id, many),
    )


class StoreInstance:
    """Options, run binding, clock, I/O hand-off, sweep debounce and lifecycle of one store instance."""

    def __init__(
        self,
        url: str | URL = "sqlite:///lightning_sql.db",
        *,
        run: str | None = None,
        create_run: bool = True,
        run_metadata: dict[str, Any] | None = None,
        read_only: bool = False,
        clock: Callable[[], float] | None = None,
        clock_sync: bool | None = None,
        default_rollout_config: RolloutConfig | None = None,
        scan_debounce_seconds: float = 10.0,
        connect_deadline_seconds: float = 30.0,
        analyze_check_seconds: float | None = 10.0,
        auto_migrate: bool = True,
        schema: str = s.DEFAULT_PG_SCHEMA,
        **engine_options: Any,
    ) -> None:
        target = normalise_url(url)
        if run is not None and (not isinstance(run, str) or not run):
            raise ValueError(f"run must be a non-empty str or None, got {run!r}")
        if run is not None:
            check_text(run, "run")
        for name, value in (("create_run", create_run), ("read_only", read_only), ("auto_migrate", auto_migrate)):
            if not isinstance(value, bool):
                raise TypeError(f"{name} must be a bool, got {value!r}")
        if clock is not None and not callable(clock):
            raise TypeError(f"clock must be a zero-argument callable or None, got {clock!r}")
        if clock_sync is not None and not isinstance(clock_sync, bool):
            raise TypeError(f"clock_sync must be a bool or None, got {clock_sync!r}")
        if clock_sync and target.dialect == "sqlite":
            raise ValueError("clock_sync=True needs a server clock: SQLite has none (use PostgreSQL or clock_sync=False)")
        for option, number in (
            ("scan_debounce_seconds", scan_debounce_seconds),
            ("connect_deadline_seconds", connect_deadline_seconds),
        ):
            if isinstance(number, bool) or not isinstance(number, (int, float)):
                raise TypeError(f"{option} must be a number, got {number!r}")
        if connect_deadline_seconds < 0:
            raise ValueError(f"connect_deadline_seconds must be >= 0, got {connect_deadline_seconds!r}")
        if analyze_check_seconds is not None and (
            isinstance(analyze_check_seconds, bool) or not isinstance(analyze_check_seconds, (int, float))
        ):
            raise TypeError(f"analyze_check_seconds must be a number or None, got {analyze_check_seconds!r}")
        if analyze_check_seconds is not None and not analyze_check_seconds >= 0:
            raise ValueError(f"analyze_check_seconds must be >= 0 or None, got {analyze_check_seconds!r}")
        if default_rollout_config is not None and not isinstance(default_rollout_config, RolloutConfig):
            raise TypeError(f"default_rollout_config must be a RolloutConfig or None, got {default_rollout_config!r}")
        if not isinstance(schema, str) or not schema:
            raise ValueError(f"schema must be a non-empty str, got {schema!r}")
        if target.dialect == "sqlite" and schema != s.DEFAULT_PG_SCHEMA:
            raise ValueError(f"schema={schema!r} applies to PostgreSQL only; SQLite files have no schemas")
        allowed = _PG_ENGINE_OPTIONS if target.dialect == "postgresql" else _SQLITE_ENGINE_OPTIONS
        for key in engine_options:
            if key not in allowed:
                raise ValueError(
                    f"Unknown engine option {key!r} for the {target.dialect} backend (allowed: {sorted(allowed)})"
                )
        if run_metadata is not None:
            encoded(run_metadata, "run_metadata")

        self._url = url if isinstance(url, str) else url.render_as_string(hide_password=False)
        self._target: DatabaseTarget = target
        self._run_name: str | None = run
        if run is None and create_run and not read_only:
            self._run_name = _generated_run_name()
            logger.info("Starting new run %s on %s", self._run_name, target.masked)
        self._create_run = create_run
        self._run_metadata = run_metadata
        self.read_only = read_only
        self._clock = clock
        self._clock_sync = (target.dialect == "postgresql") if clock_sync is None else clock_sync
        self.default_rollout_config = default_rollout_config
        self.scan_debounce_seconds = float(scan_debounce_seconds)
        self.connect_deadline_seconds = float(connect_deadline_seconds)
        # PostgreSQL: how often (monotonic seconds, at most) the lazy sweep looks for run tables due
        # for ANALYZE (planner_stats); None: never.
        self.analyze_check_seconds = None if analyze_check_seconds is None else float(analyze_check_seconds)
        self._auto_migrate = auto_migrate
        self._schema = schema
        self._engine_options = engine_options
        self._init_runtime_state()

    def _init_runtime_state(self) -> None:
        self._created_monotonic = time.monotonic()
        self._pid = os.getpid()
        self._worker: IoWorker | None = None
        self._run_id: int | None = None
        self._offset = 0.0
        self._offset_measured_at: float | None = None
        self._last_sweep: float | None = None
        self._last_analyze_check: float | None = None
        self._sweep_lock = threading.Lock()
        self._sweeping = False
        self._attach_lock = threading.Lock()
        self._closed = False
        # Waits in progress on this instance and the number of close() calls so far: close() wakes
        # them and they end (§4 close releases this instance's waiters).
        self._waits: set[tuple[asyncio.AbstractEventLoop, asyncio.Event]] = set()
        self._close_count = 0
        # (batch function, run, plan) -> what ``_bind_batch`` made of them (``_call_batchable``).
        self._batch_calls: dict[tuple[Any, int, Any], tuple[Hashable, Any, Any]] = {}
        _INSTANCES.add(self)

    def __getstate__(self) -> dict[str, Any]:
        if self._target.kind == "sqlite-memory":
            raise TypeError(f"An in-memory SQLite store ({self._target.masked}) cannot be pickled: a copy could not see its data")
        state = {
            k: v
            for k, v in self.__dict__.items()
            if k
            not in (
                "_worker",
                "_sweep_lock",
                "_attach_lock",
                "_run_id",
                "_offset",
                "_offset_measured_at",
                "_last_sweep",
                "_last_analyze_check",
                "_sweeping",
                "_pid",
                "_created_monotonic",
                "_closed",
                "_waits",
                "_close_count",
                "_batch_calls",
            )
        }
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._init_runtime_state()

    def __repr__(self) -> str:
        return f"SqlLightningStore({self._target.masked!r}, run={self._run_name!r})"

    @property
    def run(self) -> str | None:
        """The name of the run this instance is bound to."""
        return self._run_name

    @property
    def _notify_channel(self) -> str:
        """PostgreSQL: the NOTIFY channel of the store's schema (``UnitContext.notify_channel``)."""
        return notify_channel(self._schema)

    @property
    def url(self) -> str:
        """The database URL with its password masked."""
        return self._target.masked

    @property
    def dialect(self) -> str:
        return self._target.dialect

    @property
    def capabilities(self) -> LightningStoreCapabilities:
        return LightningStoreCapabilities(
            thread_safe=True,
            async_safe=True,
            zero_copy=self._target.kind != "sqlite-memory",
            otlp_traces=False,
        )

    def otlp_traces_endpoint(self) -> str:
        raise NotImplementedError()  # no OTLP endpoint (contract §2.16); upstream's text is empty too

    def _local_now(self) -> float:
        return float(self._clock()) if self._clock is not None else time.time()

    def now(self) -> float:
        """One reading of the store clock: local clock + measured offset (no I/O)."""
        return self._local_now() + self._offset

    async def _sync_clock(self, worker: IoWorker) -> None:
        local = self._local_now()
        if self._offset_measured_at is not None and abs(local - self._offset_measured_at) < CLOCK_SYNC_INTERVAL_S:
            return
        holder: dict[str, float] = {}

        def read_server(ctx: UnitContext) -> float:
            holder["sent"] = self._local_now()
            value = float(ctx.execute(d.server_epoch(ctx)).scalar_one())
            holder["received"] = self._local_now()
            return value

        server = await self._submit(worker, read_server, write=False)
        self._offset = server - (holder["sent"] + holder["received"]) / 2
        self._offset_measured_at = local

    def _attach(self) -> IoWorker:
        with self._attach_lock:
            pid = os.getpid()
            if pid != self._pid:
                # A forked child: the inherited worker belongs to the parent; forget it unclosed.
                if self._target.kind == "sqlite-memory":
                    raise RuntimeError("An in-memory SQLite store cannot be used in a forked child process")
                self._pid = pid
                self._worker = None
                self._run_id = None
                self._offset_measured_at = None
            if self._closed and self._target.kind == "sqlite-memory":
                raise RuntimeError("This in-memory SQLite store is closed")
            self._closed = False
            if self._worker is None or self._worker.closed:
                self._worker = acquire_worker(
                    self._target,
                    schema=self._schema if self._target.dialect == "postgresql" else None,
                    options=self._engine_options,
                )
            return self._worker

    async def _submit(
        self,
        worker: IoWorker,
        unit: Callable[[UnitContext], T],
        *,
        write: bool,
        snapshot: bool = False,
        autocommit: bool = False,
    ) -> T:
        """Run ``unit`` on the worker.  A read unit of the store runs without a transaction on
        PostgreSQL (``autocommit``: none relies on locks or ``SET LOCAL``) unless it asks for a
        ``snapshot`` (one REPEATABLE READ READ ONLY transaction); SQLite reads in one transaction,
        on a SQLite file in the calling thread (``SqliteThreadWorker.read_inline``).  A write unit
        runs in one transaction unless it says ``autocommit`` (honoured on PostgreSQL only); on
        SQLite in the calling thread at the loop's next turn, grouped with the loop's other writes,
        when the writer connection is free (``write_soon``), else on the writer thread."""
        if isinstance(worker, SqliteThreadWorker):
            if write:
                soon = worker.write_soon(unit)
                if soon is not None:
                    done, value = await _outcome(soon)
                    if done:
                        return value  # type: ignore[no-any-return]
                    unit = _replaying(unit, value)
            else:
                done, result = worker.read_inline(unit)
                if done:
                    # Still a suspension point, as when the unit went to the I/O thread: a caller
                    # that polls in a loop must not starve the other tasks of its event loop.
                    await asyncio.sleep(0)
                    return result  # type: ignore[return-value]
        if isinstance(worker, AsyncLoopWorker) and write and isinstance(unit, BatchUnit):
            return await self._submit_batchable(worker, unit, autocommit=autocommit)
        if isinstance(worker, AsyncLoopWorker) and (not write or autocommit):
            return await _outcome(
                self._start(worker, unit, write=write, autocommit=not snapshot, snapshot=snapshot)
            )
        return await _outcome(self._start(worker, unit, write=write))

    def _start(
        self, worker: IoWorker, unit: Any, *, write: bool, autocommit: bool = False, snapshot: bool = False
    ) -> asyncio.Future[Any]:
        """Start ``unit`` on ``worker``: in the calling loop when it is the worker's home loop
        (PostgreSQL, ``AsyncLoopWorker.run_here``), else on the I/O thread; a future of the caller's
        loop either way."""
        deadline = self.connect_deadline_seconds
        if isinstance(worker, AsyncLoopWorker):
            here = worker.run_here(unit, write=write, deadline_s=deadline, autocommit=autocommit, snapshot=snapshot)
            if here is not None:
                return here
            return _relay(worker.submit(unit, write=write, deadline_s=deadline, autocommit=autocommit, snapshot=snapshot))
        return _relay(worker.submit(unit, write=write, deadline_s=deadline))

    async def _submit_batchable(self, worker: AsyncLoopWorker, unit: BatchUnit[T], *, autocommit: bool) -> T:
        """A batchable write unit on the I/O loop (PostgreSQL, aiosqlite): the units of its key that
        this event loop's tasks submit until its next turn run as ONE unit, in one transaction, each
        caller getting its own result (the SQLite writer does the same in its group commits), or
        without a transaction when the batch is one statement (``BatchUnit.atomic``; one that
        raises ``NeedsTransaction`` runs again in a transaction).  A unit alone runs as it came
        (``autocommit`` as asked).  When the batch fails with an error of its own, its transaction
        committed nothing and the units run alone, one after the other, each for its own outcome
        (after a batch without a transaction, as replays: its statement may have committed before
        the error); an unavailable or refused database fails them all.  A batch
        holds ``BatchUnit.max_batch`` units at most (when set): the units past it start another
        batch of the same turn, which runs beside it on another connection."""
        loop = asyncio.get_running_loop()
        key = (loop, unit.key)
        fut: asyncio.Future[T] = loop.create_future()
        pending = worker.batches.get(key)
        if pending is not None and unit.max_batch and len(pending) >= unit.max_batch:
            del worker.batches[key]  # full: it runs as it is, at its flush
            pending = None
        if pending is None:
            drop_closed_loops(worker.batches, operator.itemgetter(0))
            pending = worker.batches[key] = []
            loop.call_soon(self._flush_batch, worker, key, pending)
        pending.append((unit, fut, autocommit))
        return await _outcome(fut)

    def _flush_batch(
        self, worker: AsyncLoopWorker, key: Any, items: list[tuple[BatchUnit[Any], asyncio.Future[Any], bool]]
    ) -> None:
        if worker.batches.get(key) is items:
            del worker.batches[key]

        def alone(index: int, replay: int = 0) -> None:
            """The units from ``index`` on, one after the other (in their order, as a batch runs
            them), each as it came; ``replay``: each sees ``ctx.attempt`` at least that (the batch
            may have committed: ``_replaying``)."""
            if index < len(items):
                unit, fut, autocommit = items[index]
                done = self._start(worker, _replaying(unit, replay), write=True, autocommit=autocommit)
                _settle(done, fut)
                done.add_done_callback(lambda _done: alone(index + 1, replay))

        units = [unit for unit, _fut, _autocommit in items]
        one = len(items) == 1

        def start(autocommit: bool, replay: int = 0) -> None:
            combined = self._start(
                worker,
                _replaying(lambda ctx: units[0].run_batch(ctx, [unit.args for unit in units]), replay),
                write=True,
                autocommit=autocommit,
            )
            combined.add_done_callback(lambda done: settle(done, autocommit))

        def settle(done: asyncio.Future[list[Any]], autocommit: bool) -> None:
            if done.cancelled():
                for _unit, fut, _autocommit in items:
                    fut.cancel()
                return
            exc = done.exception()
            if isinstance(exc, NeedsTransaction) and autocommit:
                start(False)  # it wrote nothing: the same batch in a transaction
            elif exc is None:
                worker.batched_units += len(items)
                for (_unit, fut, _autocommit), result in zip(items, done.result(), strict=True):
                    if not fut.done():
                        fut.set_result(result)
            elif isinstance(exc, (StoreUnavailableError, PermissionError)):
                for _unit, fut, _autocommit in items:
                    if not fut.done():
                        fut.set_exception(exc)
            elif not autocommit:  # the batch's own error: its transaction committed nothing
                alone(0)
            else:  # its one statement committed nothing, unless the error came after it: replays
                alone(0, replay=1)

        def settle_direct(done: asyncio.Future[list[Any] | None], planned: Planned[Any]) -> None:
            """The outcome of a direct write (``_HomeEngine.write``), or the unit's path where it
            has none: not sent, the batch (or the unit alone) runs as a unit; sent and failed
            (it may have committed), as a replay; ``NeedsTransaction``, in a transaction."""
            if done.cancelled():
                for _unit, fut, _autocommit in items:
                    fut.cancel()
                return
            if done.exception() is not None:
                alone(0, replay=1) if one else start(True, replay=1)
                return
            rows = done.result()
            if rows is None:
                alone(0) if one else start(True)
                return
            events: set[tuple[int, str]] = set()
            try:
                results = planned.results(rows, events)
            except Exception as exc:  # noqa: BLE001 - the unit's own outcome, as its unit gives it
                if one:
                    if not items[0][1].done():
                        items[0][1].set_exception(exc)
                elif isinstance(exc, NeedsTransaction):
                    start(False)  # it wrote nothing: the same batch in a transaction
                else:  # the batch's own error, its statement atomic: each unit alone, for its own
                    alone(0, replay=1)
                return
            for run_id, _kind in events:
                worker.hub.wake(run_id)
            if not one:
                worker.batched_units += len(items)
            for (_unit, fut, _autocommit), result in zip(items, results, strict=True):
                if not fut.done():
                    fut.set_result(result)

        # A batch (or a unit alone) that is one statement without a transaction runs as a coroutine
        # on the home engine's kept connections when it can (ADR 0005 decision 15).
        if units[0].plan is not None and (items[0][2] if one else units[0].atomic):
            home = worker.direct_writes_here()
            planned = units[0].plan([unit.args for unit in units]) if home is not None else None
            if home is not None and planned is not None:
                written = asyncio.get_running_loop().create_task(home.write(planned.stmt, planned.params))
                worker.hold(written)
                written.add_done_callback(lambda done: settle_direct(done, planned))
                return
        if one:
            alone(0)
        else:
            start(units[0].atomic)

    async def _prepare(self, *, needs_run: bool = True) -> tuple[IoWorker, int | None]:
        worker = self._attach()
        if worker._schema_ready is None:
            await self._submit(worker, SchemaUnit(self._auto_migrate, self.read_only), write=True)
        if self._clock_sync:
            await self._sync_clock(worker)
        if not needs_run:
            return worker, None
        if self._run_id is None:
            name = self._run_name
            if name is None:
                raise ValueError(
                    "This store is bound to no run (run=None with create_run=False or read_only=True): "
                    "pass run=<name>"
                )
            create = self._create_run and not self.read_only
            metadata = encoded(self._run_metadata, "run_metadata")
            now = self.now()
            self._run_id = await self._submit(
                worker,
                lambda ctx: run_units.resolve_run(ctx, name, now, create=create, metadata=metadata),
                write=create,
            )
        return worker, self._run_id

    def _check_writable(self, method: str) -> None:
        if self.read_only:
            raise PermissionError(f"{method}() writes to the store, but this store is read_only=True")

    async def _call(
        self,
        method: str,
        unit: Callable[[UnitContext, int, float], T],
        *,
        write: bool,
        sweeps: bool = False,
        autocommit: bool = False,
        direct: Callable[[int], tuple[Any, dict[str, Any], Callable[[list[Any]], T]]] | None = None,
    ) -> T:
        """Run one unit for the bound run; ``unit(ctx, run_id, now)``.  ``autocommit``: a write unit
        whose statements are each atomic and replay-safe on their own (PostgreSQL runs it without a
        transaction; see ``AsyncLoopWorker``).  ``direct``: a read unit that is ONE prebuilt
        statement, as ``direct(run_id) -> (statement, parameters, result from its rows)``; on the
        home loop of a PostgreSQL worker it runs as a coroutine on the home engine's kept connection
        (``_HomeEngine.read``), and through ``unit`` whenever that does not run it."""
        if write:
            self._check_writable(method)
        worker, run_id = await self._prepare()
        assert run_id is not None
        if sweeps:
            await self._maybe_sweep(worker, run_id)
        if direct is not None and not write and isinstance(worker, AsyncLoopWorker):
            home = worker.direct_reads_here()
            if home is not None:
                stmt, params, result = direct(run_id)
                # Awaited in the caller's task (no task or shield of its own: two loop turns
                # less); a caller cancelled mid-read makes the read give up the kept connection.
                rows = await home.read(stmt, params)
                if rows is not None:
                    return result(rows)
        now = self.now()
        return await self._submit(worker, lambda ctx: unit(ctx, run_id, now), write=write, autocommit=autocommit)

    async def _call_batchable(
        self,
        method: str,
        run_batch: Callable[[UnitContext, int, list[Any]], list[T]],
        args: Any,
        *,
        sweeps: bool = False,
        autocommit: bool = False,
        atomic_batch: bool = False,
        max_batch: int = 0,
        plan: Callable[[int, list[Any]], Planned[T] | None] | None = None,
    ) -> T:
        """``_call`` of a write unit that may run together with the units of the same ``run_batch``
        and run issued in the same turn of the caller's event loop (``engine.BatchUnit``):
        ``run_batch(ctx, run_id, [(now, args), ...])`` returns each call's result, what the calls
        would return run one after the other in that order; a call alone is a batch of one.
        ``autocommit``: a call alone may run without a transaction (PostgreSQL); ``atomic_batch``:
        a batch too (it is one statement); ``max_batch``: ``BatchUnit``'s; ``plan(run_id, [(now,
        args), ...])``: the batch as one statement (``BatchUnit.plan``), what ``run_batch`` runs
        on a first try without a transaction, or None."""
        self._check_writable(method)
        worker, run_id = await self._prepare()
        assert run_id is not None
        if sweeps:
            await self._maybe_sweep(worker, run_id)
        # Units batch with those of the same function and run (dequeue_rollout's with dequeue_many_rollouts').
        bound = self._batch_calls.get((run_batch, run_id, plan))
        if bound is None:
            if len(self._batch_calls) >= _BATCH_CALLS_KEPT:
                self._batch_calls.clear()
            bound = self._batch_calls[(run_batch, run_id, plan)] = _bind_batch(run_batch, run_id, plan)
        key, run, planned = bound
        unit = BatchUnit(key, (self.now(), args), run, atomic=atomic_batch, max_batch=max_batch, plan=planned)
        return await self._submit(worker, unit, write=True, autocommit=autocommit)

    def _sweep_due(self) -> bool:
        if self.read_only:
            return False
        with self._sweep_lock:
            if self._sweeping:
                return False
            now = self.now()
            if self.scan_debounce_seconds > 0 and self._last_sweep is not None:
                elapsed = now - self._last_sweep
                if 0 <= elapsed < self.scan_debounce_seconds:
                    return False
            self._sweeping = True
            self._last_sweep = now
            return True

    async def _sweep_only(self) -> None:
        """The [sweeps] part of a call that has nothing else to do (empty batch, unmatchable id)."""
        worker, run_id = await self._prepare()
        assert run_id is not None
        await self._maybe_sweep(worker, run_id)

    async def _maybe_sweep(self, worker: IoWorker, run_id: int) -> None:
        if not self._sweep_due():
            return
        try:
            now = self.now()
            await self._submit(worker, lambda ctx: sweeper.expire_leases(ctx, run_id, now), write=True)
        except asyncio.CancelledError:
            raise
        except Exception:  # noqa: BLE001 - a lazy sweep must not fail the caller's call
            logger.warning("Lazy sweep failed; it will be retried", exc_info=True)
        finally:
            with self._sweep_lock:
                self._sweeping = False
        if self._analyze_check_due():
            schema = self._schema
            try:
                analysed = await self._submit(
                    worker, lambda ctx: planner_stats.analyze_changed_tables(ctx, schema), write=True
                )
            except asyncio.CancelledError:
                raise
            except Exception:  # noqa: BLE001 - as the lazy sweep: never fails the caller's call
                logger.warning("Looking for tables to ANALYZE failed; it will be retried", exc_info=True)
            else:
                if analysed:
                    logger.info("Analysed %s (planner statistics) in schema %s", ", ".join(analysed), schema)
                else:
                    logger.debug("No table of schema %s is due for ANALYZE", schema)

    def _analyze_check_due(self) -> bool:
        """Whether the lazy sweep that just ran also looks for run tables due for ANALYZE
        (PostgreSQL, ``analyze_check_seconds``; ADR 0006)."""
        if self._target.dialect != "postgresql" or self.analyze_check_seconds is None:
            return False
        with self._sweep_lock:
            now = time.monotonic()
            last = self._last_analyze_check
            if last is not None and now - last < self.analyze_check_seconds:
                return False
            self._last_analyze_check = now
            return True

    async def sweep(self, all_runs: bool = False) -> int:
        """Run the sweeper now (ignoring the debounce); returns the number of attempts it expired."""
        self._check_writable("sweep")
        worker, run_id = await self._prepare(needs_run=not all_runs)
        with self._sweep_lock:
            self._last_sweep = self.now()
        now = self.now()
        target = None if all_runs else run_id
        return await self._submit(worker, lambda ctx: sweeper.expire_leases(ctx, target, now), write=True)

    def _register_wait(self, worker: IoWorker, run_id: int) -> tuple[tuple[asyncio.AbstractEventLoop, asyncio.Event], int]:
        entry = worker.hub.register(run_id)
        with self._attach_lock:
            self._waits.add(entry)
            return entry, self._close_count

    def _unregister_wait(self, worker: IoWorker, run_id: int, entry: tuple[asyncio.AbstractEventLoop, asyncio.Event]) -> None:
        worker.hub.unregister(run_id, entry)
        with self._attach_lock:
            self._waits.discard(entry)

    def _check_not_closed_since(self, method: str, close_count: int) -> None:
        if self._close_count != close_count:
            raise RuntimeError(f"{method}(): the store was closed while waiting")

    async def close(self) -> None:
        """Release this instance's hold on its I/O worker (the last instance closes it)."""
        with self._attach_lock:
            worker, self._worker = self._worker, None
            self._closed = True
            self._run_id = None if self._target.kind == "sqlite-memory" else self._run_id
            self._close_count += 1
            waits = list(self._waits)
        for loop, event in waits:  # release this instance's waiters: they wake and end
            try:
                loop.call_soon_threadsafe(event.set)
            except RuntimeError:  # the waiter's loop is closed
                pass
        if worker is not None and worker.pid == os.getpid():
            if isinstance(worker, AsyncLoopWorker):
                await worker.release_home()  # the last holder, on the home loop: close it politely
            release_worker(worker)

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(self, *exc: Any) -> None:
        await self.close()
