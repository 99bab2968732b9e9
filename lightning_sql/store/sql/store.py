"""``SqlLightningStore``: the store contract on SQLite and PostgreSQL (contract §0-§2, §4).

Each public coroutine validates its arguments in Python (so bad input fails before any I/O and
writes nothing), decides every id and *now* once, and hands one unit of work to the process's I/O
worker for its database.  The units live in one module per aggregate (rollouts, spans, resources,
workers, sweeper, runs); this class is the contract's surface and the per-instance policy (run
binding, clock, sweep debounce, waits).
"""

from __future__ import annotations

import asyncio
import logging
import math
import os
import threading
import time
import warnings
import weakref
from collections.abc import Callable, Sequence
from datetime import datetime
from typing import Any, Literal, TypeVar

from opentelemetry.sdk.trace import ReadableSpan
from sqlalchemy import URL, func, select
from sqlalchemy.exc import IntegrityError

from lightning_sql.store.base import LightningStore
from lightning_sql.store.sql import dialect as d
from lightning_sql.store.sql import filters as f
from lightning_sql.store.sql import resources as res_units
from lightning_sql.store.sql import rollouts as ro
from lightning_sql.store.sql import runs as run_units
from lightning_sql.store.sql import schema as s
from lightning_sql.store.sql import spans as span_units
from lightning_sql.store.sql import sweeper
from lightning_sql.store.sql import workers as worker_units
from lightning_sql.store.sql.engine import (
    DatabaseTarget,
    IoWorker,
    SchemaUnit,
    UnitContext,
    acquire_worker,
    normalise_url,
    release_worker,
)
from lightning_sql.store.sql.rows import (
    ROLLOUT_COLUMNS,
    attempt_from_row,
    encoded,
    resources_from_row,
    span_values,
    worker_from_row,
)
from lightning_sql.types import (
    UNSET,
    Attempt,
    AttemptedRollout,
    AttemptStatus,
    EnqueueRolloutRequest,
    LightningStoreCapabilities,
    LightningStoreStatistics,
    NamedResources,
    PaginatedResult,
    ResourcesUpdate,
    Rollout,
    RolloutConfig,
    RolloutMode,
    RolloutStatus,
    Run,
    Span,
    TaskInput,
    Unset,
    Worker,
    WorkerStatus,
    check_text,
    generate_id,
    new_attempt_id,
    new_resources_id,
    new_rollout_id,
)

logger = logging.getLogger(__name__)

T = TypeVar("T")

# How often an instance re-measures its offset to the PostgreSQL server's clock (§0.2).
CLOCK_SYNC_INTERVAL_S = 300.0
# Fallback re-read interval of waits when no notification arrives (lost NOTIFY, other hosts).
WAIT_FALLBACK_POLL_S = 1.0
# Shortest pause between a wait's reads when a burst of wake-ups arrives.
WAIT_MIN_INTERVAL_S = 0.005

_ROLLOUT_STATUSES = ("queuing", "preparing", "running", "failed", "succeeded", "cancelled", "requeuing")
_ATTEMPT_STATUSES = ("preparing", "running", "failed", "succeeded", "unresponsive", "timeout")
_MODES = ("train", "val", "test")
_WORKER_STATUSES = ("idle", "busy", "unknown")
_SQLITE_ENGINE_OPTIONS = {"busy_timeout", "echo"}
_PG_ENGINE_OPTIONS = {"pool_size", "max_overflow", "pool_timeout", "pool_recycle", "pool_pre_ping", "connect_args", "echo"}


def _storable(value: str | None) -> bool:
    """Whether a read's id/filter string could exist in the database (no NUL, no lone surrogate)."""
    if value is None:
        return True
    try:
        check_text(value, "value")
    except (ValueError, TypeError):
        return False
    return True


# Every live instance of this process, so that a forked child can reset their per-process state.
_INSTANCES: weakref.WeakSet[SqlLightningStore] = weakref.WeakSet()


def _reset_instances_after_fork() -> None:
    # Runs in the child right after fork(), single-threaded: locks held by the parent's other threads
    # and flags of the parent's in-flight calls (a lazy sweep, waits) do not belong to the child.
    for instance in list(_INSTANCES):
        instance._sweep_lock = threading.Lock()
        instance._attach_lock = threading.Lock()
        instance._sweeping = False
        instance._waits = set()


os.register_at_fork(after_in_child=_reset_instances_after_fork)


def _generated_run_name() -> str:
    return f"run-{datetime.now().strftime('%Y%m%d-%H%M%S')}-{generate_id(4)}"


def _validate_literal(value: Any, allowed: Sequence[str], field: str, model: str) -> None:
    if value not in allowed:
        from pydantic import ValidationError

        # Validate through the model so the caller gets pydantic's ValidationError, as upstream.
        if model == "Rollout":
            Rollout.model_validate({"rollout_id": "x", "input": None, "start_time": 0.0, field: value})
        elif model == "Attempt":
            Attempt.model_validate(
                {"rollout_id": "x", "attempt_id": "y", "sequence_id": 1, "start_time": 0.0, field: value}
            )
        raise ValidationError.from_exception_data(model, [])  # pragma: no cover - unreachable


