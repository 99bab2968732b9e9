"""Claims: queued rollouts picked in queue order, each with a fresh ``preparing`` attempt.

``Claim`` is one call of ``dequeue_rollout``/``dequeue_many_rollouts``.  A batch of claims is one
claim of the sum of their limits: its *slots* (one per attempt id, in the calls' order) take the
head of the queue in queue order, so earlier calls get earlier rollouts, exactly as if the calls had
run one after the other.  Each dialect module runs the batch (``claim``): PostgreSQL as one
statement (``FOR UPDATE SKIP LOCKED`` and data-modifying CTEs), SQLite as a pick, a mark and two
inserts inside the writer's transaction.  Both return one row per claimed slot: the rollout's
columns, ``attempt_count`` (the attempt's ``sequence_id``) and the slot's ``attempt_id``.
"""

from __future__ import annotations

from collections.abc import Hashable
from dataclasses import dataclass
from typing import Any, ClassVar

from sqlalchemy import Text, and_, select

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
