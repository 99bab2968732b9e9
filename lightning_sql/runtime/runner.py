"""Runners: claim rollouts from the store, run the agent, report the outcome (docs/store-contract.md §3.1).

A ``LitAgentRunner`` is one async worker.  Its claim loop sleeps while the queue is empty but is
woken by the store (``wait_for_queue``) when work arrives; its heartbeat loop refreshes the worker
row and the lease of the attempt it is running (``touch_attempt``), and abandons an attempt whose
lease was lost (expired, superseded, or its rollout cancelled or finished).  Every runner process
also sweeps expired leases periodically, once per store instance.
"""

from __future__ import annotations

import asyncio
import logging
import random
import threading
import time
import traceback
from collections.abc import Awaitable, Callable, Sequence
from typing import TYPE_CHECKING, Any, Generic, Literal, Protocol, TypeVar

import psutil
from opentelemetry.sdk.trace import ReadableSpan

from lightning_sql.runtime.adapter import reward_of
from lightning_sql.runtime.agent import LitAgent
from lightning_sql.runtime.base import ParallelWorkerBase
from lightning_sql.runtime.hooks import Hook
from lightning_sql.runtime.recovery import process_identity
from lightning_sql.runtime.tracer import OtelTracer, Tracer, emit_reward
from lightning_sql.store import StoreUnavailableError
from lightning_sql.store.base import PersistentStore
from lightning_sql.types import (
    FINISHED_STATUSES,
    AttemptedRollout,
    NamedResources,
    Rollout,
    RolloutMode,
    Span,
    SpanCoreFields,
)

if TYPE_CHECKING:
    from lightning_sql.store.base import LightningStore

__all__ = [
    "Runner",
    "LitAgentRunner",
    "StopEvent",
    "system_snapshot",
    "clean_text",
    "error_metadata",
    "final_reward_of",
    "ERROR_TRACEBACK_LIMIT",
    "FINAL_REWARD_KEY",
]

logger = logging.getLogger(__name__)

T_task = TypeVar("T_task")
_R = TypeVar("_R")

FINAL_REWARD_KEY = "final_reward"  # attempt metadata: the attempt's last reward, written when it succeeds
ERROR_TRACEBACK_LIMIT = 16_000  # characters of traceback kept in metadata["error"] (the innermost frames)
STOP_CHECK_INTERVAL_S = 0.1  # how often an idle runner looks at the stop event
MIN_IDLE_WAIT_S = 0.01  # floor of poll_interval ± jitter
OUTAGE_RETRY_MAX_S = 5.0  # longest pause between tries while the database is unavailable
MIN_SWEEP_INTERVAL_S = 1.0  # runner processes sweep at most once a second per store instance
DEFAULT_SCAN_DEBOUNCE_S = 10.0  # sweep period for stores that do not say


class StopEvent(Protocol):
    """What a runner needs of a stop event (``threading.Event``, ``multiprocessing.Event``, ``ExecutionEvent``)."""

    def is_set(self) -> bool: ...


def _stopped(event: StopEvent | None) -> bool:
    return event is not None and event.is_set()


def system_snapshot(include_gpu: bool = False) -> dict[str, Any]:
    """A JSON dict of this process's identity and this host's CPU and memory figures (GPU ones with ``include_gpu``)."""
    memory = psutil.virtual_memory()
    process = psutil.Process()
    snapshot: dict[str, Any] = {
        **process_identity(),  # host, boot id, pid: lets a trainer on this machine see the process is gone
        "cpu_count": psutil.cpu_count() or 0,
        "cpu_percent": float(psutil.cpu_percent(interval=None)),
        "memory_total_bytes": int(memory.total),
        "memory_used_bytes": int(memory.used),
        "memory_percent": float(memory.percent),
        "process_rss_bytes": int(process.memory_info().rss),
    }
    if include_gpu:
        snapshot["gpus"] = _gpu_snapshot()
    return snapshot


