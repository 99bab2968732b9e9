"""Units of work for rollouts, the queue, claims and attempts (docs/store-contract.md §2.1-§2.8, §2.11).

Every function here is one unit: sync SQLAlchemy Core over ``ctx.conn`` inside the transaction the
I/O worker opened.  Ids and *now* are decided by the caller before the first try, so a replay after
a lost commit finds its own rows instead of acting twice (docs/store-contract.md §0.3).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

from sqlalchemy import ColumnElement, Text, and_, bindparam, func, select, update

from lightning_sql.store.sql import dialect as d
from lightning_sql.store.sql import filters as f
from lightning_sql.store.sql import schema as s
from lightning_sql.store.sql.executor import Batch, EncodedJson, Operation, UnitContext
from lightning_sql.store.sql.rows import (
    ATTEMPT_FIELDS,
    ROLLOUT_COLUMNS,
    as_mapping,
    attempt_from_row,
    attempted,
    config_copy,
    rollout_from_row,
)
from lightning_sql.store.sql.statements import cached
from lightning_sql.store.sql.workers import follow, following
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
    priority: int = 0
    # The decoded values, to build the returned model without reading the row back.
    input_value: Any = None
    metadata_value: Any = None


def _config_values(config: RolloutConfig) -> dict[str, Any]:
    return {
        "timeout_seconds": config.timeout_seconds,
        "unresponsive_seconds": config.unresponsive_seconds,
        "max_attempts": config.max_attempts,
        "retry_condition": EncodedJson(_retry_json(config.retry_condition)),
        "retry_backoff_seconds": config.retry_backoff_seconds,
        "retry_backoff_factor": config.retry_backoff_factor,
        "retry_backoff_max_seconds": config.retry_backoff_max_seconds,
    }


def _retry_json(statuses: Sequence[str]) -> str:
    return "[" + ",".join(f'"{status}"' for status in statuses) + "]"


def _rollout_row(
    run_id: int, now: float, item: NewRollout, status: str, resources: tuple[str | None, int | None], pos: int
) -> dict[str, Any]:
    """The row of a new rollout: ``enqueue``'s queued at ``pos``, ``start_rollout``'s outside the queue."""
    rid, version = resources
    return {
        "run_id": run_id,
        "rollout_id": item.rollout_id,
        "input": item.input,
        "mode": item.mode,
        "resources_id": rid,
        "resources_version": version,
        "status": status,
        **_config_values(item.config),
        "metadata": item.metadata,
        "idempotency_key": item.idempotency_key,
        "start_time": now,
        "end_time": None,
        "queue_seq": pos if status == "queuing" else None,
        "create_seq": pos,
        "priority": item.priority,
        "not_before": None,
    }


def _created(item: NewRollout, row: dict[str, Any]) -> dict[str, Any]:
    """The model fields of the rollout whose ``row`` was just written for ``item`` (not read back)."""
    return {
        "rollout_id": item.rollout_id,
        "input": item.input_value,
        "start_time": row["start_time"],
        "end_time": None,
        "mode": item.mode,
        "resources_id": row["resources_id"],
        "status": row["status"],
        "config": config_copy(item.config),
        "metadata": item.metadata_value,
        "resources_version": row["resources_version"],
        "idempotency_key": item.idempotency_key,
        "priority": item.priority,
        "not_before": None,
    }


def attempt_row(
    run_id: int, rollout_id: str, attempt_id: str, sequence_id: int, worker_id: str | None, now: float
) -> dict[str, Any]:
    """The row of a fresh ``preparing`` attempt."""
    return {
        "run_id": run_id,
        "rollout_id": rollout_id,
        "attempt_id": attempt_id,
        "sequence_id": sequence_id,
        "status": "preparing",
        "worker_id": worker_id,
        "start_time": now,
    }


def preparing_attempt(
    rollout_id: str, attempt_id: str, sequence_id: int, worker_id: str | None, now: float
) -> Attempt:
    """The model of a fresh ``preparing`` attempt (its row is not read back)."""
    return Attempt.model_construct(
        rollout_id=rollout_id,
        attempt_id=attempt_id,
        sequence_id=sequence_id,
        start_time=now,
        end_time=None,
        status="preparing",
        worker_id=worker_id,
        last_heartbeat_time=None,
        metadata=None,
    )


def insert_attempt(
    ctx: UnitContext, run_id: int, now: float, rollout_id: str, attempt_id: str, seq: int, worker_id: str | None
) -> None:
    """Insert a fresh ``preparing`` attempt and make its worker, if any, busy on it."""
    ctx.execute(A.insert().values(**attempt_row(run_id, rollout_id, attempt_id, seq, worker_id, now)))
    if worker_id:  # upstream's worker sync skips a falsy id
        follow(ctx, following(run_id, worker_id, "preparing", now, rollout_id, attempt_id))


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


def fetch_rollouts(ctx: UnitContext, run_id: int, where: Any) -> list[Any]:
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
        params = [
            _rollout_row(run_id, now, item, "queuing", resources, pos)
            for item, resources, pos in zip(fresh, resolved, positions, strict=True)
        ]
        insert_rollouts = cached(
            ("enqueue_insert", ctx.dialect),
            lambda: d.insert(ctx, R).on_conflict_do_nothing().returning(R.c.rollout_id),
        )
        inserted = {row[0] for row in ctx.execute(insert_rollouts, params)}
        for item, p in zip(fresh, params, strict=True):
            if item.rollout_id in inserted:
                created[item.rollout_id] = Rollout.model_construct(**_created(item, p))
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
    """Create a rollout with its first attempt, both ``preparing``, outside the queue (``item`` has no
    idempotency key: ``start_rollout`` takes none)."""
    existing = fetch_rollouts(ctx, run_id, R.c.rollout_id == item.rollout_id)
    if existing:  # replay after a lost commit
        attempt = find_attempt(ctx, run_id, item.rollout_id, attempt_id)
        assert attempt is not None
        result = attempted(existing[0], attempt)
        assert isinstance(result, AttemptedRollout)
        return result
    (resources,) = _resolve_resources(ctx, run_id, [item])
    (pos,) = d.allocate_positions(ctx, run_id, 1)
    row = _rollout_row(run_id, now, item, "preparing", resources, pos)
    ctx.execute(R.insert().values(**row, attempt_count=1))
    insert_attempt(ctx, run_id, now, item.rollout_id, attempt_id, 1, worker_id)
    attempt = preparing_attempt(item.rollout_id, attempt_id, 1, worker_id, now)
    return AttemptedRollout.model_construct(**_created(item, row), attempt=attempt)


_ROLLOUT_ROW = select(*ROLLOUT_COLUMNS, R.c.attempt_count, R.c.queue_seq).where(
    R.c.run_id == bindparam("r_run_id"), R.c.rollout_id == bindparam("r_rollout_id")
)
ATTEMPT_BY_ID = select(A).where(
    A.c.run_id == bindparam("r_run_id"),
    A.c.rollout_id == bindparam("r_rollout_id"),
    A.c.attempt_id == bindparam("r_attempt_id"),
)


def find_attempt(ctx: UnitContext, run_id: int, rollout_id: str, attempt_id: str) -> Attempt | None:
    row = ctx.execute(
        ATTEMPT_BY_ID, {"r_run_id": run_id, "r_rollout_id": rollout_id, "r_attempt_id": attempt_id}
    ).first()
    return attempt_from_row(row) if row is not None else None


def lock_rollout(ctx: UnitContext, run_id: int, rollout_id: str, *, lock: bool = True) -> Any:
    """The rollout row, locked for the rest of the unit (PostgreSQL) unless ``lock=False``, or None."""
    stmt = cached(
        ("rollout_row", ctx.dialect, lock),
        lambda: (d.for_update(ctx, _ROLLOUT_ROW) if lock else _ROLLOUT_ROW),
    )
    return ctx.execute(stmt, {"r_run_id": run_id, "r_rollout_id": rollout_id}).first()


def enter_or_leave_queue(
    ctx: UnitContext, run_id: int, old_status: str, new_status: str, queue_seq: Any
) -> dict[str, Any]:
    """The ``queue_seq`` change for a status change (docs/store-contract.md §2.1)."""
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
    for key in ("input", "mode", "metadata", "priority"):
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
        if new_status in QUEUED_STATUSES:  # a status set by hand is claimable at once (docs/queue.md)
            values["not_before"] = None
    if values:
        ctx.execute(update(R).where(R.c.run_id == run_id, R.c.rollout_id == rollout_id).values(**values))
    new_row = fetch_rollouts(ctx, run_id, R.c.rollout_id == rollout_id)[0]
    return rollout_from_row(new_row)


# A rollout with its latest attempt, whose columns read as ``a_<field>`` (``latest_attempt``).
_LATEST = A.alias("latest")
_WITH_LATEST = R.outerjoin(
    _LATEST,
    and_(_LATEST.c.run_id == R.c.run_id, _LATEST.c.rollout_id == R.c.rollout_id, _LATEST.c.sequence_id == R.c.attempt_count),
)
_LATEST_COLUMNS = [_LATEST.c[name].label(f"a_{name}") for name in ATTEMPT_FIELDS]


def latest_attempt(row: Any) -> Attempt | None:
    """The latest attempt in a row read with ``_LATEST_COLUMNS``, or None when it has none."""
    m = as_mapping(row)
    if m["a_attempt_id"] is None:
        return None
    return Attempt.model_construct(**{name: m[f"a_{name}"] for name in ATTEMPT_FIELDS})


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
    attempts = {}
    if pairs := [(row.rollout_id, row.attempt_count) for row in rows if row.attempt_count > 0]:
        attempts = {arow.rollout_id: attempt_from_row(arow) for arow in d.attempts_by_sequence(ctx, run_id, pairs)}
    items = [attempted(row, attempts.get(row.rollout_id)) for row in rows]
    return PaginatedResult(items=items, limit=limit, offset=offset, total=total)


@dataclass(eq=False, slots=True)
class ReadRollout(Operation):
    """``get_rollout_by_id`` (the rollout with its latest attempt), or with ``attempt_only``
    ``get_latest_attempt``: calls of one run read together, one statement over their ids."""

    name: ClassVar[str] = "read_rollout"
    write: ClassVar[bool] = False
    run_id: int
    rollout_id: str
    attempt_only: bool = False

    @classmethod
    def outcomes(cls, batch: Batch, rows: Any) -> list[Any]:
        by_call = {row["n"]: row for row in rows}
        out: list[Any] = []
        for n, call in enumerate(batch.calls, 1):
            assert isinstance(call, ReadRollout)
            row = by_call.get(n)
            attempt = None if row is None else latest_attempt(row)
            if call.attempt_only:
                out.append(attempt)
            else:
                out.append(None if row is None else attempted(row, attempt))
        return out


READ_ROLLOUT_KEYS: list[d.KeyColumn] = [("rollout_id", Text())]


def read_rollout_statement(dialect: str, single: bool) -> Any:
    """The rollouts of the batch's keys with their latest attempts (``a_*``), each with ``n``."""
    keys = d.keys_source(dialect, "r", READ_ROLLOUT_KEYS, single=single)
    rollout = and_(R.c.run_id == keys.c.run_id, R.c.rollout_id == keys.c.rollout_id)
    stmt = select(keys.c.n.label("n"), *ROLLOUT_COLUMNS, R.c.attempt_count, *_LATEST_COLUMNS)
    if single:
        return stmt.select_from(_WITH_LATEST).where(rollout)
    return stmt.select_from(keys.join(_WITH_LATEST, rollout))


