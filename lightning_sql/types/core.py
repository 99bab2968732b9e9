"""Core data models of the store, mirroring Agent-Lightning v0.3 `agentlightning.types`.

Their fields and rules are specified in docs/store-contract.md §1.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Callable, Iterator, Sequence
from typing import Any, Generic, Literal, TypedDict, TypeVar, cast, overload

from pydantic import BaseModel, Field, model_validator

from .jsonvalue import MAX_INT64

__all__ = [
    "RolloutStatus",
    "AttemptStatus",
    "RolloutMode",
    "WorkerStatus",
    "RunStatus",
    "TaskInput",
    "QUEUED_STATUSES",
    "IN_FLIGHT_STATUSES",
    "FINISHED_STATUSES",
    "generate_id",
    "new_rollout_id",
    "new_attempt_id",
    "new_resources_id",
    "RolloutConfig",
    "Rollout",
    "Attempt",
    "AttemptedRollout",
    "EnqueueRolloutRequest",
    "Worker",
    "Run",
    "Triplet",
    "PaginatedResult",
    "UNSET",
    "Unset",
    "LightningStoreCapabilities",
    "LightningStoreStatistics",
    "rollout_status_from_attempt",
]

RolloutStatus = Literal["queuing", "preparing", "running", "failed", "succeeded", "cancelled", "requeuing"]
"""The status of a rollout."""

AttemptStatus = Literal["preparing", "running", "failed", "succeeded", "unresponsive", "timeout"]
"""The status of an attempt: a process state, so no queuing, cancelled or requeuing."""

RolloutMode = Literal["train", "val", "test"]
"""Possible rollout modes."""

WorkerStatus = Literal["idle", "busy", "unknown"]
"""The status of a worker."""

RunStatus = Literal["active", "finished"]
"""The status of a run (lightning_sql)."""

TaskInput = Any
"""Task input type: any JSON value in this store (§0.4)."""

QUEUED_STATUSES: tuple[RolloutStatus, ...] = ("queuing", "requeuing")
IN_FLIGHT_STATUSES: tuple[RolloutStatus, ...] = ("preparing", "running")
FINISHED_STATUSES: tuple[RolloutStatus, ...] = ("failed", "succeeded", "cancelled")

_RETRYABLE_ATTEMPT_STATUSES: tuple[AttemptStatus, ...] = ("failed", "timeout", "unresponsive")


def generate_id(length: int) -> str:
    """Return `length` random lowercase hex characters (SHA-1 over the bytes of a UUID4, as upstream).

    The UUID4's 16 bytes are built as ``uuid.uuid4()`` builds them (16 random bytes from
    ``os.urandom``, then the version and variant bits) without the ``UUID`` object (half the cost;
    ids are made on every claim and enqueue)."""
    raw = bytearray(_urandom(16))
    raw[6] = (raw[6] & 0x0F) | 0x40  # version 4
    raw[8] = (raw[8] & 0x3F) | 0x80  # RFC 4122 variant
    return _sha1(raw).hexdigest()[:length]


_urandom = os.urandom
_sha1 = hashlib.sha1


def new_rollout_id() -> str:
    """Return a fresh rollout id: `"ro-"` + 12 hex characters."""
    return "ro-" + generate_id(12)


def new_attempt_id() -> str:
    """Return a fresh attempt id: `"at-"` + 8 hex characters."""
    return "at-" + generate_id(8)


def new_resources_id() -> str:
    """Return a fresh resources snapshot id: `"rs-"` + 12 hex characters."""
    return "rs-" + generate_id(12)


class RolloutConfig(BaseModel):
    """Configuration controlling rollout retries and timeouts."""

    timeout_seconds: float | None = Field(default=None, allow_inf_nan=False)
    """The timeout for the rollout, in seconds. None indicates no timeout."""
    unresponsive_seconds: float | None = Field(default=None, allow_inf_nan=False)
    """The heartbeat limit for the rollout, in seconds. None indicates no limit."""
    max_attempts: int = Field(default=1, ge=1, le=MAX_INT64)
    """The maximum number of attempts for the rollout, including the first attempt."""
    retry_condition: list[AttemptStatus] = Field(
        default_factory=cast(Callable[[], list[AttemptStatus]], list)
    )
    """The attempt statuses that allow a retry."""
    retry_backoff_seconds: float | None = Field(default=None, ge=0, le=1e9, allow_inf_nan=False)
    """(lightning_sql) The delay before the first retry, in seconds; None or 0: retry at once (docs/queue.md)."""
    retry_backoff_factor: float = Field(default=2.0, ge=1, le=100, allow_inf_nan=False)
    """(lightning_sql) Each further retry waits this many times longer than the one before."""
    retry_backoff_max_seconds: float | None = Field(default=None, ge=0, le=1e9, allow_inf_nan=False)
    """(lightning_sql) The longest delay, in seconds; None: no cap."""


class Rollout(BaseModel):
    """A unit of work: one task input to be run by an agent, possibly over several attempts."""

    rollout_id: str
    """Unique identifier for the rollout."""
    input: TaskInput
    """Task input used to generate the rollout."""
    start_time: float
    """Timestamp when the rollout started (was created)."""
    end_time: float | None = None
    """Timestamp when the rollout ended."""
    mode: RolloutMode | None = None
    """Execution mode such as `"train"`, `"val"` or `"test"`."""
    resources_id: str | None = None
    """Identifier of the resources required to execute the rollout."""
    status: RolloutStatus = "queuing"
    """Latest status of the rollout."""
    config: RolloutConfig = Field(default_factory=RolloutConfig)
    """Retry and timeout configuration associated with the rollout."""
    metadata: dict[str, Any] | None = None
    """Additional metadata attached to the rollout."""
    resources_version: int | None = None
    """(lightning_sql) Version of `resources_id` resolved when the rollout was created; set by the store."""
    idempotency_key: str | None = None
    """(lightning_sql) Caller key that made the enqueue idempotent; set by `enqueue_*`."""
    priority: int = Field(default=0, ge=-(2**31), lt=2**31, strict=True)
    """(lightning_sql) Higher is claimed first, FIFO within one priority (docs/queue.md)."""
    not_before: float | None = None
    """(lightning_sql) Set by a requeue with back-off: the rollout is not claimed before this time."""


class Attempt(BaseModel):
    """One execution attempt of a rollout."""

    rollout_id: str
    """The rollout which this attempt belongs to."""
    attempt_id: str
    """The universal id of this attempt."""
    sequence_id: int
    """The sequence number of the attempt within its rollout, starting from 1."""
    start_time: float
    """The time when the attempt started."""
    end_time: float | None = None
    """The time when the attempt ended."""
    status: AttemptStatus = "preparing"
    """The status of the attempt."""
    worker_id: str | None = None
    """The worker executing this attempt (`""` is a legal, distinct value)."""
    last_heartbeat_time: float | None = None
    """The last time the worker reported progress (a span or a heartbeat)."""
    metadata: dict[str, Any] | None = None
    """A bucket for any other relevant information."""


class AttemptedRollout(Rollout):
    """Rollout paired with its currently active attempt."""

    attempt: Attempt
    """The attempt that is currently processing the rollout."""

    @model_validator(mode="after")
    def check_consistency(self) -> AttemptedRollout:
        if self.attempt.rollout_id != self.rollout_id:
            raise ValueError("Inconsistent rollout_id between Rollout and Attempt")
        return self


class EnqueueRolloutRequest(BaseModel):
    """Payload describing a rollout to be queued by `enqueue_rollouts`."""

    input: TaskInput
    """Task input used to generate the rollout."""
    mode: RolloutMode | None = None
    """Execution mode such as `"train"`, `"val"` or `"test"`."""
    resources_id: str | None = None
    """Identifier of the resources required to execute the rollout."""
    config: RolloutConfig | None = None
    """Retry and timeout configuration associated with the rollout."""
    metadata: dict[str, Any] | None = None
    """Additional metadata attached to the rollout."""
    idempotency_key: str | None = None
    """(lightning_sql) Enqueueing the same key twice in a run returns the existing rollout."""
    priority: int = Field(default=0, ge=-(2**31), lt=2**31, strict=True)
    """(lightning_sql) Higher is claimed first, FIFO within one priority (docs/queue.md)."""


class Worker(BaseModel):
    """A runner worker as seen by the store."""

    worker_id: str
    """The id of the worker."""
    status: WorkerStatus = "unknown"
    """The status of the worker."""
    heartbeat_stats: dict[str, Any] | None = None
    """Statistics reported with the worker's heartbeat."""
    last_heartbeat_time: float | None = None
    """The last time the worker reported its stats (set only by `update_worker`)."""
    last_dequeue_time: float | None = None
    """The last time the worker tried to dequeue a rollout."""
    last_busy_time: float | None = None
    """The last time the worker started an attempt and became busy."""
    last_idle_time: float | None = None
    """The last time the worker ended an attempt and became idle."""
    current_rollout_id: str | None = None
    """The rollout the worker is processing."""
    current_attempt_id: str | None = None
    """The attempt the worker is processing."""


