"""Query filters, sorting and pagination compiled to SQL (docs/store-contract.md §1.12, §1.13, §2.11).

Sorting and filtering only ever name columns from the allow-lists below: a caller's field name is
looked up, never spliced into SQL.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from sqlalchemy import ColumnElement, Table, and_, bindparam, case, false, func, literal, or_, select, true

from lightning_sql.store.sql import schema as s
from lightning_sql.types import MAX_INT64, PaginatedResult

# Rollouts one claim may take: the claim builds an attempt per unit of ``limit`` before it runs, so
# an unbounded limit is memory and time spent before the database is asked (a runner takes one).
MAX_CLAIM_LIMIT = 10_000


@dataclass(frozen=True)
class SortSpec:
    """The sortable scalar fields of one model and the fields that exist but cannot be sorted on."""

    model: str
    table: Table
    scalar: dict[str, str]  # field name -> kind: "str" | "int" | "float" | "time"
    non_scalar: frozenset[str]
    base_order: tuple[str, ...]  # columns giving insertion order (ties)


ROLLOUT_SORT = SortSpec(
    "Rollout",
    s.rollouts,
    {
        "rollout_id": "str",
        "start_time": "time",
        "end_time": "time",
        "mode": "str",
        "resources_id": "str",
        "status": "str",
        "resources_version": "int",
        "idempotency_key": "str",
    },
    frozenset({"input", "config", "metadata", "attempt"}),
    ("create_seq",),
)
ATTEMPT_SORT = SortSpec(
    "Attempt",
    s.attempts,
    {
        "rollout_id": "str",
        "attempt_id": "str",
        "sequence_id": "int",
        "start_time": "time",
        "end_time": "time",
        "status": "str",
        "worker_id": "str",
        "last_heartbeat_time": "time",
    },
    frozenset({"metadata"}),
    ("sequence_id",),
)
SPAN_SORT = SortSpec(
    "Span",
    s.spans,
    {
        "rollout_id": "str",
        "attempt_id": "str",
        "sequence_id": "int",
        "trace_id": "str",
        "span_id": "str",
        "parent_id": "str",
        "name": "str",
        "start_time": "time",
        "end_time": "time",
    },
    frozenset({"status", "attributes", "events", "links", "context", "parent", "resource"}),
    ("id",),
)
RESOURCES_SORT = SortSpec(
    "ResourcesUpdate",
    s.resources,
    {"resources_id": "str", "create_time": "time", "update_time": "time", "version": "int"},
    frozenset({"resources"}),
    ("create_seq",),
)
WORKER_SORT = SortSpec(
    "Worker",
    s.workers,
    {
        "worker_id": "str",
        "status": "str",
        "last_heartbeat_time": "time",
        "last_dequeue_time": "time",
        "last_busy_time": "time",
        "last_idle_time": "time",
        "current_rollout_id": "str",
        "current_attempt_id": "str",
    },
    frozenset({"heartbeat_stats"}),
    ("create_seq",),
)

_NULL_AS = {"str": "", "int": 0, "float": 0.0}


def check_sort(spec: SortSpec, sort_by: str | None, sort_order: str) -> None:
    """Raise the contract's ``ValueError`` for an unknown or non-scalar field or a bad order."""
    if sort_order not in ("asc", "desc"):
        raise ValueError(f"Unsupported sort order {sort_order!r}")
    if sort_by is None:
        return
    if not isinstance(sort_by, str) or (sort_by not in spec.scalar and sort_by not in spec.non_scalar):
        raise ValueError(f"Failed to sort items by '{sort_by}': field does not exist on {spec.model}")
    if sort_by in spec.non_scalar:
        raise ValueError(
            f"Failed to sort items by '{sort_by}': field is not a scalar field of {spec.model} and cannot be sorted"
        )


def order_by(spec: SortSpec, sort_by: str | None, sort_order: str) -> list[Any]:
    """ORDER BY clauses: the key with the contract's NULL placement, then insertion order (asc)."""
    base = [spec.table.c[name].asc() for name in spec.base_order]
    if sort_by is None:
        return base
    column = spec.table.c[sort_by]
    kind = spec.scalar[sort_by]
    desc = sort_order == "desc"
    if not column.nullable:
        # No NULL to place: the plain column, whose order an index can give (a span query's
        # (run, rollout, attempt, sequence_id) index instead of a sort of the rows found).
        keys = [column.desc() if desc else column.asc()]
    elif kind == "time":
        # NULL sorts as +infinity: last in asc, first in desc.
        is_null = case((column.is_(None), 1), else_=0)
        keys = [is_null.desc(), column.desc()] if desc else [is_null.asc(), column.asc()]
    else:
        key = func.coalesce(column, literal(_NULL_AS[kind]))
        keys = [key.desc() if desc else key.asc()]
    return keys + base


