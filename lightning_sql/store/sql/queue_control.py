"""Queue control of the bound run (docs/queue.md): cancel, and the pause / drain / resume cycle.

``QueueControl`` is the part of ``SqlLightningStore`` that controls the queue rather than moving one
rollout through it.  Each call is one unit (cancel.py, or one statement on ``runs``); waits poll the
run's counts between the store's wake-ups (notifications, and the 1 s fallback).
"""

from __future__ import annotations

import asyncio
import time

from sqlalchemy import func, select, update

from lightning_sql.store.sql import cancel
from lightning_sql.store.sql import schema as s
from lightning_sql.store.sql.executor import UnitContext
from lightning_sql.store.sql.instance import StoreInstance
from lightning_sql.store.sql.rows import run_from_row
from lightning_sql.types import IN_FLIGHT_STATUSES, Rollout, Run, is_storable_text

R = s.rollouts
# How often a drain re-reads when nothing wakes it (other hosts finish attempts without waking us).
DRAIN_POLL_S = 1.0


def _set_paused(ctx: UnitContext, run_id: int, paused: bool) -> Run:
    ctx.execute(update(s.runs).where(s.runs.c.run_id == run_id).values(paused=int(paused)))
    if not paused:
        ctx.announce(run_id, "queued")  # claimers waiting in wait_for_queue look again
    return run_from_row(ctx.execute(select(s.runs).where(s.runs.c.run_id == run_id)).one())


def in_flight(ctx: UnitContext, run_id: int) -> int:
    """The run's rollouts with an attempt in flight (preparing or running)."""
    where = (R.c.run_id == run_id, R.c.status.in_(IN_FLIGHT_STATUSES))
    return int(ctx.execute(select(func.count()).select_from(R).where(*where)).scalar_one())


class QueueControl(StoreInstance):
    """``cancel_rollout``, ``cancel_run``, ``pause_run``, ``resume_run``, ``wait_for_drain``."""

    async def cancel_rollout(self, rollout_id: str) -> Rollout:
        """Cancel one unfinished rollout; a finished one is returned unchanged."""
        self._check_writable("cancel_rollout")
        if not is_storable_text(rollout_id):
            raise ValueError(f"Rollout {rollout_id} not found")
        return await self._call("cancel_rollout", lambda ctx, r, now: cancel.cancelled_rollout(ctx, r, now, rollout_id), write=True)

    async def cancel_run(self) -> int:
        """Cancel every unfinished rollout of the run; returns how many."""
        self._check_writable("cancel_run")
        return len(await self._call("cancel_run", lambda ctx, r, now: cancel.cancel(ctx, r, now, None), write=True))

    async def pause_run(self) -> Run:
        """Pause the run: from the next statement on, its claims take nothing, on every host; attempts in
        flight go on.  Idempotent."""
        self._check_writable("pause_run")
        return await self._call("pause_run", lambda ctx, r, now: _set_paused(ctx, r, True), write=True)

    async def resume_run(self) -> Run:
        """Let the run's claims take work again, and wake the claimers waiting for it.  Idempotent."""
        self._check_writable("resume_run")
        return await self._call("resume_run", lambda ctx, r, now: _set_paused(ctx, r, False), write=True)

    async def wait_for_drain(self, timeout: float | None = None) -> bool:
        """True as soon as no rollout of the run has an attempt in flight, False at the timeout (None:
        no timeout).  Claims nothing and writes nothing; pair it with ``pause_run`` (docs/queue.md)."""
        if timeout is not None and (isinstance(timeout, bool) or not isinstance(timeout, (int, float))):
            raise TypeError(f"timeout must be a number or None, got {timeout!r}")
        worker, run_id = await self._prepare()
        assert run_id is not None
        deadline = None if timeout is None else time.monotonic() + max(float(timeout), 0.0)
        entry, close_count = self._register_wait(worker, run_id)
        try:
            while True:
                self._check_not_closed_since("wait_for_drain", close_count)
                entry[1].clear()
                if await self._submit(worker, lambda ctx: in_flight(ctx, run_id), write=False) == 0:
                    return True
                wait_s = DRAIN_POLL_S if deadline is None else min(DRAIN_POLL_S, deadline - time.monotonic())
                if wait_s <= 0:
                    return False
                try:
                    await asyncio.wait_for(entry[1].wait(), timeout=wait_s)
                except TimeoutError:
                    pass
        finally:
            self._unregister_wait(worker, run_id, entry)

