"""Units of work for resources and their append-only history (docs/store-contract.md §2.13)."""

from __future__ import annotations

from typing import Any

from sqlalchemy import bindparam, select

from lightning_sql.store.sql import dialect as d
from lightning_sql.store.sql import schema as s
from lightning_sql.store.sql.executor import EncodedJson, UnitContext
from lightning_sql.store.sql.rows import resources_from_row
from lightning_sql.types import ResourcesUpdate

RS = s.resources
RV = s.resource_versions


def _record_history(ctx: UnitContext, run_id: int, now: float, resources_id: str, version: int, payload: Any) -> None:
    ctx.execute(
        d.insert(ctx, RV)
        .values(run_id=run_id, resources_id=resources_id, version=version, resources=payload, time=now)
        .on_conflict_do_nothing()
    )


def _first_version(
    run_id: int, now: float, resources_id: str, payload: EncodedJson, pos: int
) -> dict[str, Any]:
    """The row of a new snapshot (version 1) at position ``pos``."""
    return {
        "run_id": run_id,
        "resources_id": resources_id,
        "version": 1,
        "create_time": now,
        "update_time": now,
        "resources": payload,
        "create_seq": pos,
        "touch_seq": pos,
    }


def add_resources(ctx: UnitContext, run_id: int, now: float, resources_id: str, payload: EncodedJson) -> ResourcesUpdate:
    existing = ctx.execute(select(RS).where(RS.c.run_id == run_id, RS.c.resources_id == resources_id)).first()
    if existing is not None:  # replay after a lost commit
        return resources_from_row(existing)
    (pos,) = d.allocate_positions(ctx, run_id, 1)
    stmt = RS.insert().values(**_first_version(run_id, now, resources_id, payload, pos))
    row = ctx.execute(stmt.returning(*RS.c)).one()
    _record_history(ctx, run_id, now, resources_id, 1, payload)
    return resources_from_row(row)


def update_resources(
    ctx: UnitContext, run_id: int, now: float, resources_id: str, payload: EncodedJson
) -> ResourcesUpdate:
    """Replace (or create) a snapshot; the version is computed from the locked row, never blindly."""
    (pos,) = d.allocate_positions(ctx, run_id, 1)
    stmt = d.insert(ctx, RS).values(**_first_version(run_id, now, resources_id, payload, pos))
    stmt = stmt.on_conflict_do_update(
        index_elements=[RS.c.run_id, RS.c.resources_id],
        set_={
            "resources": stmt.excluded.resources,
            "update_time": stmt.excluded.update_time,
            "version": RS.c.version + 1,
            "touch_seq": stmt.excluded.touch_seq,
        },
    ).returning(*RS.c)
    row = ctx.execute(stmt).one()
    _record_history(ctx, run_id, now, resources_id, row.version, payload)
    return resources_from_row(row)


def get_resources(ctx: UnitContext, run_id: int, resources_id: str, version: int | None) -> ResourcesUpdate | None:
    row = ctx.execute(_BY_ID, {"r_run_id": run_id, "r_resources_id": resources_id}).first()
    if row is None:
        return None
    if version is None:
        return resources_from_row(row)
    hist = ctx.execute(
        _VERSION, {"r_run_id": run_id, "r_resources_id": resources_id, "r_version": version}
    ).first()
    if hist is None:
        return None
    return ResourcesUpdate.model_validate(
        {
            "resources_id": resources_id,
            "create_time": row.create_time,
            "update_time": hist.time,
            "version": hist.version,
            "resources": hist.resources,
        }
    )


def get_latest(ctx: UnitContext, run_id: int) -> ResourcesUpdate | None:
    row = ctx.execute(_LATEST, {"r_run_id": run_id}).first()
    return resources_from_row(row) if row is not None else None


# Prebuilt reads (building a statement costs more Python than running it).
_BY_ID = select(RS).where(RS.c.run_id == bindparam("r_run_id"), RS.c.resources_id == bindparam("r_resources_id"))
_VERSION = select(RV).where(
    RV.c.run_id == bindparam("r_run_id"),
    RV.c.resources_id == bindparam("r_resources_id"),
    RV.c.version == bindparam("r_version"),
)
_LATEST = select(RS).where(RS.c.run_id == bindparam("r_run_id")).order_by(RS.c.touch_seq.desc()).limit(1)
