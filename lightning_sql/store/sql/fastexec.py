"""Execute prebuilt statements straight on the DBAPI cursor (the hot paths' last lever).

SQLAlchemy's ``Connection.execute`` costs ~60-100 µs of Python per statement on top of the driver
(execution context, cache-key walk, parameter construction, result metadata): more than SQLite needs
to run most of the store's statements.  For a statement built once (``statements.cached``), all of
that can be worked out once: the SQL text for this dialect and schema, the order of its positional
parameters, their bind processors, and the result columns with their result processors.  Each later
execution is then one ``cursor.execute(sql, params)`` plus the processors.

What stays SQLAlchemy's: the connection and its transaction (a raw execution first makes sure the
``Connection`` has begun one, so ``commit()``/``rollback()`` behave as before), error translation
(driver errors are re-raised as SQLAlchemy's ``DBAPIError`` subclasses, and a lost connection is
invalidated) and every statement this module declines: statements built per call, ``echo=True``
engines and engines or connections with event listeners (``before_cursor_execute`` and the like:
whoever listens sees every statement), Python-side column defaults, and multi-row parameters on
PostgreSQL (SQLite runs them as ``executemany``, or one ``execute`` per row with ``RETURNING``).
On PostgreSQL a single execution goes to asyncpg through SQLAlchemy's adapter connection rather
than its cursor (``_execute_asyncpg``).
"""

from __future__ import annotations

import json
import keyword
import operator
import threading
from collections import namedtuple
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from pydantic_core import from_json
from sqlalchemy import JSON, Connection
from sqlalchemy.exc import DBAPIError, MultipleResultsFound, NoResultFound
from sqlalchemy.sql.compiler import SQLCompiler
from sqlalchemy.util import await_only

from lightning_sql.store.sql.schema import JsonValue
from lightning_sql.store.sql.statements import is_prebuilt


@dataclass
class _Plan:
    """Everything about one statement on one dialect and schema that does not depend on data."""

    compiled: SQLCompiler
    sql: str | None  # None when expanding / literal-execute parameters make the text depend on data
    positiontup: tuple[str, ...]
    bind_processors: Mapping[str, Any]
    row_class: Any  # None for statements that return no rows
    result_types: tuple[Any, ...]
    # (column index, processor) of the result columns that have one (None when none has), worked
    # out at the first execution: some dialects choose a processor by the driver's column type in
    # ``cursor.description``.
    result_processors: tuple[tuple[int, Any], ...] | None | bool  # False until worked out
    schema_map: Mapping[str | None, str] | None
    executemany_ok: bool
    returning: bool
    # How to bind without SQLAlchemy's parameter machinery (``_direct_binding``).  ``slots`` has one
    # entry per placeholder name: (name, bind processor, expanding arity: 0 scalar, 1 list, n tuples).
    slots: tuple[tuple[str, Any, int], ...] | None = None
    defaults: Mapping[str, Any] | None = None
    pieces: tuple[str, ...] | None = None  # the SQL text split around expanding placeholders
    expanded_sql: dict[tuple[int, ...], str] | None = None
    # No expanding placeholder: the values in placeholder order straight from the parameters (and
    # ``defaults``) with ``operator.itemgetter``, then the bind processors ``plain_procs`` (index,
    # processor) applied; the SQL text is ``plain_sql``.
    plain_values: Any = None
    plain_procs: tuple[tuple[int, Any], ...] = ()
    plain_sql: str | None = None


_plans: dict[tuple[Any, ...], _Plan | None] = {}
_PLANS_MAX = 8192
_plans_lock = threading.Lock()


