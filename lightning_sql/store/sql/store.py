"""``SqlLightningStore``: the store contract on SQLite and PostgreSQL (docs/store-contract.md §0-§2, §4).

Each public coroutine validates its arguments in Python (so bad input fails before any I/O and
writes nothing), decides every id and *now* once, and hands one unit of work to the process's I/O
worker for its database.  The units live in one module per aggregate (rollouts, spans, resources,
workers, sweeper, runs); this class is the contract's surface, and ``instance.StoreInstance``
holds the per-instance policy (options, run binding, clock, I/O hand-off, sweep debounce, lifecycle).
"""

from __future__ import annotations

import asyncio
import logging
import time
import warnings
from collections.abc import Sequence
from functools import partial
from typing import Any, Literal, TypeVar

from opentelemetry.sdk.trace import ReadableSpan

from lightning_sql.store.base import LightningStore
from lightning_sql.store.sql import attempts, validation
from lightning_sql.store.sql import dialect as d
from lightning_sql.store.sql import filters as f
from lightning_sql.store.sql import resources as res_units
from lightning_sql.store.sql import rollouts as ro
from lightning_sql.store.sql import runs as run_units
from lightning_sql.store.sql import schema as s
from lightning_sql.store.sql import workers as worker_units
from lightning_sql.store.sql.attempts import UpdateAttempt
from lightning_sql.store.sql.claims import Claim
from lightning_sql.store.sql.executor import UnitContext
from lightning_sql.store.sql.queue_control import QueueControl
from lightning_sql.store.sql.rollouts import ReadRollout
from lightning_sql.store.sql.rows import (
    attempt_from_row,
    encoded,
    resources_from_row,
    span_values,
)
from lightning_sql.store.sql.spans import AddSpans, ReadSpans, ReserveSequenceIds
from lightning_sql.types import (
    UNSET,
    Attempt,
    AttemptedRollout,
    AttemptStatus,
    EnqueueRolloutRequest,
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
    is_storable_text,
    new_attempt_id,
    new_resources_id,
)

logger = logging.getLogger(__name__)

T = TypeVar("T")

# Fallback re-read interval of waits when no notification arrives (lost NOTIFY, other hosts).
WAIT_FALLBACK_POLL_S = 1.0
# Shortest pause between a wait's reads when a burst of wake-ups arrives.
WAIT_MIN_INTERVAL_S = 0.005