def check_pagination(limit: int, offset: int) -> None:
    if isinstance(limit, bool) or not isinstance(limit, int):
        raise TypeError(f"limit must be an int, got {limit!r}")
    if isinstance(offset, bool) or not isinstance(offset, int):
        raise TypeError(f"offset must be an int, got {offset!r}")
    if not -1 <= limit <= MAX_INT64:
        raise ValueError(f"limit must be -1 (unlimited) or in 0..{MAX_INT64}, got {limit}")
    if not 0 <= offset <= MAX_INT64:
        raise ValueError(f"offset must be in 0..{MAX_INT64}, got {offset}")


def check_claim_limit(limit: int) -> None:
    """A claim's ``limit``: an int up to ``MAX_CLAIM_LIMIT`` (zero or less claims nothing)."""
    if isinstance(limit, bool) or not isinstance(limit, int):
        raise TypeError(f"limit must be an int, got {limit!r}")
    if limit > MAX_CLAIM_LIMIT:
        raise ValueError(f"limit must be at most {MAX_CLAIM_LIMIT} rollouts per claim, got {limit}")


def check_logic(filter_logic: str) -> None:
    if filter_logic not in ("and", "or"):
        raise ValueError(f"Unsupported filter aggregate {filter_logic!r}")


def within(column: Any, values: Sequence[Any]) -> ColumnElement[bool]:
    """Membership; an empty list is always false."""
    values = list(values)
    if not values:
        return false()
    return column.in_(values)


def one_of(column: Any, values: Sequence[Any]) -> ColumnElement[bool]:
    """``column IN (values)`` for a statement compiled once: an OR of equalities, whose values are
    the statement's own (an IN list is expanded per execution)."""
    return or_(*(column == value for value in values))


def pool(conditions: list[ColumnElement[bool]], filter_logic: str) -> ColumnElement[bool]:
    """Reduce the condition pool: AND over nothing is true, OR over nothing is false."""
    if filter_logic == "or":
        return or_(false(), *conditions) if conditions else false()
    return and_(true(), *conditions) if conditions else true()


def check_str_list(values: Sequence[Any] | None, name: str) -> list[str] | None:
    if values is None:
        return None
    if isinstance(values, str):
        raise TypeError(f"{name} must be a list of str, got a str")
    out = list(values)
    for value in out:
        if not isinstance(value, str):
            raise TypeError(f"{name} must be a list of str, got an element of type {type(value).__name__}")
    return out


def fetch_page(
    ctx: Any, page: Any, count: Any, params: dict[str, Any], limit: int, offset: int
) -> tuple[list[Any], int]:
    """The rows of one page of a prebuilt ``page`` statement and the number of matches (``count``,
    run only when the page cannot tell): at most two statements; ``q_limit``/``q_offset`` bound here."""
    if limit != -1:
        params["q_limit"] = limit
    if offset != 0:
        params["q_offset"] = offset
    rows = ctx.execute(page, params).all() if limit != 0 else []
    if limit == -1 and offset == 0:
        return rows, len(rows)
    return rows, int(ctx.execute(count, params).scalar_one())


def paginate(
    ctx: Any,
    table: Any,
    where: list[Any],
    order: list[Any],
    limit: int,
    offset: int,
    build: Callable[[Any], Any],
) -> PaginatedResult[Any]:
    """The rows of ``table`` matching ``where``: one page in ``order``, each made by ``build``, and the
    number of matches (``fetch_page``)."""
    page = select(table).where(*where).order_by(*order)
    if limit != -1:
        page = page.limit(bindparam("q_limit"))
    if offset:
        page = page.offset(bindparam("q_offset"))
    count = select(func.count()).select_from(table).where(*where)
    rows, total = fetch_page(ctx, page, count, {}, limit, offset)
    return PaginatedResult(items=[build(row) for row in rows], limit=limit, offset=offset, total=total)