class FastResult:
    """The subset of SQLAlchemy's ``Result`` the store's units use, over rows already fetched."""

    __slots__ = ("_rows", "rowcount")

    def __init__(self, rows: list[Any], rowcount: int) -> None:
        self._rows = rows
        self.rowcount = rowcount

    def __iter__(self) -> Iterator[Any]:
        return iter(self._rows)

    def all(self) -> list[Any]:
        return self._rows

    fetchall = all

    def first(self) -> Any:
        return self._rows[0] if self._rows else None

    def one_or_none(self) -> Any:
        if len(self._rows) > 1:
            raise MultipleResultsFound("Multiple rows were found when one or none was required")
        return self._rows[0] if self._rows else None

    def one(self) -> Any:
        if not self._rows:
            raise NoResultFound("No row was found when one was required")
        if len(self._rows) > 1:
            raise MultipleResultsFound("Multiple rows were found when exactly one was required")
        return self._rows[0]

    def scalar(self) -> Any:
        return self._rows[0][0] if self._rows else None

    def scalar_one(self) -> Any:
        return self.one()[0]

    def scalar_one_or_none(self) -> Any:
        row = self.one_or_none()
        return None if row is None else row[0]

    def scalars(self) -> FastResult:
        return FastResult([row[0] for row in self._rows], self.rowcount)


def make_row_class(names: Sequence[str]) -> Any:
    """A named tuple with ``_mapping`` (what ``rows.py`` reads), or None when the names cannot be fields."""
    if len(set(names)) != len(names) or any(
        not n.isidentifier() or keyword.iskeyword(n) or n.startswith("_") for n in names
    ):
        return None
    fields = tuple(names)
    base = namedtuple("FastRow", fields)  # type: ignore[misc]  # noqa: PYI024

    def _mapping(self: Any) -> dict[str, Any]:
        return dict(zip(fields, self, strict=True))

    return type("FastRow", (base,), {"__slots__": (), "_mapping": property(_mapping)})


def _plan_for(
    conn: Connection, stmt: Any, schema_map: Mapping[str | None, str] | None, column_keys: tuple[str, ...] | None
) -> _Plan | None:
    dialect = conn.dialect
    compiled = stmt.compile(
        dialect=dialect,
        schema_translate_map=schema_map,
        column_keys=list(column_keys) if column_keys is not None else None,
    )
    if not isinstance(compiled, SQLCompiler) or not compiled.positional:
        return None
    if compiled.insert_prefetch or compiled.update_prefetch:
        return None  # Python-side column defaults: SQLAlchemy's execution context computes them
    expanding = bool(compiled.literal_execute_params or compiled.post_compile_params)
    sql: str | None = None
    if not expanding:
        sql = compiled.string
        if compiled.schema_translate_map:
            sql = compiled.preparer._render_schema_translates(sql, schema_map or {})
    row_class = None
    if compiled._result_columns:
        row_class = make_row_class([entry.keyname for entry in compiled._result_columns])
        if row_class is None:
            return None
    elif compiled.effective_returning or compiled.isplaintext:
        return None
    returning = bool(compiled.effective_returning or compiled._result_columns)
    slots, defaults, pieces = _direct_binding(compiled, dialect, schema_map)
    plain_values: Any = None
    plain_sql: str | None = None
    if slots and pieces is not None and all(arity == 0 for _name, _proc, arity in slots):
        names = [name for name, _proc, _arity in slots]
        plain_values = operator.itemgetter(*names) if len(names) > 1 else _one_value(names[0])
        plain_sql = pieces[0]
    return _Plan(
        plain_values=plain_values,
        plain_procs=tuple(
            (i, proc) for i, (_name, proc, _arity) in enumerate(slots or ()) if proc is not None
        ),
        plain_sql=plain_sql,
        slots=slots,
        defaults=defaults,
        pieces=pieces,
        expanded_sql={} if pieces is not None else None,
        compiled=compiled,
        sql=sql,
        positiontup=tuple(compiled.positiontup or ()),
        bind_processors=dict(compiled._bind_processors),
        row_class=row_class,
        result_types=tuple(entry.type for entry in compiled._result_columns),
        result_processors=False,
        schema_map=schema_map,
        # SQLite runs a multi-row execution as executemany, or (RETURNING) one execute per row:
        # both cost microseconds there.  PostgreSQL keeps SQLAlchemy's one-round-trip batching.
        executemany_ok=dialect.name == "sqlite" and not expanding,
        returning=returning,
    )


