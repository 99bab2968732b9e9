"""Tracers: OpenTelemetry spans of an agent routed into the store, per attempt (docs/store-contract.md §3.3).

OpenTelemetry allows one global ``TracerProvider`` per process.  ``OtelTracer`` reuses the one that
is set (installing an SDK provider only when none is), and adds ONE span processor to it per process,
however many tracers, runners, trainers or tests exist.  ``trace_context`` sets a context variable
naming the attempt; the processor routes each span to the attempt active where the span *started*,
and ignores spans started outside any attempt, so concurrent agents never mix spans.

The agent never waits on the database: an ended span is converted and queued in memory; a writer
thread with its own event loop flushes each attempt's queue every ``FLUSH_INTERVAL_S`` and whenever
it reaches ``FLUSH_BATCH_SIZE``, allocating sequence ids in end order
(``get_many_span_sequence_ids``) and writing the batch with one ``add_many_spans``.  Leaving
``trace_context`` flushes the attempt and waits (bounded), so its spans are stored before the
runner reports the attempt's status.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextvars
import logging
import os
import threading
import time
from collections.abc import AsyncIterator, Iterator, Mapping
from contextlib import asynccontextmanager, contextmanager
from typing import TYPE_CHECKING, Any

from opentelemetry import trace as trace_api
from opentelemetry.context import Context
from opentelemetry.sdk.trace import ReadableSpan, SpanProcessor, TracerProvider
from opentelemetry.trace import Status, StatusCode

from lightning_sql.runtime.base import ParallelWorkerBase
from lightning_sql.types import AGL_ANNOTATION, Span, reward_name_key, reward_value_key

if TYPE_CHECKING:
    from lightning_sql.store.base import LightningStore

__all__ = [
    "Tracer",
    "OtelTracer",
    "NoopTracer",
    "get_active_tracer",
    "emit_reward",
    "emit_message",
    "emit_object",
    "AGL_MESSAGE",
    "AGL_OBJECT",
    "FLUSH_INTERVAL_S",
    "FLUSH_BATCH_SIZE",
    "EXIT_FLUSH_TIMEOUT_S",
]

logger = logging.getLogger(__name__)

FLUSH_INTERVAL_S = 1.0  # spans reach the store within ~1 s; each flush is also the attempt's heartbeat
FLUSH_BATCH_SIZE = 256  # flush early past this many queued spans: bounds memory and one transaction's size
EXIT_FLUSH_TIMEOUT_S = 30.0  # leaving trace_context waits this long for its spans, then the runner reports anyway
SHUTDOWN_FLUSH_TIMEOUT_S = 5.0  # at interpreter exit the provider's shutdown waits at most this long for spans
WRITE_RETRIES = 5  # transient store errors are retried inside the store too; this covers StoreUnavailableError
WRITE_RETRY_BACKOFF_S = 0.2  # doubled per retry: 0.2, 0.4, 0.8, 1.6 s

AGL_MESSAGE = "agentlightning.message"
"""Span name of free-text messages emitted by an agent (`emit_message`)."""
AGL_OBJECT = "agentlightning.object"
"""Span name of JSON objects emitted by an agent (`emit_object`)."""

_ACTIVE_TRACER: contextvars.ContextVar[Tracer | None] = contextvars.ContextVar("lightning_sql_tracer", default=None)
_ACTIVE_SINK: contextvars.ContextVar[_AttemptSink | None] = contextvars.ContextVar(
    "lightning_sql_attempt_sink", default=None
)


def get_active_tracer() -> Tracer | None:
    """Return the tracer whose ``trace_context`` is active in the current context, if any."""
    return _ACTIVE_TRACER.get()


class Tracer(ParallelWorkerBase):
    """Collects the spans of one rollout attempt at a time (an async context per attempt)."""

    def __init__(self) -> None:
        self._store: LightningStore | None = None
        self._last_trace: list[Span] = []

    def init_worker(self, worker_id: int | str, store: LightningStore | None = None, *args: Any, **kwargs: Any) -> None:
        """Remember the worker id and the store the spans go to."""
        super().init_worker(worker_id)
        self._store = store

    def teardown_worker(self, worker_id: int | str, *args: Any, **kwargs: Any) -> None:
        self._store = None

    @asynccontextmanager
    async def trace_context(
        self,
        name: str | None = None,
        *,
        store: LightningStore | None = None,
        rollout_id: str | None = None,
        attempt_id: str | None = None,
    ) -> AsyncIterator[Any]:
        """Trace the code inside the context as one attempt's trace (this base class records nothing)."""
        token = _ACTIVE_TRACER.set(self)
        try:
            self._last_trace = []
            yield self
        finally:
            _ACTIVE_TRACER.reset(token)

    def get_last_trace(self) -> list[Span]:
        """Return the spans recorded by the last ``trace_context``, in sequence order."""
        return list(self._last_trace)

    def create_span(
        self,
        name: str,
        attributes: Mapping[str, Any] | None = None,
        *,
        start_time: float | None = None,
        end_time: float | None = None,
        status: StatusCode = StatusCode.OK,
    ) -> Span | ReadableSpan:
        """Record a finished span (this base class only builds it: nothing is stored)."""
        now = time.time()
        return Span.from_attributes(
            attributes=dict(attributes or {}), name=name, start_time=start_time or now, end_time=end_time or now
        )

    @contextmanager
    def operation_context(self, name: str, attributes: Mapping[str, Any] | None = None) -> Iterator[Any]:
        """Trace the code inside the context as one span (this base class records nothing)."""
        yield None


