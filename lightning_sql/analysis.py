"""Post-hoc analysis of lightning_sql runs: pandas DataFrames and streaming exports.

    from lightning_sql import analysis
    df = analysis.rollouts("sqlite:///quickstart.db", "quickstart")     # rollout_summary_v1
    analysis.export_run("sqlite:///quickstart.db", "quickstart", "out/", format="parquet")

DataFrame helpers need pandas (``pip install 'lightning_sql[analysis]'``), Parquet export needs
pyarrow (same extra); JSONL and CSV exports need nothing.  Everything here only reads: the database
is opened through a ``read_only=True`` store (never migrates, never sweeps, never creates a run).

Exports stream: rows are read in keyset-paginated chunks (``WHERE key > last ORDER BY key LIMIT n``),
each chunk its own short read transaction, and written before the next chunk is read, so memory stays
flat and no snapshot is held open for the length of the export (a long WAL snapshot on SQLite
stops checkpoints; a long transaction on PostgreSQL holds back vacuum).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import csv
import json
import math
import os
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

from sqlalchemy import BigInteger, Float, Integer, Select, Table, and_, func, or_, select, text

from lightning_sql.store.sql import schema as s
from lightning_sql.store.sql.executor import UnitContext
from lightning_sql.store.sql.store import SqlLightningStore
from lightning_sql.store.sql.views import VIEW_TABLES

if TYPE_CHECKING:
    import pandas

__all__ = [
    "AnalysisDatabase",
    "ExportResult",
    "EXPORTABLE",
    "UnknownRunError",
    "attempts",
    "export_run",
    "llm_calls",
    "read_sql",
    "rewards",
    "rollouts",
    "runs",
    "spans",
]

T = TypeVar("T")

# Rows per chunk: one short transaction each; 5k rows of spans are a few MB in flight.
EXPORT_CHUNK_ROWS = 5_000
# The CLI answers "database unreachable" quickly rather than after the store's 30 s default.
DEFAULT_CONNECT_DEADLINE_S = 10.0

FORMATS = ("jsonl", "csv", "parquet")

TABLES: dict[str, Table] = {
    "rollouts": s.rollouts,
    "attempts": s.attempts,
    "spans": s.spans,
    "resources": s.resources,
    "resource_versions": s.resource_versions,
    "workers": s.workers,
    **VIEW_TABLES,
}
EXPORTABLE = tuple(TABLES)
"""Tables and views ``export_run`` accepts."""

# The keyset of each table within a run (unique, ordered, index-backed where it matters).
_KEYS: dict[str, tuple[str, ...]] = {
    "rollouts": ("rollout_id",),
    "attempts": ("rollout_id", "attempt_id"),
    "spans": ("id",),
    "resources": ("resources_id",),
    "resource_versions": ("resources_id", "version"),
    "workers": ("worker_id",),
    "rollout_summary_v1": ("rollout_id",),
    "attempts_v1": ("rollout_id", "attempt_id"),
    "rewards_v1": ("rollout_id", "attempt_id", "span_id", "dimension"),
    "llm_calls_v1": ("rollout_id", "attempt_id", "span_id"),
}
# The column a time range (since/until) applies to; None = not time-filtered.
_TIME_COLUMNS: dict[str, str | None] = {
    "rollouts": "start_time",
    "attempts": "start_time",
    "spans": "start_time",
    "resources": "update_time",
    "resource_versions": "time",
    "workers": None,
    "rollout_summary_v1": "start_time",
    "attempts_v1": "start_time",
    "rewards_v1": "start_time",
    "llm_calls_v1": "start_time",
}


class UnknownRunError(LookupError):
    """The run name is not in the database; the message lists the runs that are."""

    def __init__(self, name: str, known: Sequence[str]) -> None:
        self.name = name
        self.known = list(known)
        listing = ", ".join(repr(n) for n in known) if known else "none"
        super().__init__(f"Run {name!r} does not exist in this database; existing runs: {listing}")


def _require_pandas() -> Any:
    try:
        import pandas
    except ImportError as exc:
        raise ImportError(
            "lightning_sql.analysis DataFrame helpers need pandas: pip install 'lightning_sql[analysis]'"
        ) from exc
    return pandas


def _require_pyarrow() -> tuple[Any, Any]:
    try:
        import pyarrow
        import pyarrow.parquet
    except ImportError as exc:
        raise ImportError("Parquet export needs pyarrow: pip install 'lightning_sql[analysis]'") from exc
    return pyarrow, pyarrow.parquet


def _run_coroutine(factory: Callable[[], Any]) -> Any:
    """Run a coroutine to completion from sync code, even inside a running loop (a notebook)."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(factory())
    with concurrent.futures.ThreadPoolExecutor(max_workers=1) as pool:
        return pool.submit(lambda: asyncio.run(factory())).result()


