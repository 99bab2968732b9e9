"""Units of work for attempts: start, resolve (``"latest"`` or an id), update, heartbeat.

An update decides from the locked rollout and attempt rows what follows from the new status (the
rollout's status, its queue position, the worker's row) and writes it with ``dialect.run_writes``.
"""

from __future__ import annotations

from typing import Any

from sqlalchemy import bindparam, update

from lightning_sql.store.sql import dialect as d
from lightning_sql.store.sql.executor import UnitContext
from lightning_sql.store.sql.rollouts import (
    ATTEMPT_BY_ID,
    ATTEMPT_BY_SEQ,
    A,
    R,
    enter_or_leave_queue,
    find_attempt,
    insert_attempt,
    lock_rollout,
)
from lightning_sql.store.sql.rows import (
    ROLLOUT_COLUMNS,
    attempt_from_row,
    attempted,
    config_from,
)
from lightning_sql.store.sql.statements import cached
from lightning_sql.store.sql.workers import worker_following, write_worker
from lightning_sql.types import (
    FINISHED_STATUSES,
    Attempt,
    AttemptedRollout,
    is_storable_text,
    rollout_status_from_attempt,
)


def _update_where(table: Any, keys: tuple[str, ...], cols: tuple[str, ...], prefix: str) -> Any:
    """UPDATE table SET <cols> WHERE <keys>, with ``<prefix><name>`` placeholders."""
    return (
        update(table)
        .where(*(table.c[k] == bindparam(f"{prefix}{k}") for k in keys))
        .values({c: bindparam(f"{prefix}{c}") for c in cols})
    )


def _row_write(
    table: Any, keys: dict[str, Any], values: dict[str, Any], *, prefix: str = "u_", returning: bool = False
) -> d.Write:
    """Writing ``values`` into the row named by ``keys``, as a prebuilt statement; with ``returning``,
    it returns the updated row (every column).  Writes run together (``dialect.run_writes``) need
    distinct ``prefix``es."""
    key_names, cols = tuple(keys), tuple(values)
    return d.Write(
        ("update_row", table.name, key_names, cols, prefix, returning),
        lambda: _update_where(table, key_names, cols, prefix).returning(*table.c)
        if returning
        else _update_where(table, key_names, cols, prefix),
        {**{f"{prefix}{k}": v for k, v in keys.items()}, **{f"{prefix}{c}": v for c, v in values.items()}},
    )


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


def resolve_attempt(ctx: UnitContext, run_id: int, rollout_id: str, attempt_id: str, *, lock: bool) -> tuple[Any, Any]:
    """(rollout row, attempt row) per the resolution order of docs/store-contract.md §2.7, or raise its errors."""
    if lock and (attempt_id == "latest" or is_storable_text(attempt_id)):  # both rows in one statement
        row, attempt_row = d.lock_rollout_and_attempt(ctx, run_id, rollout_id, attempt_id, ROLLOUT_COLUMNS)
        return _resolved(row, attempt_row, rollout_id, attempt_id)
    row = lock_rollout(ctx, run_id, rollout_id, lock=lock)
    latest = attempt_id == "latest"
    if row is None or row.attempt_count == 0 or not (latest or is_storable_text(attempt_id)):
        # A concrete id that cannot exist in the database (NUL, lone surrogate, too long) matches
        # nothing, reported after the rollout checks (§2.7 resolution order).
        return _resolved(row, None, rollout_id, attempt_id)
    base = ATTEMPT_BY_SEQ if latest else ATTEMPT_BY_ID
    stmt = cached(("attempt_row", ctx.dialect, latest, lock), lambda: d.for_update(ctx, base) if lock else base)
    params = {"r_run_id": run_id, "r_rollout_id": rollout_id}
    if latest:
        params["r_sequence_id"] = row.attempt_count
    else:
        params["r_attempt_id"] = attempt_id
    return _resolved(row, ctx.execute(stmt, params).first(), rollout_id, attempt_id)


