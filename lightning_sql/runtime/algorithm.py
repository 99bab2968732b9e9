"""Algorithms: what enqueues rollouts and consumes their results (docs/store-contract.md §3.5)."""

from __future__ import annotations

import asyncio
import functools
import inspect
import logging
import weakref
from collections import Counter
from collections.abc import Awaitable, Callable, Sequence
from typing import TYPE_CHECKING, Any, Literal, TypeVar

from lightning_sql.runtime.fingerprint import canonical_json, content_digest
from lightning_sql.store.base import PersistentStore
from lightning_sql.types import (
    FINISHED_STATUSES,
    NamedResources,
    ResourcesUpdate,
    Rollout,
    RolloutConfig,
    RolloutMode,
)

if TYPE_CHECKING:
    from lightning_sql.llm_proxy import LLMProxy
    from lightning_sql.runtime.adapter import TraceAdapter
    from lightning_sql.runtime.trainer import Trainer
    from lightning_sql.store.base import LightningStore

__all__ = [
    "Algorithm",
    "FastAlgorithm",
    "Baseline",
    "with_store",
    "baseline_key",
    "sample_keys",
    "publish_resources",
]

logger = logging.getLogger(__name__)

R = TypeVar("R")


class Algorithm:
    """Produces rollouts (through the store) and learns from their spans.

    The Trainer sets the store (a strong reference), itself and the adapter (weak references) and
    the initial resources before calling ``run(train_dataset, val_dataset)``, which may be sync or
    async.
    """

    def __init__(self) -> None:
        self._store: LightningStore | None = None
        self._trainer_ref: weakref.ReferenceType[Trainer] | None = None
        self._adapter_ref: weakref.ReferenceType[TraceAdapter[Any]] | None = None
        self._initial_resources: NamedResources | None = None
        self._llm_proxy_ref: weakref.ReferenceType[LLMProxy] | None = None

    def is_async(self) -> bool:
        return inspect.iscoroutinefunction(self.run)

    def set_trainer(self, trainer: Trainer) -> None:
        self._trainer_ref = weakref.ref(trainer)

    def get_trainer(self) -> Trainer:
        trainer = self._trainer_ref() if self._trainer_ref is not None else None
        if trainer is None:
            raise ValueError("Trainer reference is not set or has been garbage collected")
        return trainer

    def set_store(self, store: LightningStore) -> None:
        self._store = store

    def get_store(self) -> LightningStore:
        if self._store is None:
            raise ValueError("Store is not set: the Trainer sets it, or call set_store(store)")
        return self._store

    def set_adapter(self, adapter: TraceAdapter[Any] | None) -> None:
        self._adapter_ref = weakref.ref(adapter) if adapter is not None else None

    def get_adapter(self) -> TraceAdapter[Any]:
        adapter = self._adapter_ref() if self._adapter_ref is not None else None
        if adapter is None:
            raise ValueError("Adapter is not set or has been garbage collected")
        return adapter

    def set_initial_resources(self, resources: NamedResources | None) -> None:
        self._initial_resources = resources

    def get_initial_resources(self) -> NamedResources | None:
        return self._initial_resources

    def set_llm_proxy(self, llm_proxy: LLMProxy | None) -> None:
        """The Trainer's LLM proxy (a weak reference), or None."""
        self._llm_proxy_ref = weakref.ref(llm_proxy) if llm_proxy is not None else None

    def get_llm_proxy(self) -> LLMProxy | None:
        """The LLM proxy the Trainer set, or None (none configured, or garbage collected)."""
        return self._llm_proxy_ref() if self._llm_proxy_ref is not None else None

    def get_rollout_config(self) -> RolloutConfig | None:
        """The config the store gives rollouts enqueued without one (the Trainer's lease)."""
        store = self._store
        return store.default_rollout_config if isinstance(store, PersistentStore) else None

    def run(self, train_dataset: Sequence[Any] | None = None, val_dataset: Sequence[Any] | None = None) -> Any:
        raise NotImplementedError(f"{type(self).__name__} must implement run()")

    def settings(self) -> dict[str, Any]:
        """The settings that decide which rollouts ``run`` enqueues; part of a run's fingerprint (JSON)."""
        return {}

    def expected_rollouts(
        self, train_dataset: Sequence[Any] | None = None, val_dataset: Sequence[Any] | None = None
    ) -> int | None:
        """How many rollouts ``run`` will have finished in the run when it returns (for progress bars); None: unknown."""
        return None