def to_epoch(value: float | int | str | datetime | None) -> float | None:
    """Epoch seconds from a number, an ISO-8601 string or a datetime (naive = local time)."""
    if value is None:
        return None
    if isinstance(value, bool):
        raise TypeError(f"expected a time, got {value!r}")
    if isinstance(value, (int, float)):
        return float(value)
    if isinstance(value, str):
        try:
            return float(value)
        except ValueError:
            pass
        try:
            value = datetime.fromisoformat(value)
        except ValueError:
            raise ValueError(f"not a time: {value!r} (use epoch seconds or ISO 8601, e.g. 2025-01-31T12:00)") from None
    if isinstance(value, datetime):
        return value.timestamp()
    raise TypeError(f"expected a time, got {value!r}")


class AnalysisDatabase:
    """A read-only handle on a lightning_sql database: every call is one short read transaction.

    Sync, so it works from scripts, the CLI and notebooks alike.  ``schema`` names the PostgreSQL
    schema (default ``lightning_sql``).
    """

    def __init__(
        self,
        url: str,
        *,
        schema: str | None = None,
        connect_deadline_seconds: float = DEFAULT_CONNECT_DEADLINE_S,
    ) -> None:
        options: dict[str, Any] = {}
        if schema is not None:
            options["schema"] = schema
        self.store = SqlLightningStore(
            url,
            run=None,
            create_run=False,
            read_only=True,
            clock_sync=False,
            connect_deadline_seconds=connect_deadline_seconds,
            **options,
        )

    @property
    def url(self) -> str:
        """The URL with its password masked."""
        return self.store.url

    @property
    def dialect(self) -> str:
        return self.store.dialect

    @property
    def schema(self) -> str | None:
        return self.store.schema

    def read(self, unit: Callable[[UnitContext], T]) -> T:
        """Run ``unit(ctx)`` in one read transaction (one snapshot) and return its result."""
        return _run_coroutine(lambda: self.store.run_sql(unit, snapshot=True, bound=False))  # type: ignore[no-any-return]

    def rows(self, stmt: Any) -> tuple[list[str], list[tuple[Any, ...]]]:
        """Column names and rows of a SQLAlchemy statement."""

        def unit(ctx: UnitContext) -> tuple[list[str], list[tuple[Any, ...]]]:
            result = ctx.conn.execute(stmt)
            return list(result.keys()), [tuple(row) for row in result]

        return self.read(unit)

    def raw(self, sql: str, params: dict[str, Any] | None = None) -> tuple[list[str], list[tuple[Any, ...]]]:
        """Column names and rows of hand-written SQL over the plain table and view names.

        On PostgreSQL the store's schema is put first on the transaction's ``search_path``.
        """
        schema = self.schema

        def unit(ctx: UnitContext) -> tuple[list[str], list[tuple[Any, ...]]]:
            if schema is not None:
                quoted = ctx.conn.dialect.identifier_preparer.quote_schema(schema)
                ctx.conn.execute(select(func.set_config("search_path", quoted, True)))
            result = ctx.conn.execute(text(sql), params or {})
            return list(result.keys()), [tuple(row) for row in result]

        return self.read(unit)

    def run_names(self) -> list[str]:
        _, rows = self.rows(select(s.runs.c.name).order_by(s.runs.c.run_id))
        return [r[0] for r in rows]

    def run_id(self, name: str) -> int:
        """The run's id; :class:`UnknownRunError` (listing the runs) for an unknown name."""

        def unit(ctx: UnitContext) -> tuple[int | None, list[str]]:
            found = ctx.conn.execute(select(s.runs.c.run_id).where(s.runs.c.name == name)).scalar()
            if found is not None:
                return int(found), []
            return None, list(ctx.conn.execute(select(s.runs.c.name).order_by(s.runs.c.run_id)).scalars())

        run_id, known = self.read(unit)
        if run_id is None:
            raise UnknownRunError(name, known)
        return run_id

    def close(self) -> None:
        _run_coroutine(self.store.close)

    def __enter__(self) -> AnalysisDatabase:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def _frame(columns: list[str], rows: list[tuple[Any, ...]]) -> pandas.DataFrame:
    pandas = _require_pandas()
    return pandas.DataFrame.from_records(rows, columns=columns)


