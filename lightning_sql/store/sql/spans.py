"""Spans and span sequence counters (docs/store-contract.md §2.9, §2.10): the operations.

``ReserveSequenceIds``, ``AddSpans`` and ``ReadSpans`` are calls of the hot span paths; a batch of
them runs in the dialect modules (``sqlite_batches``, ``postgres_batches``) and comes back here to
be turned into each caller's result.  What both dialects must do:

* reservations: every rollout's counter moves once by the batch's total for it; a call naming a
  missing rollout reserves nothing and fails alone.  The runner returns ``{rollout_id: end}`` for
  the counters it moved and the set of missing rollout ids.
* span inserts: a call whose rollout or attempt is missing inserts nothing and fails alone; for the
  other calls each span key is inserted by its first occurrence (``ON CONFLICT DO NOTHING``), every
  rollout's counter becomes ``max(counter, highest sequence id of its groups)``, and each
  (rollout, attempt) that inserted anything gets its heartbeat (and, for the latest attempt, the
  rollout's promotion to ``running``).  The runner returns a ``SpanInsert``.

Lock order (PostgreSQL): the rollout rows first (in ``rollout_id`` order), then the attempt rows,
then the span inserts; the heartbeat written last only touches rows already locked.
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Hashable
from dataclasses import dataclass, field
from typing import Any, ClassVar

from sqlalchemy import Float, Integer, Text, case, func, select

from lightning_sql.store.sql import dialect as d
from lightning_sql.store.sql import filters as f
from lightning_sql.store.sql import schema as s
from lightning_sql.store.sql.executor import Batch, Operation
from lightning_sql.store.sql.rows import SPAN_COLUMNS, span_from_row
from lightning_sql.types import QUEUED_STATUSES, PaginatedResult, Span, check_text
from lightning_sql.types.jsonvalue import MAX_ID_BYTES

logger = logging.getLogger("lightning_sql.store")

R = s.rollouts
A = s.attempts
S = s.spans


# --- sequence ids -------------------------------------------------------------------------------


@dataclass(eq=False, slots=True)
class ReserveSequenceIds(Operation):
    """One sequence id per (rollout, attempt) pair, handed out in input order."""

    name: ClassVar[str] = "reserve_sequence_ids"
    run_id: int
    pairs: list[tuple[str, str]]

    def counts(self) -> Counter[str]:
        return Counter(rid for rid, _aid in self.pairs)  # in order of first use

    @classmethod
    def outcomes(cls, batch: Batch, rows: Any) -> list[Any]:
        ends, missing = rows
        ok = [call for call in batch.calls if not _missing_in(call, missing)]
        totals: Counter[str] = Counter()
        for call in ok:
            assert isinstance(call, ReserveSequenceIds)
            totals.update(call.counts())
        next_value = {rid: int(ends[rid]) - total + 1 for rid, total in totals.items()}
        out: list[Any] = []
        for call in batch.calls:
            assert isinstance(call, ReserveSequenceIds)
            first_missing = _missing_in(call, missing)
            if first_missing is not None:
                out.append(ValueError(f"Rollout {first_missing} not found"))
                continue
            values = []
            for rid, _aid in call.pairs:
                values.append(next_value[rid])
                next_value[rid] += 1
            out.append(values)
        return out

    @staticmethod
    def keys(batch: Batch) -> list[tuple[int, str, int]]:
        """(call position from 1, rollout id, count) for every rollout of every call."""
        out: list[Any] = []
        for n, call in enumerate(batch.calls, 1):
            assert isinstance(call, ReserveSequenceIds)
            out.extend((n, rid, count) for rid, count in call.counts().items())
        return out


def _missing_in(call: Any, missing: set[str]) -> str | None:
    for rid, _aid in call.pairs:
        if rid in missing:
            return rid  # type: ignore[no-any-return]
    return None


RESERVE_KEYS: list[d.KeyColumn] = [("call", Integer()), ("rollout_id", Text()), ("count", Integer())]


# --- span inserts -------------------------------------------------------------------------------


@dataclass(eq=False, slots=True)
class AddSpans(Operation):
    """Insert ``spans`` (their rows ``rows`` encoded by the caller), skipping duplicates.  With
    ``allocate`` (one ``add_otel_span`` without sequence id) the span takes the next counter value
    of its rollout, decided in the statement, so a failure consumes no number."""

    name: ClassVar[str] = "add_spans"
    run_id: int
    now: float
    spans: list[Span]
    rows: list[dict[str, Any]]
    allocate: bool = False

    def batch_key(self) -> Hashable:
        return (self.name, self.run_id, self.allocate)

    def conflicts(self) -> tuple[Hashable, ...]:
        # Two allocations of one rollout would both read the same counter.
        return (("rollout", self.spans[0].rollout_id),) if self.allocate else ()

    def groups(self) -> list[tuple[str, str]]:
        """The call's (rollout, attempt) groups in first-seen order."""
        return list(dict.fromkeys((span.rollout_id, span.attempt_id) for span in self.spans))

    def error(self, found: dict[tuple[str, str], tuple[bool, bool]]) -> ValueError | None:
        """The call's own error: its first missing rollout, then its first missing attempt (§2.9)."""
        groups = self.groups()
        for rid, aid in groups:
            if not found[(rid, aid)][0]:
                return ValueError(f"Rollout {rid} not found")
        for rid, aid in groups:
            if not found[(rid, aid)][1]:
                return ValueError(f"Attempt {aid} not found for rollout {rid}")
        return None

    @classmethod
    def outcomes(cls, batch: Batch, rows: Any) -> list[Any]:
        result: SpanInsert = rows
        out: list[Any] = []
        owned: set[tuple[str, str, str]] = set()
        for call in batch.calls:
            assert isinstance(call, AddSpans)
            error = call.error(result.found)
            if error is not None:
                out.append(error)
                continue
            inserted = []
            for span in call.spans:
                key = (span.rollout_id, span.attempt_id, span.span_id)
                if key in owned or key not in result.inserted:
                    _log_duplicate(span)
                    continue
                owned.add(key)
                if call.allocate:
                    span.sequence_id = int(result.inserted[key])
                inserted.append(span)
            order = {group: i for i, group in enumerate(call.groups())}
            inserted.sort(key=lambda sp: order[(sp.rollout_id, sp.attempt_id)])  # group order, stable inside
            out.append(inserted)
        return out


