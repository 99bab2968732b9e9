"""Units of work for rollouts, the queue, claims and attempts (contract §2.1-§2.8, §2.11).

Every function here is one unit: sync SQLAlchemy Core over ``ctx.conn`` inside the transaction the
I/O worker opened.  Ids and *now* are decided by the caller before the first try, so a replay after
a lost commit finds its own rows instead of acting twice (contract §0.3).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from sqlalchemy import ColumnElement, bindparam, func, select, update

from lightning_sql.store.sql import dialect as d
from lightning_sql.store.sql import filters as f
from lightning_sql.store.sql import schema as s
from lightning_sql.store.sql.executor import EncodedJson, UnitContext
from lightning_sql.store.sql.rows import (
    ROLLOUT_COLUMNS,
    attempt_from_row,
    attempted,
    config_copy,
    construct,
    rollout_from_row,
)
from lightning_sql.store.sql.statements import cached
from lightning_sql.store.sql.workers import idle_on_empty_queue, sync_worker, worker_following, write_worker
from lightning_sql.types import (
    FINISHED_STATUSES,
    QUEUED_STATUSES,
    Attempt,
    AttemptedRollout,
    PaginatedResult,
    Rollout,
    RolloutConfig,
    RolloutMode,
    is_storable_text,
    rollout_status_from_attempt,
)

R = s.rollouts
A = s.attempts


@dataclass
class NewRollout:
    """A rollout to create, with every value decided before the first try."""

    rollout_id: str
    input: EncodedJson | None
    mode: RolloutMode | None
    resources_id: str | None
    config: RolloutConfig
    metadata: EncodedJson | None
    idempotency_key: str | None
    # The decoded values, to build the returned model without reading the row back.
    input_value: Any = None
    metadata_value: Any = None


def _config_values(config: RolloutConfig) -> dict[str, Any]:
    return {
        "timeout_seconds": config.timeout_seconds,
        "unresponsive_seconds": config.unresponsive_seconds,
        "max_attempts": config.max_attempts,
        "retry_condition": EncodedJson(_retry_json(config.retry_condition)),
    }


def _retry_json(statuses: Sequence[str]) -> str:
    return "[" + ",".join(f'"{status}"' for status in statuses) + "]"


_LATEST_RESOURCES = (
    select(s.resources.c.resources_id, s.resources.c.version)
    .where(s.resources.c.run_id == bindparam("r_run_id"))
    .order_by(s.resources.c.touch_seq.desc())
    .limit(1)
)
_RESOURCE_VERSION = select(s.resources.c.resources_id, s.resources.c.version).where(
    s.resources.c.run_id == bindparam("r_run_id"), s.resources.c.resources_id == bindparam("r_resources_id")
)
_RESOURCE_VERSIONS = select(s.resources.c.resources_id, s.resources.c.version).where(
    s.resources.c.run_id == bindparam("r_run_id"),
    s.resources.c.resources_id.in_(bindparam("r_resources_ids", expanding=True)),
)


def latest_resources(ctx: UnitContext, run_id: int) -> tuple[str | None, int | None]:
    row = ctx.execute(_LATEST_RESOURCES, {"r_run_id": run_id}).first()
    return (row[0], row[1]) if row is not None else (None, None)


def resource_versions(ctx: UnitContext, run_id: int, ids: set[str]) -> dict[str, int]:
    if not ids:
        return {}
    if len(ids) == 1:
        (rid,) = ids
        rows = ctx.execute(_RESOURCE_VERSION, {"r_run_id": run_id, "r_resources_id": rid}).all()
    else:
        rows = ctx.execute(_RESOURCE_VERSIONS, {"r_run_id": run_id, "r_resources_ids": sorted(ids)}).all()
    return {r[0]: r[1] for r in rows}


def _resolve_resources(ctx: UnitContext, run_id: int, items: Sequence[NewRollout]) -> list[tuple[str | None, int | None]]:
    latest: tuple[str | None, int | None] | None = None
    if any(item.resources_id is None for item in items):
        latest = latest_resources(ctx, run_id)
    versions = resource_versions(ctx, run_id, {i.resources_id for i in items if i.resources_id is not None})
    out: list[tuple[str | None, int | None]] = []
    for item in items:
        if item.resources_id is None:
            assert latest is not None
            out.append(latest)
        else:
            out.append((item.resources_id, versions.get(item.resources_id)))
    return out


def _fetch_rollouts(ctx: UnitContext, run_id: int, where: Any) -> list[Any]:
    return list(ctx.execute(select(*ROLLOUT_COLUMNS).where(R.c.run_id == run_id, where)).all())


_ROLLOUTS_BY_ID = select(*ROLLOUT_COLUMNS).where(
    R.c.run_id == bindparam("r_run_id"), R.c.rollout_id.in_(bindparam("r_ids", expanding=True))
)
_ROLLOUTS_BY_KEY = select(*ROLLOUT_COLUMNS).where(
    R.c.run_id == bindparam("r_run_id"), R.c.idempotency_key.in_(bindparam("r_keys", expanding=True))
)


def _rollouts_by_key(ctx: UnitContext, run_id: int, keys: Sequence[str]) -> list[Any]:
    return list(ctx.execute(_ROLLOUTS_BY_KEY, {"r_run_id": run_id, "r_keys": list(keys)}).all())


def enqueue(ctx: UnitContext, run_id: int, now: float, items: Sequence[NewRollout]) -> list[Rollout]:
    """Queue new rollouts in request order; known idempotency keys return the existing rollout."""
    if not items:
        return []
    keys = sorted({i.idempotency_key for i in items if i.idempotency_key is not None})
    by_key: dict[str, Rollout] = {}
    if keys:
        for row in _rollouts_by_key(ctx, run_id, keys):
            by_key[row.idempotency_key] = rollout_from_row(row)
    # A replay after a lost commit: our pre-generated ids may already exist (the ids are fresh per
    # call, so only a replay can find them: skip the look-up on the first try).
    mine: dict[str, Rollout] = {}
    if ctx.attempt > 0:
        found = ctx.execute(_ROLLOUTS_BY_ID, {"r_run_id": run_id, "r_ids": [i.rollout_id for i in items]})
        mine = {r.rollout_id: r for r in map(rollout_from_row, found)}

    fresh: list[NewRollout] = []
    seen_keys: set[str] = set()
    for item in items:
        if item.rollout_id in mine:
            continue
        key = item.idempotency_key
        if key is not None and (key in by_key or key in seen_keys):
            continue
        if key is not None:
            seen_keys.add(key)
        fresh.append(item)

    created: dict[str, Rollout] = {}
    if fresh:
        resolved = _resolve_resources(ctx, run_id, fresh)
        positions = d.allocate_positions(ctx, run_id, len(fresh))
        params = []
        for item, (rid, version), pos in zip(fresh, resolved, positions, strict=True):
            params.append(
                {
                    "run_id": run_id,
                    "rollout_id": item.rollout_id,
                    "input": item.input,
                    "mode": item.mode,
                    "resources_id": rid,
                    "resources_version": version,
                    "status": "queuing",
                    **_config_values(item.config),
                    "metadata": item.metadata,
                    "idempotency_key": item.idempotency_key,
                    "start_time": now,
                    "end_time": None,
                    "queue_seq": pos,
                    "create_seq": pos,
                }
            )
        if d.inserts_rollouts_in_one_statement(ctx):
            inserted = d.insert_rollouts_in_one_statement(ctx, run_id, now, params)
        else:
            insert_rollouts = cached(
                ("enqueue_insert", ctx.dialect),
                lambda: d.insert(ctx, R).on_conflict_do_nothing().returning(R.c.rollout_id),
            )
            inserted = {row[0] for row in ctx.execute(insert_rollouts, params)}
        for item, p in zip(fresh, params, strict=True):
            if item.rollout_id in inserted:
                created[item.rollout_id] = Rollout.model_construct(
                    rollout_id=item.rollout_id,
                    input=item.input_value,
                    start_time=now,
                    end_time=None,
                    mode=item.mode,
                    resources_id=p["resources_id"],
                    status="queuing",
                    config=config_copy(item.config),
                    metadata=item.metadata_value,
                    resources_version=p["resources_version"],
                    idempotency_key=item.idempotency_key,
                )
        if inserted:
            ctx.announce(run_id, "queued")
        if len(inserted) < len(fresh):
            # A concurrent enqueue took some keys first: read what it created.
            missing = [i.idempotency_key for i in fresh if i.rollout_id not in inserted and i.idempotency_key]
            for row in _rollouts_by_key(ctx, run_id, missing):
                by_key[row.idempotency_key] = rollout_from_row(row)

    # A later request repeating an earlier request's key yields the rollout that request created.
    for item in fresh:
        if item.idempotency_key is not None and item.rollout_id in created:
            by_key[item.idempotency_key] = created[item.rollout_id]

    out: list[Rollout] = []
    for item in items:
        if item.rollout_id in mine:
            out.append(mine[item.rollout_id])
        elif item.rollout_id in created:
            out.append(created[item.rollout_id])
        else:
            assert item.idempotency_key is not None
            out.append(by_key[item.idempotency_key])
    return out


def start_rollout(
    ctx: UnitContext, run_id: int, now: float, item: NewRollout, attempt_id: str, worker_id: str | None
) -> AttemptedRollout:
    """Create a rollout with its first attempt, both ``preparing``, outside the queue."""
    existing = _fetch_rollouts(ctx, run_id, R.c.rollout_id == item.rollout_id)
    if existing:  # replay after a lost commit
        attempt = _attempt(ctx, run_id, item.rollout_id, attempt_id)
        assert attempt is not None
        result = attempted(existing[0], attempt)
        assert isinstance(result, AttemptedRollout)
        return result
    (rid, version), = _resolve_resources(ctx, run_id, [item])
    (pos,) = d.allocate_positions(ctx, run_id, 1)
    ctx.execute(
        R.insert().values(
            run_id=run_id,
            rollout_id=item.rollout_id,
            input=item.input,
            mode=item.mode,
            resources_id=rid,
            resources_version=version,
            status="preparing",
            **_config_values(item.config),
            metadata=item.metadata,
            idempotency_key=None,
            start_time=now,
            queue_seq=None,
            create_seq=pos,
            attempt_count=1,
        )
    )
    ctx.execute(
        A.insert().values(
            run_id=run_id,
            rollout_id=item.rollout_id,
            attempt_id=attempt_id,
            sequence_id=1,
            status="preparing",
            worker_id=worker_id,
            start_time=now,
        )
    )
    if worker_id:  # upstream's worker sync skips a falsy id
        sync = sync_worker(ctx, run_id, now, worker_id, "preparing", item.rollout_id, attempt_id, claim=False)
        sync.execute(ctx)
    attempt = Attempt.model_construct(
        rollout_id=item.rollout_id,
        attempt_id=attempt_id,
        sequence_id=1,
        start_time=now,
        end_time=None,
        status="preparing",
        worker_id=worker_id,
        last_heartbeat_time=None,
        metadata=None,
    )
    return AttemptedRollout.model_construct(
        rollout_id=item.rollout_id,
        input=item.input_value,
        start_time=now,
        end_time=None,
        mode=item.mode,
        resources_id=rid,
        status="preparing",
        config=config_copy(item.config),
        metadata=item.metadata_value,
        resources_version=version,
        idempotency_key=None,
        attempt=attempt,
    )


def _attempt(ctx: UnitContext, run_id: int, rollout_id: str, attempt_id: str) -> Attempt | None:
    row = ctx.execute(
        _ATTEMPT_BY_ID, {"r_run_id": run_id, "r_rollout_id": rollout_id, "r_attempt_id": attempt_id}
    ).first()
    return attempt_from_row(row) if row is not None else None


def claim(
    ctx: UnitContext, run_id: int, now: float, attempt_ids: Sequence[str], worker_id: str | None
) -> list[AttemptedRollout]:
    """Claim up to ``len(attempt_ids)`` queued rollouts in queue order.

    On PostgreSQL the claim is one statement (rollouts, attempts and the worker row, rows picked with
    ``FOR UPDATE SKIP LOCKED``); on SQLite, whose writers are serialised, a pick-and-mark and an
    insert.  A replay first looks for its own attempts (their ids are fresh per call)."""
    limit = len(attempt_ids)
    out: list[AttemptedRollout] = []
    synced = False  # the claim statement itself synced the worker (PostgreSQL)
    if limit > 0:
        # Only a replay can find its own attempts (the ids are fresh per call): skip the look-up on
        # the first try.
        out = _replayed_claim(ctx, run_id, attempt_ids) if ctx.attempt > 0 else []
        if not out:
            out, synced = _claim_fresh(ctx, run_id, now, attempt_ids, worker_id)
    write = None if out and synced else _worker_write(ctx, run_id, now, worker_id, out)
    if write is not None:
        write.execute(ctx)
    return out


def _worker_write(
    ctx: UnitContext, run_id: int, now: float, worker_id: str | None, claimed: list[AttemptedRollout]
) -> d.Write | None:
    """The write of a claim to its worker's row: busy on the last rollout claimed, or idle when none."""
    if claimed and worker_id:  # upstream's worker sync skips a falsy id...
        last = claimed[-1]
        rid, aid = last.rollout_id, last.attempt.attempt_id
        return sync_worker(ctx, run_id, now, worker_id, "preparing", rid, aid, claim=True)
    if not claimed and worker_id is not None:  # ...but its empty-queue idle marking does not
        return idle_on_empty_queue(ctx, run_id, now, worker_id)
    return None