def _open(url: str | AnalysisDatabase, schema: str | None) -> tuple[AnalysisDatabase, bool]:
    if isinstance(url, AnalysisDatabase):
        return url, False
    return AnalysisDatabase(url, schema=schema), True


def _view_frame(
    url: str | AnalysisDatabase, run: str, view: str, order: Sequence[str], schema: str | None, **equals: Any
) -> pandas.DataFrame:
    _require_pandas()
    db, owned = _open(url, schema)
    try:
        table = TABLES[view]
        run_id = db.run_id(run)
        where = [table.c.run_id == run_id]
        where += [table.c[k] == v for k, v in equals.items() if v is not None]
        columns, rows = db.rows(select(table).where(*where).order_by(*(table.c[c] for c in order)))
        return _frame(columns, rows)
    finally:
        if owned:
            db.close()


def runs(url: str | AnalysisDatabase, *, schema: str | None = None) -> pandas.DataFrame:
    """One row per run: name, status, times and counts of rollouts by status, attempts and spans."""
    _require_pandas()
    db, owned = _open(url, schema)
    try:
        columns, rows = db.rows(run_overview())
        return _frame(columns, rows)
    finally:
        if owned:
            db.close()


def rollouts(url: str | AnalysisDatabase, run: str, *, schema: str | None = None) -> pandas.DataFrame:
    """``rollout_summary_v1`` of the run: status, mode, resources version, attempts, duration, final reward."""
    return _view_frame(url, run, "rollout_summary_v1", ("start_time", "rollout_id"), schema)


def attempts(url: str | AnalysisDatabase, run: str, *, schema: str | None = None) -> pandas.DataFrame:
    """``attempts_v1`` of the run: worker, outcome, duration, error type and message."""
    return _view_frame(url, run, "attempts_v1", ("start_time", "rollout_id", "attempt_number"), schema)


def rewards(url: str | AnalysisDatabase, run: str, *, schema: str | None = None) -> pandas.DataFrame:
    """``rewards_v1`` of the run: one row per reward dimension of every reward span."""
    return _view_frame(url, run, "rewards_v1", ("rollout_id", "attempt_id", "sequence_id", "dimension"), schema)


def llm_calls(url: str | AnalysisDatabase, run: str, *, schema: str | None = None) -> pandas.DataFrame:
    """``llm_calls_v1`` of the run: model, prompt / completion tokens, latency per LLM-call span."""
    return _view_frame(url, run, "llm_calls_v1", ("start_time", "rollout_id", "span_id"), schema)


def spans(
    url: str | AnalysisDatabase,
    run: str,
    *,
    rollout_id: str | None = None,
    attempt_id: str | None = None,
    schema: str | None = None,
) -> pandas.DataFrame:
    """The run's spans (optionally of one rollout / attempt) in sequence order; JSON columns as dicts."""
    return _view_frame(
        url, run, "spans", ("rollout_id", "attempt_id", "sequence_id", "id"), schema,
        rollout_id=rollout_id, attempt_id=attempt_id,
    )


def read_sql(
    url: str | AnalysisDatabase, sql: str, params: dict[str, Any] | None = None, *, schema: str | None = None
) -> pandas.DataFrame:
    """Any SQL over the plain table and view names (``docs/analysis.md``) as a DataFrame."""
    _require_pandas()
    db, owned = _open(url, schema)
    try:
        columns, rows = db.raw(sql, params)
        return _frame(columns, rows)
    finally:
        if owned:
            db.close()


