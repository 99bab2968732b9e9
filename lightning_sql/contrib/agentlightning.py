"""Agent-Lightning 0.3 bridge: ``AgentLightningSqlStore``, an ``agentlightning`` store backed by SQL.

``agl.Trainer(store=AgentLightningSqlStore("sqlite:///run.db", run="exp1"))`` runs Agent-Lightning's own
trainer, runners, execution strategies and ``LightningStoreServer`` on a ``SqlLightningStore``
(docs/store-contract.md §3.9). Every method of upstream's ``LightningStore`` is implemented with
upstream's exact signature and delegates to the wrapped store, converting models both ways:

* arguments: ``agentlightning`` models (``RolloutConfig``, ``EnqueueRolloutRequest``, ``Span``, resources)
  become ``lightning_sql`` models and ``agentlightning``'s ``UNSET`` becomes ours; anything else
  (dicts, ``None``, bad values) is passed through unchanged so the store validates it and raises its
  documented errors;
* results: exactly ``agentlightning``'s classes (``AttemptedRollout`` vs ``Rollout``, ``Attempt``,
  ``Span``, ``ResourcesUpdate``, ``Worker``, ``PaginatedResult``, lists), without the fields only
  lightning_sql has (``Rollout.resources_version``, ``Rollout.idempotency_key``);
* exceptions: the store's, unchanged (it keeps upstream's types and messages, contract D9).

Importing this module imports ``agentlightning`` (the ``agentlightning`` extra). Agent-Lightning pulls in
LiteLLM, which fetches a model price list over the network at import unless
``LITELLM_LOCAL_MODEL_COST_MAP`` is set: unless LiteLLM is already imported or the variable is already
set, this module sets it to ``True`` so that importing a store never needs the network.
"""

from __future__ import annotations

import asyncio
import inspect
import os
import sys
import threading
from collections.abc import Awaitable, Coroutine, Mapping, Sequence
from typing import Any, Literal, TypeVar, cast

if "litellm" not in sys.modules:
    # Agent-Lightning imports LiteLLM, which otherwise downloads its model cost map at import time
    # (three network attempts with back-off when offline): a store import must not need the network.
    os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")

import agentlightning.types as agl_types  # noqa: E402
from agentlightning.store.base import UNSET as AGL_UNSET  # noqa: E402
from agentlightning.store.base import LightningStore as AglLightningStore  # noqa: E402
from agentlightning.store.base import LightningStoreCapabilities as AglCapabilities  # noqa: E402
from agentlightning.store.base import LightningStoreStatistics as AglStatistics  # noqa: E402
from agentlightning.store.base import Unset as AglUnset  # noqa: E402
from agentlightning.store.threading import LightningStoreThreaded  # noqa: E402
from opentelemetry.sdk.trace import ReadableSpan  # noqa: E402
from pydantic import BaseModel, TypeAdapter  # noqa: E402
from sqlalchemy import URL  # noqa: E402

from lightning_sql import types as lsql_types  # noqa: E402
from lightning_sql.store.sql.store import SqlLightningStore  # noqa: E402

__all__ = ["AgentLightningSqlStore", "to_agl", "from_agl"]

# Fields of lightning_sql models that agentlightning's models lack: dropped on the way out (§1.3).
_LSQL_ONLY_ROLLOUT_FIELDS = frozenset({"resources_version", "idempotency_key", "priority", "not_before"})