class Run(BaseModel):
    """(lightning_sql) An experiment: every row of the store belongs to exactly one run."""

    name: str
    """The run's unique name."""
    status: RunStatus = "active"
    """`"active"` at creation; `"finished"` once finished."""
    created_at: float
    """Store-clock time the run was created."""
    finished_at: float | None = None
    """Store-clock time the run was finished."""
    metadata: dict[str, Any] | None = None
    """The run's metadata (the constructor's `run_metadata`)."""
    paused: bool = False
    """(lightning_sql) Set by `pause_run`: the run's claims take nothing until `resume_run` (docs/queue.md)."""


class Triplet(BaseModel):
    """Single interaction turn captured during reinforcement learning."""

    prompt: Any
    response: Any
    reward: float | None = None
    metadata: dict[str, Any] = Field(default_factory=dict)


T_item = TypeVar("T_item")


class PaginatedResult(BaseModel, Sequence[T_item], Generic[T_item]):
    """A page of query results: a sequence of `items` plus the `limit`/`offset` asked for and the `total` matches."""

    items: Sequence[T_item]
    """Items in the result."""
    limit: int
    """Limit of the request (-1 = no limit)."""
    offset: int
    """Offset of the request."""
    total: int
    """Number of matches before pagination."""

    def __len__(self) -> int:
        return len(self.items)

    @overload
    def __getitem__(self, index: int) -> T_item: ...

    @overload
    def __getitem__(self, index: slice) -> Sequence[T_item]: ...

    def __getitem__(self, index: int | slice) -> T_item | Sequence[T_item]:
        if isinstance(index, slice):
            return list(self.items[index])
        return self.items[index]

    # Iterating yields the items (not pydantic's (field, value) pairs), so list(result) works as expected.
    def __iter__(self) -> Iterator[T_item]:  # type: ignore[override]
        return iter(self.items)

    def __repr__(self) -> str:
        first_item_repr = repr(self.items[0]) if self.items else "empty"
        items_repr = f"[{first_item_repr}, ...]" if len(self.items) > 1 else first_item_repr
        slice_repr = f"{self.offset}:" if self.limit == -1 else f"{self.offset}:{self.offset + self.limit}"
        return f"<PaginatedResult ({slice_repr} of {self.total}) {items_repr}>"


