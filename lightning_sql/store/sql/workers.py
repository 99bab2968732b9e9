"""Units of work for workers (contract §2.14): heartbeats, worker sync from attempts, reads."""

from __future__ import annotations

from typing import Any

from sqlalchemy import select

from lightning_sql.store.sql import dialect as d
from lightning_sql.store.sql import schema as s
from lightning_sql.store.sql.engine import EncodedJson, UnitContext
from lightning_sql.store.sql.rows import worker_from_row
from lightning_sql.types import Worker

W = s.workers


def _upsert(ctx: UnitContext, run_id: int, worker_id: str, insert_values: dict[str, Any], update_cols: list[str]) -> None:
    stmt = d.insert(ctx, W).values(
        run_id=run_id, worker_id=worker_id, create_seq=d.position_expr(ctx, run_id), **insert_values
    )
    stmt = stmt.on_conflict_do_update(
        index_elements=[W.c.run_id, W.c.worker_id],
        set_={col: stmt.excluded[col] for col in update_cols},
    )
    ctx.conn.execute(stmt)


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
) -> None:
    """Make the worker row follow an attempt it runs; writes only the listed fields (upsert)."""
    if attempt_status in ("succeeded", "failed"):
        values: dict[str, Any] = {
            "status": "idle",
            "last_idle_time": now,
            "current_rollout_id": None,
            "current_attempt_id": None,
        }
    elif attempt_status in ("timeout", "unresponsive"):
        values = {"status": "unknown", "last_idle_time": now, "current_rollout_id": None, "current_attempt_id": None}
    else:
        values = {
            "status": "busy",
            "last_busy_time": now,
            "current_rollout_id": rollout_id,
            "current_attempt_id": attempt_id,
        }
        if claim:
            values["last_dequeue_time"] = now
    _upsert(ctx, run_id, worker_id, values, list(values))


def update_worker(
    ctx: UnitContext, run_id: int, now: float, worker_id: str, stats: EncodedJson | None, stats_given: bool
) -> Worker:
    values: dict[str, Any] = {"status": "unknown", "last_heartbeat_time": now}
    update_cols = ["last_heartbeat_time"]
    if stats_given:
        values["heartbeat_stats"] = stats
        update_cols.append("heartbeat_stats")
    _upsert(ctx, run_id, worker_id, values, update_cols)
    worker = get_worker(ctx, run_id, worker_id)
    assert worker is not None
    return worker


def get_worker(ctx: UnitContext, run_id: int, worker_id: str) -> Worker | None:
    row = ctx.conn.execute(select(W).where(W.c.run_id == run_id, W.c.worker_id == worker_id)).first()
    return worker_from_row(row) if row is not None else None
