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


def _upsert_statement(
    dialect: str, insert_cols: tuple[str, ...], update_set: tuple[tuple[str, Any], ...], prefix: str
) -> Any:
    """INSERT ... ON CONFLICT (run_id, worker_id) DO UPDATE, with ``<prefix><col>`` placeholders."""
    run_id: Any = bindparam(f"{prefix}run_id")
    stmt = d.insert(dialect, W).values(
        run_id=run_id,
        worker_id=bindparam(f"{prefix}worker_id"),
        create_seq=d.next_create_seq(dialect, W, run_id),
        **{col: bindparam(f"{prefix}{col}") for col in insert_cols},
    )
    excluded = stmt.excluded
    set_ = {col: (excluded[col] if how == "excluded" else how(excluded)) for col, how in update_set}
    return stmt.on_conflict_do_update(index_elements=[W.c.run_id, W.c.worker_id], set_=set_)


def _upsert(
    ctx: UnitContext,
    run_id: int,
    worker_id: str,
    insert_values: dict[str, Any],
    update_set: tuple[tuple[str, Any], ...],
    prefix: str = "w_",
) -> d.Write:
    """Creating the worker row, or updating only the columns of ``update_set`` (a prebuilt statement
    whose parameters are named ``<prefix><col>``)."""
    insert_cols = tuple(insert_values)
    dialect = ctx.dialect
    params = {f"{prefix}{col}": value for col, value in insert_values.items()}
    params[f"{prefix}run_id"] = run_id
    params[f"{prefix}worker_id"] = worker_id
    return d.Write(
        ("worker_upsert", dialect, insert_cols, update_set, prefix),
        lambda: _upsert_statement(dialect, insert_cols, update_set, prefix),
        params,
    )


def _take(*cols: str) -> tuple[tuple[str, Any], ...]:
    return tuple((col, "excluded") for col in cols)


_HEARTBEAT = _take("last_heartbeat_time")
_HEARTBEAT_STATS = _take("last_heartbeat_time", "heartbeat_stats")


def _idle_time_unless_idle(excluded: Any) -> Any:
    # An already idle worker keeps its last_idle_time (docs/store-contract.md §2.4).
    return case((W.c.status == "idle", W.c.last_idle_time), else_=excluded.last_idle_time)


_IDLE_ON_EMPTY = (
    ("last_dequeue_time", "excluded"),
    ("last_idle_time", _idle_time_unless_idle),
    ("status", "excluded"),
)


def idle_on_empty_queue(ctx: UnitContext, run_id: int, now: float, worker_id: str) -> d.Write:
    """A worker that found nothing to claim: idle (unless already idle), ``last_dequeue_time = now``
    (a write: run it with ``.execute(ctx)``, or with others)."""
    values = {"status": "idle", "last_idle_time": now, "last_dequeue_time": now}
    return _upsert(ctx, run_id, worker_id, values, _IDLE_ON_EMPTY)


def sync_worker(
    ctx: UnitContext,
    run_id: int,
    now: float,
    worker_id: str,
    attempt_status: str,
    rollout_id: str,
    attempt_id: str,
    *,
    claim: bool,
) -> d.Write:
    """Making the worker row follow an attempt it runs (writes only the listed fields; an upsert): run
    it with ``.execute(ctx)``."""
    values = worker_following(now, attempt_status, rollout_id, attempt_id, claim=claim)
    return write_worker(ctx, run_id, worker_id, values)


def worker_following(
    now: float, attempt_status: str, rollout_id: str, attempt_id: str, *, claim: bool
) -> dict[str, Any]:
    """The columns of a worker row that follow an attempt it runs, now in ``attempt_status``."""
    if attempt_status in ("succeeded", "failed"):
        return {"status": "idle", "last_idle_time": now, "current_rollout_id": None, "current_attempt_id": None}
    if attempt_status in ("timeout", "unresponsive"):
        return {"status": "unknown", "last_idle_time": now, "current_rollout_id": None, "current_attempt_id": None}
    values: dict[str, Any] = {
        "status": "busy",
        "last_busy_time": now,
        "current_rollout_id": rollout_id,
        "current_attempt_id": attempt_id,
    }
    if claim:
        values["last_dequeue_time"] = now
    return values


def write_worker(ctx: UnitContext, run_id: int, worker_id: str, values: dict[str, Any], prefix: str = "w_") -> d.Write:
    """Creating the worker row with ``values``, or writing only those columns into it (an upsert;
    ``prefix`` names its parameters apart from those of other writes in the same statement).
    Successive writes of one worker are one write of their merged values, later ones winning."""
    return _upsert(ctx, run_id, worker_id, values, _take(*values), prefix)


# --- the worker rows of a batch ------------------------------------------------------------------

# What a batch writes into its workers' rows, one statement for every row of the batch:
# * ``claimed`` (a claim): busy on the call's last claim, or idle when it claimed nothing (§2.4);
# * ``follow`` (an attempt update): the columns of ``worker_following`` for the attempt's status.
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
    values: dict[str, Any] = {"status": "unknown", "last_heartbeat_time": now}
    if stats_given:
        values["heartbeat_stats"] = stats
    _upsert(ctx, run_id, worker_id, values, _HEARTBEAT_STATS if stats_given else _HEARTBEAT).execute(ctx)
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