def _gpu_snapshot() -> list[dict[str, Any]]:
    try:
        import pynvml  # type: ignore[import-not-found]
    except ImportError:
        return []
    try:
        pynvml.nvmlInit()
        gpus = []
        for index in range(pynvml.nvmlDeviceGetCount()):
            handle = pynvml.nvmlDeviceGetHandleByIndex(index)
            mem = pynvml.nvmlDeviceGetMemoryInfo(handle)
            util = pynvml.nvmlDeviceGetUtilizationRates(handle)
            gpus.append(
                {"index": index, "memory_used_bytes": int(mem.used), "memory_total_bytes": int(mem.total),
                 "utilization_percent": float(util.gpu)}
            )
        return gpus
    except Exception:  # noqa: BLE001 - a heartbeat must not fail for lack of a GPU driver
        return []


def final_reward_of(spans: Sequence[Any]) -> float | None:
    """The last reward among an attempt's spans (None: no reward span)."""
    values = [r for r in (reward_of(s) for s in spans if isinstance(s, Span)) if r is not None]
    return values[-1] if values else None


def clean_text(value: str) -> str:
    """A string the store accepts (§0.4): NUL and lone surrogates replaced."""
    return value.replace("\x00", "\\x00").encode("utf-8", "replace").decode("utf-8")


