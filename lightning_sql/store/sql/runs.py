"""Units of work for runs (docs/store-contract.md §0.1, §4): create-or-resume, list, finish, delete in batches."""

from __future__ import annotations

from typing import Any

from sqlalchemy import bindparam, delete, func, select, tuple_, update

from lightning_sql.store.sql import dialect as d
from lightning_sql.store.sql import schema as s
from lightning_sql.store.sql.executor import EncodedJson, UnitContext
from lightning_sql.store.sql.rows import run_from_row
from lightning_sql.types import Run

# Rows deleted per transaction by delete_run: short transactions never hold long locks.
DELETE_BATCH_ROWS = 5_000


def resolve_run(
    ctx: UnitContext, name: str, now: float, *, create: bool, metadata: EncodedJson | None
) -> int:
    """The run's surrogate id, creating the run row (exactly once under races) when allowed."""
    run_id = run_id_of(ctx, name)
    if run_id is not None:
        return run_id
    if not create:
        names = [r[0] for r in ctx.execute(select(s.runs.c.name).order_by(s.runs.c.run_id))]
        listing = ", ".join(repr(n) for n in names) if names else "none"
        raise ValueError(f"Run {name!r} does not exist in this database; existing runs: {listing}")
    ctx.execute(
        d.insert(ctx, s.runs)
        .values(name=name, status="active", created_at=now, metadata=metadata, seq=0)
        .on_conflict_do_nothing()
    )
    return int(ctx.execute(select(s.runs.c.run_id).where(s.runs.c.name == name)).scalar_one())


def list_runs(ctx: UnitContext) -> list[Run]:
    return [run_from_row(r) for r in ctx.execute(select(s.runs).order_by(s.runs.c.run_id))]


def get_run(ctx: UnitContext, name: str) -> Run | None:
    row = ctx.execute(select(s.runs).where(s.runs.c.name == name)).first()
    return run_from_row(row) if row is not None else None


def run_id_of(ctx: UnitContext, name: str) -> int | None:
    row = ctx.execute(select(s.runs.c.run_id).where(s.runs.c.name == name)).first()
    return int(row[0]) if row is not None else None


def mark_finished(ctx: UnitContext, run_id: int, now: float) -> Run:
    return _update_run(ctx, run_id, status="finished", finished_at=now)


def set_metadata(ctx: UnitContext, run_id: int, metadata: EncodedJson | None) -> Run:
    return _update_run(ctx, run_id, metadata=metadata)


def _update_run(ctx: UnitContext, run_id: int, **values: Any) -> Run:
    ctx.execute(update(s.runs).where(s.runs.c.run_id == run_id).values(**values))
    return run_from_row(ctx.execute(select(s.runs).where(s.runs.c.run_id == run_id)).one())


# Children first, so a crash between batches leaves a smaller but consistent run.
_DELETE_ORDER: list[tuple[Any, list[str]]] = [
    (s.spans, ["id"]),
    (s.attempts, ["rollout_id", "attempt_id"]),
    (s.rollouts, ["rollout_id"]),
    (s.resource_versions, ["resources_id", "version"]),
    (s.resources, ["resources_id"]),
    (s.workers, ["worker_id"]),
]


def delete_batch(ctx: UnitContext, run_id: int) -> bool:
    """Delete up to ``DELETE_BATCH_ROWS`` rows of the run; True when the run row itself is gone."""
    for table, key in _DELETE_ORDER:
        cols = [table.c[k] for k in key]
        batch = ctx.execute(select(*cols).where(table.c.run_id == run_id).limit(DELETE_BATCH_ROWS)).all()
        if not batch:
            continue
        ctx.execute(
            delete(table).where(table.c.run_id == run_id, tuple_(*cols).in_([tuple(r) for r in batch]))
        )
        return False
    ctx.execute(delete(s.runs).where(s.runs.c.run_id == run_id))
    return True


def _count(table: Any, *where: Any) -> Any:
    return select(func.count()).select_from(table).where(table.c.run_id == bindparam("c_run_id"), *where)


# Prebuilt: one COUNT per statistic.
_COUNTS = {
    "total_rollouts": _count(s.rollouts),
    "total_attempts": _count(s.attempts),
    "total_spans": _count(s.spans),
    "total_resources": _count(s.resources),
    "total_workers": _count(s.workers),
    "queue_depth": _count(s.rollouts, s.rollouts.c.queue_seq.isnot(None)),
}


def counts(ctx: UnitContext, run_id: int) -> dict[str, int]:
    params = {"c_run_id": run_id}
    return {name: int(ctx.execute(stmt, params).scalar_one()) for name, stmt in _COUNTS.items()}
