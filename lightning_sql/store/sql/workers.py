"""Units of work for workers (docs/store-contract.md §2.14): heartbeats, worker sync from attempts, reads."""

from __future__ import annotations

from typing import Any

from sqlalchemy import bindparam, case, select

from lightning_sql.store.sql import dialect as d
from lightning_sql.store.sql import filters as f
from lightning_sql.store.sql import schema as s
from lightning_sql.store.sql.executor import EncodedJson, UnitContext
from lightning_sql.store.sql.rows import worker_from_row
from lightning_sql.store.sql.statements import cached
from lightning_sql.types import PaginatedResult, Worker, is_storable_text

W = s.workers


def _heartbeat(dialect: str, with_stats: bool) -> Any:
    """``update_worker``: the worker row created, or only its heartbeat columns written."""
    run_id: Any = bindparam("w_run_id")
    columns = ("status", "last_heartbeat_time", *(("heartbeat_stats",) if with_stats else ()))
    stmt = d.insert(dialect, W).values(
        run_id=run_id,
        worker_id=bindparam("w_worker_id"),
        create_seq=d.next_create_seq(dialect, W, run_id),
        **{col: bindparam(f"w_{col}") for col in columns},
    )
    taken = columns[1:]  # an existing worker keeps its status (docs/store-contract.md §2.14)
    return stmt.on_conflict_do_update(
        index_elements=[W.c.run_id, W.c.worker_id], set_={col: stmt.excluded[col] for col in taken}
    )


def following(run_id: int, worker_id: str, attempt_status: str, now: float, rollout_id: str, attempt_id: str) -> dict[str, Any]:
    """The parameters of ``batch_worker_upsert(..., "follow", None)`` for a worker whose attempt is
    now in ``attempt_status``: idle after success or failure, unknown after a timeout or an
    unresponsive lease, otherwise busy on it (§2.14)."""
    busy = attempt_status not in ("succeeded", "failed", "timeout", "unresponsive")
    status = "busy" if busy else "idle" if attempt_status in ("succeeded", "failed") else "unknown"
    return {
        "w_run_id": run_id,
        "w_worker_id": worker_id,
        "w_status": status,
        "w_last_busy_time": now if busy else None,
        "w_last_idle_time": None if busy else now,
        "w_last_dequeue_time": None,
        "w_current_rollout_id": rollout_id if busy else None,
        "w_current_attempt_id": attempt_id if busy else None,
    }


def follow(ctx: UnitContext, params: dict[str, Any]) -> None:
    """Write ``following(...)`` into the worker's row, in a unit."""
    ctx.execute(cached(("worker_follow", ctx.dialect), lambda: batch_worker_upsert(ctx.dialect, "follow", None)), params)


# --- the worker rows of a batch ------------------------------------------------------------------

# What a batch writes into its workers' rows, one statement for every row of the batch:
# * ``claimed`` (a claim): busy on the call's last claim, or idle when it claimed nothing (§2.4);
# * ``follow`` (an attempt update): the columns of ``following`` for the attempt's status.
WORKER_WRITE_COLUMNS = ("status", "last_busy_time", "last_idle_time", "last_dequeue_time", "current_rollout_id", "current_attempt_id")


def _busy(excluded: Any) -> Any:
    return excluded.status == "busy"


