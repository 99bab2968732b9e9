"""The invariant checker: is one run's state consistent? (issue 4, ``lightning-sql check``).

``check_run(conn, run)`` is a read-only unit of work over one connection; ``check_invariants(store)``
runs it for the store's bound run through the store's own I/O worker, so it works on every backend
(SQLite file, aiosqlite, PostgreSQL in any schema).  Both return a list of human-readable violations:
empty means consistent.

Two families of invariants (docs/operations.md lists them with the tests that rely on them):

* **Structural** invariants hold after ANY sequence of store calls, including ``update_rollout(
  status=...)`` by hand, and after a crash at any point (every call is one transaction):
  valid status literals; ``queue_seq`` set ⇔ status queuing/requeuing; ``queue_seq`` and every other
  per-run position unique; finished rollouts and finished attempts have an ``end_time``;
  ``attempt_count`` = number of attempts = highest attempt ``sequence_id``, sequence ids contiguous
  from 1; ``span_seq`` ≥ the highest span ``sequence_id`` of the rollout; no orphan attempts, spans or
  resource versions; a busy worker points at its attempt and every worker's current ids name an
  existing attempt; every resources id has its full history ``1..version``.
* **Lifecycle** invariants hold as long as rollout statuses are driven only by the store's lifecycle
  (enqueue, claim, spans, ``update_attempt``, the sweeper, ``start_attempt``) — i.e. nobody called
  ``update_rollout(status=...)``, which the contract allows to set any status: a queuing rollout has
  no attempt; a requeuing one has a latest attempt that failed/timed out/became unresponsive; a
  preparing/running rollout has a latest attempt with the same status; a succeeded rollout's latest
  attempt succeeded; a cancelled rollout has no attempt in flight (``cancel_rollout``/``cancel_run``
  end it).  Structural too: a rollout in back-off (queued with ``not_before``) is requeuing.  Pass
  ``lifecycle=False`` to check the structural family only.

Each invariant is one SQL statement, so it is judged on one snapshot and a live run is never reported
inconsistent because a writer committed halfway through a check.  On PostgreSQL the unit also reads
under ``REPEATABLE READ`` so the whole report describes one moment; SQLite's read transaction is a
snapshot already.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from sqlalchemy import Connection, and_, func, not_, or_, select, text
from sqlalchemy.sql import Select

from lightning_sql.store.sql import schema as s
from lightning_sql.store.sql.executor import UnitContext

if TYPE_CHECKING:
    from lightning_sql.store.sql.store import SqlLightningStore

__all__ = ["MAX_EXAMPLES", "check_run", "check_invariants", "check_url"]

# Offending rows reported per invariant: enough to debug, bounded for a run of 100k rollouts.
MAX_EXAMPLES = 10

ROLLOUT_STATUSES = ("queuing", "preparing", "running", "failed", "succeeded", "cancelled", "requeuing")
ATTEMPT_STATUSES = ("preparing", "running", "failed", "succeeded", "unresponsive", "timeout")
WORKER_STATUSES = ("idle", "busy", "unknown")
_QUEUED = ("queuing", "requeuing")
_IN_FLIGHT = ("preparing", "running")
_FINISHED_ROLLOUT = ("failed", "succeeded", "cancelled")
_FINISHED_ATTEMPT = ("failed", "succeeded")
_RETRYABLE_ATTEMPT = ("failed", "timeout", "unresponsive")

# Fixed text (no runtime values): one snapshot for every statement of the unit on PostgreSQL.
_PG_SNAPSHOT = "SET TRANSACTION ISOLATION LEVEL REPEATABLE READ READ ONLY"
# Isolation levels of a connection whose transaction is one snapshot already (the store's worker
# begins the checker's transaction as REPEATABLE READ READ ONLY: ``snapshot=True``).
_PG_SNAPSHOTS = ("REPEATABLE READ", "SERIALIZABLE")

R = s.rollouts
A = s.attempts
S = s.spans
W = s.workers
RS = s.resources
RV = s.resource_versions


@dataclass(frozen=True)
class Invariant:
    """One invariant: the query that lists rows breaking it, and how to describe one such row."""

    name: str
    family: str  # "structural" | "lifecycle"
    offenders: Callable[[int], Select[Any]]
    describe: Callable[[Any], str]


def _attempt_stats(run_id: int) -> Any:
    return (
        select(
            A.c.rollout_id,
            func.count().label("n"),
            func.min(A.c.sequence_id).label("lo"),
            func.max(A.c.sequence_id).label("hi"),
        )
        .where(A.c.run_id == run_id)
        .group_by(A.c.rollout_id)
        .subquery("attempt_stats")
    )


def _latest_attempt_join(run_id: int) -> Any:
    """Rollouts of the run LEFT JOINed with their latest attempt (``sequence_id = attempt_count``)."""
    return R.outerjoin(
        A,
        and_(A.c.run_id == R.c.run_id, A.c.rollout_id == R.c.rollout_id, A.c.sequence_id == R.c.attempt_count),
    )


def _duplicates(table: Any, column: Any, run_id: int, where: Any = None) -> Select[Any]:
    stmt = select(column, func.count().label("n")).where(table.c.run_id == run_id)
    if where is not None:
        stmt = stmt.where(where)
    return stmt.group_by(column).having(func.count() > 1).order_by(column)


def _rollout_status_valid(run_id: int) -> Select[Any]:
    return (
        select(R.c.rollout_id, R.c.status)
        .where(R.c.run_id == run_id, R.c.status.not_in(ROLLOUT_STATUSES))
        .order_by(R.c.rollout_id)
    )


def _queue_membership(run_id: int) -> Select[Any]:
    queued = R.c.status.in_(_QUEUED)
    return (
        select(R.c.rollout_id, R.c.status, R.c.queue_seq)
        .where(
            R.c.run_id == run_id,
            or_(and_(queued, R.c.queue_seq.is_(None)), and_(not_(queued), R.c.queue_seq.isnot(None))),
        )
        .order_by(R.c.rollout_id)
    )


def _finished_rollout_end_time(run_id: int) -> Select[Any]:
    return (
        select(R.c.rollout_id, R.c.status)
        .where(R.c.run_id == run_id, R.c.status.in_(_FINISHED_ROLLOUT), R.c.end_time.is_(None))
        .order_by(R.c.rollout_id)
    )


def _attempt_counts(run_id: int) -> Select[Any]:
    st = _attempt_stats(run_id)
    n = func.coalesce(st.c.n, 0)
    hi = func.coalesce(st.c.hi, 0)
    return (
        select(R.c.rollout_id, R.c.attempt_count, n.label("n"), st.c.lo, hi.label("hi"))
        .select_from(R.outerjoin(st, st.c.rollout_id == R.c.rollout_id))
        .where(
            R.c.run_id == run_id,
            or_(R.c.attempt_count != n, R.c.attempt_count != hi, and_(st.c.lo.isnot(None), st.c.lo != 1)),
        )
        .order_by(R.c.rollout_id)
    )


def _span_counter(run_id: int) -> Select[Any]:
    top = (
        select(S.c.rollout_id, func.max(S.c.sequence_id).label("top"))
        .where(S.c.run_id == run_id)
        .group_by(S.c.rollout_id)
        .subquery("span_top")
    )
    return (
        select(R.c.rollout_id, R.c.span_seq, top.c.top)
        .select_from(R.join(top, top.c.rollout_id == R.c.rollout_id))
        .where(R.c.run_id == run_id, R.c.span_seq < top.c.top)
        .order_by(R.c.rollout_id)
    )


def _attempt_status_valid(run_id: int) -> Select[Any]:
    return (
        select(A.c.rollout_id, A.c.attempt_id, A.c.status)
        .where(A.c.run_id == run_id, A.c.status.not_in(ATTEMPT_STATUSES))
        .order_by(A.c.rollout_id, A.c.attempt_id)
    )


def _finished_attempt_end_time(run_id: int) -> Select[Any]:
    return (
        select(A.c.rollout_id, A.c.attempt_id, A.c.status)
        .where(A.c.run_id == run_id, A.c.status.in_(_FINISHED_ATTEMPT), A.c.end_time.is_(None))
        .order_by(A.c.rollout_id, A.c.attempt_id)
    )


def _orphan_attempts(run_id: int) -> Select[Any]:
    parent = select(R.c.rollout_id).where(R.c.run_id == A.c.run_id, R.c.rollout_id == A.c.rollout_id)
    return (
        select(A.c.rollout_id, A.c.attempt_id)
        .where(A.c.run_id == run_id, not_(parent.exists()))
        .order_by(A.c.rollout_id, A.c.attempt_id)
    )


def _orphan_spans(run_id: int) -> Select[Any]:
    parent = select(A.c.attempt_id).where(
        A.c.run_id == S.c.run_id, A.c.rollout_id == S.c.rollout_id, A.c.attempt_id == S.c.attempt_id
    )
    return (
        select(S.c.rollout_id, S.c.attempt_id, S.c.span_id)
        .where(S.c.run_id == run_id, not_(parent.exists()))
        .order_by(S.c.rollout_id, S.c.attempt_id, S.c.span_id)
    )


def _worker_status_valid(run_id: int) -> Select[Any]:
    return (
        select(W.c.worker_id, W.c.status)
        .where(W.c.run_id == run_id, W.c.status.not_in(WORKER_STATUSES))
        .order_by(W.c.worker_id)
    )


def _worker_assignment(run_id: int) -> Select[Any]:
    target = select(A.c.attempt_id).where(
        A.c.run_id == W.c.run_id, A.c.rollout_id == W.c.current_rollout_id, A.c.attempt_id == W.c.current_attempt_id
    )
    half_set = or_(
        and_(W.c.current_rollout_id.is_(None), W.c.current_attempt_id.isnot(None)),
        and_(W.c.current_rollout_id.isnot(None), W.c.current_attempt_id.is_(None)),
    )
    dangling = and_(W.c.current_attempt_id.isnot(None), not_(target.exists()))
    busy_without = and_(W.c.status == "busy", W.c.current_attempt_id.is_(None))
    return (
        select(W.c.worker_id, W.c.status, W.c.current_rollout_id, W.c.current_attempt_id)
        .where(W.c.run_id == run_id, or_(half_set, dangling, busy_without))
        .order_by(W.c.worker_id)
    )


def _resource_history(run_id: int) -> Select[Any]:
    hist = (
        select(
            RV.c.resources_id,
            func.count().label("n"),
            func.min(RV.c.version).label("lo"),
            func.max(RV.c.version).label("hi"),
        )
        .where(RV.c.run_id == run_id)
        .group_by(RV.c.resources_id)
        .subquery("history")
    )
    n = func.coalesce(hist.c.n, 0)
    return (
        select(RS.c.resources_id, RS.c.version, n.label("n"), hist.c.lo, hist.c.hi)
        .select_from(RS.outerjoin(hist, hist.c.resources_id == RS.c.resources_id))
        .where(
            RS.c.run_id == run_id,
            or_(RS.c.version < 1, n != RS.c.version, hist.c.lo != 1, hist.c.hi != RS.c.version),
        )
        .order_by(RS.c.resources_id)
    )


def _orphan_resource_versions(run_id: int) -> Select[Any]:
    current = select(RS.c.resources_id).where(RS.c.run_id == RV.c.run_id, RS.c.resources_id == RV.c.resources_id)
    return (
        select(RV.c.resources_id, func.count().label("n"))
        .where(RV.c.run_id == run_id, not_(current.exists()))
        .group_by(RV.c.resources_id)
        .order_by(RV.c.resources_id)
    )


def _queuing_has_no_attempt(run_id: int) -> Select[Any]:
    return (
        select(R.c.rollout_id, R.c.attempt_count)
        .where(R.c.run_id == run_id, R.c.status == "queuing", R.c.attempt_count != 0)
        .order_by(R.c.rollout_id)
    )


def _requeuing_after_retryable(run_id: int) -> Select[Any]:
    return (
        select(R.c.rollout_id, R.c.attempt_count, A.c.attempt_id, A.c.status.label("attempt_status"))
        .select_from(_latest_attempt_join(run_id))
        .where(
            R.c.run_id == run_id,
            R.c.status == "requeuing",
            or_(A.c.attempt_id.is_(None), A.c.status.not_in(_RETRYABLE_ATTEMPT)),
        )
        .order_by(R.c.rollout_id)
    )


def _in_flight_follows_attempt(run_id: int) -> Select[Any]:
    return (
        select(R.c.rollout_id, R.c.status, A.c.attempt_id, A.c.status.label("attempt_status"))
        .select_from(_latest_attempt_join(run_id))
        .where(
            R.c.run_id == run_id,
            R.c.status.in_(_IN_FLIGHT),
            or_(A.c.attempt_id.is_(None), A.c.status != R.c.status),
        )
        .order_by(R.c.rollout_id)
    )


def _succeeded_follows_attempt(run_id: int) -> Select[Any]:
    return (
        select(R.c.rollout_id, A.c.attempt_id, A.c.status.label("attempt_status"))
        .select_from(_latest_attempt_join(run_id))
        .where(
            R.c.run_id == run_id,
            R.c.status == "succeeded",
            or_(A.c.attempt_id.is_(None), A.c.status != "succeeded"),
        )
        .order_by(R.c.rollout_id)
    )


def _delayed_is_requeuing(run_id: int) -> Select[Any]:
    """A rollout in back-off (queued with ``not_before``) got there by a requeue (docs/queue.md)."""
    return (
        select(R.c.rollout_id, R.c.status, R.c.not_before)
        .where(R.c.run_id == run_id, R.c.queue_seq.isnot(None), R.c.not_before.isnot(None), R.c.status != "requeuing")
        .order_by(R.c.rollout_id)
    )


def _cancelled_has_nothing_in_flight(run_id: int) -> Select[Any]:
    return (
        select(R.c.rollout_id, A.c.attempt_id, A.c.status.label("attempt_status"))
        .select_from(_latest_attempt_join(run_id))
        .where(R.c.run_id == run_id, R.c.status == "cancelled", A.c.status.in_(_IN_FLIGHT))
        .order_by(R.c.rollout_id)
    )


INVARIANTS: tuple[Invariant, ...] = (
    Invariant(
        "rollout status is a valid literal",
        "structural",
        _rollout_status_valid,
        lambda r: f"rollout {r.rollout_id}: unknown status {r.status!r}",
    ),
    Invariant(
        "queue_seq is set iff status is queuing/requeuing",
        "structural",
        _queue_membership,
        lambda r: f"rollout {r.rollout_id}: status {r.status!r} with queue_seq={r.queue_seq}",
    ),
    Invariant(
        "queue_seq is unique within the run",
        "structural",
        lambda run_id: _duplicates(R, R.c.queue_seq, run_id, R.c.queue_seq.isnot(None)),
        lambda r: f"queue_seq {r.queue_seq} is held by {r.n} rollouts",
    ),
    Invariant(
        "rollout create_seq is unique within the run",
        "structural",
        lambda run_id: _duplicates(R, R.c.create_seq, run_id),
        lambda r: f"rollout create_seq {r.create_seq} is held by {r.n} rollouts",
    ),
    Invariant(
        "finished rollouts have an end_time",
        "structural",
        _finished_rollout_end_time,
        lambda r: f"rollout {r.rollout_id}: status {r.status!r} without end_time",
    ),
    Invariant(
        "attempt_count = number of attempts = highest sequence_id, sequence ids contiguous from 1",
        "structural",
        _attempt_counts,
        lambda r: (
            f"rollout {r.rollout_id}: attempt_count={r.attempt_count} but {r.n} attempts "
            f"with sequence ids {r.lo}..{r.hi}"
        ),
    ),
    Invariant(
        "span_seq >= the highest span sequence_id of the rollout",
        "structural",
        _span_counter,
        lambda r: f"rollout {r.rollout_id}: span_seq={r.span_seq} below span sequence_id {r.top}",
    ),
    Invariant(
        "attempt status is a valid literal",
        "structural",
        _attempt_status_valid,
        lambda r: f"attempt {r.rollout_id}/{r.attempt_id}: unknown status {r.status!r}",
    ),
    Invariant(
        "succeeded/failed attempts have an end_time",
        "structural",
        _finished_attempt_end_time,
        lambda r: f"attempt {r.rollout_id}/{r.attempt_id}: status {r.status!r} without end_time",
    ),
    Invariant(
        "every attempt belongs to an existing rollout",
        "structural",
        _orphan_attempts,
        lambda r: f"attempt {r.rollout_id}/{r.attempt_id}: orphan (no such rollout)",
    ),
    Invariant(
        "every span belongs to an existing attempt",
        "structural",
        _orphan_spans,
        lambda r: f"span {r.rollout_id}/{r.attempt_id}/{r.span_id}: orphan (no such attempt)",
    ),
    Invariant(
        "worker status is a valid literal",
        "structural",
        _worker_status_valid,
        lambda r: f"worker {r.worker_id!r}: unknown status {r.status!r}",
    ),
    Invariant(
        "worker current ids name an existing attempt; a busy worker has one",
        "structural",
        _worker_assignment,
        lambda r: (
            f"worker {r.worker_id!r}: status {r.status!r}, current_rollout_id={r.current_rollout_id!r}, "
            f"current_attempt_id={r.current_attempt_id!r}"
        ),
    ),
    Invariant(
        "resources touch_seq is unique within the run",
        "structural",
        lambda run_id: _duplicates(RS, RS.c.touch_seq, run_id),
        lambda r: f"resources touch_seq {r.touch_seq} is held by {r.n} resources",
    ),
    Invariant(
        "resources history holds versions 1..version",
        "structural",
        _resource_history,
        lambda r: (
            f"resources {r.resources_id!r}: version={r.version} but history has {r.n} versions "
            f"({r.lo}..{r.hi})"
        ),
    ),
    Invariant(
        "every resources version belongs to existing resources",
        "structural",
        _orphan_resource_versions,
        lambda r: f"resources {r.resources_id!r}: {r.n} history rows without a current row",
    ),
    Invariant(
        "a queuing rollout has no attempt",
        "lifecycle",
        _queuing_has_no_attempt,
        lambda r: f"rollout {r.rollout_id}: queuing with attempt_count={r.attempt_count}",
    ),
    Invariant(
        "a requeuing rollout's latest attempt failed, timed out or became unresponsive",
        "lifecycle",
        _requeuing_after_retryable,
        lambda r: (
            f"rollout {r.rollout_id}: requeuing but latest attempt {r.attempt_id} "
            f"(attempt_count={r.attempt_count}) is {r.attempt_status!r}"
        ),
    ),
    Invariant(
        "a preparing/running rollout's latest attempt has the same status",
        "lifecycle",
        _in_flight_follows_attempt,
        lambda r: f"rollout {r.rollout_id}: {r.status!r} but latest attempt {r.attempt_id} is {r.attempt_status!r}",
    ),
    Invariant(
        "a rollout in back-off (not_before set, queued) is requeuing",
        "structural",
        _delayed_is_requeuing,
        lambda r: f"rollout {r.rollout_id}: {r.status!r} with not_before={r.not_before}",
    ),
    Invariant(
        "a cancelled rollout has no attempt in flight",
        "lifecycle",
        _cancelled_has_nothing_in_flight,
        lambda r: f"rollout {r.rollout_id}: cancelled but latest attempt {r.attempt_id} is {r.attempt_status!r}",
    ),
    Invariant(
        "a succeeded rollout's latest attempt succeeded",
        "lifecycle",
        _succeeded_follows_attempt,
        lambda r: f"rollout {r.rollout_id}: succeeded but latest attempt {r.attempt_id} is {r.attempt_status!r}",
    ),
)


def _resolve_run_id(conn: Connection, run: str | int) -> int | None:
    if isinstance(run, int) and not isinstance(run, bool):
        row = conn.execute(select(s.runs.c.run_id).where(s.runs.c.run_id == run)).first()
    else:
        row = conn.execute(select(s.runs.c.run_id).where(s.runs.c.name == run)).first()
    return None if row is None else int(row[0])


def check_run(
    conn: Connection | UnitContext,
    run: str | int,
    *,
    lifecycle: bool = True,
    invariants: Iterable[Invariant] = INVARIANTS,
) -> list[str]:
    """The violations of ``run``'s invariants (empty = consistent); ``run`` is a name or a run_id.

    ``conn`` is a SQLAlchemy ``Connection`` (on PostgreSQL its engine must map the default schema to
    the store's, as the store's engine does) or a store ``UnitContext``.  Only reads; call it at the
    start of a transaction so PostgreSQL can take its snapshot.
    """
    if isinstance(conn, UnitContext):
        connection, dialect = conn.conn, conn.dialect
    else:
        connection, dialect = conn, conn.dialect.name
    if dialect == "postgresql" and connection.get_execution_options().get("isolation_level") not in _PG_SNAPSHOTS:
        connection.execute(text(_PG_SNAPSHOT))
    run_id = _resolve_run_id(connection, run)
    if run_id is None:
        return [f"run {run!r} does not exist"]
    out: list[str] = []
    for inv in invariants:
        if inv.family == "lifecycle" and not lifecycle:
            continue
        rows = connection.execute(inv.offenders(run_id).limit(MAX_EXAMPLES + 1)).all()
        for row in rows[:MAX_EXAMPLES]:
            out.append(f"[{inv.name}] {inv.describe(row)}")
        if len(rows) > MAX_EXAMPLES:
            out.append(f"[{inv.name}] ... more violations not shown (first {MAX_EXAMPLES} listed)")
    return out


async def check_invariants(store: SqlLightningStore, *, lifecycle: bool = True) -> list[str]:
    """The violations of the store's bound run (empty = consistent), read in one transaction.

    Works on any ``SqlLightningStore``, read-only ones included: it writes nothing and never sweeps.
    Like every run-scoped call it creates the run on a writable store; a ``read_only=True`` or
    ``create_run=False`` store raises the store's ``ValueError`` naming the run instead.
    """
    # snapshot=True: one REPEATABLE READ READ ONLY transaction on PostgreSQL (a store's other reads
    # run without a transaction there); SQLite's read transaction is a snapshot already.
    def check(ctx: UnitContext) -> list[str]:
        assert ctx.run_id is not None
        return check_run(ctx, ctx.run_id, lifecycle=lifecycle)

    return await store.run_sql(check, snapshot=True)


async def check_url(url: str, run: str, *, lifecycle: bool = True, **store_options: Any) -> list[str]:
    """Open a read-only store on ``url`` bound to ``run``, check it and close it (the CLI's entry point).

    ``store_options`` are passed to ``SqlLightningStore`` (e.g. ``schema=`` on PostgreSQL,
    ``connect_deadline_seconds=``).  An unknown run raises the store's ``ValueError`` listing the runs.
    """
    from lightning_sql.store.sql.store import SqlLightningStore

    store_options.setdefault("clock_sync", False)
    store = SqlLightningStore(url, run=run, read_only=True, **store_options)
    try:
        return await check_invariants(store, lifecycle=lifecycle)
    finally:
        await store.close()
