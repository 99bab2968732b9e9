"""Attempts: ``start_attempt`` (a unit) and ``update_attempt``/``touch_attempt`` (an operation).

``UpdateAttempt`` is one call of ``update_attempt`` or ``touch_attempt`` (which writes only
``last_heartbeat_time = now``).  A batch decides everything in ONE select over its keys joined to
the locked rollout and attempt rows (``decided``): the attempt's new columns, what follows for the
rollout (its status from the attempt's, ``end_time``, queue placement, docs/store-contract.md §2.7)
and for the worker (§2.14).  PostgreSQL writes the decisions in the same statement (data-modifying
CTEs, with the NOTIFY); SQLite runs the select, then writes its rows with ``executemany``.  Both
return the decided rows, which carry the resolution (§2.7 errors) and the attempt after the write.
"""

from __future__ import annotations

from collections.abc import Hashable
from dataclasses import dataclass
from typing import Any, ClassVar

from sqlalchemy import Float, Integer, Text, and_, case, func, literal, null, or_, select, update

from lightning_sql.store.sql import dialect as d
from lightning_sql.store.sql import filters as f
from lightning_sql.store.sql import schema as s
from lightning_sql.store.sql.executor import Batch, Operation, UnitContext
from lightning_sql.store.sql.rollouts import find_attempt, insert_attempt, lock_rollout
from lightning_sql.store.sql.rows import ATTEMPT_FIELDS, attempt_from_row, attempted
from lightning_sql.types import FINISHED_STATUSES, QUEUED_STATUSES, AttemptedRollout, is_storable_text

R = s.rollouts
A = s.attempts


def start_attempt(
    ctx: UnitContext, run_id: int, now: float, rollout_id: str, attempt_id: str, worker_id: str | None
) -> AttemptedRollout:
    row = lock_rollout(ctx, run_id, rollout_id)
    if row is None:
        raise ValueError(f"Rollout {rollout_id} not found")
    existing = find_attempt(ctx, run_id, rollout_id, attempt_id)
    if existing is None:
        seq = row.attempt_count + 1
        ctx.execute(
            update(R)
            .where(R.c.run_id == run_id, R.c.rollout_id == rollout_id)
            .values(status="preparing", queue_seq=None, attempt_count=seq)
        )
        insert_attempt(ctx, run_id, now, rollout_id, attempt_id, seq, worker_id)
        existing = find_attempt(ctx, run_id, rollout_id, attempt_id)
        row = lock_rollout(ctx, run_id, rollout_id)
    assert existing is not None
    ar = attempted(row, existing)
    assert isinstance(ar, AttemptedRollout)
    return ar


_CHANGES = ("status", "worker_id", "last_heartbeat_time", "metadata")


@dataclass(eq=False, slots=True)
class UpdateAttempt(Operation):
    """``update_attempt(rollout_id, attempt_id, **changes)`` (``attempt_id`` may be ``"latest"``);
    ``changes`` holds the validated columns given (metadata as encoded JSON)."""

    name: ClassVar[str] = "update_attempt"
    run_id: int
    rollout_id: str
    attempt_id: str
    changes: dict[str, Any]
    now: float

    def conflicts(self) -> tuple[Hashable, ...]:
        # The batch decides from the rollout's row as it was before the batch.
        return (("rollout", self.rollout_id),)

    def key_row(self) -> tuple[Any, ...]:
        """This call's row of ``UPDATE_KEYS``."""
        latest = self.attempt_id == "latest"
        # A concrete id that cannot be stored matches nothing (NULL), reported after the rollout checks.
        attempt_id = None if latest or not is_storable_text(self.attempt_id) else self.attempt_id
        row: list[Any] = [self.rollout_id, attempt_id, int(latest)]
        for name in _CHANGES:
            given = name in self.changes
            row += [int(given), self.changes[name] if given else None]
        row.append(self.now)
        return tuple(row)

    @classmethod
    def outcomes(cls, batch: Batch, rows: Any) -> list[Any]:
        by_call = {row["n"]: row for row in rows}
        out: list[Any] = []
        for n, call in enumerate(batch.calls, 1):
            assert isinstance(call, UpdateAttempt)
            row = by_call.get(n)
            rid, aid = call.rollout_id, call.attempt_id
            if row is None or row["found_rollout"] is None:
                out.append(ValueError(f"Rollout {rid} not found"))
            elif row["attempt_count"] == 0 or (row["attempt_id"] is None and aid == "latest"):
                out.append(ValueError(f"No attempts found for rollout {rid}"))
            elif row["attempt_id"] is None:
                out.append(ValueError(f"Attempt {aid} not found for rollout {rid}"))
            else:
                out.append(attempt_from_row(row))
        return out