@dataclass
class SpanInsert:
    """What a dialect's span insert did: for every (rollout, attempt) group of the batch, whether
    the rollout and the attempt exist; and the sequence id of every span key it inserted."""

    found: dict[tuple[str, str], tuple[bool, bool]] = field(default_factory=dict)
    inserted: dict[tuple[str, str, str], int] = field(default_factory=dict)


def insert_rows(batch: Batch, bad_calls: set[int]) -> list[tuple[int, dict[str, Any]]]:
    """The span rows to insert, with their call's position from 1: the first occurrence of each span
    key among the calls that did not fail (a repeat is a duplicate, reported by ``outcomes``)."""
    seen: set[tuple[str, str, str]] = set()
    out = []
    for n, call in enumerate(batch.calls, 1):
        assert isinstance(call, AddSpans)
        if n in bad_calls:
            continue
        for span, row in zip(call.spans, call.rows, strict=True):
            key = (span.rollout_id, span.attempt_id, span.span_id)
            if key not in seen:
                seen.add(key)
                out.append((n, row))
    return out


def group_keys(batch: Batch) -> list[tuple[int, str, str, int, float]]:
    """(call position from 1, rollout id, attempt id, highest sequence id, the call's now) for every
    (rollout, attempt) group of every call."""
    out: list[Any] = []
    for n, call in enumerate(batch.calls, 1):
        assert isinstance(call, AddSpans)
        highest: dict[tuple[str, str], int] = {}
        for span in call.spans:
            key = (span.rollout_id, span.attempt_id)
            highest[key] = max(highest.get(key, 0), span.sequence_id)
        out.extend((n, rid, aid, seq, call.now) for (rid, aid), seq in highest.items())
    return out


GROUP_KEYS: list[d.KeyColumn] = [
    ("call", Integer()),
    ("rollout_id", Text()),
    ("attempt_id", Text()),
    ("highest", Integer()),
    ("now", Float(precision=53)),
]
# The touched groups of a batch: (rollout, attempt, its call's now), and the rollouts' new counters.
TOUCHED_KEYS: list[d.KeyColumn] = [("rollout_id", Text()), ("attempt_id", Text()), ("now", Float(precision=53))]
# Per rollout of the batch: its highest sequence id, and the highest sequence id of its attempts that
# inserted a span (0: none).
COUNTER_KEYS: list[d.KeyColumn] = [("rollout_id", Text()), ("highest", Integer()), ("touched_seq", Integer())]