class NoopTracer(Tracer):
    """A tracer that records nothing: for agents that return their own spans or rewards."""


# --- the process-wide span processor and writer ----------------------------------------------------------


class _AttemptSink:
    """The spans of one attempt: queued for the writer, and all of them for ``get_last_trace``."""

    def __init__(self, store: LightningStore | None, rollout_id: str, attempt_id: str) -> None:
        self.store = store
        self.rollout_id = rollout_id
        self.attempt_id = attempt_id
        self.lock = threading.Lock()
        self.pending: list[Span] = []
        self.spans: list[Span] = []
        self.failed: list[Span] = []
        self.closed = False
        self.task: asyncio.Task[None] | None = None  # the writer's flush in progress (writer loop only)
        self.write_lock: asyncio.Lock | None = None  # serialises flushes of this attempt (writer loop only)
        self._local_seq = 0

    def add(self, readable: ReadableSpan) -> bool:
        """Queue an ended span; True when the queue has reached the batch size."""
        span = Span.from_opentelemetry(readable, self.rollout_id, self.attempt_id, 0)
        with self.lock:
            if self.store is None:  # standalone tracing: sequence ids are local, nothing is written
                self._local_seq += 1
                span.sequence_id = self._local_seq
            else:
                self.pending.append(span)
            self.spans.append(span)
            return len(self.pending) >= FLUSH_BATCH_SIZE

    def take(self, limit: int) -> list[Span]:
        with self.lock:
            batch, self.pending = self.pending[:limit], self.pending[limit:]
            return batch

    def has_pending(self) -> bool:
        with self.lock:
            return bool(self.pending)

    def snapshot(self) -> list[Span]:
        with self.lock:
            return sorted(self.spans, key=lambda s: (s.sequence_id == 0, s.sequence_id))


