"""``LightningStore``: the abstract async store contract (mirrors Agent-Lightning v0.3).

The behaviour of every method is specified in ``docs/store-contract.md``; ``SqlLightningStore`` is
the implementation.  Runtime components (runners, algorithms, tracers) depend only on this class.
"""

from __future__ import annotations

import asyncio
import time
from abc import ABC, abstractmethod
from collections.abc import Sequence
from typing import Any, Literal, Protocol, runtime_checkable

from opentelemetry.sdk.trace import ReadableSpan

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
)

__all__ = ["LightningStore", "PersistentStore"]


@runtime_checkable
class PersistentStore(Protocol):
    """What the runtime uses of a store beyond ``LightningStore``: a named, persistent run, the
    store clock, leases and sweeps.  ``SqlLightningStore`` has all of it; with any other
    ``LightningStore`` (Agent-Lightning's in-memory one, say) the runtime does without (no run
    fingerprint, no periodic sweeps, no lease heartbeats, the local clock)."""

    read_only: bool
    scan_debounce_seconds: float
    connect_deadline_seconds: float
    default_rollout_config: RolloutConfig | None

    @property
    def unavailable_since(self) -> float | None: ...

    @property
    def run(self) -> str | None: ...

    @property
    def url(self) -> str: ...

    def now(self) -> float: ...

    async def sweep(self, all_runs: bool = False) -> int: ...

    async def wait_for_queue(self, timeout: float) -> bool: ...

    async def touch_attempt(self, rollout_id: str, attempt_id: str) -> Attempt: ...

    async def get_run(self, name: str) -> Run | None: ...

    async def update_run_metadata(self, metadata: dict[str, Any] | None) -> Run: ...

    async def mark_run_finished(self) -> Run: ...


