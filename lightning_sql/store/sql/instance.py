"""Per-instance plumbing of ``SqlLightningStore``.

Everything an instance holds besides the contract's methods: its options and their validation, the
run it is bound to, the store clock, the hand-off of units to the process's executor (with
cancellation safety), the lazy sweeper's debounce, waiters released by ``close()``, pickling and
fork handling.  Durable state lives in the database; this is the little that lives in the instance.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import logging
import os
import threading
import time
import weakref
from collections.abc import Callable, Iterator
from datetime import datetime
from typing import Any, Self, TypeVar

from sqlalchemy import URL

from lightning_sql.store.sql import dialect as d
from lightning_sql.store.sql import planner_stats, sweeper
from lightning_sql.store.sql import runs as run_units
from lightning_sql.store.sql import schema as s
from lightning_sql.store.sql.errors import StoreUnavailableError
from lightning_sql.store.sql.executor import (
    Executor,
    Operation,
    SchemaUnit,
    UnitCall,
    UnitContext,
    acquire_executor,
    notify_channel,
    release_executor,
)
from lightning_sql.store.sql.rows import encoded
from lightning_sql.store.sql.urls import DatabaseTarget, normalise_url
from lightning_sql.store.sql.waits import WaitEntry, call_soon_threadsafe
from lightning_sql.types import LightningStoreCapabilities, RolloutConfig, check_text, generate_id

logger = logging.getLogger("lightning_sql.store.sql.store")

T = TypeVar("T")

# How often an instance re-measures its offset to the PostgreSQL server's clock.
CLOCK_SYNC_INTERVAL_S = 300.0
_SQLITE_OPTIONS = {"busy_timeout", "echo"}
_PG_OPTIONS = {"pool_size", "pool_recycle", "pool_pre_ping", "connect_args", "echo", "listen", "listen_url"}


# Every live instance of this process, so that a forked child can reset their per-process state.
_INSTANCES: weakref.WeakSet[StoreInstance] = weakref.WeakSet()


def _reset_instances_after_fork() -> None:
    # Runs in the child right after fork(), single-threaded: locks held by the parent's other threads
    # and flags of the parent's in-flight calls (a lazy sweep, waits) do not belong to the child.
    for instance in list(_INSTANCES):
        instance._sweep_lock = threading.Lock()
        instance._attach_lock = threading.Lock()
        instance._sweeping = False
        instance._waits = set()


os.register_at_fork(after_in_child=_reset_instances_after_fork)


async def _outcome(call: Operation, fut: asyncio.Future[T], grace_s: float) -> T:
    """The result of a unit that was handed over; a cancelled caller still lets it complete or roll
    back as a whole, then re-raises (a cancelled claim never leaves an ownerless rollout), waiting
    out an outage for ``grace_s`` at most (however patient its call was)."""
    try:
        return await asyncio.shield(fut)
    except asyncio.CancelledError:
        call.deadline = min(call.deadline, time.monotonic() + grace_s)
        while not fut.done():
            try:
                await asyncio.shield(fut)
            except asyncio.CancelledError:
                continue
            except BaseException:  # noqa: BLE001 - the caller is cancelled anyway
                break
        raise


# When the public call in progress in this context must be answered by (monotonic seconds): the
# units of one call share its connect_deadline_seconds instead of each having a fresh one.
_call_deadline: contextvars.ContextVar[float | None] = contextvars.ContextVar("lightning_sql_call_deadline", default=None)
# How long the calls made in this context retry an unavailable database instead of the store's
# connect_deadline_seconds (math.inf: until it answers); set by outage_patience().
_patience: contextvars.ContextVar[float | None] = contextvars.ContextVar("lightning_sql_patience", default=None)


@contextlib.contextmanager
def outage_patience(seconds: float) -> Iterator[None]:
    """Store calls made inside the block, and in the tasks and threads started from it (they copy
    the context), retry a database outage for ``seconds`` (``math.inf``: until it answers) instead
    of ``connect_deadline_seconds`` before they raise ``StoreUnavailableError``; a cancelled call
    still returns within ``connect_deadline_seconds``.  The Trainer runs its algorithm inside one."""
    if not seconds >= 0:
        raise ValueError(f"outage patience must be >= 0 seconds, got {seconds!r}")
    token = _patience.set(float(seconds))
    try:
        yield
    finally:
        _patience.reset(token)


_PER_PROCESS_STATE = frozenset(
    "_created_monotonic _pid _worker _run_id _offset _offset_measured_at _last_sweep _last_analyze_check "
    "_sweep_lock _sweeping _attach_lock _closed _waits _close_count".split()
)


def _generated_run_name() -> str:
    return f"run-{datetime.now().strftime('%Y%m%d-%H%M%S')}-{generate_id(4)}"


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
        for option, number, optional in (
            ("scan_debounce_seconds", scan_debounce_seconds, False),
            ("connect_deadline_seconds", connect_deadline_seconds, False),
            ("analyze_check_seconds", analyze_check_seconds, True),
        ):
            if optional and number is None:
                continue
            if isinstance(number, bool) or not isinstance(number, (int, float)):
                raise TypeError(f"{option} must be a number{' or None' if optional else ''}, got {number!r}")
        if connect_deadline_seconds < 0:
            raise ValueError(f"connect_deadline_seconds must be >= 0, got {connect_deadline_seconds!r}")
        if analyze_check_seconds is not None and not analyze_check_seconds >= 0:
            raise ValueError(f"analyze_check_seconds must be >= 0 or None, got {analyze_check_seconds!r}")
        if default_rollout_config is not None and not isinstance(default_rollout_config, RolloutConfig):
            raise TypeError(f"default_rollout_config must be a RolloutConfig or None, got {default_rollout_config!r}")
        if not isinstance(schema, str) or not schema:
            raise ValueError(f"schema must be a non-empty str, got {schema!r}")
        if target.dialect == "sqlite" and schema != s.DEFAULT_PG_SCHEMA:
            raise ValueError(f"schema={schema!r} applies to PostgreSQL only; SQLite files have no schemas")
        allowed = _PG_OPTIONS if target.dialect == "postgresql" else _SQLITE_OPTIONS
        for key in engine_options:
            if key not in allowed:
                raise ValueError(
                    f"Unknown engine option {key!r} for the {target.dialect} backend (allowed: {sorted(allowed)})"
                )
        pool_size = engine_options.get("pool_size", 1)
        if isinstance(pool_size, bool) or not isinstance(pool_size, int):
            raise TypeError(f"pool_size must be an int, got {pool_size!r}")
        if pool_size < 1:
            raise ValueError(f"pool_size must be >= 1, got {pool_size!r}")
        if not isinstance(engine_options.get("listen", True), bool):
            raise TypeError(f"listen must be a bool, got {engine_options['listen']!r}")
        if "listen_url" in engine_options:
            normalise_url(engine_options["listen_url"])  # a clear error now rather than a silent poll later
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
        # Per-process state (_PER_PROCESS_STATE): rebuilt here in an unpickled copy, never pickled.
        self._created_monotonic = time.monotonic()
        self._pid = os.getpid()
        self._worker: Executor | None = None
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
        _INSTANCES.add(self)

    def __getstate__(self) -> dict[str, Any]:
        if self._target.kind == "sqlite-memory":
            raise TypeError(f"An in-memory SQLite store ({self._target.masked}) cannot be pickled: a copy could not see its data")
        return {k: v for k, v in self.__dict__.items() if k not in _PER_PROCESS_STATE}

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
        raise NotImplementedError()  # no OTLP endpoint (docs/store-contract.md §2.16); upstream's text is empty too

    def _local_now(self) -> float:
        return float(self._clock()) if self._clock is not None else time.time()

    def now(self) -> float:
        """One reading of the store clock: local clock + measured offset (no I/O)."""
        return self._local_now() + self._offset

    async def _sync_clock(self, worker: Executor) -> None:
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

    def _attach(self) -> Executor:
        with self._attach_lock:
            pid = os.getpid()
            if pid != self._pid:
                # A forked child: the inherited executor belongs to the parent; forget it unclosed.
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
                self._worker = acquire_executor(
                    self._target,
                    schema=self._schema if self._target.dialect == "postgresql" else None,
                    options=self._engine_options,
                )
            return self._worker

    async def _submit(
        self, worker: Executor, unit: Callable[[UnitContext], T], *, write: bool, snapshot: bool = False
    ) -> T:
        """Run ``unit`` on the executor in one transaction (``snapshot``: a read that must see one
        snapshot across its statements) and wait for its result, cancellation-safe."""
        return await self._run(worker, UnitCall(unit, write, snapshot))  # type: ignore[no-any-return]

    async def _run(self, worker: Executor, call: Operation) -> Any:
        """Hand ``call`` to the executor and wait for its outcome, cancellation-safe; the call's
        deadline is what is left of the public call's ``connect_deadline_seconds``."""
        deadline_at = _call_deadline.get()
        call.deadline = self._deadline_at() if deadline_at is None else deadline_at
        return await _outcome(call, worker.submit(call), self.connect_deadline_seconds)

    def _deadline_at(self) -> float:
        """When a call starting now gives up on an unavailable database (monotonic seconds)."""
        patience = _patience.get()
        return time.monotonic() + (self.connect_deadline_seconds if patience is None else patience)

    @property
    def unavailable_since(self) -> float | None:
        """Since when (a ``time.time()`` timestamp) this process's calls to the store's database have
        been failing and retried (a stopped server, a full disk), or None: no outage."""
        worker = self._worker
        return None if worker is None else worker.unavailable_since()

    async def _prepare(self, *, needs_run: bool = True) -> tuple[Executor, int | None]:
        worker = self._attach()
        if worker.schema_ready is None:
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

    async def run_sql(
        self, work: Callable[[UnitContext], T], *, write: bool = False, snapshot: bool = False, bound: bool = True
    ) -> T:
        """Run ``work(ctx)``, plain synchronous SQLAlchemy Core over ``ctx.conn``, in ONE transaction
        of this store's executor, within the call's ``connect_deadline_seconds``, replayed after a
        transient error (so it must be replay-safe, as every unit of the store is).  ``write``: a
        transaction that may write (refused on a read-only store); ``snapshot``: a read that sees one
        snapshot across its statements (REPEATABLE READ READ ONLY on PostgreSQL).  With ``bound``
        the store's run is resolved first and ``ctx.run_id`` is its id; tables of a named
        PostgreSQL schema are reached through ``schema_translate_map``.  The entry point of the
        checker, the analysis helpers and ``lightning-sql gc`` (docs/architecture.md §7)."""
        if write:
            self._check_writable("run_sql")
        token = _call_deadline.set(self._deadline_at())
        try:
            worker, run_id = await self._prepare(needs_run=bound)

            def unit(ctx: UnitContext) -> T:
                ctx.run_id = run_id
                return work(ctx)

            return await self._submit(worker, unit, write=write, snapshot=snapshot)
        finally:
            _call_deadline.reset(token)

    @property
    def schema(self) -> str | None:
        """The PostgreSQL schema of the store's tables (None on SQLite)."""
        return self._schema if self._target.dialect == "postgresql" else None

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
    ) -> T:
        """Run one unit for the bound run: ``unit(ctx, run_id, now)``, after a due lazy sweep."""
        result = await self._call_op(
            method, lambda run_id, now: UnitCall(lambda ctx: unit(ctx, run_id, now), write), write=write, sweeps=sweeps
        )
        return result  # type: ignore[no-any-return]

    async def _call_op(
        self, method: str, make: Callable[[int, float], Operation], *, write: bool, sweeps: bool = False
    ) -> Any:
        """Run the operation ``make(run_id, now)`` for the bound run, after a due lazy sweep.  The
        call's ``connect_deadline_seconds`` covers all of it (schema check, sweep and operation)."""
        if write:
            self._check_writable(method)
        token = _call_deadline.set(self._deadline_at())
        try:
            worker, run_id = await self._prepare()
            assert run_id is not None
            if sweeps:
                await self._maybe_sweep(worker, run_id)
            return await self._run(worker, make(run_id, self.now()))
        finally:
            _call_deadline.reset(token)

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

    async def _maybe_sweep(self, worker: Executor, run_id: int) -> None:
        if not self._sweep_due():
            return
        try:
            now = self.now()
            await self._submit(worker, lambda ctx: sweeper.expire_leases(ctx, run_id, now), write=True)
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # noqa: BLE001 - a lazy sweep must not fail the caller's call
            outage = isinstance(exc, StoreUnavailableError)  # logged by the executor: no traceback
            logger.warning("Lazy sweep failed; it will be retried: %s", exc, exc_info=not outage)
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
            except Exception as exc:  # noqa: BLE001 - as the lazy sweep: never fails the caller's call
                outage = isinstance(exc, StoreUnavailableError)
                logger.warning("Looking for tables to ANALYZE failed; it will be retried: %s", exc, exc_info=not outage)
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

    def _register_wait(self, worker: Executor, run_id: int) -> tuple[WaitEntry, int]:
        entry = worker.hub.register(run_id)
        with self._attach_lock:
            self._waits.add(entry)
            return entry, self._close_count

    def _unregister_wait(self, worker: Executor, run_id: int, entry: WaitEntry) -> None:
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
            call_soon_threadsafe(loop, event.set)
        if worker is not None and worker.pid == os.getpid():
            release_executor(worker)

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(self, *exc: Any) -> None:
        await self.close()