def run_overview(run_id: int | None = None) -> Select[Any]:
    """Per run: name, status, created/finished, rollouts by status, attempts, spans, workers."""
    ro, at, sp, wk, ru = s.rollouts, s.attempts, s.spans, s.workers, s.runs

    def count_of(table: Table, *where: Any) -> Any:
        return (
            select(func.count()).select_from(table).where(table.c.run_id == ru.c.run_id, *where).scalar_subquery()
        )

    stmt = select(
        ru.c.run_id,
        ru.c.name,
        ru.c.status,
        ru.c.created_at,
        ru.c.finished_at,
        count_of(ro).label("rollouts"),
        count_of(ro, ro.c.queue_seq.isnot(None)).label("queued"),
        count_of(ro, ro.c.status.in_(("preparing", "running"))).label("running"),
        count_of(ro, ro.c.status == "succeeded").label("succeeded"),
        count_of(ro, ro.c.status == "failed").label("failed"),
        count_of(ro, ro.c.status == "cancelled").label("cancelled"),
        count_of(at).label("attempts"),
        count_of(sp).label("spans"),
        count_of(wk).label("workers"),
    ).order_by(ru.c.run_id)
    if run_id is not None:
        stmt = stmt.where(ru.c.run_id == run_id)
    return stmt


# --- export -------------------------------------------------------------------------------------


@dataclass
class ExportResult:
    """What ``export_run`` wrote: one file and row count per table, and the chunks it read."""

    files: dict[str, Path] = field(default_factory=dict)
    rows: dict[str, int] = field(default_factory=dict)
    chunks: int = 0


def iter_chunks(
    db: AnalysisDatabase,
    name: str,
    run_id: int,
    *,
    since: float | None = None,
    until: float | None = None,
    chunk_rows: int = EXPORT_CHUNK_ROWS,
) -> Iterator[tuple[list[str], list[tuple[Any, ...]]]]:
    """The run's rows of table/view ``name`` in key order, one read transaction per chunk."""
    if chunk_rows < 1:
        raise ValueError(f"chunk_rows must be >= 1, got {chunk_rows!r}")
    table = TABLES[name]
    key_columns = [table.c[k] for k in _KEYS[name]]
    where: list[Any] = [table.c.run_id == run_id]
    time_column = _TIME_COLUMNS[name]
    if time_column is not None and since is not None:
        where.append(table.c[time_column] >= since)
    if time_column is not None and until is not None:
        where.append(table.c[time_column] < until)
    last: tuple[Any, ...] | None = None
    while True:
        page = select(table).where(*where)
        if last is not None:
            page = page.where(_after(key_columns, last))
        columns, rows = db.rows(page.order_by(*key_columns).limit(chunk_rows))
        if not rows:
            return
        yield columns, rows
        if len(rows) < chunk_rows:
            return
        positions = [columns.index(c.name) for c in key_columns]
        last = tuple(rows[-1][i] for i in positions)


def _after(columns: list[Any], last: tuple[Any, ...]) -> Any:
    if len(columns) == 1:
        return columns[0] > last[0]
    # Expanded rather than a row-value comparison: both dialects plan it on the index prefix.
    clauses = []
    for i, column in enumerate(columns):
        clauses.append(and_(*(columns[j] == last[j] for j in range(i)), column > last[i]))
    return or_(*clauses) if len(clauses) > 1 else clauses[0]


