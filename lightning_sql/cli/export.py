"""``lightning-sql export``: a run to JSONL, CSV or Parquet files."""

from __future__ import annotations

import contextlib

import click

from lightning_sql.cli.options import common_options, fail, handled, need_run, open_existing, run_option
from lightning_sql.cli.output import emit, print_table

DEFAULT_TABLES = ("rollouts", "attempts", "spans", "resource_versions", "workers")


@click.command("export")
@run_option()
@click.option("--to", "directory", required=True, type=click.Path(file_okay=False), help="Output directory.")
@click.option("--format", "fmt", type=click.Choice(["jsonl", "csv", "parquet"]), default="jsonl", show_default=True)
@click.option("--table", "tables", multiple=True, help="Table or view to export (repeatable); default: the run's tables.")
@click.option("--views", is_flag=True, help="Also export the analysis views (*_v1).")
@click.option("--since", help="Rows from this time on (epoch seconds or ISO 8601).")
@click.option("--until", help="Rows before this time (epoch seconds or ISO 8601).")
@click.option("--chunk-rows", type=click.IntRange(min=1), default=5_000, show_default=True)
@common_options
@handled
def export_command(
    run: str | None,
    directory: str,
    fmt: str,
    tables: tuple[str, ...],
    views: bool,
    since: str | None,
    until: str | None,
    chunk_rows: int,
    url: str | None,
    schema: str | None,
    connect_timeout: float,
    as_json: bool,
) -> None:
    """Export a run to JSONL, CSV or Parquet, streaming in short read transactions."""
    from lightning_sql import analysis
    from lightning_sql.store.sql.views import VIEW_NAMES

    name = need_run(run)
    chosen = list(tables) or list(DEFAULT_TABLES)
    if views:
        chosen += [v for v in VIEW_NAMES if v not in chosen]
    unknown = [t for t in chosen if t not in analysis.EXPORTABLE]
    if unknown:
        raise click.UsageError(f"unknown table(s) {', '.join(unknown)}; choose from {', '.join(analysis.EXPORTABLE)}")
    try:
        start, end = analysis.to_epoch(since), analysis.to_epoch(until)
    except ValueError as exc:
        raise click.UsageError(str(exc)) from exc
    with contextlib.closing(open_existing(url, schema, connect_timeout)) as database:
        try:
            result = analysis.export_run(
                database, name, directory, format=fmt, tables=chosen, since=start, until=end, chunk_rows=chunk_rows
            )
        except ImportError as exc:
            fail(as_json, str(exc))
    data = {
        "run": name,
        "format": fmt,
        "files": {k: str(v) for k, v in result.files.items()},
        "rows": result.rows,
        "chunks": result.chunks,
    }
    records = [{"table": t, "rows": result.rows[t], "file": str(result.files[t])} for t in result.files]
    emit(as_json, data, lambda c: print_table(c, f"export of {name}", ["table", "rows", "file"], records))