def heartbeat(dialect: str, touched: Any) -> Any:
    """The UPDATE giving each touched attempt its heartbeat: ``last_heartbeat_time`` = its call's now,
    preparing or unresponsive -> running; only those two columns (a concurrent update of the
    attempt's metadata or worker must survive)."""
    running = case((f.one_of(A.c.status, ("preparing", "unresponsive")), "running"), else_=A.c.status)
    return d.keyed_update(
        dialect, A, touched, ("rollout_id", "attempt_id"), lambda key: {"last_heartbeat_time": key("now"), "status": running}
    )


def counters(dialect: str, new: Any) -> Any:
    """The UPDATE of each rollout named in ``new``: counter = max(counter, highest); and when a span
    of its latest attempt was inserted and it is preparing, queuing or requeuing, its promotion to
    running, out of the queue (§2.8)."""

    def values(key: Any) -> dict[str, Any]:
        promote = (R.c.attempt_count == key("touched_seq")) & f.one_of(R.c.status, ("preparing", *QUEUED_STATUSES))
        return {
            "span_seq": d.greatest(dialect, R.c.span_seq, key("highest")),
            "status": case((promote, "running"), else_=R.c.status),
            "queue_seq": case((promote, None), else_=R.c.queue_seq),
        }

    return d.keyed_update(dialect, R, new, ("rollout_id",), values)


def _log_duplicate(span: Span) -> None:
    logger.error(
        "Duplicated span added for rollout=%s, attempt=%s, span=%s. Skipping.",
        span.rollout_id,
        span.attempt_id,
        span.span_id,
    )


# --- reads --------------------------------------------------------------------------------------

SPAN_FILTER_FIELDS = ("trace_id", "span_id", "parent_id", "name")


def _shape(value: str | None, *, max_bytes: int | None = MAX_ID_BYTES) -> bool | None:
    """None: no filter; True: a bound value; False: a value that cannot be stored (matches nothing).
    Span names have no length limit (they are no index key): ``max_bytes=None`` for them."""
    if value is None:
        return None
    try:
        check_text(value, "value", max_bytes=max_bytes)
    except (TypeError, ValueError):
        return False
    return True


def _limit(field: str) -> int | None:
    return None if field == "name" else MAX_ID_BYTES


@dataclass(eq=False, slots=True)
class ReadSpans(Operation):
    """One ``query_spans`` call.  Calls of one query shape (which filters are present, the attempt
    mode, the sort) read together in one statement over the batch's keys; a call with a limit or an
    offset reads alone (its page and count are its own)."""

    name: ClassVar[str] = "query_spans"
    write: ClassVar[bool] = False
    run_id: int
    rollout_id: str
    attempt_id: str | None
    exact: dict[str, str | None]
    contains: dict[str, str | None]
    filter_logic: str
    limit: int
    offset: int
    sort_by: str | None
    sort_order: str
    shape: tuple[Any, ...] = ()

    def __post_init__(self) -> None:
        if self.attempt_id is None or self.attempt_id == "latest":
            attempt_mode: Any = self.attempt_id
        else:
            attempt_mode = bool(_shape(self.attempt_id))
        self.shape = (
            bool(_shape(self.rollout_id)),
            attempt_mode,
            tuple(_shape(self.exact[name], max_bytes=_limit(name)) for name in SPAN_FILTER_FIELDS),
            tuple(_shape(self.contains[name], max_bytes=_limit(name)) for name in SPAN_FILTER_FIELDS),
            self.filter_logic,
            self.sort_by,
            self.sort_order,
            self.limit != -1,
            self.offset != 0,
        )

    def batch_key(self) -> Hashable:
        # A page reads alone: its LIMIT, OFFSET and count belong to it.
        return (self.name, self.run_id, self.shape, id(self) if self.paged else 0)

    @property
    def paged(self) -> bool:
        return self.limit != -1 or self.offset != 0

    def key_row(self) -> tuple[Any, ...]:
        """This call's row of the batch's keys (``read_keys``)."""
        rid_ok, attempt_mode, exact, contains = self.shape[:4]
        row: list[Any] = [self.rollout_id if rid_ok else "", self.attempt_id if attempt_mode is True else ""]
        row.extend(self.exact[name] if ok else "" for name, ok in zip(SPAN_FILTER_FIELDS, exact, strict=True))
        row.extend(self.contains[name] if ok else "" for name, ok in zip(SPAN_FILTER_FIELDS, contains, strict=True))
        return tuple(row)

    @classmethod
    def outcomes(cls, batch: Batch, rows: Any) -> list[Any]:
        page_rows, total = rows
        by_call: dict[int, list[Span]] = {}
        for row in page_rows:
            by_call.setdefault(row["n"], []).append(span_from_row(row))
        out: list[Any] = []
        for n, call in enumerate(batch.calls, 1):
            assert isinstance(call, ReadSpans)
            items = by_call.get(n, [])
            count = len(items) if total is None else total
            out.append(PaginatedResult(items=items, limit=call.limit, offset=call.offset, total=count))
        return out