class _SpanWriter:
    """One thread and event loop per process that writes queued spans to their stores."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._pid: int | None = None
        self._sinks: set[_AttemptSink] = set()

    def _ensure_loop(self) -> asyncio.AbstractEventLoop:
        with self._lock:
            if self._loop is not None and self._pid == os.getpid():
                return self._loop
            # First use, or a forked child: the parent's thread does not exist here.
            loop = asyncio.new_event_loop()
            self._sinks = set()
            ready = threading.Event()

            def run() -> None:
                asyncio.set_event_loop(loop)
                loop.call_soon(ready.set)
                loop.create_task(self._periodic())
                loop.run_forever()

            threading.Thread(target=run, name="lightning-sql-span-writer", daemon=True).start()
            ready.wait()
            self._loop, self._pid = loop, os.getpid()
            return loop

    def register(self, sink: _AttemptSink) -> None:
        self._ensure_loop()
        with self._lock:
            self._sinks.add(sink)

    def kick(self, sink: _AttemptSink) -> None:
        """Ask for a flush of `sink` soon (from any thread)."""
        self._ensure_loop().call_soon_threadsafe(self._schedule, sink)

    def flush(self, sink: _AttemptSink) -> concurrent.futures.Future[None]:
        """Flush everything queued for `sink`; the future completes when it is written (or given up)."""
        return asyncio.run_coroutine_threadsafe(self._flush(sink), self._ensure_loop())

    def forget(self, sink: _AttemptSink) -> None:
        with self._lock:
            self._sinks.discard(sink)

    def flush_all(self, timeout: float) -> bool:
        with self._lock:
            sinks = list(self._sinks)
        if not sinks or self._loop is None or self._pid != os.getpid():
            return True
        futures = [self.flush(sink) for sink in sinks]
        done, not_done = concurrent.futures.wait(futures, timeout=timeout)
        return not not_done

    async def _periodic(self) -> None:
        while True:
            await asyncio.sleep(FLUSH_INTERVAL_S)
            with self._lock:
                sinks = list(self._sinks)
            for sink in sinks:
                if sink.has_pending():
                    self._schedule(sink)
                elif sink.closed:
                    self.forget(sink)

    def _schedule(self, sink: _AttemptSink) -> None:
        if sink.task is None or sink.task.done():
            sink.task = asyncio.get_running_loop().create_task(self._flush(sink))

    async def _flush(self, sink: _AttemptSink) -> None:
        if sink.write_lock is None:
            sink.write_lock = asyncio.Lock()
        async with sink.write_lock:
            while True:
                batch = sink.take(FLUSH_BATCH_SIZE)
                if not batch:
                    return
                await self._write(sink, batch)

    async def _write(self, sink: _AttemptSink, batch: list[Span]) -> None:
        store = sink.store
        assert store is not None
        for attempt in range(WRITE_RETRIES):
            try:
                missing = [span for span in batch if span.sequence_id == 0]
                if missing:
                    ids = await store.get_many_span_sequence_ids([(sink.rollout_id, sink.attempt_id)] * len(missing))
                    for span, seq in zip(missing, ids, strict=True):
                        span.sequence_id = seq
                await store.add_many_spans(batch)
                return
            except (ValueError, TypeError) as exc:
                # Not transient: an unknown rollout/attempt, or a span the store refuses (§0.4).
                await self._write_one_by_one(sink, batch, exc)
                return
            except Exception as exc:  # noqa: BLE001 - a writer must survive any store failure
                logger.warning(
                    "Writing %d spans of rollout %s attempt %s failed (try %d/%d): %s",
                    len(batch), sink.rollout_id, sink.attempt_id, attempt + 1, WRITE_RETRIES, exc,
                )
                await asyncio.sleep(WRITE_RETRY_BACKOFF_S * 2**attempt)
        logger.error(
            "Giving up on %d spans of rollout %s attempt %s; they stay in get_last_trace()",
            len(batch), sink.rollout_id, sink.attempt_id,
        )
        sink.failed.extend(batch)

    async def _write_one_by_one(self, sink: _AttemptSink, batch: list[Span], cause: Exception) -> None:
        store = sink.store
        assert store is not None
        for span in batch:
            if span.sequence_id == 0:
                logger.error("Spans of rollout %s attempt %s not stored: %s", sink.rollout_id, sink.attempt_id, cause)
                sink.failed.append(span)
                continue
            try:
                await store.add_span(span)
            except Exception as exc:  # noqa: BLE001
                logger.error("Span %s (%s) of rollout %s not stored: %s", span.span_id, span.name, sink.rollout_id, exc)
                sink.failed.append(span)


class _LightningSpanProcessor(SpanProcessor):
    """Routes each sampled span to the attempt that was active where it started."""

    def __init__(self, writer: _SpanWriter) -> None:
        self._writer = writer
        self._routes: dict[tuple[int, int], _AttemptSink] = {}
        self._lock = threading.Lock()

    def on_start(self, span: Any, parent_context: Context | None = None) -> None:
        sink = _ACTIVE_SINK.get()
        if sink is None:
            return
        ctx = span.get_span_context()
        with self._lock:
            self._routes[(ctx.trace_id, ctx.span_id)] = sink

    def on_end(self, span: ReadableSpan) -> None:
        ctx = span.get_span_context()
        if ctx is None:
            return
        with self._lock:
            sink = self._routes.pop((ctx.trace_id, ctx.span_id), None)
        if sink is None or not ctx.trace_flags.sampled:
            return
        try:
            full = sink.add(span)
        except Exception:  # noqa: BLE001 - never break the agent's code path
            logger.exception("Could not convert span %s of rollout %s", span.name, sink.rollout_id)
            return
        if full:
            self._writer.kick(sink)

    def shutdown(self) -> None:
        self._writer.flush_all(SHUTDOWN_FLUSH_TIMEOUT_S)

    def force_flush(self, timeout_millis: int = 30000) -> bool:
        return self._writer.flush_all(timeout_millis / 1000)


_WRITER = _SpanWriter()
_PROCESSOR: _LightningSpanProcessor | None = None
_INSTALL_LOCK = threading.Lock()


def _install_processor() -> trace_api.TracerProvider:
    """Return the global provider, with lightning_sql's processor added to it (once per process)."""
    global _PROCESSOR
    with _INSTALL_LOCK:
        provider = trace_api.get_tracer_provider()
        if _PROCESSOR is not None:
            return provider
        if isinstance(provider, trace_api.ProxyTracerProvider):
            # No provider set yet: install an SDK one (set_tracer_provider refuses to replace one).
            trace_api.set_tracer_provider(TracerProvider())
            provider = trace_api.get_tracer_provider()
        add = getattr(provider, "add_span_processor", None)
        if add is None:
            raise TypeError(
                f"The global OpenTelemetry TracerProvider is a {type(provider).__module__}."
                f"{type(provider).__qualname__}, which cannot take span processors; OtelTracer needs an "
                "opentelemetry.sdk.trace.TracerProvider (or none set, and it installs one)"
            )
        _PROCESSOR = _LightningSpanProcessor(_WRITER)
        add(_PROCESSOR)
        return provider