# The JSON fast path of the read paths: pydantic-core's parser (a dependency already, through
# pydantic), ~25% faster than the C scanner that ``json.loads`` ends in on span rows.  For every
# text that ``json.loads`` accepts it gives the same value — integers of any size exactly (orjson
# would make floats of those beyond 64 bits), floats bit for bit, NaN and ±Infinity, the last of
# duplicate keys, escaped surrogate pairs — except the escape of a lone surrogate, which it refuses;
# it refuses what ``json.loads`` refuses.  Whatever it refuses (and any non-text value) takes the
# standard path, which decodes or raises exactly as before.  Tests: test_read_paths.py
# (``test_json_reads_decode_as_json_loads``), test_json_values.py (``..._round_trip_exactly``).
_FAST_REFUSES = (ValueError, TypeError)


def _fast_parser_is_exact() -> bool:
    """Whether this pydantic-core parses what the fast path relies on as ``json.loads`` does (an
    older one may not): if not, every read takes the standard path."""
    text = '[18446744073709551616,-170141183460469231731687303715884105729,5e-324,0.1,{"a":1,"a":2}]'
    try:
        value = from_json(text)
    except _FAST_REFUSES:
        return False
    expected = json.loads(text)
    return value == expected and [type(v) for v in value] == [type(v) for v in expected]


_parse_json: Callable[[Any], Any] = from_json if _fast_parser_is_exact() else json.loads


def loads_json(text: str) -> Any:
    """``json.loads(text)`` (the engines' ``json_deserializer``: PostgreSQL's JSONB arrives as
    text), through the fast parser where it can; every error is ``json.loads``'s own."""
    try:
        return _parse_json(text)
    except _FAST_REFUSES:
        return json.loads(text)


def _sqlite_json(processor: Any) -> Any:
    """SQLAlchemy's result processor of a JSON column on SQLite (``json.loads`` through three Python
    frames, and numbers passed through), with the fast parser in front; anything it refuses goes to
    ``processor``, which decodes or raises exactly as before."""

    def process(value: Any) -> Any:
        if value is None:
            return None
        try:
            return _parse_json(value)
        except _FAST_REFUSES:
            return processor(value)

    return process


def _result_processor(conn: Connection, type_: Any, coltype: Any) -> Any:
    processor = type_._cached_result_processor(conn.dialect, coltype)
    if (
        processor is not None
        and conn.dialect.name == "sqlite"
        and isinstance(type_, (JSON, JsonValue))  # JsonValue: JSON on SQLite, no processing of its own
        and getattr(conn.dialect, "_json_deserializer", None) in (None, json.loads)
    ):
        return _sqlite_json(processor)
    return processor


def _result_processors(
    conn: Connection, plan: _Plan, description: Any
) -> tuple[tuple[int, Any], ...] | None:
    if description is None or len(description) != len(plan.result_types):
        raise RuntimeError("fastexec: the driver described another result than the statement compiled to")
    procs = tuple(
        (index, proc)
        for index, (type_, col) in enumerate(zip(plan.result_types, description, strict=True))
        if (proc := _result_processor(conn, type_, col[1])) is not None
    )
    plan.result_processors = procs or None
    return plan.result_processors


def _one_value(name: str) -> Any:
    def values(params: Mapping[str, Any]) -> tuple[Any]:
        return (params[name],)

    return values


# The plans last looked up, by statement, parameter names (in the caller's order) and the
# connection's schema translation map (the one execution option a plan depends on; a unit's own
# options such as its isolation level make a new options object, not a new map): what ``_lookup``
# would find again, without building its key (about a microsecond per statement).  Each entry holds
# the statement and the map object it was found for and is used only for those very objects; the
# dict is emptied when it grows past ``_HOT_MAX`` entries.
_hot: dict[tuple[int, tuple[str, ...], int], tuple[Any, Any, Any, _Plan | None]] = {}
_HOT_MAX = 4096