def read_rollout_params(dialect: str, batch: Batch) -> tuple[dict[str, Any], bool]:
    single = len(batch.calls) == 1
    rows = [(call.rollout_id,) for call in batch.calls]  # type: ignore[attr-defined]
    return {"run_id": batch.run_id, **d.keys_params(dialect, "r", READ_ROLLOUT_KEYS, rows, single=single)}, single


def rollout_exists(ctx: UnitContext, run_id: int, rollout_id: str) -> bool:
    row = ctx.execute(
        select(R.c.rollout_id).where(R.c.run_id == run_id, R.c.rollout_id == rollout_id)
    ).first()
    return row is not None


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


def queue_state(ctx: UnitContext, run_id: int, now: float) -> tuple[bool, float | None]:
    """(whether a claim at ``now`` finds work, the earliest ``not_before`` in back-off): the heads of
    the claimable and the delayed index (docs/queue.md); a paused run has none."""
    if ctx.execute(select(s.runs.c.paused).where(s.runs.c.run_id == run_id)).scalar():
        return False, None
    if ctx.execute(select(R.c.queue_seq).where(R.c.run_id == run_id, s.CLAIMABLE).limit(1)).first() is not None:
        return True, None
    due = ctx.execute(select(func.min(R.c.not_before)).where(R.c.run_id == run_id, s.DELAYED)).scalar()
    return due is not None and due <= now, due