def _resolved(row: Any, attempt_row: Any, rollout_id: str, attempt_id: str) -> tuple[Any, Any]:
    """The rollout and attempt rows found, or the error of §2.7 they call for."""
    if row is None:
        raise ValueError(f"Rollout {rollout_id} not found")
    if row.attempt_count == 0 or (attempt_row is None and attempt_id == "latest"):
        raise ValueError(f"No attempts found for rollout {rollout_id}")
    if attempt_row is None:
        raise ValueError(f"Attempt {attempt_id} not found for rollout {rollout_id}")
    return row, attempt_row


def update_attempt(
    ctx: UnitContext, run_id: int, now: float, rollout_id: str, attempt_id: str, changes: dict[str, Any]
) -> Attempt:
    row, attempt_row = resolve_attempt(ctx, run_id, rollout_id, attempt_id, lock=True)
    writes, worker = _attempt_writes(ctx, run_id, now, row, attempt_row, changes)
    if not writes:
        return attempt_from_row(attempt_row)
    if worker is not None:
        writes.append(write_worker(ctx, run_id, *worker))
    new_row = d.run_writes(ctx, writes)
    assert new_row is not None  # locked above
    return attempt_from_row(new_row)


def _attempt_writes(
    ctx: UnitContext, run_id: int, now: float, row: Any, attempt_row: Any, changes: dict[str, Any]
) -> tuple[list[d.Write], tuple[str, dict[str, Any]] | None]:
    """The row writes of one ``update_attempt`` of the locked ``row`` and ``attempt_row`` (none
    when nothing changes), the attempt's first (it returns the updated row), and what it writes
    into a worker's row, ``(worker_id, values)`` or None (``workers.write_worker``)."""
    values: dict[str, Any] = {}
    for key in ("status", "worker_id", "last_heartbeat_time", "metadata"):
        if key in changes:
            values[key] = changes[key]
    if changes.get("status") in ("failed", "succeeded"):
        values["end_time"] = now
    if not values:
        return [], None
    rollout_id, aid = row.rollout_id, attempt_row.attempt_id
    keys = {"run_id": run_id, "rollout_id": rollout_id, "attempt_id": aid}
    # The attempt's row, the rollout's and the worker's are written together (dialect.run_writes:
    # one statement on PostgreSQL): what follows from the attempt's new status and worker is decided
    # here from the locked row and the changes, not read back.
    writes = [_row_write(A, keys, values, prefix="ua_", returning=True)]
    status = values.get("status", attempt_row.status)
    if "status" in changes and attempt_row.sequence_id == row.attempt_count and row.status != "cancelled":
        new_status = rollout_status_from_attempt(status, attempt_row.sequence_id, config_from(row))
        if new_status != row.status:
            rvalues: dict[str, Any] = {"status": new_status}
            if new_status in FINISHED_STATUSES:
                rvalues["end_time"] = now
                ctx.announce(run_id, "finished")
            rvalues.update(enter_or_leave_queue(ctx, run_id, row.status, new_status, row.queue_seq))
            writes.append(_row_write(R, {"run_id": run_id, "rollout_id": rollout_id}, rvalues, prefix="ur_"))
    wid = values["worker_id"] if "worker_id" in values else attempt_row.worker_id
    if ("worker_id" in changes and changes["worker_id"]) or ("status" in changes and wid):
        return writes, (wid, worker_following(now, status, rollout_id, aid, claim=False))
    return writes, None


def touch_attempt(ctx: UnitContext, run_id: int, now: float, rollout_id: str, attempt_id: str) -> Attempt:
    # Lock order (§2.17): the rollout row first, so a concurrent sweep either skips this rollout or has
    # committed its verdict before the heartbeat lands (never judges a heartbeat it did not see).
    _row, attempt_row = resolve_attempt(ctx, run_id, rollout_id, attempt_id, lock=True)
    keys = {"run_id": run_id, "rollout_id": rollout_id, "attempt_id": attempt_row.attempt_id}
    _row_write(A, keys, {"last_heartbeat_time": now}).execute(ctx)
    attempt = attempt_from_row(attempt_row)
    attempt.last_heartbeat_time = now
    return attempt