READ_KEYS: list[d.KeyColumn] = [
    ("rollout_id", Text()),
    ("attempt_id", Text()),
    *((name, Text()) for name in SPAN_FILTER_FIELDS),
    *((f"{name}_contains", Text()) for name in SPAN_FILTER_FIELDS),
]


def read_statements(dialect: str, shape: tuple[Any, ...], single: bool) -> tuple[Any, Any]:
    """(page, count) of one query shape over the batch's keys (``keys_source(dialect, "q",
    READ_KEYS, single=single)``; ``single``: a batch of one call): the page's rows carry ``n``,
    their call's position; ``run_id``, and for a paged shape ``q_limit``/``q_offset``, are its
    other parameters."""
    rid_ok, attempt_mode, exact, contains, logic, sort_by, sort_order, has_limit, has_offset = shape
    keys = d.keys_source(dialect, "q", READ_KEYS, single=single)
    run_id: Any = keys.c.run_id
    must = [S.c.run_id == run_id, S.c.rollout_id == keys.c.rollout_id if rid_ok else f.false()]
    if attempt_mode == "latest":
        latest = (
            select(A.c.attempt_id)
            .where(A.c.run_id == run_id, A.c.rollout_id == keys.c.rollout_id)
            .order_by(A.c.sequence_id.desc())
            .limit(1)
            .scalar_subquery()
        )
        must.append(S.c.attempt_id == latest)
    elif attempt_mode is not None:
        must.append(S.c.attempt_id == keys.c.attempt_id if attempt_mode else f.false())
    conditions = []
    for name, ok in zip(SPAN_FILTER_FIELDS, exact, strict=True):
        if ok is not None:
            conditions.append(S.c[name] == keys.c[name] if ok else f.false())
    for name, ok in zip(SPAN_FILTER_FIELDS, contains, strict=True):
        if ok is not None:
            conditions.append(d.contains(dialect, S.c[name], keys.c[f"{name}_contains"]) if ok else f.false())
    where = [*must, f.pool(conditions, logic)]
    order = f.order_by(f.SPAN_SORT, sort_by, sort_order)
    joined = S if single else keys.join(S, S.c.run_id == run_id)
    if has_limit or has_offset:
        page = d.span_page(dialect, joined, where, order, has_limit=has_limit, has_offset=has_offset)
    else:
        page = select(keys.c.n.label("n"), *SPAN_COLUMNS).select_from(joined).where(*where)
        page = page.order_by(*order) if single else page.order_by(keys.c.n, *order)
    count = select(func.count().label("total")).select_from(joined).where(*where)
    return page, count


def read_params(dialect: str, batch: Batch) -> tuple[dict[str, Any], tuple[Any, ...], bool]:
    """The parameters of a read batch, its statements' key (``read_statements``), and whether it
    must count its total (a page cannot tell it)."""
    head = batch.calls[0]
    assert isinstance(head, ReadSpans)
    single = len(batch.calls) == 1
    rows = [call.key_row() for call in batch.calls]  # type: ignore[attr-defined]
    params: dict[str, Any] = {"run_id": head.run_id, **d.keys_params(dialect, "q", READ_KEYS, rows, single=single)}
    if head.limit != -1:
        params["q_limit"] = head.limit
    if head.offset != 0:
        params["q_offset"] = head.offset
    return params, (head.shape, single), head.paged