def _claim_many_sqlite(
    ctx: UnitContext, run_id: int, calls: Sequence[tuple[float, tuple[Sequence[str], str | None]]]
) -> list[list[AttemptedRollout]]:
    """SQLite (writers serialised, no locks): the rollouts and attempts of one claim or of several
    calls' claims, without the worker rows: one rollout is picked and marked by one statement,
    several by a pick and a mark; their attempts are one insert."""
    total = sum(len(attempt_ids) for _now, (attempt_ids, _worker_id) in calls)
    if total == 1:
        rows = ctx.execute(cached(("claim_next", ctx.dialect), _claim_next), {"c_run_id": run_id}).all()
        ids = [row.rollout_id for row in rows]
    else:
        ids, rows = _pick_and_mark(ctx, run_id, total) if total else ([], [])
    by_id = {row.rollout_id: row for row in rows}
    picked = iter(ids)
    out: list[list[AttemptedRollout]] = []
    attempt_rows = []
    for now, (attempt_ids, worker_id) in calls:
        claimed = []
        for aid, rid in zip(attempt_ids, picked, strict=False):  # attempt ids first: zip takes no extra id
            row = by_id[rid]
            attempt_rows.append(_attempt_row(run_id, rid, aid, row.attempt_count, worker_id, now))
            claimed.append(_attempted_claim(row, aid, now, worker_id))
        out.append(claimed)
    if attempt_rows:
        ctx.execute(cached("attempt_insert", A.insert), attempt_rows)
    return out