def error_metadata(exc: BaseException) -> dict[str, str]:
    """``metadata["error"]`` for an agent's exception: qualified type, message, truncated traceback."""
    cls = type(exc)
    qualified = cls.__qualname__ if cls.__module__ == "builtins" else f"{cls.__module__}.{cls.__qualname__}"
    tb = "".join(traceback.format_exception(cls, exc, exc.__traceback__))
    if len(tb) > ERROR_TRACEBACK_LIMIT:
        # Keep the innermost frames and the start of the exception's own text: a huge message must
        # not push the frames that say where it failed out of the limit.
        only = "".join(traceback.format_exception_only(cls, exc))
        frames = tb[: len(tb) - len(only)] if tb.endswith(only) else tb
        if len(only) > ERROR_TRACEBACK_LIMIT // 4:
            only = only[: ERROR_TRACEBACK_LIMIT // 4] + "...(truncated)\n"
        room = ERROR_TRACEBACK_LIMIT - len(only)
        if len(frames) > room:
            frames = "...(truncated)\n" + frames[-room:]
        tb = frames + only
    return {"type": clean_text(qualified), "message": clean_text(str(exc)), "traceback": clean_text(tb)}


# --- the periodic sweeper: once per store instance per process -------------------------------------------


class _PeriodicSweeper:
    """A thread that sweeps one store instance periodically while any runner uses it."""

    def __init__(self, store: Any) -> None:
        self.store = store
        self.users = 0
        self.stop = threading.Event()
        self.interval = max(float(store.scan_debounce_seconds), MIN_SWEEP_INTERVAL_S)
        self.thread = threading.Thread(target=self._run, name="lightning-sql-sweeper", daemon=True)

    def _run(self) -> None:
        loop = asyncio.new_event_loop()
        try:
            while not self.stop.wait(self.interval):
                try:
                    hits = loop.run_until_complete(self.store.sweep())
                    if hits:
                        logger.info("Sweeper expired %d attempts", hits)
                except Exception as exc:  # noqa: BLE001 - the next period tries again
                    logger.warning("Periodic sweep failed: %s", exc)
        finally:
            loop.close()


_SWEEPERS: dict[int, _PeriodicSweeper] = {}
_SWEEPERS_LOCK = threading.Lock()


def _acquire_sweeper(store: Any) -> None:
    if not isinstance(store, PersistentStore) or store.read_only:
        return
    with _SWEEPERS_LOCK:
        sweeper = _SWEEPERS.get(id(store))
        if sweeper is None or sweeper.store is not store:
            sweeper = _SWEEPERS[id(store)] = _PeriodicSweeper(store)
            sweeper.thread.start()
        sweeper.users += 1


def _release_sweeper(store: Any) -> None:
    with _SWEEPERS_LOCK:
        sweeper = _SWEEPERS.get(id(store))
        if sweeper is None or sweeper.store is not store:
            return
        sweeper.users -= 1
        if sweeper.users <= 0:
            sweeper.stop.set()
            del _SWEEPERS[id(store)]


# --- runners ------------------------------------------------------------------------------------------------


class Runner(ParallelWorkerBase, Generic[T_task]):
    """Runs an agent on rollouts of a store: ``iter`` claims from the queue, ``step`` runs one input."""

    def init(self, agent: LitAgent[T_task], *, hooks: Sequence[Hook] | None = None, **kwargs: Any) -> None:
        raise NotImplementedError

    def init_worker(self, worker_id: int | str, store: LightningStore, **kwargs: Any) -> None:
        raise NotImplementedError

    async def iter(self, *, event: StopEvent | None = None) -> None:
        raise NotImplementedError

    async def step(
        self,
        input: T_task,
        *,
        resources: NamedResources | None = None,
        mode: RolloutMode | None = None,
        event: StopEvent | None = None,
    ) -> Rollout:
        raise NotImplementedError

    def get_tracer(self) -> Tracer:
        raise NotImplementedError


class _Lease:
    """The attempt a runner is working on, as the heartbeat last saw it."""

    def __init__(self, rollout: AttemptedRollout) -> None:
        self.rollout_id = rollout.rollout_id
        self.attempt_id = rollout.attempt.attempt_id
        self.metadata: dict[str, Any] = dict(rollout.attempt.metadata or {})
        self.lost_reason: str | None = None
        self.reporting = False
        self.loop: asyncio.AbstractEventLoop | None = None
        self.task: asyncio.Task[Any] | None = None


class _LeaseLost(Exception):
    pass


class LitAgentRunner(Runner[T_task]):
    """The standard runner: claim, trace, run the agent, report; heartbeats alongside."""

    def __init__(
        self,
        tracer: Tracer | None = None,
        max_rollouts: int | None = None,
        poll_interval: float = 5.0,
        heartbeat_interval: float = 10.0,
        interval_jitter: float = 0.5,
        heartbeat_launch_mode: Literal["thread", "asyncio"] = "thread",
        heartbeat_include_gpu: bool = False,
    ) -> None:
        if heartbeat_launch_mode not in ("thread", "asyncio"):
            raise ValueError(f"heartbeat_launch_mode must be 'thread' or 'asyncio', got {heartbeat_launch_mode!r}")
        if max_rollouts is not None and max_rollouts < 0:
            raise ValueError(f"max_rollouts must be >= 0 or None, got {max_rollouts!r}")
        self.tracer: Tracer = tracer if tracer is not None else OtelTracer()
        self.max_rollouts = max_rollouts
        self.poll_interval = float(poll_interval)
        self.heartbeat_interval = float(heartbeat_interval)
        self.interval_jitter = float(interval_jitter)
        self.heartbeat_launch_mode = heartbeat_launch_mode
        self.heartbeat_include_gpu = heartbeat_include_gpu
        self._agent: LitAgent[T_task] | None = None
        self._hooks: list[Hook] = []
        self._store: LightningStore | None = None
        self._lease: _Lease | None = None
        self._heartbeat_stop: threading.Event | None = None
        self._heartbeat_runner: threading.Thread | asyncio.Task[None] | None = None
        self.completed_rollouts = 0

    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        for key in ("_agent", "_store", "_lease", "_heartbeat_stop", "_heartbeat_runner"):
            state[key] = None
        state["_hooks"] = []
        return state

    # --- lifecycle -----------------------------------------------------------------------------------

    def init(self, agent: LitAgent[T_task], *, hooks: Sequence[Hook] | None = None, **kwargs: Any) -> None:
        self._agent = agent
        agent.set_runner(self)
        self._hooks = list(hooks or [])
        self.tracer.init()

    def init_worker(self, worker_id: int | str, store: LightningStore, **kwargs: Any) -> None:
        ParallelWorkerBase.init_worker(self, worker_id)
        self._store = store
        self.tracer.init_worker(worker_id, store)

    def teardown_worker(self, worker_id: int | str, *args: Any, **kwargs: Any) -> None:
        self.tracer.teardown_worker(worker_id)
        self._store = None

    def teardown(self, *args: Any, **kwargs: Any) -> None:
        self.tracer.teardown()
        self._agent = None
        self._hooks = []

    @property
    def worker_name(self) -> str:
        """The worker id in the store: ``Worker-<worker_id>``."""
        return f"Worker-{self.worker_id}"

    def get_tracer(self) -> Tracer:
        return self.tracer

    def get_agent(self) -> LitAgent[T_task]:
        if self._agent is None:
            raise ValueError("The runner has no agent: call init(agent) first")
        return self._agent

    def get_store(self) -> LightningStore:
        if self._store is None:
            raise ValueError("The runner has no store: call init_worker(worker_id, store) first")
        return self._store

    # --- the claim loop --------------------------------------------------------------------------------

    async def iter(self, *, event: StopEvent | None = None) -> None:
        """Claim and run rollouts until the event is set or ``max_rollouts`` are done."""
        store = self.get_store()
        await self._start_heartbeat()
        _acquire_sweeper(store)
        try:
            done = 0
            while not _stopped(event) and (self.max_rollouts is None or done < self.max_rollouts):
                try:
                    rollout = await self._through_outages(
                        "claiming", lambda: store.dequeue_rollout(worker_id=self.worker_name), event
                    )
                except StoreUnavailableError:
                    break  # told to stop during an outage: nothing was claimed
                if rollout is None:
                    await self._wait_for_work(event)
                    continue
                await self._run_attempt(rollout)
                done += 1
        finally:
            _release_sweeper(store)
            await self._stop_heartbeat()

    async def _wait_for_work(self, event: StopEvent | None) -> None:
        """Sleep ``poll_interval ± jitter``, returning early on stop or when the store reports queued work."""
        store = self.get_store()
        interval = max(self.poll_interval + random.uniform(-self.interval_jitter, self.interval_jitter), MIN_IDLE_WAIT_S)
        deadline = time.monotonic() + interval
        persistent = isinstance(store, PersistentStore)
        waiter = asyncio.ensure_future(store.wait_for_queue(interval)) if persistent else None
        try:
            while not _stopped(event):
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    return
                if waiter is not None and waiter.done():
                    if not waiter.cancelled() and waiter.exception() is None and waiter.result():
                        return
                    if waiter.exception() is not None:  # the store logs outages itself
                        logger.debug("wait_for_queue failed: %s", waiter.exception())
                    waiter = None
                    continue
                if waiter is not None:
                    await asyncio.wait({waiter}, timeout=min(STOP_CHECK_INTERVAL_S, remaining))
                else:
                    await asyncio.sleep(min(STOP_CHECK_INTERVAL_S, remaining))
        finally:
            if waiter is not None and not waiter.done():
                waiter.cancel()
                try:
                    await waiter
                except (asyncio.CancelledError, Exception):  # noqa: BLE001
                    pass

    async def step(
        self,
        input: T_task,
        *,
        resources: NamedResources | None = None,
        mode: RolloutMode | None = None,
        event: StopEvent | None = None,
    ) -> Rollout:
        """Run one input outside the queue (``start_rollout``) and return the rollout as it ended."""
        store = self.get_store()
        resources_id = None
        if resources:
            resources_id = (await store.add_resources(resources)).resources_id
        rollout = await store.start_rollout(input, mode=mode, resources_id=resources_id, worker_id=self.worker_name)
        owns_heartbeat = self._heartbeat_runner is None
        if owns_heartbeat:
            await self._start_heartbeat()
        try:
            await self._run_attempt(rollout)
        finally:
            if owns_heartbeat:
                await self._stop_heartbeat()
        result = await store.get_rollout_by_id(rollout.rollout_id)
        assert result is not None
        return result

    # --- one attempt -----------------------------------------------------------------------------------

    async def _run_attempt(self, rollout: AttemptedRollout) -> None:
        store = self.get_store()
        agent = self.get_agent()
        rid, aid = rollout.rollout_id, rollout.attempt.attempt_id
        lease = _Lease(rollout)
        lease.loop = asyncio.get_running_loop()
        self._lease = lease
        error: BaseException | dict[str, str] | None = None
        spans: list[Any] = []
        started = interrupted = False
        try:
            try:
                resources = await self._resolve_resources(rollout)
            except LookupError as exc:
                error = {"type": "LookupError", "message": clean_text(str(exc)), "traceback": ""}
                logger.error("Rollout %s: %s", rid, exc)
                return
            started = True
            await self._fire("on_rollout_start", agent=agent, runner=self, rollout=rollout)
            result: Any = None
            async with self.tracer.trace_context(name=rid, rollout_id=rid, attempt_id=aid):
                await self._fire("on_trace_start", agent=agent, runner=self, tracer=self.tracer, rollout=rollout)
                try:
                    result = await self._call_agent(agent, rollout, resources, lease)
                except _LeaseLost:
                    pass
                except Exception as exc:  # noqa: BLE001 - the agent's failure is the attempt's outcome
                    logger.info("Agent failed on rollout %s attempt %s: %r", rid, aid, exc)
                    error = exc
                await self._fire("on_trace_end", agent=agent, runner=self, tracer=self.tracer, rollout=rollout)
            spans = self.tracer.get_last_trace()
            if error is None and lease.lost_reason is None:
                traced = spans
                try:
                    spans = await self._through_outages(
                        f"storing the result of rollout {rid}", lambda: self._post_process(result, rid, aid, traced)
                    )
                except Exception as exc:  # noqa: BLE001 - an unusable return value fails the attempt
                    logger.warning("Rollout %s attempt %s returned an unusable value: %s", rid, aid, exc)
                    error = exc
        except (asyncio.CancelledError, KeyboardInterrupt):
            interrupted = True
            raise
        finally:
            lease.reporting = True
            self._lease = None
            if started:
                await self._fire("on_rollout_end", agent=agent, runner=self, rollout=rollout, spans=spans)
            if interrupted:
                await self._hand_back(store, lease)
            else:
                await self._report(store, lease, error, spans)

    async def _hand_back(self, store: LightningStore, lease: _Lease) -> None:
        """The runner is stopping mid-attempt: end the attempt as its lease expiry would, but now.

        Marking it ``unresponsive`` requeues the rollout at once (or fails it when its attempts are
        used up, per its config), instead of leaving it in flight until the sweeper notices.
        """
        if lease.lost_reason is not None:
            return
        metadata = {
            **lease.metadata,
            "error": {"type": "asyncio.CancelledError", "message": "the runner stopped during the attempt", "traceback": ""},
        }
        try:
            await store.update_attempt(lease.rollout_id, lease.attempt_id, status="unresponsive", metadata=metadata)
            logger.warning("Runner stopped: handed rollout %s back to the queue", lease.rollout_id)
        except BaseException as exc:  # noqa: BLE001 - the lease recovers it anyway
            logger.warning("Could not hand back rollout %s: %r", lease.rollout_id, exc)

    async def _report(
        self,
        store: LightningStore,
        lease: _Lease,
        error: BaseException | dict[str, str] | None,
        spans: Sequence[Any] = (),
    ) -> None:
        if lease.lost_reason is not None:
            logger.warning(
                "Abandoned rollout %s attempt %s: %s; not reporting", lease.rollout_id, lease.attempt_id, lease.lost_reason
            )
            return
        try:
            if error is None:
                reward = final_reward_of(spans)

                async def succeeded() -> Any:
                    if reward is None:
                        return await store.update_attempt(lease.rollout_id, lease.attempt_id, status="succeeded")
                    # Kept with the attempt, so a summary of the run reads rewards with its rollouts.
                    metadata = {**lease.metadata, FINAL_REWARD_KEY: reward}
                    return await store.update_attempt(
                        lease.rollout_id, lease.attempt_id, status="succeeded", metadata=metadata
                    )

                await self._through_outages(f"reporting rollout {lease.rollout_id}", succeeded)
            else:
                details = error if isinstance(error, dict) else error_metadata(error)
                metadata = {**lease.metadata, "error": details}
                await self._through_outages(
                    f"reporting rollout {lease.rollout_id}",
                    lambda: store.update_attempt(lease.rollout_id, lease.attempt_id, status="failed", metadata=metadata),
                )
        except Exception as exc:  # noqa: BLE001 - the lease recovers an unreported attempt
            logger.error("Could not report rollout %s attempt %s: %s", lease.rollout_id, lease.attempt_id, exc)
        else:
            self.completed_rollouts += 1

    async def _through_outages(
        self, what: str, call: Callable[[], Awaitable[_R]], event: StopEvent | None = None
    ) -> _R:
        """``call()``, tried again while the database is unavailable (``StoreUnavailableError``), with
        one warning per outage: a runner outlives an outage and goes on once the database answers.
        Gives up (re-raises) only when ``event`` says stop."""
        delay, logged = 0.1, False
        while True:
            try:
                result = await call()
            except StoreUnavailableError as exc:
                if _stopped(event):
                    raise
                if not logged:  # the store logged the outage once for the whole process
                    logger.debug("Runner %s: the database is unavailable (%s): %s; retrying", self.worker_name, what, exc)
                    logged = True
                await asyncio.sleep(delay)
                delay = min(delay * 2, OUTAGE_RETRY_MAX_S)
                continue
            if logged:
                logger.debug("Runner %s: the database answers again (%s)", self.worker_name, what)
            return result

    async def _resolve_resources(self, rollout: Rollout) -> NamedResources:
        store = self.get_store()
        if rollout.resources_id:
            # The version current when the rollout was enqueued: a later version is another experiment.
            update = await store.get_resources_by_id(rollout.resources_id, version=rollout.resources_version)
            if update is None:
                raise LookupError(
                    f"Resources {rollout.resources_id} version {rollout.resources_version} not found "
                    f"(rollout {rollout.rollout_id})"
                )
            return update.resources
        latest = await store.get_latest_resources()
        return latest.resources if latest is not None else {}

    async def _call_agent(
        self, agent: LitAgent[T_task], rollout: AttemptedRollout, resources: NamedResources, lease: _Lease
    ) -> Any:
        task_input: Any = rollout.input
        if agent.is_async():
            fn_async = agent.training_rollout_async if rollout.mode == "train" else agent.validation_rollout_async
            work: Awaitable[Any] = fn_async(task_input, resources, rollout)
        else:
            fn = agent.training_rollout if rollout.mode == "train" else agent.validation_rollout
            # to_thread copies the context: spans started by the sync agent reach this attempt.
            work = asyncio.to_thread(fn, task_input, resources, rollout)
        task = asyncio.ensure_future(work)
        lease.task = task
        try:
            return await task
        except asyncio.CancelledError:
            current = asyncio.current_task()
            if lease.lost_reason is not None and task.cancelled() and (current is None or not current.cancelling()):
                raise _LeaseLost(lease.lost_reason) from None
            raise
        finally:
            lease.task = None

    async def _post_process(self, result: Any, rid: str, aid: str, spans: list[Span]) -> list[Any]:
        store = self.get_store()
        if result is None:
            return spans
        if isinstance(result, (bool, int, float)):
            reward = emit_reward(float(result), propagate=False)
            assert isinstance(reward, Span)
            reward.rollout_id, reward.attempt_id = rid, aid
            reward.sequence_id = await store.get_next_span_sequence_id(rid, aid)
            await store.add_span(reward)
            return [*spans, reward]
        if isinstance(result, (list, tuple)):
            if not result:
                logger.warning("Rollout %s attempt %s returned an empty list of spans", rid, aid)
                return spans
            if all(isinstance(item, ReadableSpan) for item in result):
                stored = [await store.add_otel_span(rid, aid, item) for item in result]
                return [s for s in stored if s is not None]
            if all(isinstance(item, Span) for item in result):
                for item in result:
                    await store.add_span(item)
                return list(result)
            if all(isinstance(item, SpanCoreFields) for item in result):
                seq_ids = await store.get_many_span_sequence_ids([(rid, aid)] * len(result))
                built = [
                    Span.from_core_fields(core, rollout_id=rid, attempt_id=aid, sequence_id=seq)
                    for core, seq in zip(result, seq_ids, strict=True)
                ]
                await store.add_many_spans(built)
                return built
        raise ValueError(
            f"Invalid rollout result of type {type(result).__name__}: expected None, a number, or a list of "
            "ReadableSpan / Span / SpanCoreFields"
        )

    async def _fire(self, name: str, **kwargs: Any) -> None:
        for hook in self._hooks:
            try:
                await getattr(hook, name)(**kwargs)
            except Exception:  # noqa: BLE001 - hooks must not break the runner
                logger.exception("Hook %s.%s failed", type(hook).__name__, name)

    # --- heartbeats ------------------------------------------------------------------------------------

    def _next_interval(self) -> float:
        jitter = random.uniform(-self.interval_jitter, self.interval_jitter)
        return max(self.heartbeat_interval + jitter, MIN_IDLE_WAIT_S)

    async def _start_heartbeat(self) -> None:
        if self.heartbeat_interval <= 0 or self._heartbeat_runner is not None:
            return
        stop = threading.Event()
        self._heartbeat_stop = stop
        if self.heartbeat_launch_mode == "thread":

            def run() -> None:
                asyncio.run(self._heartbeat_loop(stop))

            thread = threading.Thread(target=run, name=f"lightning-sql-heartbeat-{self.worker_name}", daemon=True)
            thread.start()
            self._heartbeat_runner = thread
        else:
            self._heartbeat_runner = asyncio.ensure_future(self._heartbeat_loop(stop))

    async def _stop_heartbeat(self) -> None:
        runner, self._heartbeat_runner = self._heartbeat_runner, None
        if self._heartbeat_stop is not None:
            self._heartbeat_stop.set()
        if isinstance(runner, threading.Thread):
            await asyncio.to_thread(runner.join, 30.0)
        elif runner is not None:
            try:
                await asyncio.wait_for(runner, 30.0)
            except (TimeoutError, asyncio.CancelledError):
                runner.cancel()

    async def _heartbeat_loop(self, stop: threading.Event) -> None:
        while not stop.is_set():
            await self._heartbeat_once()
            deadline = time.monotonic() + self._next_interval()
            while not stop.is_set() and time.monotonic() < deadline:
                await asyncio.sleep(min(STOP_CHECK_INTERVAL_S, max(deadline - time.monotonic(), 0.0)))

    async def _heartbeat_once(self) -> None:
        store = self._store
        if store is None:
            return
        try:
            await store.update_worker(self.worker_name, system_snapshot(self.heartbeat_include_gpu))
        except Exception as exc:  # noqa: BLE001
            logger.warning("Worker heartbeat of %s failed: %s", self.worker_name, exc)
        lease = self._lease
        if lease is None or lease.reporting or not isinstance(store, PersistentStore):
            return
        try:
            attempt = await store.touch_attempt(lease.rollout_id, lease.attempt_id)
            rollout = await store.get_rollout_by_id(lease.rollout_id)
        except Exception as exc:  # noqa: BLE001
            logger.warning("Attempt heartbeat of %s/%s failed: %s", lease.rollout_id, lease.attempt_id, exc)
            return
        lease.metadata = dict(attempt.metadata or {})
        reason = None
        if attempt.status in ("timeout", "unresponsive"):
            reason = f"the attempt is {attempt.status}"
        elif isinstance(rollout, AttemptedRollout) and rollout.attempt.attempt_id != lease.attempt_id:
            reason = f"the rollout moved on to attempt {rollout.attempt.attempt_id}"
        elif rollout is None or rollout.status in FINISHED_STATUSES:
            reason = f"the rollout is {rollout.status if rollout else 'gone'}"
        if reason is not None and not lease.reporting:
            self._abandon(lease, reason)

    def _abandon(self, lease: _Lease, reason: str) -> None:
        lease.lost_reason = reason
        logger.warning("Lost the lease of rollout %s attempt %s: %s", lease.rollout_id, lease.attempt_id, reason)
        task, loop = lease.task, lease.loop
        if task is not None and loop is not None and not task.done():
            loop.call_soon_threadsafe(task.cancel)