def _hot_lookup(conn: Connection, stmt: Any, first_params: Mapping[str, Any] | None) -> _Plan | None:
    """``_lookup``, through ``_hot`` first."""
    schema_map = conn.get_execution_options().get("schema_translate_map")
    key = (id(stmt), tuple(first_params) if first_params else (), id(schema_map))
    entry = _hot.get(key)
    if entry is not None and entry[0] is stmt and entry[1] is schema_map and entry[2] is conn.dialect:
        return entry[3]
    plan = _lookup(conn, stmt, first_params)
    if len(_hot) >= _HOT_MAX:
        _hot.clear()
    _hot[key] = (stmt, schema_map, conn.dialect, plan)
    return plan


def _lookup(conn: Connection, stmt: Any, first_params: Mapping[str, Any] | None) -> _Plan | None:
    options = conn.get_execution_options()
    schema_map = options.get("schema_translate_map")
    dialect = conn.dialect
    # An INSERT/UPDATE without explicit values compiles the columns its parameters name.
    column_keys = tuple(sorted(first_params)) if stmt.is_dml and first_params else None
    key = (
        id(stmt),
        column_keys,
        dialect.name,
        dialect.server_version_info,
        tuple(sorted((schema_map or {}).items(), key=str)),
    )
    try:
        return _plans[key]
    except KeyError:
        pass
    plan = _plan_for(conn, stmt, schema_map, column_keys)
    with _plans_lock:
        if len(_plans) >= _PLANS_MAX:
            _plans.clear()  # plans are per schema: a process that opens stores on many keeps no more
        return _plans.setdefault(key, plan)


def _direct_binding(
    compiled: SQLCompiler, dialect: Any, schema_map: Mapping[str | None, str] | None
) -> tuple[tuple[tuple[str, Any, int], ...] | None, dict[str, Any] | None, tuple[str, ...] | None]:
    """Precompute the binding: placeholder order, processors, defaults, and (SQLite) expansion points.
    Other positional paramstyles (asyncpg's ``$n``) only for statements without expanding parameters."""
    if compiled.literal_execute_params or (dialect.paramstyle != "qmark" and compiled.post_compile_params):
        return None, None, None
    slots: list[tuple[str, Any, int]] = []
    defaults: dict[str, Any] = {}
    for name in compiled.positiontup or ():
        bind = compiled.binds[name]
        if bind.callable is not None:
            return None, None, None
        if not bind.required:
            defaults[name] = bind.value
        if bind.expanding:
            types = getattr(bind.type, "types", None)
            element_types = types if types is not None else [bind.type]
            if any(t._cached_bind_processor(dialect) is not None for t in element_types):
                return None, None, None
            slots.append((name, None, len(types) if types is not None else 1))
        else:
            slots.append((name, compiled._bind_processors.get(name), 0))
    sql = compiled.string
    if compiled.schema_translate_map:
        sql = compiled.preparer._render_schema_translates(sql, schema_map or {})
    pieces = [sql]
    for name, _proc, arity in slots:
        if arity:
            head, sep, tail = pieces[-1].partition(f"__[POSTCOMPILE_{name}]")
            if not sep:
                return None, None, None
            pieces[-1:] = [head, tail]
    return tuple(slots), defaults, tuple(pieces)