class FastAlgorithm(Algorithm):
    """Marker for algorithms cheap enough for ``Trainer.dev()``."""


def with_store(func: Callable[..., Awaitable[R]]) -> Callable[..., Awaitable[R]]:
    """Inject the algorithm's store as the first argument after ``self``."""

    @functools.wraps(func)
    async def wrapper(self: Algorithm, *args: Any, **kwargs: Any) -> R:
        return await func(self, self.get_store(), *args, **kwargs)

    return wrapper


def baseline_key(prefix: str | int, mode: str, sample: Any, occurrence: int = 0) -> str:
    """The idempotency key of one sample: ``<prefix>:<mode>:<content hash>``, ``#<n>`` for the n-th repeat.

    Keyed by content, not position: a resumed run whose datasets were reordered or extended finds
    each finished sample under its own key and never counts one sample as another.
    """
    key = f"{prefix}:{mode}:{content_digest(sample)}"
    return f"{key}#{occurrence}" if occurrence else key


def sample_keys(prefix: str | int, samples: Sequence[tuple[str, Any]]) -> list[str]:
    """``baseline_key`` of every ``(mode, sample)``, numbering repeats of the same content."""
    seen: Counter[tuple[str, str]] = Counter()
    keys = []
    for mode, sample in samples:
        digest = content_digest(sample)
        keys.append(baseline_key(prefix, mode, sample, seen[(mode, digest)]))
        seen[(mode, digest)] += 1
    return keys


async def publish_resources(store: LightningStore, resources_id: str, resources: NamedResources) -> ResourcesUpdate:
    """``update_resources`` unless the latest version of ``resources_id`` holds these resources already.

    Publishing the same initial resources on every resume would add an identical version each time.
    """
    latest = await store.get_resources_by_id(resources_id)
    if latest is not None and canonical_json(latest.resources) == canonical_json(resources):
        return latest
    return await store.update_resources(resources_id, resources)


class _Epoch:
    """Book-keeping of one epoch: rollouts not yet harvested, and a signal when new ones are added."""

    def __init__(self) -> None:
        self.outstanding: dict[str, Rollout] = {}
        self.seen_finished: set[str] = set()
        self.changed = asyncio.Event()
        self.enqueue_done = False

    def add(self, rollout: Rollout) -> None:
        self.outstanding[rollout.rollout_id] = rollout
        self.changed.set()