def _attempt_row(
    run_id: int, rollout_id: str, attempt_id: str, sequence_id: int, worker_id: str | None, now: float
) -> dict[str, Any]:
    """The row of a claim's fresh ``preparing`` attempt."""
    return {
        "run_id": run_id,
        "rollout_id": rollout_id,
        "attempt_id": attempt_id,
        "sequence_id": sequence_id,
        "status": "preparing",
        "worker_id": worker_id,
        "start_time": now,
    }


def _replayed_claim(ctx: UnitContext, run_id: int, attempt_ids: Sequence[str]) -> list[AttemptedRollout]:
    rows = ctx.execute(
        select(A).where(A.c.run_id == run_id, A.c.attempt_id.in_(list(attempt_ids)))
    ).all()
    if not rows:
        return []
    attempts = {row.rollout_id: attempt_from_row(row) for row in rows}
    order = {aid: i for i, aid in enumerate(attempt_ids)}
    result = []
    for row in _fetch_rollouts(ctx, run_id, R.c.rollout_id.in_(sorted(attempts))):
        ar = attempted(row, attempts[row.rollout_id])
        assert isinstance(ar, AttemptedRollout)
        result.append(ar)
    result.sort(key=lambda ar: order[ar.attempt.attempt_id])
    return result


def _claim_fresh(
    ctx: UnitContext, run_id: int, now: float, attempt_ids: Sequence[str], worker_id: str | None
) -> tuple[list[AttemptedRollout], bool]:
    """The claimed rollouts, and whether the worker row was synced with them."""
    one_trip = d.claim_in_one_statement(ctx, run_id, now, attempt_ids, worker_id, ROLLOUT_COLUMNS)
    if one_trip is not None:
        return [_attempted_claim(row, row.attempt_id, now, worker_id) for row in one_trip], True
    return _claim_many_sqlite(ctx, run_id, [(now, (attempt_ids, worker_id))])[0], False