def _direct_positional(plan: _Plan, params: Mapping[str, Any]) -> tuple[str, Sequence[Any]] | None:
    """The text and parameters straight from ``params``; None to take SQLAlchemy's path (a
    missing value, an empty IN list) so that its errors and special cases stay exactly its own."""
    if plan.plain_values is not None:
        try:
            values = plan.plain_values({**plan.defaults, **params} if plan.defaults else params)
        except KeyError:
            return None  # a missing value: SQLAlchemy's path raises its own error
        if plan.plain_procs:
            values = list(values)
            for index, proc in plan.plain_procs:
                values[index] = proc(values[index])
        return plan.plain_sql, values  # type: ignore[return-value]  # a str when plain_values is set
    assert plan.slots is not None and plan.defaults is not None and plan.pieces is not None
    out: list[Any] = []
    lengths: list[int] = []
    for name, proc, arity in plan.slots:
        if name in params:
            value = params[name]
        elif name in plan.defaults:
            value = plan.defaults[name]
        else:
            return None
        if arity == 0:
            out.append(value if proc is None else proc(value))
        elif not value:
            return None
        elif arity == 1:
            out.extend(value)
            lengths.append(len(value))
        else:
            for item in value:
                if len(item) != arity:
                    return None
                out.extend(item)
            lengths.append(len(value))
    key = tuple(lengths)
    assert plan.expanded_sql is not None
    sql = plan.expanded_sql.get(key)
    if sql is None:
        parts = [plan.pieces[0]]
        expanding = [(arity, n) for (_name, _p, arity), n in zip((x for x in plan.slots if x[2]), key, strict=True)]
        for (arity, n), piece in zip(expanding, plan.pieces[1:], strict=True):
            group = "?" if arity == 1 else "(" + ", ".join(["?"] * arity) + ")"
            rendered = ", ".join([group] * n)
            parts.append(rendered if arity == 1 else "VALUES " + rendered)
            parts.append(piece)
        sql = plan.expanded_sql.setdefault(key, "".join(parts))
    return sql, out


def _positional(plan: _Plan, params: Mapping[str, Any]) -> tuple[str, Sequence[Any]]:
    """The SQL text and positional parameters of one execution."""
    if plan.slots is not None:
        fast = _direct_positional(plan, params)
        if fast is not None:
            return fast
    compiled = plan.compiled
    if plan.sql is not None:
        values = compiled.construct_params(params, escape_names=False)
        procs = plan.bind_processors
        return plan.sql, [
            procs[name](values[name]) if name in procs else values[name] for name in plan.positiontup
        ]
    values = compiled.construct_params(params, escape_names=False)
    expanded = compiled._process_parameters_for_postcompile(values)
    sql = expanded.statement
    if compiled.schema_translate_map:
        sql = compiled.preparer._render_schema_translates(sql, plan.schema_map or {})
    procs = dict(plan.bind_processors)
    procs.update(expanded.processors)
    return sql, [
        procs[name](expanded.parameters[name]) if name in procs else expanded.parameters[name]
        for name in expanded.positiontup or ()
    ]


def execute(conn: Connection, stmt: Any, params: Mapping[str, Any] | Sequence[Mapping[str, Any]] | None = None) -> Any:
    """``conn.execute(stmt, params)``, straight on the driver when ``stmt`` is a prebuilt statement."""
    engine = conn.engine
    if not is_prebuilt(stmt) or engine.echo or engine._has_events or conn._has_events:
        # Echo and connection-event listeners (statement counters, OpenTelemetry's SQLAlchemy
        # instrumentation) see every statement: SQLAlchemy's own path.
        return conn.execute(stmt, params)  # type: ignore[arg-type]
    many: list[Mapping[str, Any]] | None = None
    if isinstance(params, (list, tuple)):
        if not params:
            return conn.execute(stmt, params)
        many = list(params)
    single: Mapping[str, Any] = {} if many is not None or params is None else params  # type: ignore[assignment]
    plan = _hot_lookup(conn, stmt, many[0] if many is not None else single)
    if plan is None or (many is not None and not plan.executemany_ok):
        return conn.execute(stmt, params)  # type: ignore[arg-type]
    if not conn.in_transaction():
        conn.begin()  # so that the unit's commit()/rollback() reach the driver as before
    dbapi_conn = conn.connection.dbapi_connection
    assert dbapi_conn is not None
    positional: Any
    if many is not None:
        batches = [_positional(plan, p) for p in many]
        sql, positional = batches[0][0], [b[1] for b in batches]
    else:
        sql, positional = _positional(plan, single)
    if many is None and _asyncpg_direct(dbapi_conn):
        return _execute_asyncpg(conn, dbapi_conn, plan, sql, positional)
    cursor = dbapi_conn.cursor()
    try:
        raw: list[Any] = []
        if many is None:
            cursor.execute(sql, positional)
            if plan.row_class is not None:
                raw = list(cursor.fetchall())
            rowcount = cursor.rowcount
        elif plan.returning:
            for one in positional:
                cursor.execute(sql, one)
                raw.extend(cursor.fetchall())
            rowcount = len(raw)
        else:
            cursor.executemany(sql, positional)
            rowcount = cursor.rowcount
        return FastResult(_rows(conn, plan, raw, lambda: cursor.description), rowcount)
    except conn.dialect.loaded_dbapi.Error as exc:
        raise _translated(conn, dbapi_conn, cursor, sql, positional, exc) from exc
    finally:
        cursor.close()