class OtelTracer(Tracer):
    """Stores the OpenTelemetry spans that an agent (or its instrumented libraries) produce.

    Any span started inside ``trace_context`` (in the same task, or in threads and tasks that copy
    its context) belongs to that attempt.
    """

    def __init__(self, instrumentation_name: str = "lightning_sql") -> None:
        super().__init__()
        self.instrumentation_name = instrumentation_name
        self._otel_tracer: trace_api.Tracer | None = None

    def init(self, *args: Any, **kwargs: Any) -> None:
        self._otel()

    def _otel(self) -> trace_api.Tracer:
        if self._otel_tracer is None:
            self._otel_tracer = _install_processor().get_tracer(self.instrumentation_name)
        return self._otel_tracer

    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        state["_otel_tracer"] = None
        state["_store"] = None
        return state

    @asynccontextmanager
    async def trace_context(
        self,
        name: str | None = None,
        *,
        store: LightningStore | None = None,
        rollout_id: str | None = None,
        attempt_id: str | None = None,
    ) -> AsyncIterator[Any]:
        self._otel()
        store = store if store is not None else self._store
        if store is not None and (rollout_id is None or attempt_id is None):
            raise ValueError("trace_context with a store needs rollout_id and attempt_id")
        sink = _AttemptSink(store, rollout_id or "", attempt_id or "")
        if store is not None:
            _WRITER.register(sink)
        tracer_token = _ACTIVE_TRACER.set(self)
        sink_token = _ACTIVE_SINK.set(sink)
        try:
            yield self
        finally:
            _ACTIVE_SINK.reset(sink_token)
            _ACTIVE_TRACER.reset(tracer_token)
            sink.closed = True
            if store is not None:
                await self._flush_on_exit(sink)
            self._last_trace = sink.snapshot()

    async def _flush_on_exit(self, sink: _AttemptSink) -> None:
        future = _WRITER.flush(sink)
        try:
            await asyncio.wait_for(asyncio.shield(asyncio.wrap_future(future)), EXIT_FLUSH_TIMEOUT_S)
        except TimeoutError:
            logger.error(
                "Spans of rollout %s attempt %s not written within %.0f s; reporting anyway",
                sink.rollout_id, sink.attempt_id, EXIT_FLUSH_TIMEOUT_S,
            )

    def create_span(
        self,
        name: str,
        attributes: Mapping[str, Any] | None = None,
        *,
        start_time: float | None = None,
        end_time: float | None = None,
        status: StatusCode = StatusCode.OK,
    ) -> Span | ReadableSpan:
        """Record a finished span as a child of the current OpenTelemetry span; returns the SDK span."""
        start_ns = int(start_time * 1e9) if start_time is not None else None
        span = self._otel().start_span(name, attributes=dict(attributes or {}), start_time=start_ns)
        span.set_status(Status(status))
        span.end(end_time=int(end_time * 1e9) if end_time is not None else None)
        return span  # type: ignore[return-value]  # an SDK span is a ReadableSpan

    @contextmanager
    def operation_context(self, name: str, attributes: Mapping[str, Any] | None = None) -> Iterator[Any]:
        """Trace the code inside the context as one span (exceptions are recorded on it)."""
        with self._otel().start_as_current_span(name, attributes=dict(attributes or {})) as span:
            yield span