def _claim_next() -> Any:
    """Mark the first rollout of the queue claimed (SQLite: writers are serialised, no lock needed)."""
    queued = R.alias("queued")
    first = (
        select(queued.c.rollout_id)
        .where(queued.c.run_id == bindparam("c_run_id"), queued.c.queue_seq.isnot(None))
        .order_by(queued.c.queue_seq)
        .limit(1)
        .scalar_subquery()
    )
    return _mark_claimed(R.c.rollout_id == first)


def _mark_claimed(which: ColumnElement[bool]) -> Any:
    """UPDATE the run's rollouts ``which`` to claimed (``preparing``, out of the queue, one more
    attempt), returning their rows with ``attempt_count``."""
    return (
        update(R)
        .where(R.c.run_id == bindparam("c_run_id"), which)
        .values(status="preparing", queue_seq=None, attempt_count=R.c.attempt_count + 1)
        .returning(*ROLLOUT_COLUMNS, R.c.attempt_count)
    )


def _pick_and_mark(ctx: UnitContext, run_id: int, limit: int) -> tuple[list[str], list[Any]]:
    """The ids of up to ``limit`` queued rollouts in queue order, and their rows once marked claimed."""
    picked = cached(
        ("claim_pick", ctx.dialect),
        lambda: d.for_update(
            ctx,
            select(R.c.rollout_id)
            .where(R.c.run_id == bindparam("c_run_id"), R.c.queue_seq.isnot(None))
            .order_by(R.c.queue_seq)
            .limit(bindparam("c_limit")),
            skip_locked=True,
        ),
    )
    ids = [row[0] for row in ctx.execute(picked, {"c_run_id": run_id, "c_limit": limit})]
    if not ids:
        return [], []
    # One claimed row compares with = : an expanding IN is compiled again per call.
    single = len(ids) == 1
    mark = cached(
        ("claim_mark", single),
        lambda: _mark_claimed(
            R.c.rollout_id == bindparam("c_id") if single else R.c.rollout_id.in_(bindparam("c_ids", expanding=True))
        ),
    )
    params: dict[str, Any] = {"c_run_id": run_id}
    if single:
        params["c_id"] = ids[0]
    else:
        params["c_ids"] = ids
    return ids, ctx.execute(mark, params).all()