class Baseline(FastAlgorithm):
    """Run every train and val sample through the runners, ``n_epochs`` times; resumable.

    Each sample is enqueued with the idempotency key ``<epoch>:<mode>:<content hash>`` (see
    ``baseline_key``), so a resumed run
    (or a second algorithm process) never enqueues it twice: samples already finished in the run
    are skipped, queued or in-flight ones are awaited and harvested.  At most ``max_queue_length``
    rollouts wait in the queue; finished rollouts are harvested as they finish (logged per
    ``span_verbosity`` and fed to the adapter).  ``val_priority`` > 0 puts validation ahead of
    training: val samples are enqueued first, with that priority (docs/queue.md).
    """

    def __init__(
        self,
        *,
        n_epochs: int = 1,
        train_split: float = 0.5,
        polling_interval: float = 5.0,
        max_queue_length: int = 4,
        span_verbosity: Literal["keys", "key_values", "none"] = "keys",
        val_priority: int = 0,
    ) -> None:
        super().__init__()
        if isinstance(val_priority, bool) or not isinstance(val_priority, int):
            raise TypeError(f"val_priority must be an int, got {val_priority!r}")
        if not 0 < train_split < 1:
            raise ValueError("train_split must be between 0 and 1.")
        if span_verbosity not in ("keys", "key_values", "none"):
            raise ValueError(f"span_verbosity must be 'keys', 'key_values' or 'none', got {span_verbosity!r}")
        if n_epochs < 0:
            raise ValueError(f"n_epochs must be >= 0, got {n_epochs!r}")
        if max_queue_length < 1:
            raise ValueError(f"max_queue_length must be >= 1, got {max_queue_length!r}")
        self.n_epochs = n_epochs
        self.train_split = train_split
        self.polling_interval = float(polling_interval)
        self.max_queue_length = max_queue_length
        self.span_verbosity = span_verbosity
        self.val_priority = val_priority
        self.harvested: list[Rollout] = []
        """Rollouts this instance harvested (finished while it ran), in finish order."""
        self.skipped = 0
        """Samples found already finished in the run at start (resume)."""
        self.triplets_count = 0

    def expected_rollouts(
        self, train_dataset: Sequence[Any] | None = None, val_dataset: Sequence[Any] | None = None
    ) -> int | None:
        return self.n_epochs * (len(train_dataset or []) + len(val_dataset or []))

    async def run(self, train_dataset: Sequence[Any] | None = None, val_dataset: Sequence[Any] | None = None) -> None:
        store = self.get_store()
        resources_id: str | None = None
        initial = self.get_initial_resources()
        if initial:
            await publish_resources(store, "default", initial)
            resources_id = "default"
        train: list[tuple[RolloutMode, Any]] = [("train", s) for s in train_dataset or []]
        val: list[tuple[RolloutMode, Any]] = [("val", s) for s in val_dataset or []]
        samples = val + train if self.val_priority > 0 else train + val
        if not samples:
            logger.error("Baseline has nothing to do: the train and val datasets are empty")
            return
        for epoch in range(self.n_epochs):
            await self.run_batch(store, sample_keys(epoch, samples), samples, resources_id, label=f"Epoch {epoch}")

    async def run_batch(
        self,
        store: LightningStore,
        keys: Sequence[str],
        samples: Sequence[tuple[RolloutMode, Any]],
        resources_id: str | None,
        *,
        label: str = "Batch",
    ) -> list[Rollout]:
        """Run each ``(mode, sample)`` once under its idempotency key; return the batch's finished rollouts.

        Samples already finished in the run are not enqueued again (their rollouts are returned as
        they are); queued or in-flight ones are awaited.  At most ``max_queue_length`` rollouts wait in
        the queue at a time.
        """
        state = _Epoch()
        known = await self._existing(store, list(keys))
        finished: list[Rollout] = []
        for rollout in known.values():
            if rollout.status in FINISHED_STATUSES:
                self.skipped += 1
                finished.append(rollout)
            else:
                state.add(rollout)
        if known:
            logger.info(
                "%s: resuming; %d samples already finished, %d in flight or queued",
                label, len(known) - len(state.outstanding), len(state.outstanding),
            )
        harvester = asyncio.ensure_future(self._harvest(store, state, finished))
        try:
            for key, (mode, sample) in zip(keys, samples, strict=True):
                if key in known:
                    continue
                await self._wait_for_room(store, state)
                rollout = await self._enqueue(store, sample, mode, resources_id, key)
                if rollout.status in FINISHED_STATUSES:
                    self.skipped += 1  # enqueued and finished meanwhile by another algorithm process
                    finished.append(rollout)
                else:
                    state.add(rollout)
            state.enqueue_done = True
            state.changed.set()
            await harvester
        finally:
            if not harvester.done():
                harvester.cancel()
                await asyncio.gather(harvester, return_exceptions=True)
        return finished

    async def _existing(self, store: LightningStore, keys: list[str]) -> dict[str, Rollout]:
        try:
            found = await store.query_rollouts(idempotency_key_in=keys)  # type: ignore[call-arg]
        except TypeError:  # a store without idempotency keys: nothing to resume from
            return {}
        return {r.idempotency_key: r for r in found if getattr(r, "idempotency_key", None)}  # type: ignore[misc]

    async def _enqueue(
        self, store: LightningStore, sample: Any, mode: RolloutMode, resources_id: str | None, key: str
    ) -> Rollout:
        # A priority only when asked for: stores without one (agentlightning's) take the call as before.
        extra: dict[str, Any] = {"priority": self.val_priority} if mode == "val" and self.val_priority else {}
        return await store.enqueue_rollout(  # type: ignore[call-arg]
            sample, mode=mode, resources_id=resources_id, metadata={"baseline_sample": key}, idempotency_key=key, **extra
        )

    async def _queue_depth(self, store: LightningStore) -> int:
        stats = await store.statistics()
        depth = stats.get("queue_depth")
        if depth is None:
            return (await store.query_rollouts(status_in=["queuing", "requeuing"], limit=0)).total
        return int(depth)

    async def _wait_for_room(self, store: LightningStore, state: _Epoch) -> None:
        while await self._queue_depth(store) >= self.max_queue_length:
            ids = [rid for rid in state.outstanding if rid not in state.seen_finished]
            if not ids:
                await asyncio.sleep(self.polling_interval)
                continue
            finished = await store.wait_for_rollouts(
                rollout_ids=ids, timeout=self.polling_interval, return_when="first"
            )
            state.seen_finished.update(r.rollout_id for r in finished)

    async def _harvest(self, store: LightningStore, state: _Epoch, finished: list[Rollout]) -> None:
        while True:
            state.changed.clear()  # before reading the ids: an add after this line wakes the wait below
            ids = list(state.outstanding)
            if not ids:
                if state.enqueue_done:
                    return
                await state.changed.wait()
                continue
            waiter = asyncio.ensure_future(
                store.wait_for_rollouts(rollout_ids=ids, timeout=self.polling_interval, return_when="first")
            )
            changed = asyncio.ensure_future(state.changed.wait())
            try:
                await asyncio.wait({waiter, changed}, return_when=asyncio.FIRST_COMPLETED)
            finally:
                changed.cancel()
                if not waiter.done():
                    waiter.cancel()
                await asyncio.gather(changed, waiter, return_exceptions=True)
            if waiter.cancelled():
                continue  # new rollouts were added: wait again over all of them
            for rollout in waiter.result():
                if state.outstanding.pop(rollout.rollout_id, None) is not None:
                    state.seen_finished.add(rollout.rollout_id)
                    finished.append(rollout)
                    await self._handle_finished(store, rollout)

    async def _handle_finished(self, store: LightningStore, rollout: Rollout) -> None:
        self.harvested.append(rollout)
        duration = (rollout.end_time - rollout.start_time) if rollout.end_time is not None else float("nan")
        logger.info(
            "Rollout %s (%s, %s) %s in %.2f s", rollout.rollout_id, rollout.mode,
            (rollout.metadata or {}).get("baseline_sample"), rollout.status, duration,
        )
        try:
            if self.span_verbosity != "none":
                attempts = await store.query_attempts(rollout.rollout_id)
                spans = await store.query_spans(rollout.rollout_id)
                for attempt in attempts:
                    logger.info(
                        "  attempt %s #%d %s on %s", attempt.attempt_id, attempt.sequence_id, attempt.status,
                        attempt.worker_id,
                    )
                    for span in (s for s in spans if s.attempt_id == attempt.attempt_id):
                        if self.span_verbosity == "keys":
                            logger.info("    span %s #%d keys=%s", span.name, span.sequence_id, sorted(span.attributes))
                        else:
                            logger.info("    span %s #%d %s", span.name, span.sequence_id, dict(span.attributes))
            if rollout.status != "succeeded":
                # Failed and cancelled rollouts have no trace worth adapting; fit's summary reports them.
                logger.info("Rollout %s %s: not adapted", rollout.rollout_id, rollout.status)
                return
            self._adapt(await store.query_spans(rollout.rollout_id, attempt_id="latest"), rollout)
        except Exception as exc:  # noqa: BLE001 - harvesting must not stop the epoch
            logger.warning("Could not harvest rollout %s: %s", rollout.rollout_id, exc)

    def _adapt(self, spans: Sequence[Any], rollout: Rollout) -> None:
        try:
            adapter = self.get_adapter()
        except ValueError:
            logger.warning("No adapter set: spans of rollout %s are not adapted", rollout.rollout_id)
            return
        if not spans:
            logger.warning(
                "Rollout %s succeeded but stored no spans (the agent returned None and emitted no spans): "
                "nothing to adapt", rollout.rollout_id,
            )
            return
        try:
            result = adapter.adapt(spans)
        except ValueError as exc:
            logger.warning("Adapter could not process rollout %s: %s", rollout.rollout_id, exc)
            return
        size = len(result) if isinstance(result, Sequence) else 1
        self.triplets_count += size
        logger.info("Adapted rollout %s into %d items", rollout.rollout_id, size)