# --- emitters ----------------------------------------------------------------------------------------------


def _reward_attributes(reward: float | Mapping[str, float], primary_key: str | None) -> dict[str, Any]:
    if isinstance(reward, Mapping):
        items = list(reward.items())
        if primary_key is not None:
            if primary_key not in reward:
                raise ValueError(f"primary_key {primary_key!r} is not a key of the reward {dict(reward)!r}")
            items.sort(key=lambda kv: kv[0] != primary_key)
    else:
        items = [(primary_key or "primary", reward)]
    attributes: dict[str, Any] = {}
    for index, (name, value) in enumerate(items):
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise TypeError(f"reward {name!r} must be a number, got {value!r}")
        attributes[reward_name_key(index)] = str(name)
        attributes[reward_value_key(index)] = float(value)
    return attributes


def _emit(name: str, attributes: dict[str, Any], propagate: bool) -> Span | ReadableSpan:
    tracer = get_active_tracer()
    if propagate and tracer is not None:
        return tracer.create_span(name, attributes)
    if propagate:
        logger.warning("%s emitted outside any trace_context: it is not stored", name)
    now = time.time()
    return Span.from_attributes(attributes=attributes, name=name, start_time=now, end_time=now)


def emit_reward(
    reward: float | Mapping[str, float],
    *,
    primary_key: str | None = None,
    attributes: Mapping[str, Any] | None = None,
    propagate: bool = True,
) -> Span | ReadableSpan:
    """Record a reward as an ``agentlightning.annotation`` span.

    A number is dimension 0 (``agentlightning.reward.0.value``); a dict gives one dimension per key,
    ``primary_key`` first.  With ``propagate=True`` the span goes to the active tracer (and so to the
    store); with ``False`` it is only returned, as a ``Span`` without rollout ids.
    """
    attrs = _reward_attributes(reward, primary_key)
    attrs.update(attributes or {})
    return _emit(AGL_ANNOTATION, attrs, propagate)


def emit_message(message: str, *, attributes: Mapping[str, Any] | None = None, propagate: bool = True) -> Span | ReadableSpan:
    """Record a free-text message as an ``agentlightning.message`` span (attribute ``message.body``)."""
    attrs: dict[str, Any] = {"message.body": str(message), **(attributes or {})}
    return _emit(AGL_MESSAGE, attrs, propagate)


def emit_object(obj: Any, *, attributes: Mapping[str, Any] | None = None, propagate: bool = True) -> Span | ReadableSpan:
    """Record a JSON-serialisable object as an ``agentlightning.object`` span (``object.type``, ``object.json``)."""
    import json

    attrs: dict[str, Any] = {
        "object.type": type(obj).__name__,
        "object.json": json.dumps(obj, default=str, sort_keys=True),
        **(attributes or {}),
    }
    return _emit(AGL_OBJECT, attrs, propagate)