def _attempted_claim(row: Any, attempt_id: str, now: float, worker_id: str | None) -> AttemptedRollout:
    """The claimed rollout (a row with ``attempt_count``) with its fresh ``preparing`` attempt."""
    attempt = construct(
        Attempt,
        {
            "rollout_id": row.rollout_id,
            "attempt_id": attempt_id,
            "sequence_id": row.attempt_count,
            "start_time": now,
            "end_time": None,
            "status": "preparing",
            "worker_id": worker_id,
            "last_heartbeat_time": None,
            "metadata": None,
        },
    )
    ar = attempted(row, attempt)
    assert isinstance(ar, AttemptedRollout)
    return ar


def lock_rollout(ctx: UnitContext, run_id: int, rollout_id: str, *, lock: bool = True) -> Any:
    """The rollout row, locked for the rest of the unit (PostgreSQL) unless ``lock=False``, or None."""
    stmt = cached(
        ("rollout_row", ctx.dialect, lock),
        lambda: (d.for_update(ctx, _ROLLOUT_ROW) if lock else _ROLLOUT_ROW),
    )
    return ctx.execute(stmt, {"r_run_id": run_id, "r_rollout_id": rollout_id}).first()


_ROLLOUT_ROW = select(*ROLLOUT_COLUMNS, R.c.attempt_count, R.c.queue_seq).where(
    R.c.run_id == bindparam("r_run_id"), R.c.rollout_id == bindparam("r_rollout_id")
)
_ATTEMPT_BY_ID = select(A).where(
    A.c.run_id == bindparam("r_run_id"),
    A.c.rollout_id == bindparam("r_rollout_id"),
    A.c.attempt_id == bindparam("r_attempt_id"),
)
_ATTEMPT_BY_SEQ = select(A).where(
    A.c.run_id == bindparam("r_run_id"),
    A.c.rollout_id == bindparam("r_rollout_id"),
    A.c.sequence_id == bindparam("r_sequence_id"),
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
    it returns the updated row (every column)."""
    key_names, cols = tuple(keys), tuple(values)
    return d.Write(
        ("update_row", table.name, key_names, cols, prefix, returning),
        lambda: _update_where(table, key_names, cols, prefix).returning(*table.c)
        if returning
        else _update_where(table, key_names, cols, prefix),
        {**{f"{prefix}{k}": v for k, v in keys.items()}, **{f"{prefix}{c}": v for c, v in values.items()}},
    )


def _update_row(ctx: UnitContext, table: Any, keys: dict[str, Any], values: dict[str, Any]) -> None:
    """Write ``values`` into the row named by ``keys`` through a prebuilt statement."""
    _row_write(table, keys, values).execute(ctx)


def start_attempt(
    ctx: UnitContext, run_id: int, now: float, rollout_id: str, attempt_id: str, worker_id: str | None
) -> AttemptedRollout:
    row = lock_rollout(ctx, run_id, rollout_id)
    if row is None:
        raise ValueError(f"Rollout {rollout_id} not found")
    existing = _attempt(ctx, run_id, rollout_id, attempt_id)
    if existing is None:
        seq = row.attempt_count + 1
        ctx.execute(
            update(R)
            .where(R.c.run_id == run_id, R.c.rollout_id == rollout_id)
            .values(status="preparing", queue_seq=None, attempt_count=seq)
        )
        ctx.execute(
            A.insert().values(
                run_id=run_id,
                rollout_id=rollout_id,
                attempt_id=attempt_id,
                sequence_id=seq,
                status="preparing",
                worker_id=worker_id,
                start_time=now,
            )
        )
        if worker_id:  # upstream's worker sync skips a falsy id
            sync = sync_worker(ctx, run_id, now, worker_id, "preparing", rollout_id, attempt_id, claim=False)
            sync.execute(ctx)
        existing = _attempt(ctx, run_id, rollout_id, attempt_id)
        row = lock_rollout(ctx, run_id, rollout_id)
    assert existing is not None
    ar = attempted(row, existing)
    assert isinstance(ar, AttemptedRollout)
    return ar


def enter_or_leave_queue(
    ctx: UnitContext, run_id: int, old_status: str, new_status: str, queue_seq: Any
) -> dict[str, Any]:
    """The ``queue_seq`` change for a status change (contract §2.1)."""
    was_queued = old_status in QUEUED_STATUSES
    is_queued = new_status in QUEUED_STATUSES
    if is_queued and not was_queued:
        ctx.announce(run_id, "queued")
        return {"queue_seq": d.allocate_positions(ctx, run_id, 1)[0]}
    if is_queued and queue_seq is None:  # repair: a queued row always has a position
        return {"queue_seq": d.allocate_positions(ctx, run_id, 1)[0]}
    if was_queued and not is_queued:
        return {"queue_seq": None}
    return {}


def update_rollout(
    ctx: UnitContext, run_id: int, now: float, rollout_id: str, changes: dict[str, Any]
) -> Rollout:
    row = lock_rollout(ctx, run_id, rollout_id)
    if row is None:
        raise ValueError(f"Item does not exist with primary key(s): rollout_id='{rollout_id}'")
    values: dict[str, Any] = {}
    for key in ("input", "mode", "metadata"):
        if key in changes:
            values[key] = changes[key]
    if "resources_id" in changes:
        rid = changes["resources_id"]
        values["resources_id"] = rid
        values["resources_version"] = resource_versions(ctx, run_id, {rid}).get(rid) if rid is not None else None
    if "config" in changes:
        values.update(_config_values(changes["config"]))
    if "status" in changes:
        new_status = changes["status"]
        values["status"] = new_status
        if new_status in FINISHED_STATUSES:
            values["end_time"] = now
            ctx.announce(run_id, "finished")
        values.update(enter_or_leave_queue(ctx, run_id, row.status, new_status, row.queue_seq))
    if values:
        ctx.execute(update(R).where(R.c.run_id == run_id, R.c.rollout_id == rollout_id).values(**values))
    new_row = _fetch_rollouts(ctx, run_id, R.c.rollout_id == rollout_id)[0]
    return rollout_from_row(new_row)


def resolve_attempt(ctx: UnitContext, run_id: int, rollout_id: str, attempt_id: str, *, lock: bool) -> tuple[Any, Any]:
    """(rollout row, attempt row) per the resolution order of contract §2.7, or raise its errors."""
    if lock and (attempt_id == "latest" or is_storable_text(attempt_id)):  # both rows in one statement
        row, attempt_row = d.lock_rollout_and_attempt(ctx, run_id, rollout_id, attempt_id, ROLLOUT_COLUMNS)
        return _resolved(row, attempt_row, rollout_id, attempt_id)
    row = lock_rollout(ctx, run_id, rollout_id, lock=lock)
    if row is None:
        raise ValueError(f"Rollout {rollout_id} not found")
    if row.attempt_count == 0:
        raise ValueError(f"No attempts found for rollout {rollout_id}")
    if attempt_id != "latest" and not is_storable_text(attempt_id):
        # A concrete id that cannot exist in the database (NUL, lone surrogate, too long): it matches
        # nothing, reported after the rollout checks above (§2.7 resolution order).
        raise ValueError(f"Attempt {attempt_id} not found for rollout {rollout_id}")
    latest = attempt_id == "latest"
    base = _ATTEMPT_BY_SEQ if latest else _ATTEMPT_BY_ID
    stmt = cached(("attempt_row", ctx.dialect, latest, lock), lambda: d.for_update(ctx, base) if lock else base)
    params = {"r_run_id": run_id, "r_rollout_id": rollout_id}
    if latest:
        params["r_sequence_id"] = row.attempt_count
    else:
        params["r_attempt_id"] = attempt_id
    attempt_row = ctx.execute(stmt, params).first()
    if attempt_row is None:
        if attempt_id == "latest":
            raise ValueError(f"No attempts found for rollout {rollout_id}")
        raise ValueError(f"Attempt {attempt_id} not found for rollout {rollout_id}")
    return row, attempt_row


def _resolved(row: Any, attempt_row: Any, rollout_id: str, attempt_id: str) -> tuple[Any, Any]:
    """The rows that ``dialect.lock_rollout_and_attempt`` found, or the error of §2.7 they call for."""
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
    specs, worker = _attempt_writes(ctx, run_id, now, row, attempt_row, changes)
    if not specs:
        return attempt_from_row(attempt_row)
    writes = [_spec_write(spec, "") for spec in specs]
    if worker is not None:
        writes.append(write_worker(ctx, run_id, *worker))
    new_row = d.run_writes(ctx, writes)
    assert new_row is not None  # locked above
    return attempt_from_row(new_row)


@dataclass(frozen=True)
class _RowWrite:
    """Writing ``values`` into the row of ``table`` named by ``keys`` (``_row_write``), before its
    parameters are named: ``shape`` tells which statement it takes."""

    table: Any
    keys: dict[str, Any]
    values: dict[str, Any]
    returning: bool = False

    @property
    def shape(self) -> tuple[str, tuple[str, ...], tuple[str, ...], bool]:
        return (self.table.name, tuple(self.keys), tuple(self.values), self.returning)


def _spec_write(spec: _RowWrite, tag: str) -> d.Write:
    """``spec`` as a prebuilt write whose parameters ``tag`` names apart (``ua<tag>_``: attempts)."""
    prefix = f"u{spec.table.name[0]}{tag}_"
    return _row_write(spec.table, spec.keys, spec.values, prefix=prefix, returning=spec.returning)


def _attempt_writes(
    ctx: UnitContext, run_id: int, now: float, row: Any, attempt_row: Any, changes: dict[str, Any]
) -> tuple[list[_RowWrite], tuple[str, dict[str, Any]] | None]:
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
    writes = [_RowWrite(A, keys, values, returning=True)]
    status = values.get("status", attempt_row.status)
    if "status" in changes and attempt_row.sequence_id == row.attempt_count and row.status != "cancelled":
        config = RolloutConfig.model_construct(
            timeout_seconds=row.timeout_seconds,
            unresponsive_seconds=row.unresponsive_seconds,
            max_attempts=row.max_attempts,
            retry_condition=list(row.retry_condition or []),
        )
        new_status = rollout_status_from_attempt(status, attempt_row.sequence_id, config)
        if new_status != row.status:
            rvalues: dict[str, Any] = {"status": new_status}
            if new_status in FINISHED_STATUSES:
                rvalues["end_time"] = now
                ctx.announce(run_id, "finished")
            rvalues.update(enter_or_leave_queue(ctx, run_id, row.status, new_status, row.queue_seq))
            writes.append(_RowWrite(R, {"run_id": run_id, "rollout_id": rollout_id}, rvalues))
    wid = values["worker_id"] if "worker_id" in values else attempt_row.worker_id
    if ("worker_id" in changes and changes["worker_id"]) or ("status" in changes and wid):
        return writes, (wid, worker_following(now, status, rollout_id, aid, claim=False))
    return writes, None


def touch_attempt(ctx: UnitContext, run_id: int, now: float, rollout_id: str, attempt_id: str) -> Attempt:
    # Lock order (§2.17): the rollout row first, so a concurrent sweep either skips this rollout or has
    # committed its verdict before the heartbeat lands (never judges a heartbeat it did not see).
    _row, attempt_row = resolve_attempt(ctx, run_id, rollout_id, attempt_id, lock=True)
    _update_row(
        ctx,
        A,
        {"run_id": run_id, "rollout_id": rollout_id, "attempt_id": attempt_row.attempt_id},
        {"last_heartbeat_time": now},
    )
    attempt = attempt_from_row(attempt_row)
    attempt.last_heartbeat_time = now
    return attempt


# --- reads --------------------------------------------------------------------------------------


def latest_attempts(ctx: UnitContext, run_id: int, rows: Sequence[Any]) -> dict[str, Attempt]:
    """The latest attempt of each rollout row (one query for all of them)."""
    pairs = [(row.rollout_id, row.attempt_count) for row in rows if row.attempt_count > 0]
    if not pairs:
        return {}
    out: dict[str, Attempt] = {}
    if len(pairs) == 1:
        ((rid, seq),) = pairs
        arow = ctx.execute(_ATTEMPT_BY_SEQ, {"r_run_id": run_id, "r_rollout_id": rid, "r_sequence_id": seq}).first()
        if arow is not None:
            out[arow.rollout_id] = attempt_from_row(arow)
        return out
    for arow in d.attempts_by_sequence(ctx, run_id, pairs):
        out[arow.rollout_id] = attempt_from_row(arow)
    return out


def with_latest_attempts(ctx: UnitContext, run_id: int, rows: Sequence[Any]) -> list[Rollout | AttemptedRollout]:
    attempts = latest_attempts(ctx, run_id, rows)
    return [attempted(row, attempts.get(row.rollout_id)) for row in rows]


def _membership(values: list[str] | None) -> bool | None:
    """A list filter's shape: None no filter, True a bound list, False nothing can match."""
    if values is None:
        return None
    return bool(values)


def _rollout_query(ctx: UnitContext, shape: tuple[Any, ...]) -> tuple[Any, Any]:
    """(page statement, count statement) of ``query_rollouts`` for one shape, ``q_*`` placeholders."""
    status, ids, contains, keys, logic, sort_by, sort_order, has_limit, has_offset = shape
    conditions: list[ColumnElement[bool]] = []
    for column, name, kind in ((R.c.status, "q_status", status), (R.c.rollout_id, "q_ids", ids)):
        if kind is not None:
            conditions.append(column.in_(bindparam(name, expanding=True)) if kind else f.false())
    if contains is not None:
        conditions.append(d.contains(ctx, R.c.rollout_id, bindparam("q_contains")) if contains else f.false())
    if keys is not None:
        conditions.append(R.c.idempotency_key.in_(bindparam("q_keys", expanding=True)) if keys else f.false())
    where = [R.c.run_id == bindparam("q_run_id")]
    if conditions:
        where.append(f.pool(conditions, logic))
    order = f.order_by(f.ROLLOUT_SORT, sort_by, sort_order)
    page = select(*ROLLOUT_COLUMNS, R.c.attempt_count).where(*where).order_by(*order)
    if has_limit:
        page = page.limit(bindparam("q_limit"))
    if has_offset:
        page = page.offset(bindparam("q_offset"))
    return page, select(func.count()).select_from(R).where(*where)


def query_rollouts(
    ctx: UnitContext,
    run_id: int,
    status_in: list[str] | None,
    rollout_id_in: list[str] | None,
    rollout_id_contains: str | None,
    idempotency_key_in: list[str] | None,
    filter_logic: str,
    limit: int,
    offset: int,
    sort_by: str | None,
    sort_order: str,
) -> PaginatedResult[Rollout | AttemptedRollout]:
    """One page of the run's rollouts (each with its latest attempt) and the number of matches,
    through a statement prebuilt per query shape (which filters are present, sort, pagination).
    Ids and keys that could not be stored match nothing."""
    ids = None if rollout_id_in is None else [v for v in rollout_id_in if is_storable_text(v)]
    keys = None if idempotency_key_in is None else [v for v in idempotency_key_in if is_storable_text(v)]
    contains = None if rollout_id_contains is None else is_storable_text(rollout_id_contains)
    shape = (
        _membership(status_in),
        _membership(ids),
        contains,
        _membership(keys),
        filter_logic,
        sort_by,
        sort_order,
        limit != -1,
        offset != 0,
    )
    page, count = cached(("query_rollouts", ctx.dialect, shape), lambda: _rollout_query(ctx, shape))
    params: dict[str, Any] = {"q_run_id": run_id}
    for name, values in (("q_status", status_in), ("q_ids", ids), ("q_keys", keys)):
        if values:
            params[name] = values
    if contains:
        params["q_contains"] = rollout_id_contains
    rows, total = f.fetch_page(ctx, page, count, params, limit, offset)
    items = with_latest_attempts(ctx, run_id, rows)
    return PaginatedResult(items=items, limit=limit, offset=offset, total=total)


def get_rollout(ctx: UnitContext, run_id: int, rollout_id: str) -> Rollout | AttemptedRollout | None:
    rows = ctx.execute(_ROLLOUT_WITH_COUNT, {"r_run_id": run_id, "r_rollout_id": rollout_id}).all()
    if not rows:
        return None
    return with_latest_attempts(ctx, run_id, rows)[0]


_ROLLOUT_WITH_COUNT = select(*ROLLOUT_COLUMNS, R.c.attempt_count).where(
    R.c.run_id == bindparam("r_run_id"), R.c.rollout_id == bindparam("r_rollout_id")
)


def rollout_exists(ctx: UnitContext, run_id: int, rollout_id: str) -> bool:
    row = ctx.execute(
        select(R.c.rollout_id).where(R.c.run_id == run_id, R.c.rollout_id == rollout_id)
    ).first()
    return row is not None


def get_latest_attempt(ctx: UnitContext, run_id: int, rollout_id: str) -> Attempt | None:
    row = ctx.execute(
        select(A)
        .where(A.c.run_id == run_id, A.c.rollout_id == rollout_id)
        .order_by(A.c.sequence_id.desc())
        .limit(1)
    ).first()
    return attempt_from_row(row) if row is not None else None


def finished_rollouts(
    ctx: UnitContext, run_id: int, rollout_ids: Sequence[str]
) -> tuple[list[Rollout], int, int]:
    """(finished rollouts in request order, one per requested id as upstream returns them; number of
    distinct ids that exist; number of distinct ids finished)."""
    rows = ctx.execute(
        select(*ROLLOUT_COLUMNS).where(R.c.run_id == run_id, R.c.rollout_id.in_(sorted(set(rollout_ids))))
    ).all()
    finished = {row.rollout_id: rollout_from_row(row) for row in rows if row.status in FINISHED_STATUSES}
    return [finished[rid] for rid in rollout_ids if rid in finished], len(rows), len(finished)


def queue_depth(ctx: UnitContext, run_id: int) -> int:
    return int(
        ctx.execute(
            select(func.count()).select_from(R).where(R.c.run_id == run_id, R.c.queue_seq.isnot(None))
        ).scalar_one()
    )


def has_queued(ctx: UnitContext, run_id: int) -> bool:
    row = ctx.execute(
        select(R.c.queue_seq).where(R.c.run_id == run_id, R.c.queue_seq.isnot(None)).limit(1)
    ).first()
    return row is not None
