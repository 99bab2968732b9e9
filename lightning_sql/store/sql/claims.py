"""Claims: queued rollouts picked in queue order, each with a fresh ``preparing`` attempt.

``Claim`` is one call of ``dequeue_rollout``/``dequeue_many_rollouts``.  A batch of claims is one
claim of the sum of their limits: its *slots* (one per attempt id, in the calls' order) take the
head of the queue in queue order, so earlier calls get earlier rollouts, exactly as if the calls had
run one after the other.  Each dialect module runs the batch (``claim``): PostgreSQL as one
statement (``FOR UPDATE SKIP LOCKED`` and data-modifying CTEs), SQLite as a pick, a mark and two
inserts inside the writer's transaction.  Both return one row per claimed slot: the rollout's
columns, ``attempt_count`` (the attempt's ``sequence_id``) and the slot's ``attempt_id``.

The queue order is ``priority DESC, queue_seq``.  The candidates are the head of the claimable
index and the due head of the delayed one (``queue_heads``; docs/queue.md): a claim never reads a
rollout still in back-off.  A paused run's claims read nothing (``paused``, checked in the same
statement, so a pause stops every host's next claim).
"""

from __future__ import annotations

from collections.abc import Hashable
from dataclasses import dataclass
from typing import Any, ClassVar

from sqlalchemy import Text, and_, select, union_all

from lightning_sql.store.sql import dialect as d
from lightning_sql.store.sql import schema as s
from lightning_sql.store.sql.executor import Batch, Operation
from lightning_sql.store.sql.rollouts import preparing_attempt
from lightning_sql.store.sql.rows import ROLLOUT_COLUMNS, attempted
from lightning_sql.types import AttemptedRollout

R, A = s.rollouts, s.attempts


@dataclass(eq=False, slots=True)
class Claim(Operation):
    """Claim up to ``len(attempt_ids)`` queued rollouts for ``worker_id`` (their attempts get those
    ids, generated before the first try so that a replay finds what an earlier try claimed)."""

    name: ClassVar[str] = "claim"
    run_id: int
    attempt_ids: list[str]
    worker_id: str | None
    now: float

    def conflicts(self) -> tuple[Hashable, ...]:
        # The worker row follows the call's last claim: one call per worker in a batch.
        return () if self.worker_id is None else (("worker", self.worker_id),)

    def worker_effect(self, claimed: int) -> str | None:
        """What the call writes into its worker's row: ``busy`` on its last claim, ``idle`` when it
        claimed nothing, or None (docs/store-contract.md §2.4: a falsy id is not synced on a claim,
        but an empty queue marks any given id idle)."""
        if self.worker_id is None:
            return None
        if claimed:
            return "busy" if self.worker_id else None
        return "idle"

    @classmethod
    def outcomes(cls, batch: Batch, rows: Any) -> list[Any]:
        by_attempt = {row["attempt_id"]: row for row in rows}
        out = []
        for call in batch.calls:
            assert isinstance(call, Claim)
            claimed = []
            for attempt_id in call.attempt_ids:
                row = by_attempt.get(attempt_id)
                if row is not None:
                    claimed.append(claimed_rollout(row, attempt_id, call.now, call.worker_id))
            out.append(claimed)
        return out


def slots(batch: Batch) -> list[tuple[int, Claim, str]]:
    """The batch's slots: (position from 1, call, attempt id), in the calls' order."""
    out: list[Any] = []
    for call in batch.calls:
        assert isinstance(call, Claim)
        for attempt_id in call.attempt_ids:
            out.append((len(out) + 1, call, attempt_id))
    return out


ATTEMPT_IDS = [("attempt_id", Text())]


def queue_heads(run_id: Any, limit: Any, now: Any, *, lock: bool) -> tuple[Any, Any]:
    """The claim's two reads, ``limit`` rows each: the claimable index's head in queue order, and the
    delayed index's rows due at ``now`` (earliest first); ``lock``: ``FOR UPDATE SKIP LOCKED``."""
    columns = (R.c.run_id, R.c.rollout_id, R.c.priority, R.c.queue_seq)
    live = ~paused(run_id)
    ready = select(*columns).where(R.c.run_id == run_id, s.CLAIMABLE, live).order_by(R.c.priority.desc(), R.c.queue_seq)
    due = select(*columns).where(R.c.run_id == run_id, s.DELAYED, R.c.not_before <= now, live).order_by(R.c.not_before)
    ready, due = ready.limit(limit), due.limit(limit)
    if lock:
        ready, due = ready.with_for_update(skip_locked=True), due.with_for_update(skip_locked=True)
    return ready, due


def paused(run_id: Any) -> Any:
    """Whether the run is paused (``pause_run``): a claim of a paused run reads no rollout."""
    return select(s.runs.c.run_id).where(s.runs.c.run_id == run_id, s.runs.c.paused == 1).exists()


def queue_order(ready: Any, due: Any, limit: Any) -> Any:
    """The first ``limit`` of both reads (selectables with ``queue_heads``' columns) in queue order."""
    both = union_all(select(ready), select(due)).subquery("candidates")
    return select(both).order_by(both.c.priority.desc(), both.c.queue_seq).limit(limit)


def replayed_statement(dialect: str) -> Any:
    """The claims an earlier try of a batch committed: the rollouts (``attempt_count`` being the
    attempt's sequence id) of the batch's attempt ids that exist."""
    ids = d.keys_source(dialect, "ids", ATTEMPT_IDS)
    return (
        select(*ROLLOUT_COLUMNS, A.c.sequence_id.label("attempt_count"), A.c.attempt_id)
        .select_from(ids)
        .join(A, and_(A.c.run_id == ids.c.run_id, A.c.attempt_id == ids.c.attempt_id))
        .join(R, and_(R.c.run_id == A.c.run_id, R.c.rollout_id == A.c.rollout_id))
    )


def claimed_rollout(row: Any, attempt_id: str, now: float, worker_id: str | None) -> AttemptedRollout:
    """The claimed rollout (a row with ``attempt_count``) with its fresh ``preparing`` attempt."""
    ar = attempted(row, preparing_attempt(row["rollout_id"], attempt_id, row["attempt_count"], worker_id, now))
    assert isinstance(ar, AttemptedRollout)
    return ar