class LightningStore(ABC):
    """The coordination store shared by an algorithm and its runners."""

    #: Config given to rollouts enqueued or started without one (lightning_sql, docs/store-contract.md §4).
    default_rollout_config: RolloutConfig | None = None

    @property
    def capabilities(self) -> LightningStoreCapabilities:
        return LightningStoreCapabilities()

    async def statistics(self) -> LightningStoreStatistics:
        return LightningStoreStatistics(name=self.__class__.__name__)

    def otlp_traces_endpoint(self) -> str:
        raise NotImplementedError(f"{self.__class__.__name__} does not expose an OTLP endpoint")

    # --- rollouts and the queue ---------------------------------------------------------------

    @abstractmethod
    async def start_rollout(
        self,
        input: TaskInput,
        mode: RolloutMode | None = None,
        resources_id: str | None = None,
        config: RolloutConfig | None = None,
        metadata: dict[str, Any] | None = None,
        worker_id: str | None = None,
    ) -> AttemptedRollout: ...

    @abstractmethod
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
    ) -> Rollout: ...

    @abstractmethod
    async def enqueue_many_rollouts(self, requests: Sequence[EnqueueRolloutRequest]) -> Sequence[Rollout]: ...

    @abstractmethod
    async def dequeue_rollout(self, worker_id: str | None = None) -> AttemptedRollout | None: ...

    @abstractmethod
    async def dequeue_many_rollouts(
        self, *, limit: int = 1, worker_id: str | None = None
    ) -> Sequence[AttemptedRollout]: ...

    @abstractmethod
    async def start_attempt(self, rollout_id: str, worker_id: str | None = None) -> AttemptedRollout: ...

    @abstractmethod
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
    ) -> PaginatedResult[Rollout | AttemptedRollout]: ...

    @abstractmethod
    async def get_rollout_by_id(self, rollout_id: str) -> Rollout | AttemptedRollout | None: ...

    @abstractmethod
    async def query_attempts(
        self,
        rollout_id: str,
        *,
        sort_by: str | None = "sequence_id",
        sort_order: Literal["asc", "desc"] = "asc",
        limit: int = -1,
        offset: int = 0,
    ) -> PaginatedResult[Attempt]: ...

    @abstractmethod
    async def get_latest_attempt(self, rollout_id: str) -> Attempt | None: ...

    @abstractmethod
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
    ) -> Rollout: ...

    @abstractmethod
    async def update_attempt(
        self,
        rollout_id: str,
        attempt_id: str | Literal["latest"],
        status: AttemptStatus | Unset = UNSET,
        worker_id: str | Unset = UNSET,
        last_heartbeat_time: float | Unset = UNSET,
        metadata: dict[str, Any] | Unset = UNSET,
    ) -> Attempt: ...

    @abstractmethod
    async def wait_for_rollouts(
        self,
        *,
        rollout_ids: list[str],
        timeout: float | None = None,
        return_when: Literal["all", "first"] = "all",
    ) -> list[Rollout]: ...

    # --- spans ----------------------------------------------------------------------------------

    @abstractmethod
    async def add_span(self, span: Span) -> Span | None: ...

    @abstractmethod
    async def add_many_spans(self, spans: Sequence[Span]) -> Sequence[Span]: ...

    @abstractmethod
    async def add_otel_span(
        self,
        rollout_id: str,
        attempt_id: str,
        readable_span: ReadableSpan,
        sequence_id: int | None = None,
    ) -> Span | None: ...

    @abstractmethod
    async def get_next_span_sequence_id(self, rollout_id: str, attempt_id: str) -> int: ...

    @abstractmethod
    async def get_many_span_sequence_ids(self, rollout_attempt_ids: Sequence[tuple[str, str]]) -> Sequence[int]: ...

    @abstractmethod
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
    ) -> PaginatedResult[Span]: ...

    # --- resources ------------------------------------------------------------------------------

    @abstractmethod
    async def add_resources(self, resources: NamedResources) -> ResourcesUpdate: ...

    @abstractmethod
    async def update_resources(self, resources_id: str, resources: NamedResources) -> ResourcesUpdate: ...

    @abstractmethod
    async def get_resources_by_id(self, resources_id: str, version: int | None = None) -> ResourcesUpdate | None: ...

    @abstractmethod
    async def get_latest_resources(self) -> ResourcesUpdate | None: ...

    @abstractmethod
    async def query_resources(
        self,
        *,
        resources_id: str | None = None,
        resources_id_contains: str | None = None,
        sort_by: str | None = None,
        sort_order: Literal["asc", "desc"] = "asc",
        limit: int = -1,
        offset: int = 0,
    ) -> PaginatedResult[ResourcesUpdate]: ...

    # --- lightning_sql extensions (docs/store-contract.md §4), with conservative defaults ------------------------

    async def touch_attempt(self, rollout_id: str, attempt_id: str) -> Attempt:
        """Refresh an attempt's lease; stores with their own clock override this."""
        return await self.update_attempt(rollout_id, attempt_id, last_heartbeat_time=time.time())

    async def wait_for_queue(self, timeout: float) -> bool:
        """True as soon as the queue holds work; this default polls the queue depth."""
        deadline = time.monotonic() + max(timeout, 0.0)
        while True:
            queued = await self.query_rollouts(status_in=["queuing", "requeuing"], limit=0)
            if queued.total > 0:
                return True
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return False
            await asyncio.sleep(min(remaining, 0.5))

    async def sweep(self, all_runs: bool = False) -> int:
        """Expire leases now; stores without a shared sweeper have nothing to do."""
        return 0

    # --- workers --------------------------------------------------------------------------------

    @abstractmethod
    async def update_worker(
        self, worker_id: str, heartbeat_stats: dict[str, Any] | Unset = UNSET
    ) -> Worker: ...

    @abstractmethod
    async def get_worker_by_id(self, worker_id: str) -> Worker | None: ...

    @abstractmethod
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
    ) -> PaginatedResult[Worker]: ...