class _UnsetType:
    """Type of the `UNSET` sentinel, which tells "argument not given" from an explicit None."""

    __slots__ = ()

    def __repr__(self) -> str:
        return "UNSET"

    def __reduce__(self) -> tuple[Callable[[], _UnsetType], tuple[()]]:
        return (_get_unset, ())


def _get_unset() -> _UnsetType:
    return UNSET


UNSET = _UnsetType()
Unset = _UnsetType


class LightningStoreCapabilities(TypedDict, total=False):
    """Capabilities of a store implementation; every key is optional and false by default."""

    thread_safe: bool
    """Whether the store is thread-safe."""
    async_safe: bool
    """Whether the store is async-safe."""
    zero_copy: bool
    """Whether the store has only one copy across all threads/processes."""
    otlp_traces: bool
    """Whether the store serves an OTLP/HTTP traces endpoint."""


class LightningStoreStatistics(TypedDict, total=False):
    """Statistics of a store implementation (counts are scoped to the bound run)."""

    name: str
    """Name of the store implementation (its class name)."""
    total_rollouts: int
    total_attempts: int
    total_spans: int
    total_resources: int
    """Number of resources ids (not history versions)."""
    total_workers: int
    uptime: float
    """`time.monotonic()` seconds since this instance was constructed."""
    queue_depth: int
    """(lightning_sql) Number of rollouts waiting in the queue."""


def rollout_status_from_attempt(
    attempt_status: str, sequence_id: int, config: RolloutConfig
) -> RolloutStatus:
    """Return the rollout status implied by the status of its latest attempt (§2.7).

    preparing, running and succeeded map one to one; failed, timeout and unresponsive give `"requeuing"` when
    the status is in `config.retry_condition` and `sequence_id < config.max_attempts`, else `"failed"`.

    Raises:
        ValueError: `attempt_status` is not an attempt status.
    """
    if attempt_status == "preparing" or attempt_status == "running" or attempt_status == "succeeded":
        return cast(RolloutStatus, attempt_status)
    if attempt_status in _RETRYABLE_ATTEMPT_STATUSES:
        if attempt_status in config.retry_condition and sequence_id < config.max_attempts:
            return "requeuing"
        return "failed"
    raise ValueError(f"Invalid attempt status: {attempt_status}")