def _json_ready(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value


class _Writer:
    def write(self, columns: list[str], rows: list[tuple[Any, ...]]) -> None:
        raise NotImplementedError

    def close(self) -> None:
        raise NotImplementedError


class _JsonlWriter(_Writer):
    def __init__(self, path: Path) -> None:
        self._file = open(path, "w", encoding="utf-8")  # noqa: SIM115 - closed by close()

    def write(self, columns: list[str], rows: list[tuple[Any, ...]]) -> None:
        for row in rows:
            record = {c: _json_ready(v) for c, v in zip(columns, row, strict=True)}
            self._file.write(json.dumps(record, ensure_ascii=False, separators=(",", ":")))
            self._file.write("\n")

    def close(self) -> None:
        self._file.close()


class _CsvWriter(_Writer):
    """CSV; JSON columns are written as JSON text, NULL as an empty field."""

    def __init__(self, path: Path, json_columns: set[str]) -> None:
        self._file = open(path, "w", encoding="utf-8", newline="")  # noqa: SIM115 - closed by close()
        self._writer = csv.writer(self._file)
        self._json_columns = json_columns
        self._header_written = False

    def write(self, columns: list[str], rows: list[tuple[Any, ...]]) -> None:
        if not self._header_written:
            self._writer.writerow(columns)
            self._header_written = True
        json_at = [i for i, c in enumerate(columns) if c in self._json_columns]
        for row in rows:
            values = list(row)
            for i in json_at:
                if values[i] is not None:
                    values[i] = json.dumps(values[i], ensure_ascii=False, separators=(",", ":"))
            self._writer.writerow(["" if v is None else v for v in values])

    def close(self) -> None:
        self._file.close()


class _ParquetWriter(_Writer):
    """Parquet, one row group per chunk; JSON columns as JSON text (``string``)."""

    def __init__(self, path: Path, table: Table) -> None:
        pa, pq = _require_pyarrow()
        self._pa = pa
        self._json_columns = {c.name for c in table.columns if isinstance(c.type, s.JsonValue)}
        fields = []
        for column in table.columns:
            if isinstance(column.type, (Integer, BigInteger)):
                kind = pa.int64()
            elif isinstance(column.type, Float):
                kind = pa.float64()
            else:
                kind = pa.string()
            fields.append(pa.field(column.name, kind))
        self._schema = pa.schema(fields)
        self._writer = pq.ParquetWriter(str(path), self._schema)

    def write(self, columns: list[str], rows: list[tuple[Any, ...]]) -> None:
        data: dict[str, list[Any]] = {c: [] for c in columns}
        for row in rows:
            for c, v in zip(columns, row, strict=True):
                if c in self._json_columns and v is not None:
                    v = json.dumps(v, ensure_ascii=False, separators=(",", ":"))
                data[c].append(v)
        self._writer.write_table(self._pa.table(data, schema=self._schema))

    def close(self) -> None:
        self._writer.close()


def _writer(format: str, path: Path, table: Table) -> _Writer:
    if format == "jsonl":
        return _JsonlWriter(path)
    if format == "csv":
        return _CsvWriter(path, {c.name for c in table.columns if isinstance(c.type, s.JsonValue)})
    return _ParquetWriter(path, table)


def export_run(
    url: str | AnalysisDatabase,
    run: str,
    directory: str | os.PathLike[str],
    *,
    format: str = "jsonl",
    tables: Sequence[str] = ("rollouts", "attempts", "spans", "resource_versions", "workers"),
    since: float | int | str | datetime | None = None,
    until: float | int | str | datetime | None = None,
    chunk_rows: int = EXPORT_CHUNK_ROWS,
    schema: str | None = None,
    on_chunk: Callable[[str, int], None] | None = None,
) -> ExportResult:
    """Write the run's ``tables`` (tables and/or ``*_v1`` views) to ``directory/<table>.<format>``.

    ``since``/``until`` (epoch seconds, ISO 8601 or datetime) keep rows whose time column (start time;
    ``time`` for resource versions) is in ``[since, until)``.  Streams in ``chunk_rows`` chunks, each
    one read transaction; ``on_chunk(table, rows)`` is called after each chunk is written.
    """
    if format not in FORMATS:
        raise ValueError(f"format={format!r}: expected one of {', '.join(FORMATS)}")
    unknown = [t for t in tables if t not in TABLES]
    if unknown or not tables:
        raise ValueError(f"tables={list(tables)!r}: expected some of {', '.join(EXPORTABLE)}")
    if format == "parquet":
        _require_pyarrow()
    start, end = to_epoch(since), to_epoch(until)
    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    db, owned = _open(url, schema)
    result = ExportResult()
    try:
        run_id = db.run_id(run)
        for name in tables:
            path = out / f"{name}.{format}"
            writer = _writer(format, path, TABLES[name])
            count = 0
            try:
                for columns, rows in iter_chunks(db, name, run_id, since=start, until=end, chunk_rows=chunk_rows):
                    writer.write(columns, rows)
                    count += len(rows)
                    result.chunks += 1
                    if on_chunk is not None:
                        on_chunk(name, len(rows))
                if count == 0 and format != "jsonl":
                    writer.write([c.name for c in TABLES[name].columns], [])
            finally:
                writer.close()
            result.files[name] = path
            result.rows[name] = count
    finally:
        if owned:
            db.close()
    return result