UPDATE_KEYS: list[d.KeyColumn] = [
    ("rollout_id", Text()),
    ("attempt_id", Text()),
    ("latest", Integer()),
    ("set_status", Integer()),
    ("status", Text()),
    ("set_worker", Integer()),
    ("worker_id", Text()),
    ("set_hb", Integer()),
    ("hb", Float(precision=53)),
    ("set_meta", Integer()),
    ("metadata", Text()),
    ("now", Float(precision=53)),
]
# The rollout's columns a decision reads.
DECISION_ROLLOUT_COLUMNS = (
    "rollout_id", "status", "attempt_count", "queue_seq", "end_time", "max_attempts", "retry_condition",
    "retry_backoff_seconds", "retry_backoff_factor", "retry_backoff_max_seconds", "not_before",
)
# The back-off's exponent stops growing here (factor <= 100: 100**64 * 1e9 s is far from overflow).
BACKOFF_MAX_EXPONENT = 64


def backoff_until(now: Any, failed_attempt: Any, rollout: Any) -> Any:
    """When a rollout requeued after its ``failed_attempt``-th attempt becomes claimable (docs/queue.md):
    ``now + min(max, first * factor ** (n - 1))``, or NULL (at once) without a first delay.  One SQL
    expression on both dialects, over the rollout's columns, so it is decided inside the unit."""
    first, cap = rollout.c.retry_backoff_seconds, rollout.c.retry_backoff_max_seconds
    exponent = case((failed_attempt - 1 > BACKOFF_MAX_EXPONENT, BACKOFF_MAX_EXPONENT), else_=failed_attempt - 1)
    delay = first * func.power(rollout.c.retry_backoff_factor, exponent)
    capped = case((and_(cap.isnot(None), cap < delay), cap), else_=delay)
    return case((first > 0, now + capped), else_=null())


def attempt_match(keys: Any, rollout: Any, attempt: Any) -> Any:
    """The attempt a key names: the rollout's latest, or the one with the key's id."""
    return or_(
        and_(keys.c.latest == 1, attempt.c.sequence_id == rollout.c.attempt_count),
        and_(keys.c.latest == 0, attempt.c.attempt_id == keys.c.attempt_id),
    )