# Our model class -> agentlightning's class of the same name (same field names).
_TO_AGL: dict[type[BaseModel], type[BaseModel]] = {
    lsql_types.AttemptedRollout: agl_types.AttemptedRollout,
    lsql_types.Rollout: agl_types.Rollout,
    lsql_types.Attempt: agl_types.Attempt,
    lsql_types.Worker: agl_types.Worker,
    lsql_types.ResourcesUpdate: agl_types.ResourcesUpdate,
    lsql_types.Span: agl_types.Span,
    lsql_types.RolloutConfig: agl_types.RolloutConfig,
}
_FROM_AGL: dict[type[BaseModel], type[BaseModel]] = {
    agl_types.RolloutConfig: lsql_types.RolloutConfig,
    agl_types.EnqueueRolloutRequest: lsql_types.EnqueueRolloutRequest,
    agl_types.Span: lsql_types.Span,
    agl_types.AttemptedRollout: lsql_types.AttemptedRollout,
    agl_types.Rollout: lsql_types.Rollout,
    agl_types.Attempt: lsql_types.Attempt,
    agl_types.Worker: lsql_types.Worker,
    agl_types.ResourcesUpdate: lsql_types.ResourcesUpdate,
}
_LSQL_RESOURCE: TypeAdapter[Any] = TypeAdapter(lsql_types.ResourceUnion)

T = TypeVar("T")

# --- calls made under LightningStoreThreaded's lock ---------------------------------------------------
#
# Agent-Lightning's shared-memory strategy wraps the store in `LightningStoreThreaded`, which holds a
# `threading.Lock` across `await store.method(...)`. That is safe only for stores whose coroutines never
# suspend (the in-memory store): when the call suspends (ours waits for its I/O thread), another task on
# the same event loop that calls the wrapper blocks the loop's thread on the lock, and the lock holder,
# which needs that loop to resume, never does. Calls coming from the wrapper are therefore completed
# without suspending the caller's loop: they run on a helper event loop thread and the caller blocks on
# the result, exactly as long as the database call takes. Every other caller stays fully asynchronous.

_THREADED_CODES = frozenset(
    member.__code__ for member in vars(LightningStoreThreaded).values() if inspect.isfunction(member)
)


def _called_from_threaded_wrapper(depth: int) -> bool:
    frame = inspect.currentframe()
    for _ in range(depth + 1):
        frame = frame.f_back if frame is not None else None
    return frame is not None and frame.f_code in _THREADED_CODES


