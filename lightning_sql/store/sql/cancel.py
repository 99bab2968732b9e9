"""Cancel (docs/queue.md): ``cancel_rollout`` and ``cancel_run`` as one unit each.

The unfinished rollouts named are locked in ``rollout_id`` order (the store's lock order), become
``cancelled`` (``end_time`` now, out of the queue, so nothing claims them again), and the attempt in
flight of each, if any, ends ``failed`` with ``metadata["error"]["type"] == "cancelled"``; its
runner learns it at its next heartbeat, stops the agent and does not report.  A finished rollout is
left as it is.
"""

from __future__ import annotations

from typing import Any

from sqlalchemy import bindparam, select, update

from lightning_sql.store.sql import dialect as d
from lightning_sql.store.sql import schema as s
from lightning_sql.store.sql.executor import EncodedJson, UnitContext
from lightning_sql.store.sql.rows import encoded
from lightning_sql.types import FINISHED_STATUSES, IN_FLIGHT_STATUSES

R, A = s.rollouts, s.attempts
CANCELLED_ERROR = {"type": "cancelled", "message": "the rollout was cancelled", "traceback": ""}

_ATTEMPT = update(A).where(
    A.c.run_id == bindparam("b_run"), A.c.rollout_id == bindparam("b_rollout"), A.c.attempt_id == bindparam("b_attempt")
)


def cancel(ctx: UnitContext, run_id: int, now: float, rollout_id: str | None) -> list[str]:
    """Cancel the unfinished rollout ``rollout_id`` (every unfinished one of the run when None);
    returns the ids cancelled."""
    where = [R.c.run_id == run_id, R.c.status.notin_(FINISHED_STATUSES)]
    if rollout_id is not None:
        where.append(R.c.rollout_id == rollout_id)
    locked = d.for_update(ctx, select(R.c.rollout_id, R.c.attempt_count).where(*where).order_by(R.c.rollout_id))
    rows = ctx.execute(locked).all()
    if not rows:
        return []
    ids = [row.rollout_id for row in rows]
    for start in range(0, len(ids), 500):
        chunk = ids[start : start + 500]
        ctx.execute(
            update(R)
            .where(R.c.run_id == run_id, R.c.rollout_id.in_(chunk))
            .values(status="cancelled", end_time=now, queue_seq=None)
        )
    latest = [(row.rollout_id, row.attempt_count) for row in rows if row.attempt_count > 0]
    in_flight = [a for a in d.attempts_by_sequence(ctx, run_id, latest) if a.status in IN_FLIGHT_STATUSES] if latest else []
    params = []
    for a in in_flight:
        metadata: EncodedJson | None = encoded({**(a.metadata or {}), "error": CANCELLED_ERROR}, "metadata")
        params.append({"b_run": run_id, "b_rollout": a.rollout_id, "b_attempt": a.attempt_id, "meta": metadata})
    if params:
        ctx.execute(_ATTEMPT.values(status="failed", end_time=now, metadata=bindparam("meta", type_=A.c.metadata.type)), params)
    ctx.announce(run_id, "finished")
    return ids


def cancelled_rollout(ctx: UnitContext, run_id: int, now: float, rollout_id: str) -> Any:
    """``cancel_rollout``'s unit: the rollout after the cancel (a finished one unchanged)."""
    from lightning_sql.store.sql.rollouts import fetch_rollouts, rollout_from_row

    cancel(ctx, run_id, now, rollout_id)
    found = fetch_rollouts(ctx, run_id, R.c.rollout_id == rollout_id)
    if not found:
        raise ValueError(f"Rollout {rollout_id} not found")
    return rollout_from_row(found[0])