def control(conn: Connection, sql: str) -> None:
    """A SQLite unit's ``BEGIN [IMMEDIATE]`` or ``COMMIT``, straight on the driver (~2 µs against ~10
    through SQLAlchemy).  SQLAlchemy's own transaction is left as it is: on SQLite it only mirrors
    the driver's (pysqlite's begin sends nothing), so it may stay open across units, and a rollback
    (``conn.rollback()``) still ends both.  With echo or connection-event listeners, SQLAlchemy's path
    (``exec_driver_sql``, ``commit()``), as for every statement (``execute``)."""
    engine = conn.engine
    if engine.echo or engine._has_events or conn._has_events:
        if sql == "COMMIT":
            conn.commit()
        else:
            conn.exec_driver_sql(sql)
        return
    dbapi_conn = conn.connection.dbapi_connection
    assert dbapi_conn is not None
    try:
        dbapi_conn.execute(sql)
    except conn.dialect.loaded_dbapi.Error as exc:
        raise _translated(conn, dbapi_conn, None, sql, (), exc) from exc


def _rows(conn: Connection, plan: _Plan, raw: Sequence[Any], description: Any) -> list[Any]:
    """The driver's rows as the plan's row class, through the result processors (worked out from
    ``description()`` at the plan's first execution)."""
    if plan.row_class is None:
        return []
    make = plan.row_class._make
    procs = plan.result_processors
    if procs is False or procs is True:
        procs = _result_processors(conn, plan, description())
    if procs is None:
        return [make(r) for r in raw]
    out = []
    for r in raw:  # only the columns that have a processor (a span row: 5 of 16) are visited
        values = list(r)
        for index, proc in procs:
            values[index] = proc(values[index])
        out.append(make(values))
    return out


def _translated(conn: Connection, dbapi_conn: Any, cursor: Any, sql: str, params: Any, exc: Any) -> Exception:
    """SQLAlchemy's error for a driver error of a raw execution; a lost connection is invalidated."""
    invalidated = conn.dialect.is_disconnect(exc, dbapi_conn, cursor)
    if invalidated:
        conn.invalidate(exc)
    return DBAPIError.instance(
        sql,
        params,
        exc,
        conn.dialect.loaded_dbapi.Error,
        connection_invalidated=invalidated,
        dialect=conn.dialect,
    )


# --- asyncpg without SQLAlchemy's cursor adapter ------------------------------------------------
#
# SQLAlchemy's asyncpg cursor costs ~15-20 µs of Python per statement on top of asyncpg (a lock, a
# result description list, a deque, a regular expression on the status line).  For one execution
# of a prebuilt statement, ``_execute_asyncpg`` does what its ``_prepare_and_execute`` does through
# the same adapter connection: the same lock, the same lazily started transaction, the same
# prepared-statement cache, the same translation of asyncpg's errors.  It relies on private names of
# SQLAlchemy's adapter (2.0 and 2.1 have them alike); an adapter without them takes the cursor path.
_ASYNCPG_ADAPTER_NAMES = (
    "_connection",
    "_execute_mutex",
    "_transaction",
    "_start_transaction",
    "_prepare",
    "_handle_exception",
)
_asyncpg_adapters: dict[type, bool] = {}


