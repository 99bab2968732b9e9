"""The ONLY place where SQLite and PostgreSQL differ: upserts, row locks, positions, substring tests.

Every other module builds dialect-neutral SQLAlchemy Core and asks this module for the pieces that
cannot be neutral.

Keyed UPDATEs on PostgreSQL.  A statement that updates several rows it names by key joins the
target to a MATERIALIZED CTE carrying the whole key, ``run_id`` included (``target.run_id =
keys.run_id AND target.rollout_id = keys.rollout_id``), never to ``target.run_id = :run_id`` plus a
join on the id alone.  With the constant, the planner may read the run's rows through any index
that starts with ``run_id`` and filter them, and it takes that plan whenever it believes the run
small: always for a new run in a table analysed before the run existed, and for every run while a
table has no statistics (``run_id`` is never sampled, migration 0003: it assumes 0.5% of the
table).  Through the CTE it sees no condition on the target of its own: its only choices are a
look-up per key or a scan of the whole table, which it costs by the table's real size.  The CTE of
the keys ends in ``LIMIT :n``, ``n`` being the number of keys it holds (so it drops none): a generic
plan cannot know the length of an array parameter and counts on 10 keys, for which a scan of a
table of a few thousand rows looks cheaper than the look-ups; with the LIMIT it counts on one.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from typing import Any

from sqlalchemy import (
    BigInteger,
    ColumnElement,
    Integer,
    Select,
    Table,
    Text,
    and_,
    bindparam,
    cast,
    exists,
    func,
    literal,
    select,
    true,
    tuple_,
    update,
)
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.dialects.postgresql import ARRAY, JSONB

from lightning_sql.store.sql import schema as s
from lightning_sql.store.sql.executor import UnitContext
from lightning_sql.store.sql.rows import SPAN_COLUMNS
from lightning_sql.store.sql.statements import cached


def insert(ctx: UnitContext | str, table: Table) -> Any:
    """An INSERT that supports ``on_conflict_do_nothing`` / ``on_conflict_do_update`` on both dialects."""
    dialect = ctx if isinstance(ctx, str) else ctx.dialect
    if dialect == "postgresql":
        return postgresql.insert(table)
    return sqlite.insert(table)


# --- a batch's rows as a table ----------------------------------------------------------------

KeyColumn = tuple[str, Any]  # (name, SQLAlchemy type: Text, Integer, Float, Boolean)


def keys_source(dialect: str, name: str, columns: Sequence[KeyColumn], *, single: bool = False) -> Any:
    """The rows of a batch as a table with ``run_id`` (the ``run_id`` parameter), ``columns`` and
    ``n``, the row's position from 1; ``keys_params`` binds them.  Statements join their targets
    on ``run_id`` and the ids of these rows.

    PostgreSQL: ``unnest`` of one array parameter per column ``WITH ORDINALITY``, as a MATERIALIZED
    CTE ending in ``LIMIT <name>__count`` (the number of rows, so it drops none): joined through it,
    the planner sees no condition on the target's run of its own, so it looks each key up rather
    than scanning a run it believes small, and a generic plan counts on one key, not a hundred
    ("Keyed UPDATEs" above).  SQLite: ``json_each`` of ONE parameter holding the rows as JSON arrays
    (one SQL text for every batch size, which sqlite3's statement cache keeps).

    ``single``: a batch of one row, as one scalar parameter per column, which both planners fold
    into the statement (a page then reads the spans' index in its order, with no sort)."""
    run_id = bindparam("run_id", type_=Integer)
    if single:
        return ScalarKeys(run_id, {col: bindparam(f"{name}_{col}", type_=kind) for col, kind in columns})
    if dialect == "postgresql":
        arrays = [bindparam(f"{name}_{col}", type_=ARRAY(kind)) for col, kind in columns]
        rows = (
            func.unnest(*arrays)
            .table_valued(*(col for col, _kind in columns), with_ordinality="n")
            .render_derived(name=f"{name}_rows")
        )
        return (
            select(run_id.label("run_id"), *rows.c)
            .limit(bindparam(f"{name}__count", type_=Integer))
            .cte(name)
            .prefix_with("MATERIALIZED")
        )
    each = func.json_each(bindparam(name, type_=Text)).table_valued("key", "value").alias(f"{name}_rows")
    return select(
        run_id.label("run_id"),
        *(func.json_extract(each.c.value, f"$[{i}]", type_=kind).label(col) for i, (col, kind) in enumerate(columns)),
        (each.c.key + 1).label("n"),
    ).subquery(name)


class ScalarKeys:
    """The one row of a batch of one, as its parameters: ``.c.<column>`` like a table's columns,
    with no FROM of its own (statements over it select from their tables alone)."""

    def __init__(self, run_id: Any, columns: dict[str, Any]) -> None:
        self.c = _Columns({"run_id": run_id, "n": literal(1, Integer), **columns})


class _Columns(dict[str, Any]):
    def __getattr__(self, name: str) -> Any:
        try:
            return self[name]
        except KeyError:
            raise AttributeError(name) from None


def keys_params(
    dialect: str, name: str, columns: Sequence[KeyColumn], rows: Sequence[Sequence[Any]], *, single: bool = False
) -> dict[str, Any]:
    """The parameters of ``keys_source(dialect, name, columns, single=...)`` for ``rows`` (tuples
    in column order); ``run_id`` is the statement's own."""
    if single:
        ((row,),) = (rows,)
        return {f"{name}_{col}": row[i] for i, (col, _kind) in enumerate(columns)}
    if dialect == "postgresql":
        params: dict[str, Any] = {f"{name}_{col}": [row[i] for row in rows] for i, (col, _kind) in enumerate(columns)}
        params[f"{name}__count"] = len(rows)
        return params
    return {name: json.dumps(rows, separators=(",", ":"), ensure_ascii=False)}


def keyed_update(
    dialect: str, table: Table, keys: Any, on: Sequence[str], values: Callable[[Callable[[str], Any]], dict[str, Any]]
) -> Any:
    """An UPDATE of the rows of ``table`` named by the batch's ``keys`` (equal ``run_id`` and the
    columns ``on``), with ``values(key)``, where ``key(name)`` is the key row's column ``name``.
    PostgreSQL: ``UPDATE ... FROM`` the keys.  SQLite: the rows ``IN`` the keys and each value a
    correlated look-up of its key row, a plan that reads the target by its key whatever the
    planner guesses of a ``json_each`` (joined, it may scan the run instead)."""
    names = ("run_id", *on)
    if dialect == "postgresql":
        match = [table.c[name] == keys.c[name] for name in names]
        return update(table).where(*match).values(values(lambda name: keys.c[name]))
    row = [keys.c[name] == table.c[name] for name in on]

    def key(name: str) -> Any:
        return select(keys.c[name]).where(*row).limit(1).scalar_subquery()

    first, *rest = on
    where = [table.c.run_id == bindparam("run_id", type_=Integer), table.c[first].in_(select(keys.c[first]))]
    if rest:
        where.append(exists(select(literal(1)).select_from(keys).where(*row)))
    return update(table).where(*where).values(values(key))


def json_array_has(dialect: str, array: Any, value: Any) -> ColumnElement[bool]:
    """Whether the JSON array of plain strings (statuses) ``array`` holds the string ``value``."""
    if dialect == "postgresql":
        return array.op("?")(value)  # type: ignore[no-any-return]
    return func.instr(array, func.json_quote(value)) > 0


def as_json(dialect: str, text_value: Any) -> Any:
    """Encoded JSON text as a value of a JSON column."""
    if dialect == "postgresql":
        return cast(text_value, JSONB)
    return text_value


def greatest(dialect: str, a: Any, b: Any) -> Any:
    """The larger of two values (never NULL when ``a`` is not)."""
    if dialect == "postgresql":
        return func.greatest(a, b)
    return func.max(a, func.coalesce(b, a))


def next_create_seq(dialect: str, table: Table, run_id: Any) -> Any:
    """An expression giving a fresh insertion position for one new row of ``table`` in a prebuilt
    statement: the position sequence on PostgreSQL; on SQLite (writers serialised) the run's
    highest ``create_seq`` + 1, an index lookup."""
    if dialect == "postgresql":
        return s.position_seq.next_value()
    return (
        select(func.coalesce(func.max(table.c.create_seq), 0) + 1).where(table.c.run_id == run_id).scalar_subquery()
    )


def for_update(ctx: UnitContext, stmt: Select[Any], *, skip_locked: bool = False, of: Any = None) -> Select[Any]:
    """Lock the selected rows (of the table ``of``, when given) on PostgreSQL; SQLite's ``BEGIN
    IMMEDIATE`` already serialises writers."""
    if ctx.dialect == "postgresql":
        return stmt.with_for_update(skip_locked=skip_locked, of=of)
    return stmt


def contains(ctx: UnitContext | str, column: Any, needle: Any) -> ColumnElement[bool]:
    """Case-sensitive substring test with no LIKE metacharacters (docs/store-contract.md §2.17)."""
    if (ctx if isinstance(ctx, str) else ctx.dialect) == "postgresql":
        return func.strpos(column, needle) > 0
    return func.instr(column, needle) > 0


def span_page(dialect: str, joined: Any, where: list[Any], order: list[Any], *, has_limit: bool, has_offset: bool) -> Any:
    """One page of spans (``n`` = 1: a page belongs to one call) of the batch keys joined to the
    spans.  PostgreSQL computes the output columns (JSONB as text, out-of-line values fetched) of
    every row an OFFSET skips, so with an offset the page's ids come first, from the spans' index,
    then only its rows.  SQLite skips a row before reading its columns."""
    S = s.spans
    columns = [literal(1, Integer).label("n"), *SPAN_COLUMNS]
    if has_offset and dialect == "postgresql":
        ids = select(S.c.id).select_from(joined).where(*where).order_by(*order).offset(bindparam("q_offset"))
        if has_limit:
            ids = ids.limit(bindparam("q_limit"))
        return select(*columns).where(S.c.id.in_(ids.correlate(None))).order_by(*order)
    page = select(*columns).select_from(joined).where(*where).order_by(*order)
    if has_limit:
        page = page.limit(bindparam("q_limit"))
    if has_offset:
        page = page.offset(bindparam("q_offset"))
    return page


def allocate_positions(ctx: UnitContext, run_id: int, count: int) -> list[int]:
    """``count`` increasing positions (create/touch/queue order) for the run, inside the unit.

    PostgreSQL draws them from one database-wide sequence (no lock on a per-run row, so concurrent
    writers never queue behind each other); SQLite bumps ``runs.seq`` (writers are serialised
    anyway).  Either way every run sees strictly increasing values.
    """
    if count <= 0:
        return []
    if ctx.dialect == "postgresql":
        rows = ctx.execute(
            select(s.position_seq.next_value()).select_from(func.generate_series(1, count))
        ).scalars()
        return sorted(int(v) for v in rows)
    end = ctx.execute(
        update(s.runs).where(s.runs.c.run_id == run_id).values(seq=s.runs.c.seq + count).returning(s.runs.c.seq)
    ).scalar_one()
    return list(range(int(end) - count + 1, int(end) + 1))


def server_epoch(ctx: UnitContext) -> Any:
    """The database server's clock in epoch seconds (only for measuring the clock offset, §0.2)."""
    return select(func.extract("epoch", func.clock_timestamp()))


def _keys(derived: str, count: Any, **arrays: Any) -> Select[Any]:
    """The keys of a keyed statement: the rows of parallel array parameters (``unnest``), one
    column per keyword, ending in ``LIMIT count``, ``count`` being how many there are ("Keyed
    UPDATEs" above: a generic plan then counts on one key, not ten)."""
    return select(func.unnest(*arrays.values()).table_valued(*arrays).render_derived(name=derived)).limit(count)


def attempts_by_sequence(ctx: UnitContext, run_id: int, pairs: Sequence[tuple[str, int]]) -> list[Any]:
    """The attempt rows (``select(attempts)``'s columns) of ``(rollout id, sequence id)`` pairs of
    the run that exist: each rollout's latest attempt, for a page of rollouts read back.

    PostgreSQL: ONE statement for any number of pairs, one look-up per pair by its key (``LATERAL
    ... LIMIT 1`` on the pairs of two array parameters, the module's keyed look-ups).  A row-value
    ``IN`` list, the form SQLite takes, was planned there as a read of every attempt of the run
    with the pairs' sequence id, filtered by an ``OR`` of the ids, whenever the pairs share that id
    (a page of first attempts), a cost that grows with the run.  SQLite: that list, in chunks of 500 pairs
    (within its bound-parameter limit), which it reads by key."""
    if not pairs:
        return []
    if ctx.dialect == "postgresql":
        params = {
            "la_run_id": run_id,
            "la_rollout_ids": [rid for rid, _seq in pairs],
            "la_sequence_ids": [seq for _rid, seq in pairs],
            "la_pairs": len(pairs),
        }
        return list(ctx.execute(cached("attempts_by_sequence", _attempts_by_sequence_statement), params))
    rows: list[Any] = []
    for start in range(0, len(pairs), 500):
        chunk = pairs[start : start + 500]
        rows.extend(ctx.execute(_ATTEMPTS_BY_PAIRS_IN, {"la_run_id": run_id, "la_pairs": chunk}))
    return rows


_ATTEMPTS_BY_PAIRS_IN = select(s.attempts).where(
    s.attempts.c.run_id == bindparam("la_run_id"),
    tuple_(s.attempts.c.rollout_id, s.attempts.c.sequence_id).in_(bindparam("la_pairs", expanding=True)),
)


def _attempts_by_sequence_statement() -> Any:
    A = s.attempts
    wanted = _keys(
        "pairs",
        bindparam("la_pairs", type_=Integer),
        rollout_id=bindparam("la_rollout_ids", type_=ARRAY(Text)),
        sequence_id=bindparam("la_sequence_ids", type_=ARRAY(BigInteger)),
    ).subquery("wanted")
    attempt = (
        select(A)
        .where(
            A.c.run_id == bindparam("la_run_id", type_=Integer),
            A.c.rollout_id == wanted.c.rollout_id,
            A.c.sequence_id == wanted.c.sequence_id,
        )
        .limit(1)
        .lateral("attempt")
    )
    return select(*(attempt.c[c.name] for c in A.c)).select_from(wanted.join(attempt, true()))


def named_attempts(ctx: UnitContext, keys: Sequence[tuple[int, str, str]]) -> ColumnElement[bool]:
    """A condition on ``attempts`` that holds for the rows of these ``(run_id, rollout_id,
    attempt_id)`` keys, for a statement that changes them (the sweeper's re-check).  PostgreSQL: a
    join to a MATERIALIZED CTE of the keys ending in ``LIMIT n`` ("Keyed UPDATEs" above); as a
    row-value ``IN`` list, whose keys share ``run_id``, the re-check was planned as a walk of every
    in-flight rollout of the run filtered by the list.  SQLite: that list, which it reads by key."""
    A = s.attempts
    if ctx.dialect != "postgresql":
        return tuple_(A.c.run_id, A.c.rollout_id, A.c.attempt_id).in_(list(keys))
    named = (
        _keys(
            "given",
            len(keys),
            run_id=bindparam(None, [run for run, _rid, _aid in keys], type_=ARRAY(Integer)),
            rollout_id=bindparam(None, [rid for _run, rid, _aid in keys], type_=ARRAY(Text)),
            attempt_id=bindparam(None, [aid for _run, _rid, aid in keys], type_=ARRAY(Text)),
        )
        .cte("named_attempts")
        .prefix_with("MATERIALIZED")
    )
    return and_(
        A.c.run_id == named.c.run_id, A.c.rollout_id == named.c.rollout_id, A.c.attempt_id == named.c.attempt_id
    )



# The analysis views' SQL that differs per dialect (views.py fills ``{c}`` a column, ``{k}``/``{k2}``
# keys, and the reward pieces' names; only module constants, never user input).  JSON values of
# the wrong type read as NULL rather than failing the query.
VIEW_SQL: dict[str, dict[str, str]] = {
    "postgresql": {
        "text": "({c} ->> '{k}')",
        "nested_text": "({c} -> '{k}' ->> '{k2}')",
        "number": "(CASE WHEN jsonb_typeof({c} -> '{k}') = 'number' THEN ({c} ->> '{k}')::double precision END)",
        "integer": "(CASE WHEN jsonb_typeof({c} -> '{k}') = 'number' THEN round(({c} ->> '{k}')::numeric)::bigint END)",
        "has_key_prefix": "EXISTS (SELECT 1 FROM jsonb_object_keys(CASE WHEN jsonb_typeof({c}) = 'object' "
        "THEN {c} END) AS k(key) WHERE substr(k.key, 1, {n}) = '{k}')",
        "contains": "strpos({c}, '{k}') > 0",
        "reward_source": """FROM {ns}spans sp
JOIN {ns}runs ru ON ru.run_id = sp.run_id
CROSS JOIN LATERAL jsonb_each(CASE WHEN jsonb_typeof(sp.attributes) = 'object' THEN sp.attributes END) AS kv(key, value)
CROSS JOIN LATERAL (SELECT substr(kv.key, {after}, greatest(length(kv.key) - {less}, 0)) AS dim) AS d
WHERE sp.name = '{span}'
  AND kv.key LIKE 'agentlightning.reward.%.value'
  AND d.dim ~ '^[0-9]+$'""",
        "reward_dim": "d.dim",
        "reward_dimension": "d.dim::integer",
        "reward_name": "(sp.attributes ->> ('{prefix}' || d.dim || '.name'))",
        "reward_value": "(CASE WHEN jsonb_typeof(kv.value) = 'number' THEN (kv.value #>> '{{}}')::double precision END)",
    },
    "sqlite": {
        "text": "json_extract({c}, '$.\"{k}\"')",
        "nested_text": "json_extract({c}, '$.\"{k}\".\"{k2}\"')",
        "number": "(CASE WHEN json_type({c}, '$.\"{k}\"') IN ('integer', 'real') "
        "THEN CAST(json_extract({c}, '$.\"{k}\"') AS REAL) END)",
        "integer": "(CASE WHEN json_type({c}, '$.\"{k}\"') IN ('integer', 'real') "
        "THEN CAST(round(json_extract({c}, '$.\"{k}\"')) AS INTEGER) END)",
        "has_key_prefix": "EXISTS (SELECT 1 FROM json_each({c}) AS k WHERE substr(k.key, 1, {n}) = '{k}')",
        "contains": "instr({c}, '{k}') > 0",
        "reward_source": """FROM {ns}spans sp
JOIN {ns}runs ru ON ru.run_id = sp.run_id
JOIN json_each(sp.attributes) AS kv
WHERE sp.name = '{span}'
  AND kv.key GLOB 'agentlightning.reward.[0-9]*.value'
  AND substr(kv.key, {after}, length(kv.key) - {less}) NOT GLOB '*[^0-9]*'""",
        "reward_dim": "substr(kv.key, {after}, length(kv.key) - {less})",
        "reward_dimension": "CAST({dim} AS INTEGER)",
        "reward_name": "json_extract(sp.attributes, '$.\"{prefix}' || {dim} || '.name\"')",
        "reward_value": "(CASE WHEN kv.type IN ('integer', 'real') THEN CAST(kv.value AS REAL) END)",
    },
}