def decided(dialect: str, keys: Any, rollout: Any, attempt: Any, run_id: Any, *, tables: bool) -> Any:
    """For each key of the batch (``keys_source(dialect, "u", UPDATE_KEYS)``), what its update does,
    decided from ``rollout`` and ``attempt`` (the tables, or PostgreSQL's CTEs of the locked rows;
    ``tables``: they are the tables, and need the run's condition).  Its columns:

    * ``n``; ``found_rollout`` (NULL: no such rollout), ``attempt_count``; the attempt's fields as
      they are after the update (NULL ``attempt_id``: no such attempt), ``changed`` (1: write them);
    * ``rollout_status``, ``rollout_end_time``, ``rollout_not_before`` (a requeue's back-off),
      ``rollout_changes`` (1: write those three),
      ``new_position`` (1: the rollout enters the queue), ``leaves_queue``, ``finished``;
    * ``worker_sync`` (1: write the worker row) and ``worker_status``.
    """
    k = keys
    given = {name: k.c[f"set_{short}"] == 1 for name, short in zip(_CHANGES, ("status", "worker", "hb", "meta"), strict=True)}
    status = case((given["status"], k.c.status), else_=attempt.c.status)
    worker_id = case((given["worker_id"], k.c.worker_id), else_=attempt.c.worker_id)
    heartbeat = case((given["last_heartbeat_time"], k.c.hb), else_=attempt.c.last_heartbeat_time)
    metadata = case((given["metadata"], d.as_json(dialect, k.c.metadata)), else_=attempt.c.metadata)
    end_time = case((and_(given["status"], f.one_of(k.c.status, ("failed", "succeeded"))), k.c.now), else_=attempt.c.end_time)
    changed = or_(*given.values())

    # §2.7 propagation: a status set on the latest attempt of a rollout that is not cancelled.
    propagates = and_(
        given["status"], attempt.c.sequence_id == rollout.c.attempt_count, rollout.c.status != "cancelled"
    )
    retried = and_(
        d.json_array_has(dialect, rollout.c.retry_condition, k.c.status), attempt.c.sequence_id < rollout.c.max_attempts
    )
    from_attempt = case(
        (f.one_of(k.c.status, ("preparing", "running", "succeeded")), k.c.status),
        (retried, literal("requeuing", Text)),
        else_=literal("failed", Text),
    )
    rollout_status = case((propagates, from_attempt), else_=rollout.c.status)
    rollout_changes = and_(propagates, from_attempt != rollout.c.status)
    requeued = and_(rollout_changes, from_attempt == "requeuing")
    not_before = case((requeued, backoff_until(k.c.now, attempt.c.sequence_id, rollout)), else_=rollout.c.not_before)
    queued_before = f.one_of(rollout.c.status, QUEUED_STATUSES)
    queued_after = f.one_of(from_attempt, QUEUED_STATUSES)
    finished = and_(rollout_changes, f.one_of(from_attempt, FINISHED_STATUSES))

    sync = or_(
        and_(given["worker_id"], k.c.worker_id != ""),
        and_(given["status"], worker_id.isnot(None), worker_id != ""),
    )
    worker_status = case(  # workers.following
        (f.one_of(status, ("succeeded", "failed")), "idle"), (f.one_of(status, ("timeout", "unresponsive")), "unknown"), else_="busy"
    )
    rollout_on = [rollout.c.rollout_id == k.c.rollout_id]
    attempt_on = [attempt.c.rollout_id == k.c.rollout_id, attempt_match(k, rollout, attempt)]
    if tables:
        rollout_on.insert(0, rollout.c.run_id == run_id)
        attempt_on.insert(0, attempt.c.run_id == run_id)
    flag = _flag
    fields = {
        "rollout_id": k.c.rollout_id,
        "attempt_id": attempt.c.attempt_id,
        "sequence_id": attempt.c.sequence_id,
        "start_time": attempt.c.start_time,
        "end_time": end_time,
        "status": status,
        "worker_id": worker_id,
        "last_heartbeat_time": heartbeat,
        "metadata": metadata,
    }
    assert set(fields) == set(ATTEMPT_FIELDS)
    return (
        select(
            k.c.n,
            k.c.now,
            rollout.c.rollout_id.label("found_rollout"),
            rollout.c.attempt_count,
            *(value.label(name) for name, value in fields.items()),
            flag(changed).label("changed"),
            rollout_status.label("rollout_status"),
            case((finished, k.c.now), else_=rollout.c.end_time).label("rollout_end_time"),
            not_before.label("rollout_not_before"),
            flag(rollout_changes).label("rollout_changes"),
            flag(and_(rollout_changes, queued_after, or_(~queued_before, rollout.c.queue_seq.is_(None)))).label(
                "new_position"
            ),
            flag(and_(rollout_changes, queued_before, ~queued_after)).label("leaves_queue"),
            flag(finished).label("finished"),
            flag(and_(rollout_changes, queued_after, ~queued_before)).label("enters_queue"),
            flag(sync).label("worker_sync"),
            worker_status.label("worker_status"),
        )
        .select_from(
            k.outerjoin(rollout, and_(*rollout_on)).outerjoin(attempt, and_(*attempt_on))
        )
        .order_by(k.c.n)
    )


def _flag(condition: Any) -> Any:
    """A condition as 1/0 (NULL counts as 0): the same in both dialects' rows."""
    return case((condition, 1), else_=0)
