"""Attribution and storage of proxied calls: which rollout attempt a call belongs to, and its span.

A call names its rollout and attempt in the URL (``/rollout/<rid>/attempt/<aid>/...``).  The recorder
checks once per attempt that both exist (remembered afterwards) and stores the call's span with
``add_otel_span`` when the call ends, before the client sees the end of the response, so a finished
rollout's calls are already in the store (a call with token ids also stores its ``raw_gen_ai_request``
child, a second write under the same sequence id).  The store gives the span the rollout's next sequence id in
the transaction that inserts it: one write per call, and an attempt's calls are numbered in the order
they end.

A call whose rollout or attempt is unknown, or that names none, is recorded under the proxy's own
*unattributed* rollout (started on first need, without lease, so the sweeper never requeues it) or
refused, as ``ProxySettings.unattributed`` says.
"""

from __future__ import annotations

import asyncio
import logging
from collections import OrderedDict
from collections.abc import Callable
from typing import TYPE_CHECKING

from lightning_sql.llm_proxy.config import UnattributedPolicy
from lightning_sql.llm_proxy.spans import Attribution, CallRecord, build_raw_span, build_span
from lightning_sql.types import RolloutConfig

if TYPE_CHECKING:
    from lightning_sql.store.base import LightningStore

__all__ = ["SpanRecorder", "UNATTRIBUTED_METADATA_KEY"]

logger = logging.getLogger(__name__)

UNATTRIBUTED_METADATA_KEY = "lightning_sql.llm_proxy"
"""Metadata key marking the rollout that holds unattributed calls (value ``"unattributed"``)."""
_KNOWN_ATTEMPTS = 4096  # attempts remembered as existing (LRU)


class SpanRecorder:
    """Attributes calls and writes their spans to the store that ``get_store()`` returns."""

    def __init__(
        self,
        get_store: Callable[[], LightningStore | None],
        policy: UnattributedPolicy,
        unattributed_target: tuple[str, str] | None = None,
    ) -> None:
        self._get_store = get_store
        self.policy = policy
        self._store_seen: LightningStore | None = None
        self._known: OrderedDict[tuple[str, str], None] = OrderedDict()
        self.unattributed_target = unattributed_target
        """(rollout id, attempt id) of the unattributed rollout once started."""
        self._unattributed_lock: asyncio.Lock | None = None
        self._background: set[asyncio.Task[None]] = set()

    @property
    def store(self) -> LightningStore:
        store = self._get_store()
        if store is None:
            raise RuntimeError("The LLM proxy has no store: call set_store(store) first")
        if store is not self._store_seen:  # a new store: nothing known about it yet
            self._store_seen = store
            self._known.clear()
            self.unattributed_target = None
        return store

    async def _exists(self, rollout_id: str, attempt_id: str) -> bool:
        key = (rollout_id, attempt_id)
        store = self.store
        if key in self._known:
            self._known.move_to_end(key)
            return True
        try:
            latest = await store.get_latest_attempt(rollout_id)
            found = latest is not None and latest.attempt_id == attempt_id
            if latest is not None and not found:
                found = any(a.attempt_id == attempt_id for a in await store.query_attempts(rollout_id))
        except ValueError:  # ids the store cannot even look up
            found = False
        if found:
            self._known[key] = None
            if len(self._known) > _KNOWN_ATTEMPTS:
                self._known.popitem(last=False)
        return found

    async def _unattributed(self) -> tuple[str, str]:
        if self.unattributed_target is not None:
            return self.unattributed_target
        if self._unattributed_lock is None:
            self._unattributed_lock = asyncio.Lock()
        async with self._unattributed_lock:
            if self.unattributed_target is None:
                rollout = await self.store.start_rollout(
                    input={"llm_proxy": "calls without a known rollout attempt"},
                    config=RolloutConfig(timeout_seconds=None, unresponsive_seconds=None, max_attempts=1),
                    metadata={UNATTRIBUTED_METADATA_KEY: "unattributed"},
                )
                self.unattributed_target = (rollout.rollout_id, rollout.attempt.attempt_id)
                logger.warning(
                    "LLM proxy: calls without a known rollout attempt are recorded under rollout %s",
                    rollout.rollout_id,
                )
            return self.unattributed_target

    async def attribute(self, requested: tuple[str, str] | None) -> Attribution | None:
        """Where the call's span goes; None: refuse the call."""
        if requested is not None and await self._exists(*requested):
            return Attribution(requested[0], requested[1], attributed=True, requested=requested)
        if self.policy == "refuse":
            return None
        rollout_id, attempt_id = await self._unattributed()
        return Attribution(rollout_id, attempt_id, attributed=False, requested=requested)

    async def record(self, record: CallRecord, attribution: Attribution) -> None:
        """Store the call's span; a store failure is logged, never raised to the client."""
        try:
            span = build_span(record, attribution)
            stored = await self.store.add_otel_span(attribution.rollout_id, attribution.attempt_id, span)
            raw = build_raw_span(record, span)
            if raw is not None and stored is not None:  # the child shares its call's sequence id
                await self.store.add_otel_span(
                    attribution.rollout_id, attribution.attempt_id, raw, sequence_id=stored.sequence_id
                )
        except Exception:  # noqa: BLE001 - the client already has its answer
            logger.exception(
                "LLM proxy: could not store the span of a call for rollout %s attempt %s",
                attribution.rollout_id, attribution.attempt_id,
            )

    def record_task(
        self, record: CallRecord, attribution: asyncio.Future[Attribution | None]
    ) -> asyncio.Task[None]:
        """Record once ``attribution`` is known, in a task of its own.

        A request task may be cancelled at any await (a client that leaves a stream); the store call must
        not be, so callers await this task through ``asyncio.shield`` or not at all.
        """

        async def run() -> None:
            try:
                target = await attribution
            except Exception as exc:  # noqa: BLE001 - the call is served even if it cannot be recorded
                logger.error("LLM proxy: call not recorded, attribution failed: %r", exc)
                return
            if target is not None:
                await self.record(record, target)

        task = asyncio.get_running_loop().create_task(run())
        self._background.add(task)
        task.add_done_callback(self._background.discard)
        return task

    async def drain(self) -> None:
        """Wait for the spans still being recorded."""
        while self._background:
            await asyncio.gather(*list(self._background), return_exceptions=True)

    async def close_unattributed(self) -> None:
        """Mark the unattributed rollout finished (it stays open while the proxy serves)."""
        if self.unattributed_target is None:
            return
        try:
            await self.store.update_rollout(self.unattributed_target[0], status="succeeded")
        except Exception:  # noqa: BLE001 - best effort at shutdown
            logger.warning("LLM proxy: could not close the unattributed rollout", exc_info=True)