class SqlLightningStore(QueueControl, LightningStore):
    """A ``LightningStore`` persisted in SQLite or PostgreSQL, bound to one named run."""

    # --- rollouts -------------------------------------------------------------------------------

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
        item = validation.new_rollout(self.default_rollout_config, input, mode, resources_id, config, metadata, None)
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
        priority: int = 0,
    ) -> Rollout:
        self._check_writable("enqueue_rollout")
        item = validation.new_rollout(
            self.default_rollout_config, input, mode, resources_id, config, metadata, idempotency_key, priority=priority
        )
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
                validation.new_rollout(self.default_rollout_config,
                    req.input, req.mode, req.resources_id, req.config, req.metadata, req.idempotency_key, f"requests[{i}].",
                    req.priority,
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
        f.check_claim_limit(limit)
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
        return await self._call_op(  # type: ignore[no-any-return]
            method, lambda run_id, now: Claim(run_id, attempt_ids, worker_id, now), write=True, sweeps=True
        )

    async def start_attempt(self, rollout_id: str, worker_id: str | None = None) -> AttemptedRollout:
        self._check_writable("start_attempt")
        if worker_id is not None:
            check_text(worker_id, "worker_id")
        if not is_storable_text(rollout_id):
            raise ValueError(f"Rollout {rollout_id} not found")
        attempt_id = new_attempt_id()
        return await self._call(
            "start_attempt",
            lambda ctx, run_id, now: attempts.start_attempt(ctx, run_id, now, rollout_id, attempt_id, worker_id),
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
        *,
        priority: int | Unset = UNSET,
    ) -> Rollout:
        self._check_writable("update_rollout")
        changes = validation.rollout_changes(input, mode, resources_id, status, config, metadata, priority)
        if not is_storable_text(rollout_id):
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
        changes = validation.attempt_changes(status, worker_id, last_heartbeat_time, metadata)
        self._check_ids_for_attempt(rollout_id, attempt_id)
        return await self._call_op(  # type: ignore[no-any-return]
            "update_attempt",
            lambda run_id, now: UpdateAttempt(run_id, rollout_id, attempt_id, changes, now),
            write=True,
            sweeps=True,
        )

    @staticmethod
    def _check_ids_for_attempt(rollout_id: str, attempt_id: str) -> None:
        # Only the rollout can be decided without I/O: an unstorable attempt id is a concrete id that
        # matches nothing, resolved in the unit after the rollout checks (§2.7 resolution order).
        if not is_storable_text(rollout_id):
            raise ValueError(f"Rollout {rollout_id} not found")

    async def touch_attempt(self, rollout_id: str, attempt_id: str) -> Attempt:
        """A runner's heartbeat for one attempt, stamped with the store clock (no status change)."""
        self._check_writable("touch_attempt")
        self._check_ids_for_attempt(rollout_id, attempt_id)
        return await self._call_op(  # type: ignore[no-any-return]
            "touch_attempt",
            lambda run_id, now: UpdateAttempt(run_id, rollout_id, attempt_id, {"last_heartbeat_time": now}, now),
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
            if status_in is None:  # upstream warns only when the deprecated alias is used
                warnings.warn("status is deprecated, use status_in instead", DeprecationWarning, stacklevel=2)
                status_in = status
        if rollout_ids is not None:
            if rollout_id_in is None:
                warnings.warn("rollout_ids is deprecated, use rollout_id_in instead", DeprecationWarning, stacklevel=2)
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
            return ro.query_rollouts(
                ctx,
                run_id,
                status_list,
                id_list,
                rollout_id_contains,
                key_list,
                filter_logic,
                limit,
                offset,
                sort_by,
                sort_order,
            )

        return await self._call("query_rollouts", unit, write=False, sweeps=True)

    async def get_rollout_by_id(self, rollout_id: str) -> Rollout | AttemptedRollout | None:
        return await self._read_of_rollout("get_rollout_by_id", rollout_id, attempt_only=False)  # type: ignore[no-any-return]

    async def _read_of_rollout(self, method: str, rollout_id: str, *, attempt_only: bool) -> Any:
        """A read of one rollout by id; an id that cannot be stored matches nothing (no I/O but the sweep)."""
        if not is_storable_text(rollout_id):
            await self._sweep_only()
            return None
        return await self._call_op(
            method, lambda run_id, now: ReadRollout(run_id, rollout_id, attempt_only), write=False, sweeps=True
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
        storable = is_storable_text(rollout_id)

        def unit(ctx: UnitContext, run_id: int, now: float) -> PaginatedResult[Attempt]:
            A = s.attempts
            where = [A.c.run_id == run_id, A.c.rollout_id == rollout_id if storable else f.false()]
            order = f.order_by(f.ATTEMPT_SORT, sort_by, sort_order)
            return f.paginate(ctx, A, where, order, limit, offset, attempt_from_row)

        return await self._call("query_attempts", unit, write=False, sweeps=True)

    async def get_latest_attempt(self, rollout_id: str) -> Attempt | None:
        return await self._read_of_rollout("get_latest_attempt", rollout_id, attempt_only=True)  # type: ignore[no-any-return]

    # --- waits ----------------------------------------------------------------------------------

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
        ids = [rid for rid in f.check_str_list(rollout_ids, "rollout_ids") or [] if is_storable_text(rid)]
        if not ids:
            await self._sweep_only()
            return []
        worker, run_id = await self._prepare()
        assert run_id is not None
        deadline = None if timeout is None else time.monotonic() + max(float(timeout), 0.0)

        def done(result: tuple[list[Rollout], int, int]) -> bool:
            _finished, known, finished_distinct = result
            return finished_distinct >= known or (return_when == "first" and finished_distinct > 0)

        async def read() -> tuple[list[Rollout], int, int]:
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
                now = self.now()
                ready, due = await self._submit(worker, partial(ro.queue_state, run_id=run_id, now=now), write=False)
                if ready:
                    return True
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    return False
                # A rollout in back-off becomes due without a notification: wake at its time.
                wait_s = min(WAIT_FALLBACK_POLL_S, remaining, WAIT_FALLBACK_POLL_S if due is None else max(due - now, 0.01))
                try:
                    await asyncio.wait_for(entry[1].wait(), timeout=wait_s)
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
            if not is_storable_text(span.rollout_id):
                raise ValueError(f"Rollout {span.rollout_id} not found")
        # Validate and encode before any I/O (bad input writes nothing and needs no database), on the
        # caller's thread: the I/O thread only stamps the run id.
        rows = [span_values(span, 0) for span in spans]
        return await self._call_op(  # type: ignore[no-any-return]
            method, lambda run_id, now: AddSpans(run_id, now, spans, rows, allocate), write=True
        )

    async def add_otel_span(
        self,
        rollout_id: str,
        attempt_id: str,
        readable_span: ReadableSpan,
        sequence_id: int | None = None,
    ) -> Span | None:
        self._check_writable("add_otel_span")
        self._check_ids_for_attempt(rollout_id, attempt_id)
        if not is_storable_text(attempt_id):
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
            if not is_storable_text(rid):
                raise ValueError(f"Rollout {rid} not found")
        return await self._call_op(  # type: ignore[no-any-return]
            "get_many_span_sequence_ids", lambda run_id, now: ReserveSequenceIds(run_id, pairs), write=True
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
        given = (trace_id_contains, span_id_contains, parent_id_contains, name_contains)
        contains = dict(zip(exact, given, strict=True))
        for label, value in [*exact.items(), *((k + "_contains", v) for k, v in contains.items())]:
            if value is not None and not isinstance(value, str):
                raise TypeError(f"{label} must be a str or None, got a value of type {type(value).__name__}")

        def read(run_id: int, now: float) -> ReadSpans:
            return ReadSpans(
                run_id, rollout_id, attempt_id, exact, contains, filter_logic, limit, offset, sort_by, sort_order
            )

        return await self._call_op("query_spans", read, write=False, sweeps=True)  # type: ignore[no-any-return]

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
        if not is_storable_text(resources_id):
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
                where.append(RS.c.resources_id == resources_id if is_storable_text(resources_id) else f.false())
            if resources_id_contains is not None:
                where.append(
                    d.contains(ctx, RS.c.resources_id, resources_id_contains)
                    if is_storable_text(resources_id_contains)
                    else f.false()
                )
            order = f.order_by(f.RESOURCES_SORT, sort_by, sort_order)
            return f.paginate(ctx, RS, where, order, limit, offset, resources_from_row)

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
        if not is_storable_text(worker_id):
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
            return worker_units.query_workers(
                ctx, run_id, status_list, worker_id_contains, filter_logic, sort_by, sort_order, limit, offset
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
        if not is_storable_text(name):
            return None
        worker, _ = await self._prepare(needs_run=False)
        return await self._submit(worker, lambda ctx: run_units.get_run(ctx, name), write=False)

    async def mark_run_finished(self) -> Run:
        self._check_writable("mark_run_finished")
        return await self._call(
            "mark_run_finished", lambda ctx, run_id, now: run_units.mark_finished(ctx, run_id, now), write=True
        )

    async def update_run_metadata(self, metadata: dict[str, Any] | None) -> Run:
        """Replace the bound run's metadata (the constructor's ``run_metadata`` only sets it at creation)."""
        self._check_writable("update_run_metadata")
        payload = encoded(metadata, "run_metadata")
        return await self._call(
            "update_run_metadata", lambda ctx, run_id, now: run_units.set_metadata(ctx, run_id, payload), write=True
        )

    async def delete_run(self, name: str) -> bool:
        """Delete a run and everything in it, in short batches; False for an unknown name."""
        self._check_writable("delete_run")
        if not is_storable_text(name):
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