def _asyncpg_direct(dbapi_conn: Any) -> bool:
    kind = type(dbapi_conn)
    known = _asyncpg_adapters.get(kind)
    if known is None:
        known = kind.__name__ == "AsyncAdapt_asyncpg_connection" and all(
            hasattr(dbapi_conn, name) for name in _ASYNCPG_ADAPTER_NAMES
        )
        _asyncpg_adapters[kind] = known
    return known


async def _asyncpg_run(adapter: Any, sql: str, params: Sequence[Any]) -> tuple[list[Any], str | None, Any]:
    async with adapter._execute_mutex:
        if adapter._transaction is None:
            await adapter._start_transaction()
        try:
            prepared, attributes = await adapter._prepare(sql, 0)
            rows = await prepared.fetch(*params)
            return rows, prepared.get_statusmsg(), attributes
        except Exception as error:  # noqa: BLE001 - translated (and re-raised) as the cursor does
            adapter._handle_exception(error)
            raise  # unreachable: _handle_exception raises


def _status_rowcount(status: str | None) -> int:
    """The row count of a command status ("UPDATE 3", "INSERT 0 2", "SELECT 5"), else -1 (the
    cursor's rule)."""
    parts = (status or "").split()
    if len(parts) == 2 and parts[0] in ("SELECT", "UPDATE", "DELETE") and parts[1].isdigit():
        return int(parts[1])
    if len(parts) == 3 and parts[0] == "INSERT" and parts[1].isdigit() and parts[2].isdigit():
        return int(parts[2])
    return -1


def _description(attributes: Any) -> Any:
    """A cursor's ``description`` from asyncpg's result attributes (what ``_rows`` reads once)."""
    if not attributes:
        return None
    return [(attr.name, attr.type.oid, None, None, None, None, None) for attr in attributes]


def _execute_asyncpg(
    conn: Connection, adapter: Any, plan: _Plan, sql: str, params: Sequence[Any]
) -> FastResult:
    try:
        raw, status, attributes = await_only(_asyncpg_run(adapter, sql, params))
    except conn.dialect.loaded_dbapi.Error as exc:
        raise _translated(conn, adapter, None, sql, params, exc) from exc
    return FastResult(_rows(conn, plan, raw, lambda: _description(attributes)), _status_rowcount(status))


async def fetch_prebuilt(conn: Connection, stmt: Any, params: Mapping[str, Any]) -> list[Any] | None:
    """The rows of ONE execution of the prebuilt read ``stmt`` on ``conn``'s asyncpg connection,
    awaited in the calling coroutine: no greenlet, and nothing of ``conn`` but its plan look-up
    (``conn`` must rest in autocommit, outside any transaction).  None, before anything is sent,
    when the statement cannot run so (not prebuilt, echo or event listeners, not asyncpg, a plan
    SQLAlchemy must bind itself); the driver's errors as SQLAlchemy's adapter raises them
    (``execute`` would translate them further: a caller of this one gives up the connection and
    runs the statement through ``execute`` instead)."""
    engine = conn.engine
    if not is_prebuilt(stmt) or engine.echo or engine._has_events or conn._has_events:
        return None
    dbapi_conn = conn.connection.dbapi_connection
    if dbapi_conn is None or not _asyncpg_direct(dbapi_conn) or dbapi_conn._transaction is not None:
        return None
    plan = _hot_lookup(conn, stmt, params)
    if plan is None or plan.row_class is None or plan.slots is None:
        return None
    positional = _direct_positional(plan, params)
    if positional is None:
        return None  # a missing value or an empty list: SQLAlchemy's path and its own error
    raw, _status, attributes = await _asyncpg_run(dbapi_conn, positional[0], positional[1])
    return _rows(conn, plan, raw, lambda: _description(attributes))