_CLAIMED_SET = {
    "status": lambda ex: ex.status,
    "last_dequeue_time": lambda ex: ex.last_dequeue_time,
    "last_busy_time": lambda ex: case((_busy(ex), ex.last_busy_time), else_=W.c.last_busy_time),
    # An already idle worker keeps its last_idle_time (docs/store-contract.md §2.4).
    "last_idle_time": lambda ex: case((_busy(ex) | (W.c.status == "idle"), W.c.last_idle_time), else_=ex.last_idle_time),
    "current_rollout_id": lambda ex: case((_busy(ex), ex.current_rollout_id), else_=W.c.current_rollout_id),
    "current_attempt_id": lambda ex: case((_busy(ex), ex.current_attempt_id), else_=W.c.current_attempt_id),
}
_FOLLOW_SET = {
    "status": lambda ex: ex.status,
    "last_busy_time": lambda ex: case((_busy(ex), ex.last_busy_time), else_=W.c.last_busy_time),
    "last_idle_time": lambda ex: case((_busy(ex), W.c.last_idle_time), else_=ex.last_idle_time),
    "current_rollout_id": lambda ex: ex.current_rollout_id,
    "current_attempt_id": lambda ex: ex.current_attempt_id,
}


def batch_worker_upsert(dialect: str, kind: str, source: Any | None) -> Any:
    """The upsert of a batch's worker rows (``kind``: ``claimed`` or ``follow``, see above): from the
    select ``source`` (columns ``run_id``, ``worker_id`` and ``WORKER_WRITE_COLUMNS``), or with
    ``source=None`` from ``w_*`` placeholders, one row per execution (SQLite's ``executemany``: a
    new worker's ``create_seq`` is read per row)."""
    sets = _CLAIMED_SET if kind == "claimed" else _FOLLOW_SET
    columns = ("run_id", "worker_id", *WORKER_WRITE_COLUMNS)
    if source is None:
        run_id: Any = bindparam("w_run_id")
        stmt = d.insert(dialect, W).values(
            {**{col: bindparam(f"w_{col}") for col in columns}, "create_seq": d.next_create_seq(dialect, W, run_id)}
        )
    else:
        with_seq = source.add_columns(d.next_create_seq(dialect, W, None).label("create_seq"))
        stmt = d.insert(dialect, W).from_select([*columns, "create_seq"], with_seq)
    excluded = stmt.excluded
    return stmt.on_conflict_do_update(
        index_elements=[W.c.run_id, W.c.worker_id], set_={col: how(excluded) for col, how in sets.items()}
    )


def update_worker(
    ctx: UnitContext, run_id: int, now: float, worker_id: str, stats: EncodedJson | None, stats_given: bool
) -> Worker:
    params = {"w_run_id": run_id, "w_worker_id": worker_id, "w_status": "unknown", "w_last_heartbeat_time": now}
    if stats_given:
        params["w_heartbeat_stats"] = stats
    ctx.execute(cached(("worker_heartbeat", ctx.dialect, stats_given), lambda: _heartbeat(ctx.dialect, stats_given)), params)
    worker = get_worker(ctx, run_id, worker_id)
    assert worker is not None
    return worker


def get_worker(ctx: UnitContext, run_id: int, worker_id: str) -> Worker | None:
    stmt = cached(
        "worker_by_id",
        lambda: select(W).where(W.c.run_id == bindparam("w_run_id"), W.c.worker_id == bindparam("w_worker_id")),
    )
    row = ctx.execute(stmt, {"w_run_id": run_id, "w_worker_id": worker_id}).first()
    return worker_from_row(row) if row is not None else None


def query_workers(
    ctx: UnitContext,
    run_id: int,
    status_list: list[str] | None,
    worker_id_contains: str | None,
    filter_logic: str,
    sort_by: str | None,
    sort_order: str,
    limit: int,
    offset: int,
) -> PaginatedResult[Worker]:
    """One page of the run's workers."""
    conditions = []
    if status_list is not None:
        conditions.append(f.within(W.c.status, status_list))
    if worker_id_contains is not None:
        conditions.append(
            d.contains(ctx, W.c.worker_id, worker_id_contains) if is_storable_text(worker_id_contains) else f.false()
        )
    where = [W.c.run_id == run_id]
    if conditions:
        where.append(f.pool(conditions, filter_logic))
    order = f.order_by(f.WORKER_SORT, sort_by, sort_order)
    return f.paginate(ctx, W, where, order, limit, offset, worker_from_row)