class _BlockingRunner:
    """One helper event loop thread per process that runs store coroutines for blocking callers."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._pid: int | None = None

    def _ensure_loop(self) -> asyncio.AbstractEventLoop:
        with self._lock:
            # A forked child inherits the loop object but not its thread: start a fresh one.
            if self._loop is None or self._pid != os.getpid():
                loop = asyncio.new_event_loop()
                thread = threading.Thread(
                    target=loop.run_forever, name="lightning-sql-agl-blocking", daemon=True
                )
                thread.start()
                self._loop, self._pid = loop, os.getpid()
            return self._loop

    def run(self, coro: Coroutine[Any, Any, T]) -> T:
        return asyncio.run_coroutine_threadsafe(coro, self._ensure_loop()).result()


_BLOCKING = _BlockingRunner()


async def _ready(value: T) -> T:
    return value


def _delegate(coro: Coroutine[Any, Any, T]) -> Awaitable[T]:
    """Return an awaitable of the store call ``coro``, completed at once for LightningStoreThreaded's calls.

    Must be called directly by a bridge method, so that the frame two levels up is the bridge's caller.
    """
    if _called_from_threaded_wrapper(2):
        return _ready(_BLOCKING.run(coro))
    return coro


def to_agl(obj: Any) -> Any:
    """Return ``obj`` as agentlightning's model of the same class name (``None``, lists and pages recursively).

    ``AttemptedRollout`` stays ``AttemptedRollout`` and ``Rollout`` stays ``Rollout`` (exact classes);
    lightning_sql-only rollout fields are dropped; a ``PaginatedResult`` becomes agentlightning's.
    """
    if obj is None:
        return None
    if isinstance(obj, lsql_types.PaginatedResult):
        return agl_types.PaginatedResult(
            items=[to_agl(item) for item in obj.items], limit=obj.limit, offset=obj.offset, total=obj.total
        )
    if isinstance(obj, list | tuple):
        return [to_agl(item) for item in obj]
    target = _TO_AGL.get(type(obj))
    if target is None:
        raise TypeError(f"No agentlightning counterpart for {type(obj).__qualname__}")
    if isinstance(obj, lsql_types.Rollout):
        return target.model_validate(obj.model_dump(exclude=set(_LSQL_ONLY_ROLLOUT_FIELDS)))
    return target.model_validate(obj.model_dump())


def from_agl(obj: Any) -> Any:
    """Return an agentlightning model as lightning_sql's model of the same name; anything else unchanged.

    Values that are not agentlightning models (dicts, ``None``, invalid values) pass through unchanged, so
    the store validates them and raises its own documented errors. agentlightning's ``UNSET`` becomes ours.
    """
    if isinstance(obj, AglUnset):
        return lsql_types.UNSET
    target = _FROM_AGL.get(type(obj))
    if target is not None:
        return target.model_validate(obj.model_dump())
    if isinstance(obj, agl_types.Resource):
        return _LSQL_RESOURCE.validate_python(obj.model_dump())
    return obj


def _resources_from_agl(resources: Any) -> Any:
    if isinstance(resources, Mapping):
        return {name: from_agl(resource) for name, resource in resources.items()}
    return resources


def _page(result: lsql_types.PaginatedResult[Any]) -> agl_types.PaginatedResult[Any]:
    return cast(agl_types.PaginatedResult[Any], to_agl(result))


class AgentLightningSqlStore(AglLightningStore):
    """An ``agentlightning.LightningStore`` whose every call is served by a ``SqlLightningStore``.

    Args:
        url_or_store: a database URL (``sqlite:///run.db``, ``postgresql://…``) to build a store from,
            or an existing ``SqlLightningStore`` to wrap (then no ``store_options`` may be given).
        **store_options: ``SqlLightningStore`` constructor options (``run=``, ``schema=``,
            ``default_rollout_config=`` — an agentlightning or lightning_sql ``RolloutConfig`` —, …).
            Unless given, ``clock=None`` and ``clock_sync=False``: every timestamp is the calling host's
            ``time.time()`` at call time, Agent-Lightning's convention (docs/store-contract.md §0.2).
    """

    def __init__(self, url_or_store: str | URL | SqlLightningStore, **store_options: Any) -> None:
        super().__init__()
        if isinstance(url_or_store, SqlLightningStore):
            if store_options:
                raise TypeError(
                    f"store options {sorted(store_options)} apply only when building a store from a URL, "
                    "not when wrapping an existing SqlLightningStore"
                )
            self._store = url_or_store
            return
        if not isinstance(url_or_store, str | URL):
            raise TypeError(
                f"url_or_store must be a database URL or a SqlLightningStore, got {type(url_or_store).__name__}"
            )
        store_options.setdefault("clock", None)
        store_options.setdefault("clock_sync", False)
        if "default_rollout_config" in store_options:
            store_options["default_rollout_config"] = from_agl(store_options["default_rollout_config"])
        self._store = SqlLightningStore(url_or_store, **store_options)

    def __repr__(self) -> str:
        return f"AgentLightningSqlStore({self._store!r})"

    # --- lightning_sql surface ------------------------------------------------------------------

    @property
    def sql_store(self) -> SqlLightningStore:
        """The wrapped store, for lightning_sql's extensions (runs, ``sweep``, ``touch_attempt``, ...)."""
        return self._store

    @property
    def run(self) -> str | None:
        """The name of the run the wrapped store is bound to."""
        return self._store.run

    @property
    def default_rollout_config(self) -> agl_types.RolloutConfig | None:
        """The config given to rollouts created without one (an agentlightning ``RolloutConfig``)."""
        config = self._store.default_rollout_config
        return None if config is None else cast(agl_types.RolloutConfig, to_agl(config))

    @default_rollout_config.setter
    def default_rollout_config(
        self, config: agl_types.RolloutConfig | lsql_types.RolloutConfig | None
    ) -> None:
        converted = from_agl(config)
        if converted is not None and not isinstance(converted, lsql_types.RolloutConfig):
            raise TypeError(f"default_rollout_config must be a RolloutConfig or None, got {config!r}")
        self._store.default_rollout_config = converted

    async def close(self) -> None:
        """Release the wrapped store's hold on its I/O thread (a later call reattaches)."""
        await self._store.close()

    async def __aenter__(self) -> AgentLightningSqlStore:
        return self

    async def __aexit__(self, *exc: Any) -> None:
        await self.close()

    # --- capabilities, statistics -----------------------------------------------------------------

    @property
    def capabilities(self) -> AglCapabilities:
        caps = self._store.capabilities
        return AglCapabilities(
            thread_safe=bool(caps.get("thread_safe", False)),
            async_safe=bool(caps.get("async_safe", False)),
            zero_copy=bool(caps.get("zero_copy", False)),
            otlp_traces=bool(caps.get("otlp_traces", False)),
        )

    async def statistics(self) -> AglStatistics:
        stats = dict(await _delegate(self._store.statistics()))
        stats["name"] = self.__class__.__name__
        return cast(AglStatistics, stats)

    def otlp_traces_endpoint(self) -> str:
        return self._store.otlp_traces_endpoint()

    # --- rollouts and the queue -------------------------------------------------------------------

    async def start_rollout(
        self,
        input: agl_types.TaskInput,
        mode: agl_types.RolloutMode | None = None,
        resources_id: str | None = None,
        config: agl_types.RolloutConfig | None = None,
        metadata: dict[str, Any] | None = None,
        worker_id: str | None = None,
    ) -> agl_types.AttemptedRollout:
        result = await _delegate(
            self._store.start_rollout(input, mode, resources_id, from_agl(config), metadata, worker_id)
        )
        return cast(agl_types.AttemptedRollout, to_agl(result))

    async def enqueue_rollout(
        self,
        input: agl_types.TaskInput,
        mode: Literal["train", "val", "test"] | None = None,
        resources_id: str | None = None,
        config: agl_types.RolloutConfig | None = None,
        metadata: dict[str, Any] | None = None,
    ) -> agl_types.Rollout:
        result = await _delegate(
            self._store.enqueue_rollout(input, mode, resources_id, from_agl(config), metadata)
        )
        return cast(agl_types.Rollout, to_agl(result))

    async def enqueue_many_rollouts(
        self, rollouts: Sequence[agl_types.EnqueueRolloutRequest]
    ) -> Sequence[agl_types.Rollout]:
        requests = [from_agl(request) for request in rollouts]
        return cast(
            list[agl_types.Rollout],
            to_agl(list(await _delegate(self._store.enqueue_many_rollouts(requests)))),
        )

    async def dequeue_rollout(self, worker_id: str | None = None) -> agl_types.AttemptedRollout | None:
        return cast(
            "agl_types.AttemptedRollout | None",
            to_agl(await _delegate(self._store.dequeue_rollout(worker_id))),
        )

    async def dequeue_many_rollouts(
        self, *, limit: int = 1, worker_id: str | None = None
    ) -> Sequence[agl_types.AttemptedRollout]:
        claimed = await _delegate(self._store.dequeue_many_rollouts(limit=limit, worker_id=worker_id))
        return cast(list[agl_types.AttemptedRollout], to_agl(list(claimed)))

    async def start_attempt(
        self, rollout_id: str, worker_id: str | None = None
    ) -> agl_types.AttemptedRollout:
        return cast(
            agl_types.AttemptedRollout,
            to_agl(await _delegate(self._store.start_attempt(rollout_id, worker_id))),
        )

    async def query_rollouts(
        self,
        *,
        status_in: Sequence[agl_types.RolloutStatus] | None = None,
        rollout_id_in: Sequence[str] | None = None,
        rollout_id_contains: str | None = None,
        filter_logic: Literal["and", "or"] = "and",
        sort_by: str | None = None,
        sort_order: Literal["asc", "desc"] = "asc",
        limit: int = -1,
        offset: int = 0,
        status: Sequence[agl_types.RolloutStatus] | None = None,
        rollout_ids: Sequence[str] | None = None,
    ) -> Sequence[agl_types.Rollout]:
        result = await _delegate(
            self._store.query_rollouts(
                status_in=status_in,
                rollout_id_in=rollout_id_in,
                rollout_id_contains=rollout_id_contains,
                filter_logic=filter_logic,
                sort_by=sort_by,
                sort_order=sort_order,
                limit=limit,
                offset=offset,
                status=status,
                rollout_ids=rollout_ids,
            )
        )
        return _page(result)

    async def query_attempts(
        self,
        rollout_id: str,
        *,
        sort_by: str | None = "sequence_id",
        sort_order: Literal["asc", "desc"] = "asc",
        limit: int = -1,
        offset: int = 0,
    ) -> Sequence[agl_types.Attempt]:
        result = await _delegate(
            self._store.query_attempts(
                rollout_id, sort_by=sort_by, sort_order=sort_order, limit=limit, offset=offset
            )
        )
        return _page(result)

    async def get_rollout_by_id(self, rollout_id: str) -> agl_types.Rollout | None:
        return cast(
            "agl_types.Rollout | None", to_agl(await _delegate(self._store.get_rollout_by_id(rollout_id)))
        )

    async def get_latest_attempt(self, rollout_id: str) -> agl_types.Attempt | None:
        return cast(
            "agl_types.Attempt | None", to_agl(await _delegate(self._store.get_latest_attempt(rollout_id)))
        )

    async def update_rollout(
        self,
        rollout_id: str,
        input: agl_types.TaskInput | AglUnset = AGL_UNSET,
        mode: Literal["train", "val", "test"] | None | AglUnset = AGL_UNSET,
        resources_id: str | None | AglUnset = AGL_UNSET,
        status: agl_types.RolloutStatus | AglUnset = AGL_UNSET,
        config: agl_types.RolloutConfig | AglUnset = AGL_UNSET,
        metadata: dict[str, Any] | None | AglUnset = AGL_UNSET,
    ) -> agl_types.Rollout:
        result = await _delegate(
            self._store.update_rollout(
                rollout_id,
                input=from_agl(input),
                mode=from_agl(mode),
                resources_id=from_agl(resources_id),
                status=from_agl(status),
                config=from_agl(config),
                metadata=from_agl(metadata),
            )
        )
        return cast(agl_types.Rollout, to_agl(result))

    async def update_attempt(
        self,
        rollout_id: str,
        attempt_id: str | Literal["latest"],
        status: agl_types.AttemptStatus | AglUnset = AGL_UNSET,
        worker_id: str | AglUnset = AGL_UNSET,
        last_heartbeat_time: float | AglUnset = AGL_UNSET,
        metadata: dict[str, Any] | None | AglUnset = AGL_UNSET,
    ) -> agl_types.Attempt:
        result = await _delegate(
            self._store.update_attempt(
                rollout_id,
                attempt_id,
                status=from_agl(status),
                worker_id=from_agl(worker_id),
                last_heartbeat_time=from_agl(last_heartbeat_time),
                metadata=from_agl(metadata),
            )
        )
        return cast(agl_types.Attempt, to_agl(result))

    async def wait_for_rollouts(
        self, *, rollout_ids: list[str], timeout: float | None = None
    ) -> list[agl_types.Rollout]:
        finished = await self._store.wait_for_rollouts(rollout_ids=rollout_ids, timeout=timeout)
        return cast(list[agl_types.Rollout], to_agl(list(finished)))

    # --- spans ------------------------------------------------------------------------------------

    async def add_span(self, span: agl_types.Span) -> agl_types.Span | None:
        stored = await _delegate(self._store.add_span(from_agl(span)))
        # The store returns the very object it was given (§2.9); hand back the caller's object likewise.
        return None if stored is None else span

    async def add_many_spans(self, spans: Sequence[agl_types.Span]) -> Sequence[agl_types.Span]:
        originals = list(spans)
        converted = [from_agl(span) for span in originals]
        original_of = {id(copy): original for copy, original in zip(converted, originals, strict=True)}
        inserted = await _delegate(self._store.add_many_spans(converted))
        return [original_of[id(span)] for span in inserted]

    async def add_otel_span(
        self,
        rollout_id: str,
        attempt_id: str,
        readable_span: ReadableSpan,
        sequence_id: int | None = None,
    ) -> agl_types.Span | None:
        stored = await _delegate(
            self._store.add_otel_span(rollout_id, attempt_id, readable_span, sequence_id)
        )
        return cast("agl_types.Span | None", to_agl(stored))

    async def get_next_span_sequence_id(self, rollout_id: str, attempt_id: str) -> int:
        return await _delegate(self._store.get_next_span_sequence_id(rollout_id, attempt_id))

    async def get_many_span_sequence_ids(
        self, rollout_attempt_ids: Sequence[tuple[str, str]]
    ) -> Sequence[int]:
        return list(await _delegate(self._store.get_many_span_sequence_ids(rollout_attempt_ids)))

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
    ) -> Sequence[agl_types.Span]:
        result = await _delegate(
            self._store.query_spans(
                rollout_id,
                attempt_id,
                trace_id=trace_id,
                trace_id_contains=trace_id_contains,
                span_id=span_id,
                span_id_contains=span_id_contains,
                parent_id=parent_id,
                parent_id_contains=parent_id_contains,
                name=name,
                name_contains=name_contains,
                filter_logic=filter_logic,
                limit=limit,
                offset=offset,
                sort_by=sort_by,
                sort_order=sort_order,
            )
        )
        return _page(result)

    # --- resources --------------------------------------------------------------------------------

    async def add_resources(self, resources: agl_types.NamedResources) -> agl_types.ResourcesUpdate:
        result = await _delegate(self._store.add_resources(_resources_from_agl(resources)))
        return cast(agl_types.ResourcesUpdate, to_agl(result))

    async def update_resources(
        self, resources_id: str, resources: agl_types.NamedResources
    ) -> agl_types.ResourcesUpdate:
        result = await _delegate(self._store.update_resources(resources_id, _resources_from_agl(resources)))
        return cast(agl_types.ResourcesUpdate, to_agl(result))

    async def get_resources_by_id(self, resources_id: str) -> agl_types.ResourcesUpdate | None:
        return cast(
            "agl_types.ResourcesUpdate | None",
            to_agl(await _delegate(self._store.get_resources_by_id(resources_id))),
        )

    async def get_latest_resources(self) -> agl_types.ResourcesUpdate | None:
        return cast(
            "agl_types.ResourcesUpdate | None", to_agl(await _delegate(self._store.get_latest_resources()))
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
    ) -> Sequence[agl_types.ResourcesUpdate]:
        result = await _delegate(
            self._store.query_resources(
                resources_id=resources_id,
                resources_id_contains=resources_id_contains,
                sort_by=sort_by,
                sort_order=sort_order,
                limit=limit,
                offset=offset,
            )
        )
        return _page(result)

    # --- workers ----------------------------------------------------------------------------------

    async def update_worker(
        self, worker_id: str, heartbeat_stats: dict[str, Any] | AglUnset = AGL_UNSET
    ) -> agl_types.Worker:
        result = await _delegate(self._store.update_worker(worker_id, from_agl(heartbeat_stats)))
        return cast(agl_types.Worker, to_agl(result))

    async def get_worker_by_id(self, worker_id: str) -> agl_types.Worker | None:
        return cast(
            "agl_types.Worker | None", to_agl(await _delegate(self._store.get_worker_by_id(worker_id)))
        )

    async def query_workers(
        self,
        *,
        status_in: Sequence[agl_types.WorkerStatus] | None = None,
        worker_id_contains: str | None = None,
        filter_logic: Literal["and", "or"] = "and",
        sort_by: str | None = None,
        sort_order: Literal["asc", "desc"] = "asc",
        limit: int = -1,
        offset: int = 0,
    ) -> Sequence[agl_types.Worker]:
        result = await _delegate(
            self._store.query_workers(
                status_in=status_in,
                worker_id_contains=worker_id_contains,
                filter_logic=filter_logic,
                sort_by=sort_by,
                sort_order=sort_order,
                limit=limit,
                offset=offset,
            )
        )
        return _page(result)