class SqlLightningStore(LightningStore):
    """A ``LightningStore`` persisted in SQLite or PostgreSQL, bound to one named run."""

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
        self._sweep_lock = threading.Lock()
        self._sweeping = False
        self._attach_lock = threading.Lock()
        self._closed = False
        # Waits in progress on this instance and the number of close() calls so far: close() wakes
        # them and they end (§4 close releases this instance's waiters).
        self._waits: set[tuple[asyncio.AbstractEventLoop, asyncio.Event]] = set()
        self._close_count = 0
        _INSTANCES.add(self)

    # --- pickling, repr -------------------------------------------------------------------------

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
                "_sweeping",
                "_pid",
                "_created_monotonic",
                "_closed",
                "_waits",
                "_close_count",
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
        raise NotImplementedError("SqlLightningStore does not expose an OTLP endpoint")

    # --- clock ----------------------------------------------------------------------------------

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
            value = float(ctx.conn.execute(d.server_epoch(ctx)).scalar_one())
            holder["received"] = self._local_now()
            return value

        server = await self._submit(worker, read_server, write=False)
        self._offset = server - (holder["sent"] + holder["received"]) / 2
        self._offset_measured_at = local

    # --- plumbing -------------------------------------------------------------------------------

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

    async def _submit(self, worker: IoWorker, unit: Callable[[UnitContext], T], *, write: bool) -> T:
        fut = worker.submit(unit, write=write, deadline_s=self.connect_deadline_seconds)
        afut = asyncio.wrap_future(fut)
        try:
            return await asyncio.shield(afut)
        except asyncio.CancelledError:
            # The unit was handed over: let it complete or roll back as a whole, then re-raise.
            while not afut.done():
                try:
                    await asyncio.shield(afut)
                except asyncio.CancelledError:
                    continue
                except BaseException:  # noqa: BLE001 - the caller is cancelled anyway
                    break
            raise

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
    ) -> T:
        """Run one unit for the bound run; ``unit(ctx, run_id, now)``."""
        if write:
            self._check_writable(method)
        worker, run_id = await self._prepare()
        assert run_id is not None
        if sweeps:
            await self._maybe_sweep(worker, run_id)
        now = self.now()
        return await self._submit(worker, lambda ctx: unit(ctx, run_id, now), write=write)

    # --- sweeper --------------------------------------------------------------------------------

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

    async def sweep(self, all_runs: bool = False) -> int:
        """Run the sweeper now (ignoring the debounce); returns the number of attempts it expired."""
        self._check_writable("sweep")
        worker, run_id = await self._prepare(needs_run=not all_runs)
        with self._sweep_lock:
            self._last_sweep = self.now()
        now = self.now()
        target = None if all_runs else run_id
        return await self._submit(worker, lambda ctx: sweeper.expire_leases(ctx, target, now), write=True)

    # --- rollouts -------------------------------------------------------------------------------

    def _new_rollout(
        self,
        input: Any,
        mode: Any,
        resources_id: Any,
        config: Any,
        metadata: Any,
        idempotency_key: Any,
        where: str = "",
    ) -> ro.NewRollout:
        if mode is not None:
            _validate_literal(mode, _MODES, "mode", "Rollout")
        if resources_id is not None:
            check_text(resources_id, f"{where}resources_id")
        if config is None:
            config = self.default_rollout_config.model_copy(deep=True) if self.default_rollout_config else RolloutConfig()
        elif isinstance(config, RolloutConfig):
            config = config.model_copy(deep=True)
        else:
            config = RolloutConfig.model_validate(config)
        if metadata is not None and not isinstance(metadata, dict):
            raise TypeError(f"{where}metadata must be a dict or None, got a value of type {type(metadata).__name__}")
        metadata_value = dict(metadata) if metadata is not None else {}
        if idempotency_key is not None:
            if not isinstance(idempotency_key, str) or not idempotency_key:
                raise ValueError(f"{where}idempotency_key must be a non-empty str or None, got {idempotency_key!r}")
            check_text(idempotency_key, f"{where}idempotency_key")
        return ro.NewRollout(
            rollout_id=new_rollout_id(),
            input=encoded(input, f"{where}input"),
            mode=mode,
            resources_id=resources_id,
            config=config,
            metadata=encoded(metadata_value, f"{where}metadata"),
            idempotency_key=idempotency_key,
            input_value=_json_roundtrip_value(input),
            metadata_value=metadata_value,
        )

    async def start_rollout(
        self,
        input: TaskInput,
        mode: RolloutMode | None = None,
        resources_id: str | None = None,
        config: RolloutConfig | None = None,
        metadata: dict[str, Any] | None = None,
        worker_id: str | None = None,
    ) -> AttemptedRollout:
        self._check_writable("start_rollout")
        item = self._new_rollout(input, mode, resources_id, config, metadata, None)
        if worker_id is not None:
            check_text(worker_id, "worker_id")
        attempt_id = new_attempt_id()
        return await self._call(
            "start_rollout",
            lambda ctx, run_id, now: ro.start_rollout(ctx, run_id, now, item, attempt_id, worker_id),
            write=True,
            sweeps=True,
        )

    async def enqueue_rollout(
        self,
        input: TaskInput,
        mode: RolloutMode | None = None,
        resources_id: str | None = None,
        config: RolloutConfig | None = None,
        metadata: dict[str, Any] | None = None,
        *,
        idempotency_key: str | None = None,
    ) -> Rollout:
        self._check_writable("enqueue_rollout")
        item = self._new_rollout(input, mode, resources_id, config, metadata, idempotency_key)
        (result,) = await self._call(
            "enqueue_rollout", lambda ctx, run_id, now: ro.enqueue(ctx, run_id, now, [item]), write=True, sweeps=True
        )
        return result

    async def enqueue_many_rollouts(self, requests: Sequence[EnqueueRolloutRequest]) -> Sequence[Rollout]:
        self._check_writable("enqueue_many_rollouts")
        items = []
        for i, req in enumerate(requests):
            if not isinstance(req, EnqueueRolloutRequest):
                req = EnqueueRolloutRequest.model_validate(req)
            items.append(
                self._new_rollout(
                    req.input, req.mode, req.resources_id, req.config, req.metadata, req.idempotency_key, f"requests[{i}]."
                )
            )
        if not items:
            await self._sweep_only()
            return []
        return await self._call(
            "enqueue_many_rollouts", lambda ctx, run_id, now: ro.enqueue(ctx, run_id, now, items), write=True, sweeps=True
        )

    async def dequeue_rollout(self, worker_id: str | None = None) -> AttemptedRollout | None:
        result = await self._dequeue("dequeue_rollout", 1, worker_id)
        return result[0] if result else None

    async def dequeue_many_rollouts(self, *, limit: int = 1, worker_id: str | None = None) -> Sequence[AttemptedRollout]:
        if isinstance(limit, bool) or not isinstance(limit, int):
            raise TypeError(f"limit must be an int, got {limit!r}")
        return await self._dequeue("dequeue_many_rollouts", limit, worker_id)

    async def _dequeue(self, method: str, limit: int, worker_id: str | None) -> list[AttemptedRollout]:
        self._check_writable(method)
        if worker_id is not None:
            check_text(worker_id, "worker_id")
        attempt_ids = [new_attempt_id() for _ in range(max(limit, 0))]
        if not attempt_ids and worker_id is None:
            # Nothing to claim and no worker to mark idle: only the [sweeps] part of the call remains.
            await self._sweep_only()
            return []
        return await self._call(
            method,
            lambda ctx, run_id, now: ro.claim(ctx, run_id, now, attempt_ids, worker_id),
            write=True,
            sweeps=True,
        )

    async def start_attempt(self, rollout_id: str, worker_id: str | None = None) -> AttemptedRollout:
        self._check_writable("start_attempt")
        if worker_id is not None:
            check_text(worker_id, "worker_id")
        if not _storable(rollout_id):
            raise ValueError(f"Rollout {rollout_id} not found")
        attempt_id = new_attempt_id()
        return await self._call(
            "start_attempt",
            lambda ctx, run_id, now: ro.start_attempt(ctx, run_id, now, rollout_id, attempt_id, worker_id),
            write=True,
            sweeps=True,
        )

    async def update_rollout(
        self,
        rollout_id: str,
        input: TaskInput | Unset = UNSET,
        mode: RolloutMode | None | Unset = UNSET,
        resources_id: str | None | Unset = UNSET,
        status: RolloutStatus | Unset = UNSET,
        config: RolloutConfig | Unset = UNSET,
        metadata: dict[str, Any] | None | Unset = UNSET,
    ) -> Rollout:
        self._check_writable("update_rollout")
        changes: dict[str, Any] = {}
        if not isinstance(input, Unset):
            changes["input"] = encoded(input, "input")
        if not isinstance(mode, Unset):
            if mode is not None:
                _validate_literal(mode, _MODES, "mode", "Rollout")
            changes["mode"] = mode
        if not isinstance(resources_id, Unset):
            if resources_id is not None:
                check_text(resources_id, "resources_id")
            changes["resources_id"] = resources_id
        if not isinstance(status, Unset):
            _validate_literal(status, _ROLLOUT_STATUSES, "status", "Rollout")
            changes["status"] = status
        if not isinstance(config, Unset):
            if not isinstance(config, RolloutConfig):
                config = Rollout.model_validate(
                    {"rollout_id": "x", "input": None, "start_time": 0.0, "config": config}
                ).config
            changes["config"] = config
        if not isinstance(metadata, Unset):
            if metadata is not None and not isinstance(metadata, dict):
                raise TypeError(f"metadata must be a dict or None, got a value of type {type(metadata).__name__}")
            changes["metadata"] = encoded(metadata, "metadata")
        if not _storable(rollout_id):
            raise ValueError(f"Item does not exist with primary key(s): rollout_id='{rollout_id}'")
        return await self._call(
            "update_rollout",
            lambda ctx, run_id, now: ro.update_rollout(ctx, run_id, now, rollout_id, changes),
            write=True,
            sweeps=True,
        )

    async def update_attempt(
        self,
        rollout_id: str,
        attempt_id: str | Literal["latest"],
        status: AttemptStatus | Unset = UNSET,
        worker_id: str | Unset = UNSET,
        last_heartbeat_time: float | Unset = UNSET,
        metadata: dict[str, Any] | Unset = UNSET,
    ) -> Attempt:
        self._check_writable("update_attempt")
        changes: dict[str, Any] = {}
        if not isinstance(status, Unset):
            _validate_literal(status, _ATTEMPT_STATUSES, "status", "Attempt")
            changes["status"] = status
        if not isinstance(worker_id, Unset):
            if worker_id is not None:
                check_text(worker_id, "worker_id")
            changes["worker_id"] = worker_id
        if not isinstance(last_heartbeat_time, Unset):
            if last_heartbeat_time is not None and (
                isinstance(last_heartbeat_time, bool) or not isinstance(last_heartbeat_time, (int, float))
            ):
                Attempt.model_validate(
                    {"rollout_id": "x", "attempt_id": "y", "sequence_id": 1, "start_time": 0.0,
                     "last_heartbeat_time": last_heartbeat_time}
                )
            if last_heartbeat_time is not None and not math.isfinite(last_heartbeat_time):
                raise ValueError(f"last_heartbeat_time must be a finite number, got {last_heartbeat_time!r}")
            changes["last_heartbeat_time"] = None if last_heartbeat_time is None else float(last_heartbeat_time)
        if not isinstance(metadata, Unset):
            if metadata is not None and not isinstance(metadata, dict):
                raise TypeError(f"metadata must be a dict or None, got a value of type {type(metadata).__name__}")
            changes["metadata"] = encoded(metadata, "metadata")
        self._check_ids_for_attempt(rollout_id, attempt_id)
        return await self._call(
            "update_attempt",
            lambda ctx, run_id, now: ro.update_attempt(ctx, run_id, now, rollout_id, attempt_id, changes),
            write=True,
            sweeps=True,
        )

    @staticmethod
    def _check_ids_for_attempt(rollout_id: str, attempt_id: str) -> None:
        # Only the rollout can be decided without I/O: an unstorable attempt id is a concrete id that
        # matches nothing, resolved in the unit after the rollout checks (§2.7 resolution order).
        if not _storable(rollout_id):
            raise ValueError(f"Rollout {rollout_id} not found")

    async def touch_attempt(self, rollout_id: str, attempt_id: str) -> Attempt:
        """A runner's heartbeat for one attempt, stamped with the store clock (no status change)."""
        self._check_writable("touch_attempt")
        self._check_ids_for_attempt(rollout_id, attempt_id)
        return await self._call(
            "touch_attempt",
            lambda ctx, run_id, now: ro.touch_attempt(ctx, run_id, now, rollout_id, attempt_id),
            write=True,
        )

    async def query_rollouts(
        self,
        *,
        status_in: Sequence[RolloutStatus] | None = None,
        rollout_id_in: Sequence[str] | None = None,
        rollout_id_contains: str | None = None,
        filter_logic: Literal["and", "or"] = "and",
        sort_by: str | None = None,
        sort_order: Literal["asc", "desc"] = "asc",
        limit: int = -1,
        offset: int = 0,
        status: Sequence[RolloutStatus] | None = None,
        rollout_ids: Sequence[str] | None = None,
        idempotency_key_in: Sequence[str] | None = None,
    ) -> PaginatedResult[Rollout | AttemptedRollout]:
        if status is not None:
            warnings.warn("query_rollouts(status=...) is deprecated; use status_in", DeprecationWarning, stacklevel=2)
            if status_in is None:
                status_in = status
        if rollout_ids is not None:
            warnings.warn(
                "query_rollouts(rollout_ids=...) is deprecated; use rollout_id_in", DeprecationWarning, stacklevel=2
            )
            if rollout_id_in is None:
                rollout_id_in = rollout_ids
        f.check_logic(filter_logic)
        f.check_sort(f.ROLLOUT_SORT, sort_by, sort_order)
        f.check_pagination(limit, offset)
        status_list = f.check_str_list(status_in, "status_in")
        id_list = f.check_str_list(rollout_id_in, "rollout_id_in")
        key_list = f.check_str_list(idempotency_key_in, "idempotency_key_in")
        if rollout_id_contains is not None and not isinstance(rollout_id_contains, str):
            raise TypeError("rollout_id_contains must be a str or None")

        def unit(ctx: UnitContext, run_id: int, now: float) -> PaginatedResult[Rollout | AttemptedRollout]:
            R = s.rollouts
            conditions = []
            if status_list is not None:
                conditions.append(f.within(R.c.status, status_list))
            if id_list is not None:
                conditions.append(f.within(R.c.rollout_id, [v for v in id_list if _storable(v)]))
            if rollout_id_contains is not None:
                conditions.append(
                    d.contains(ctx, R.c.rollout_id, rollout_id_contains) if _storable(rollout_id_contains) else f.false()
                )
            if key_list is not None:
                conditions.append(f.within(R.c.idempotency_key, [v for v in key_list if _storable(v)]))
            where = [R.c.run_id == run_id]
            if conditions:
                where.append(f.pool(conditions, filter_logic))
            return _paginate(
                ctx,
                select(*ROLLOUT_COLUMNS, R.c.attempt_count).where(*where),
                R,
                where,
                f.order_by(f.ROLLOUT_SORT, sort_by, sort_order),
                limit,
                offset,
                lambda rows: ro.with_latest_attempts(ctx, run_id, rows),
            )

        return await self._call("query_rollouts", unit, write=False, sweeps=True)

    async def get_rollout_by_id(self, rollout_id: str) -> Rollout | AttemptedRollout | None:
        if not _storable(rollout_id):
            await self._sweep_only()
            return None
        return await self._call(
            "get_rollout_by_id",
            lambda ctx, run_id, now: ro.get_rollout(ctx, run_id, rollout_id),
            write=False,
            sweeps=True,
        )

    async def query_attempts(
        self,
        rollout_id: str,
        *,
        sort_by: str | None = "sequence_id",
        sort_order: Literal["asc", "desc"] = "asc",
        limit: int = -1,
        offset: int = 0,
    ) -> PaginatedResult[Attempt]:
        f.check_sort(f.ATTEMPT_SORT, sort_by, sort_order)
        f.check_pagination(limit, offset)
        storable = _storable(rollout_id)

        def unit(ctx: UnitContext, run_id: int, now: float) -> PaginatedResult[Attempt]:
            A = s.attempts
            where = [A.c.run_id == run_id, A.c.rollout_id == rollout_id if storable else f.false()]
            return _paginate(
                ctx,
                select(A).where(*where),
                A,
                where,
                f.order_by(f.ATTEMPT_SORT, sort_by, sort_order),
                limit,
                offset,
                lambda rows: [attempt_from_row(r) for r in rows],
            )

        return await self._call("query_attempts", unit, write=False, sweeps=True)

    async def get_latest_attempt(self, rollout_id: str) -> Attempt | None:
        if not _storable(rollout_id):
            await self._sweep_only()
            return None
        return await self._call(
            "get_latest_attempt",
            lambda ctx, run_id, now: ro.get_latest_attempt(ctx, run_id, rollout_id),
            write=False,
            sweeps=True,
        )

    # --- waits ----------------------------------------------------------------------------------

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

    async def wait_for_rollouts(
        self,
        *,
        rollout_ids: list[str],
        timeout: float | None = None,
        return_when: Literal["all", "first"] = "all",
    ) -> list[Rollout]:
        if return_when not in ("all", "first"):
            raise ValueError(f"return_when must be 'all' or 'first', got {return_when!r}")
        if timeout is not None and (isinstance(timeout, bool) or not isinstance(timeout, (int, float))):
            raise TypeError(f"timeout must be a number or None, got {timeout!r}")
        ids = [rid for rid in f.check_str_list(rollout_ids, "rollout_ids") or [] if _storable(rid)]
        if not ids:
            await self._sweep_only()
            return []
        worker, run_id = await self._prepare()
        assert run_id is not None
        deadline = None if timeout is None else time.monotonic() + max(float(timeout), 0.0)

        def done(result: tuple[list[Rollout], int]) -> bool:
            finished, known = result
            return len(finished) >= known or (return_when == "first" and bool(finished))

        async def read() -> tuple[list[Rollout], int]:
            await self._maybe_sweep(worker, run_id)
            return await self._submit(worker, lambda ctx: ro.finished_rollouts(ctx, run_id, ids), write=False)

        entry, close_count = self._register_wait(worker, run_id)
        try:
            while True:
                self._check_not_closed_since("wait_for_rollouts", close_count)
                entry[1].clear()
                result = await read()
                if done(result) or (deadline is not None and time.monotonic() >= deadline):
                    return result[0]
                wait_s = WAIT_FALLBACK_POLL_S
                if deadline is not None:
                    wait_s = min(wait_s, max(deadline - time.monotonic(), 0.0))
                try:
                    await asyncio.wait_for(entry[1].wait(), timeout=wait_s)
                except TimeoutError:
                    pass
                await asyncio.sleep(WAIT_MIN_INTERVAL_S)
        finally:
            self._unregister_wait(worker, run_id, entry)

    async def wait_for_queue(self, timeout: float) -> bool:
        """True as soon as the run's queue holds work (claims nothing), False at the timeout."""
        if isinstance(timeout, bool) or not isinstance(timeout, (int, float)):
            raise TypeError(f"timeout must be a number, got {timeout!r}")
        worker, run_id = await self._prepare()
        assert run_id is not None
        deadline = time.monotonic() + max(float(timeout), 0.0)
        entry, close_count = self._register_wait(worker, run_id)
        try:
            while True:
                self._check_not_closed_since("wait_for_queue", close_count)
                entry[1].clear()
                if await self._submit(worker, lambda ctx: ro.has_queued(ctx, run_id), write=False):
                    return True
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    return False
                try:
                    await asyncio.wait_for(entry[1].wait(), timeout=min(WAIT_FALLBACK_POLL_S, remaining))
                except TimeoutError:
                    pass
        finally:
            self._unregister_wait(worker, run_id, entry)

    # --- spans ----------------------------------------------------------------------------------

    async def add_span(self, span: Span) -> Span | None:
        result = await self._add_spans("add_span", [span])
        return result[0] if result else None

    async def add_many_spans(self, spans: Sequence[Span]) -> Sequence[Span]:
        spans = list(spans)
        if not spans:
            self._check_writable("add_many_spans")
            return []
        return await self._add_spans("add_many_spans", spans)

    async def _add_spans(self, method: str, spans: list[Span], *, allocate: bool = False) -> list[Span]:
        self._check_writable(method)
        for span in spans:
            if not isinstance(span, Span):
                raise TypeError(f"{method}() takes Span objects, got a value of type {type(span).__name__}")
        for span in spans:
            if not _storable(span.rollout_id):
                raise ValueError(f"Rollout {span.rollout_id} not found")
        # Validate and encode before any I/O (bad input writes nothing and needs no database), on the
        # caller's thread: the I/O thread only stamps the run id.
        rows = [span_values(span, 0) for span in spans]

        def unit(ctx: UnitContext, run_id: int, now: float) -> list[Span]:
            if rows[0]["run_id"] != run_id:
                for row in rows:
                    row["run_id"] = run_id
            return span_units.add_spans(ctx, run_id, now, spans, rows, allocate=allocate)

        return await self._call(method, unit, write=True)

    async def add_otel_span(
        self,
        rollout_id: str,
        attempt_id: str,
        readable_span: ReadableSpan,
        sequence_id: int | None = None,
    ) -> Span | None:
        self._check_writable("add_otel_span")
        self._check_ids_for_attempt(rollout_id, attempt_id)
        if not _storable(attempt_id):
            # Validate the rollout before the attempt (§2.9), then report the attempt as missing.
            exists = await self._call(
                "add_otel_span",
                lambda ctx, run_id, now: ro.rollout_exists(ctx, run_id, rollout_id),
                write=False,
            )
            if not exists:
                raise ValueError(f"Rollout {rollout_id} not found")
            raise ValueError(f"Attempt {attempt_id} not found for rollout {rollout_id}")
        span = Span.from_opentelemetry(
            readable_span, rollout_id=rollout_id, attempt_id=attempt_id, sequence_id=sequence_id or 0
        )
        result = await self._add_spans("add_otel_span", [span], allocate=sequence_id is None)
        return result[0] if result else None

    async def get_next_span_sequence_id(self, rollout_id: str, attempt_id: str) -> int:
        self._check_writable("get_next_span_sequence_id")  # name this method, not the one it delegates to
        (value,) = await self.get_many_span_sequence_ids([(rollout_id, attempt_id)])
        return value

    async def get_many_span_sequence_ids(self, rollout_attempt_ids: Sequence[tuple[str, str]]) -> Sequence[int]:
        self._check_writable("get_many_span_sequence_ids")
        pairs = [(str(rid), str(aid)) for rid, aid in rollout_attempt_ids]
        if not pairs:
            return []
        for rid, _aid in pairs:
            if not _storable(rid):
                raise ValueError(f"Rollout {rid} not found")
        return await self._call(
            "get_many_span_sequence_ids",
            lambda ctx, run_id, now: span_units.reserve_sequence_ids(ctx, run_id, pairs),
            write=True,
        )

    async def query_spans(
        self,
        rollout_id: str,
        attempt_id: str | Literal["latest"] | None = None,
        *,
        trace_id: str | None = None,
        trace_id_contains: str | None = None,
        span_id: str | None = None,
        span_id_contains: str | None = None,
        parent_id: str | None = None,
        parent_id_contains: str | None = None,
        name: str | None = None,
        name_contains: str | None = None,
        filter_logic: Literal["and", "or"] = "and",
        limit: int = -1,
        offset: int = 0,
        sort_by: str | None = "sequence_id",
        sort_order: Literal["asc", "desc"] = "asc",
    ) -> PaginatedResult[Span]:
        f.check_logic(filter_logic)
        f.check_sort(f.SPAN_SORT, sort_by, sort_order)
        f.check_pagination(limit, offset)
        exact = {"trace_id": trace_id, "span_id": span_id, "parent_id": parent_id, "name": name}
        contains = {
            "trace_id": trace_id_contains,
            "span_id": span_id_contains,
            "parent_id": parent_id_contains,
            "name": name_contains,
        }
        for label, value in [*exact.items(), *((k + "_contains", v) for k, v in contains.items())]:
            if value is not None and not isinstance(value, str):
                raise TypeError(f"{label} must be a str or None, got a value of type {type(value).__name__}")

        def unit(ctx: UnitContext, run_id: int, now: float) -> PaginatedResult[Span]:
            return span_units.query_spans(
                ctx, run_id, rollout_id, attempt_id, exact, contains, filter_logic, limit, offset, sort_by, sort_order
            )

        return await self._call("query_spans", unit, write=False, sweeps=True)

    # --- resources ------------------------------------------------------------------------------

    @staticmethod
    def _resources_payload(resources: NamedResources) -> Any:
        if not isinstance(resources, dict):
            raise TypeError(f"resources must be a dict of named resources, got {type(resources).__name__}")
        validated = ResourcesUpdate.model_validate(
            {"resources_id": "x", "create_time": 0.0, "update_time": 0.0, "version": 1, "resources": resources}
        )
        for key in validated.resources:
            check_text(key, "resources")
        return encoded(
            {k: v.model_dump(mode="python") for k, v in validated.resources.items()}, "resources"
        )

    async def add_resources(self, resources: NamedResources) -> ResourcesUpdate:
        self._check_writable("add_resources")
        payload = self._resources_payload(resources)
        resources_id = new_resources_id()
        return await self._call(
            "add_resources",
            lambda ctx, run_id, now: res_units.add_resources(ctx, run_id, now, resources_id, payload),
            write=True,
        )

    async def update_resources(self, resources_id: str, resources: NamedResources) -> ResourcesUpdate:
        self._check_writable("update_resources")
        check_text(resources_id, "resources_id")
        payload = self._resources_payload(resources)
        return await self._call(
            "update_resources",
            lambda ctx, run_id, now: res_units.update_resources(ctx, run_id, now, resources_id, payload),
            write=True,
            sweeps=True,
        )

    async def get_resources_by_id(self, resources_id: str, version: int | None = None) -> ResourcesUpdate | None:
        if version is not None and (isinstance(version, bool) or not isinstance(version, int)):
            raise TypeError(f"version must be an int or None, got {version!r}")
        if not _storable(resources_id):
            return None
        return await self._call(
            "get_resources_by_id",
            lambda ctx, run_id, now: res_units.get_resources(ctx, run_id, resources_id, version),
            write=False,
        )

    async def get_latest_resources(self) -> ResourcesUpdate | None:
        return await self._call(
            "get_latest_resources", lambda ctx, run_id, now: res_units.get_latest(ctx, run_id), write=False
        )

    async def query_resources(
        self,
        *,
        resources_id: str | None = None,
        resources_id_contains: str | None = None,
        sort_by: str | None = None,
        sort_order: Literal["asc", "desc"] = "asc",
        limit: int = -1,
        offset: int = 0,
    ) -> PaginatedResult[ResourcesUpdate]:
        f.check_sort(f.RESOURCES_SORT, sort_by, sort_order)
        f.check_pagination(limit, offset)

        def unit(ctx: UnitContext, run_id: int, now: float) -> PaginatedResult[ResourcesUpdate]:
            RS = s.resources
            where = [RS.c.run_id == run_id]
            if resources_id is not None:
                where.append(RS.c.resources_id == resources_id if _storable(resources_id) else f.false())
            if resources_id_contains is not None:
                where.append(
                    d.contains(ctx, RS.c.resources_id, resources_id_contains)
                    if _storable(resources_id_contains)
                    else f.false()
                )
            return _paginate(
                ctx,
                select(RS).where(*where),
                RS,
                where,
                f.order_by(f.RESOURCES_SORT, sort_by, sort_order),
                limit,
                offset,
                lambda rows: [resources_from_row(r) for r in rows],
            )

        return await self._call("query_resources", unit, write=False)

    # --- workers --------------------------------------------------------------------------------

    async def update_worker(self, worker_id: str, heartbeat_stats: dict[str, Any] | Unset = UNSET) -> Worker:
        self._check_writable("update_worker")
        check_text(worker_id, "worker_id")
        if heartbeat_stats is None:
            raise TypeError("heartbeat_stats must be a dict when given (None is not allowed)")
        given = not isinstance(heartbeat_stats, Unset)
        if given and not isinstance(heartbeat_stats, dict):
            raise TypeError(f"heartbeat_stats must be a dict, got a value of type {type(heartbeat_stats).__name__}")
        stats = encoded(dict(heartbeat_stats), "heartbeat_stats") if given else None  # type: ignore[arg-type]
        return await self._call(
            "update_worker",
            lambda ctx, run_id, now: worker_units.update_worker(ctx, run_id, now, worker_id, stats, given),
            write=True,
        )

    async def get_worker_by_id(self, worker_id: str) -> Worker | None:
        if not _storable(worker_id):
            return None
        return await self._call(
            "get_worker_by_id", lambda ctx, run_id, now: worker_units.get_worker(ctx, run_id, worker_id), write=False
        )

    async def query_workers(
        self,
        *,
        status_in: Sequence[WorkerStatus] | None = None,
        worker_id_contains: str | None = None,
        filter_logic: Literal["and", "or"] = "and",
        sort_by: str | None = None,
        sort_order: Literal["asc", "desc"] = "asc",
        limit: int = -1,
        offset: int = 0,
    ) -> PaginatedResult[Worker]:
        f.check_logic(filter_logic)
        f.check_sort(f.WORKER_SORT, sort_by, sort_order)
        f.check_pagination(limit, offset)
        status_list = f.check_str_list(status_in, "status_in")

        def unit(ctx: UnitContext, run_id: int, now: float) -> PaginatedResult[Worker]:
            W = s.workers
            conditions = []
            if status_list is not None:
                conditions.append(f.within(W.c.status, status_list))
            if worker_id_contains is not None:
                conditions.append(
                    d.contains(ctx, W.c.worker_id, worker_id_contains) if _storable(worker_id_contains) else f.false()
                )
            where = [W.c.run_id == run_id]
            if conditions:
                where.append(f.pool(conditions, filter_logic))
            return _paginate(
                ctx,
                select(W).where(*where),
                W,
                where,
                f.order_by(f.WORKER_SORT, sort_by, sort_order),
                limit,
                offset,
                lambda rows: [worker_from_row(r) for r in rows],
            )

        return await self._call("query_workers", unit, write=False, sweeps=True)

    # --- statistics, runs, lifecycle ------------------------------------------------------------

    async def statistics(self) -> LightningStoreStatistics:
        result = await self._call("statistics", lambda ctx, run_id, now: run_units.counts(ctx, run_id), write=False)
        return LightningStoreStatistics(
            name=self.__class__.__name__,
            uptime=time.monotonic() - self._created_monotonic,
            **result,  # type: ignore[typeddict-item]
        )

    async def list_runs(self) -> list[Run]:
        worker, _ = await self._prepare(needs_run=False)
        return await self._submit(worker, run_units.list_runs, write=False)

    async def get_run(self, name: str) -> Run | None:
        if not _storable(name):
            return None
        worker, _ = await self._prepare(needs_run=False)
        return await self._submit(worker, lambda ctx: run_units.get_run(ctx, name), write=False)

    async def mark_run_finished(self) -> Run:
        self._check_writable("mark_run_finished")
        return await self._call(
            "mark_run_finished", lambda ctx, run_id, now: run_units.mark_finished(ctx, run_id, now), write=True
        )

    async def delete_run(self, name: str) -> bool:
        """Delete a run and everything in it, in short batches; False for an unknown name."""
        self._check_writable("delete_run")
        if not _storable(name):
            return False
        worker, _ = await self._prepare(needs_run=False)
        run_id = await self._submit(worker, lambda ctx: run_units.run_id_of(ctx, name), write=False)
        if run_id is None:
            return False
        while not await self._submit(worker, lambda ctx: run_units.delete_batch(ctx, run_id), write=True):
            pass
        if name == self._run_name:
            self._run_id = None
        return True

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
            release_worker(worker)

    async def __aenter__(self) -> SqlLightningStore:
        return self

    async def __aexit__(self, *exc: Any) -> None:
        await self.close()


def _json_roundtrip_value(value: Any) -> Any:
    """What a JSON value reads back as (tuples become lists), without encoding it again."""
    if isinstance(value, tuple | list):
        return [_json_roundtrip_value(v) for v in value]
    if isinstance(value, dict):
        return {k: _json_roundtrip_value(v) for k, v in value.items()}
    return value


def _paginate(
    ctx: UnitContext,
    stmt: Any,
    table: Any,
    where: list[Any],
    order: list[Any],
    limit: int,
    offset: int,
    build: Callable[[Sequence[Any]], list[Any]],
) -> PaginatedResult[Any]:
    """Count the matches and fetch one page in the requested order (at most two statements)."""
    page = stmt.order_by(*order)
    if limit != -1:
        page = page.limit(limit)
    if offset:
        page = page.offset(offset)
    rows = ctx.conn.execute(page).all() if limit != 0 else []
    if limit == -1 and offset == 0:
        total = len(rows)
    else:
        total = int(ctx.conn.execute(select(func.count()).select_from(table).where(*where)).scalar_one())
    return PaginatedResult(items=build(rows), limit=limit, offset=offset, total=total)


_ = IntegrityError
