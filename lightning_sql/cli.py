"""``lightning-sql``: inspect, export, maintain and serve lightning_sql runs from a terminal.

Every command takes ``--url`` (or ``LIGHTNING_SQL_URL``), ``--schema`` for PostgreSQL (or
``LIGHTNING_SQL_SCHEMA``; default ``lightning_sql``), ``--run`` (or ``LIGHTNING_SQL_RUN``) where a
run applies, and ``--json`` for machine-readable output.  Exit codes: 0 ok, 1 failed (check found
violations, run or rollout not found, database unreachable or at the wrong revision), 2 usage.

Read commands open the database read-only (no migration, no sweep, no run created); writing
commands (``sweep``, ``gc``, ``worker``) never create a run and never migrate: only ``db upgrade``
changes the schema.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import importlib.util
import json
import os
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, TypeVar

import click
from rich.console import Console
from rich.table import Table
from rich.tree import Tree

from lightning_sql.store.sql.urls import DatabaseTarget, mask_url, normalise_url

F = TypeVar("F", bound=Callable[..., Any])

EXIT_OK = 0
EXIT_FAILED = 1
EXIT_USAGE = 2

# How long a command waits for an unreachable database before saying so.
DEFAULT_CONNECT_TIMEOUT_S = 10.0
# Span rows deleted per transaction by `gc --spans-before`: short enough never to hold writers up.
GC_BATCH_ROWS = 2_000
STATUS_THROUGHPUT_WINDOW_S = 300.0  # "recent" throughput in `status`

DEMO_SCRIPT = Path(__file__).resolve().parents[1] / "examples" / "quickstart.py"


class Failed(click.ClickException):
    """A command that ran but failed: exit code 1, message on stderr (and as JSON with --json)."""

    exit_code = EXIT_FAILED

    def __init__(self, message: str, **details: Any) -> None:
        super().__init__(message)
        self.details = details


# --- options ------------------------------------------------------------------------------------


def _common(func: F) -> F:
    func = click.option("--json", "as_json", is_flag=True, help="Machine-readable JSON on stdout.")(func)
    func = click.option(
        "--connect-timeout",
        type=float,
        default=DEFAULT_CONNECT_TIMEOUT_S,
        show_default=True,
        help="Seconds to wait for an unreachable database.",
    )(func)
    func = click.option(
        "--schema", envvar="LIGHTNING_SQL_SCHEMA", help="PostgreSQL schema (default lightning_sql)."
    )(func)
    func = click.option("--url", envvar="LIGHTNING_SQL_URL", help="Database URL (or LIGHTNING_SQL_URL).")(func)
    return func


def _run_option(required: bool = True) -> Callable[[F], F]:
    return click.option(
        "--run",
        envvar="LIGHTNING_SQL_RUN",
        required=False,
        help="Run name (or LIGHTNING_SQL_RUN)." + ("" if required else " Optional."),
    )


def _handled(func: F) -> F:
    """Turn the store's and the database's errors into messages and exit codes."""

    @functools.wraps(func)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        from lightning_sql.analysis import UnknownRunError
        from lightning_sql.store.sql.errors import StoreUnavailableError
        from lightning_sql.store.sql.migrate import SchemaError

        as_json = bool(kwargs.get("as_json"))
        try:
            return func(*args, **kwargs)
        except (click.ClickException, click.exceptions.Exit, click.Abort):
            raise
        except UnknownRunError as exc:
            _fail(as_json, str(exc), runs=exc.known)
        except SchemaError as exc:
            _fail(as_json, str(exc))
        except StoreUnavailableError as exc:
            _fail(as_json, str(exc))
        except ValueError as exc:
            message = str(exc)
            if "does not exist in this database" in message:  # the store's unknown-run error
                _fail(as_json, message)
            raise click.UsageError(message) from exc

    return wrapper  # type: ignore[return-value]


def _fail(as_json: bool, message: str, **details: Any) -> None:
    if as_json:
        click.echo(json.dumps({"error": message, **details}, default=str))
    raise Failed(message, **details)


def _console() -> Console:
    # No file: rich writes to whatever sys.stdout is at the time (click's test runner swaps it).
    return Console(soft_wrap=True)


def _emit(as_json: bool, data: Any, render: Callable[[Console], None]) -> None:
    if as_json:
        click.echo(json.dumps(data, default=str, ensure_ascii=False))
    else:
        render(_console())


def _target(url: str | None, schema: str | None) -> DatabaseTarget:
    if not url:
        raise click.UsageError("no database: pass --url URL or set LIGHTNING_SQL_URL")
    try:
        target = normalise_url(url)
    except ValueError as exc:
        raise click.UsageError(str(exc)) from exc
    if target.kind == "sqlite-memory":
        raise click.UsageError("an in-memory SQLite database holds nothing to inspect: pass a file URL")
    if target.dialect == "sqlite" and schema is not None:
        raise click.UsageError(f"--schema {schema!r} applies to PostgreSQL only; a SQLite file has no schemas")
    return target


def _require_existing_file(target: DatabaseTarget) -> None:
    if target.path is not None and not Path(target.path).exists():
        raise Failed(f"no database at {target.path} ({target.masked})")


def _open(url: str | None, schema: str | None, connect_timeout: float) -> Any:
    from lightning_sql.analysis import AnalysisDatabase

    target = _target(url, schema)
    _require_existing_file(target)
    assert url is not None
    return AnalysisDatabase(url, schema=schema, connect_deadline_seconds=connect_timeout)


def _store_options(schema: str | None, connect_timeout: float) -> dict[str, Any]:
    options: dict[str, Any] = {"connect_deadline_seconds": connect_timeout, "auto_migrate": False}
    if schema is not None:
        options["schema"] = schema
    return options


def _need_run(run: str | None) -> str:
    if not run:
        raise click.UsageError("no run: pass --run NAME or set LIGHTNING_SQL_RUN (`lightning-sql runs` lists them)")
    return run


def _records(columns: list[str], rows: list[tuple[Any, ...]]) -> list[dict[str, Any]]:
    return [dict(zip(columns, row, strict=True)) for row in rows]


def _fmt(value: Any) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.4g}" if abs(value) < 1e6 else time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(value))
    return str(value)


def _table(title: str, columns: list[str], rows: list[dict[str, Any]]) -> Table:
    table = Table(title=title)
    for column in columns:
        table.add_column(column)
    for row in rows:
        table.add_row(*(_fmt(row.get(c)) for c in columns))
    return table


# --- the command group ----------------------------------------------------------------------------


@click.group(context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 100})
@click.version_option(package_name="lightning_sql")
def cli() -> None:
    """Inspect, export and maintain lightning_sql runs (SQLite or PostgreSQL)."""


# --- db ---------------------------------------------------------------------------------------------


@cli.group()
def db() -> None:
    """Schema migrations: upgrade, downgrade, current, check."""


@contextlib.contextmanager
def _sqlite_connection(target: DatabaseTarget, *, migrating: bool, timeout: float) -> Iterator[Any]:
    """A SQLite connection in one transaction, opened the way migrate.py expects (its docstring):
    the sidecar file lock and foreign keys off before ``BEGIN IMMEDIATE`` when migrating."""
    if target.dialect == "sqlite":
        from sqlalchemy import create_engine, event
        from sqlalchemy.pool import NullPool

        from lightning_sql.store.sql import migrate

        engine = create_engine(target.url, poolclass=NullPool, connect_args={"timeout": timeout})

        @event.listens_for(engine, "connect")
        def _manual(dbapi_connection: Any, _record: Any) -> None:
            dbapi_connection.isolation_level = None
            # Off before the transaction (a no-op inside one): batch revisions rebuild tables.
            dbapi_connection.execute(f"PRAGMA foreign_keys={'OFF' if migrating else 'ON'}")

        @event.listens_for(engine, "begin")
        def _begin(conn: Any) -> None:
            conn.exec_driver_sql("BEGIN IMMEDIATE" if migrating else "BEGIN")

        assert target.path is not None
        lock = migrate.migration_file_lock(target.path) if migrating else contextlib.nullcontext()
        try:
            with lock, engine.connect() as conn, conn.begin():
                yield conn
        finally:
            engine.dispose()
        return
    raise ValueError(f"{target.masked}: only SQLite migrations run on a sync connection")


def _with_connection(
    url: str | None, schema: str | None, timeout: float, fn: Callable[[Any, str | None], Any], *, migrating: bool
) -> Any:
    """Run ``fn(conn, schema)`` in one committed transaction on the database."""
    from lightning_sql.store.sql.schema import DEFAULT_PG_SCHEMA

    target = _target(url, schema)
    if target.dialect == "sqlite":
        if not migrating:
            _require_existing_file(target)
        try:
            with _sqlite_connection(target, migrating=migrating, timeout=timeout) as conn:
                return fn(conn, None)
        except Exception as exc:
            _reraise_unreachable(exc, target)
            raise
    pg_schema = schema or DEFAULT_PG_SCHEMA

    async def go() -> Any:
        from sqlalchemy.ext.asyncio import create_async_engine
        from sqlalchemy.pool import NullPool

        engine = create_async_engine(target.url, poolclass=NullPool, connect_args={"timeout": timeout})
        try:
            async with engine.begin() as conn:
                return await conn.run_sync(lambda sync: fn(sync, pg_schema))
        finally:
            await engine.dispose()

    try:
        return asyncio.run(go())
    except Exception as exc:
        _reraise_unreachable(exc, target)
        raise


def _reraise_unreachable(exc: Exception, target: DatabaseTarget) -> None:
    from sqlalchemy.exc import DBAPIError, InterfaceError, OperationalError

    from lightning_sql.store.sql.migrate import SchemaError

    if isinstance(exc, SchemaError | click.ClickException):
        return
    connection_failure = isinstance(exc, OSError | TimeoutError | asyncio.TimeoutError | InterfaceError)
    if isinstance(exc, OperationalError | DBAPIError) and ("connect" in str(exc).lower() or "unable to open" in str(exc)):
        connection_failure = True
    if type(exc).__module__.startswith("asyncpg"):
        connection_failure = True
    if not connection_failure:
        return
    reason = f"{type(exc).__name__}: {exc}"
    password = target.url.password
    if password:
        reason = reason.replace(str(password), "***")
    raise Failed(f"cannot reach database {target.masked}: {reason}") from exc


def _state(current: str | None, head: str) -> str:
    if current is None:
        return "empty"
    if current == head:
        return "up to date"
    from lightning_sql.store.sql import migrate

    return "behind" if current in migrate._known_revisions() else "ahead"


@db.command("upgrade")
@click.argument("revision", default="head")
@_common
@_handled
def db_upgrade(revision: str, url: str | None, schema: str | None, connect_timeout: float, as_json: bool) -> None:
    """Upgrade the schema to REVISION (default: head); creates it on an empty database."""
    from lightning_sql.store.sql import migrate

    def work(conn: Any, sch: str | None) -> tuple[str | None, str | None]:
        before = migrate.current_revision(conn, sch)
        migrate.upgrade(conn, sch, revision)
        return before, migrate.current_revision(conn, sch)

    before, after = _with_connection(url, schema, connect_timeout, work, migrating=True)
    data = {"from": before, "to": after, "head": migrate.HEAD_REVISION, "url": mask_url(url or "")}
    _emit(as_json, data, lambda c: c.print(f"Schema at revision [bold]{after}[/] (was {before or 'empty'})."))


@db.command("downgrade")
@click.argument("revision")
@click.option("--yes", is_flag=True, help="Do not ask for confirmation.")
@_common
@_handled
def db_downgrade(
    revision: str, yes: bool, url: str | None, schema: str | None, connect_timeout: float, as_json: bool
) -> None:
    """Downgrade the schema to REVISION (e.g. 0001; `base` drops every table and its data)."""
    from lightning_sql.store.sql import migrate

    if not yes:
        click.confirm(f"Downgrade {mask_url(url or '')} to revision {revision}?", abort=True)

    def work(conn: Any, sch: str | None) -> tuple[str | None, str | None]:
        before = migrate.current_revision(conn, sch)
        migrate.downgrade(conn, sch, revision)
        return before, migrate.current_revision(conn, sch)

    before, after = _with_connection(url, schema, connect_timeout, work, migrating=True)
    data = {"from": before, "to": after, "head": migrate.HEAD_REVISION}
    _emit(as_json, data, lambda c: c.print(f"Schema at revision [bold]{after or 'base'}[/] (was {before})."))


@db.command("current")
@_common
@_handled
def db_current(url: str | None, schema: str | None, connect_timeout: float, as_json: bool) -> None:
    """Show the schema revision of the database and this code's head."""
    from lightning_sql.store.sql import migrate

    current = _with_connection(
        url, schema, connect_timeout, lambda conn, sch: migrate.current_revision(conn, sch), migrating=False
    )
    data = {"revision": current, "head": migrate.HEAD_REVISION, "state": _state(current, migrate.HEAD_REVISION)}
    _emit(
        as_json,
        data,
        lambda c: c.print(f"revision {current or '<empty>'} (code head {migrate.HEAD_REVISION}): {data['state']}"),
    )


@db.command("check")
@_common
@_handled
def db_check(url: str | None, schema: str | None, connect_timeout: float, as_json: bool) -> None:
    """Exit 1 unless the database is at head and matches the models (no autogenerate diff)."""
    from lightning_sql.store.sql import migrate

    def work(conn: Any, sch: str | None) -> tuple[str | None, list[Any]]:
        return migrate.current_revision(conn, sch), migrate.check(conn, sch)

    current, diffs = _with_connection(url, schema, connect_timeout, work, migrating=False)
    ok = current == migrate.HEAD_REVISION and not diffs
    data = {"ok": ok, "revision": current, "head": migrate.HEAD_REVISION, "differences": [repr(d) for d in diffs]}

    def render(c: Console) -> None:
        c.print(f"revision {current or '<empty>'}, code head {migrate.HEAD_REVISION}")
        for diff in diffs:
            c.print(f"  [red]{diff!r}[/]")
        c.print("[green]schema OK[/]" if ok else f"[red]schema differs[/]: run `{migrate.UPGRADE_COMMAND}`")

    _emit(as_json, data, render)
    if not ok:
        raise click.exceptions.Exit(EXIT_FAILED)


# --- runs, status -------------------------------------------------------------------------------------


@cli.command("runs")
@_common
@_handled
def runs_command(url: str | None, schema: str | None, connect_timeout: float, as_json: bool) -> None:
    """List the runs with their state and counts."""
    from lightning_sql.analysis import run_overview

    with contextlib.closing(_open(url, schema, connect_timeout)) as database:
        records = _records(*database.rows(run_overview()))
    columns = ["name", "status", "created_at", "rollouts", "queued", "running", "succeeded", "failed", "attempts", "spans", "workers"]
    _emit(as_json, records, lambda c: c.print(_table("runs", columns, records)))


def _status_snapshot(database: Any, run: str, now: float) -> dict[str, Any]:
    from sqlalchemy import func, select

    from lightning_sql.analysis import run_overview
    from lightning_sql.store.sql import schema as s

    run_id = database.run_id(run)
    overview = _records(*database.rows(run_overview(run_id)))[0]
    ro = s.rollouts
    finished = ro.c.status.in_(("succeeded", "failed", "cancelled"))
    window_start = now - STATUS_THROUGHPUT_WINDOW_S
    _, [(recent, first_start, last_end, n_finished)] = database.rows(
        select(
            func.count().filter(ro.c.end_time >= window_start),
            func.min(ro.c.start_time),
            func.max(ro.c.end_time),
            func.count().filter(ro.c.end_time.isnot(None)),
        ).where(ro.c.run_id == run_id, finished)
    )
    wk = s.workers
    worker_rows = _records(
        *database.rows(
            select(wk.c.worker_id, wk.c.status, wk.c.current_rollout_id, wk.c.last_heartbeat_time)
            .where(wk.c.run_id == run_id)
            .order_by(wk.c.create_seq)
        )
    )
    for worker in worker_rows:
        beat = worker["last_heartbeat_time"]
        worker["heartbeat_age_seconds"] = None if beat is None else round(now - beat, 3)
    span = (last_end - first_start) if (first_start is not None and last_end is not None) else None
    return {
        "run": run,
        "now": now,
        "status": overview["status"],
        "rollouts": overview["rollouts"],
        "queue_depth": overview["queued"],
        "running": overview["running"],
        "succeeded": overview["succeeded"],
        "failed": overview["failed"],
        "cancelled": overview["cancelled"],
        "throughput_per_min_recent": round(recent * 60.0 / STATUS_THROUGHPUT_WINDOW_S, 3),
        "throughput_per_min_overall": round(n_finished * 60.0 / span, 3) if span else None,
        "workers": worker_rows,
    }


def _render_status(snapshot: dict[str, Any]) -> Any:
    from rich.console import Group

    head = Table(title=f"run {snapshot['run']} ({snapshot['status']})")
    keys = ["rollouts", "queue_depth", "running", "succeeded", "failed", "cancelled",
            "throughput_per_min_recent", "throughput_per_min_overall"]
    for key in keys:
        head.add_column(key.replace("_", " "))
    head.add_row(*(_fmt(snapshot[k]) for k in keys))
    workers = _table("workers", ["worker_id", "status", "current_rollout_id", "heartbeat_age_seconds"], snapshot["workers"])
    return Group(head, workers)


@cli.command("status")
@_run_option()
@click.option("--watch", is_flag=True, help="Refresh until interrupted.")
@click.option("--interval", type=float, default=2.0, show_default=True, help="Seconds between refreshes.")
@click.option("--count", type=int, default=0, help="With --watch: stop after N refreshes (0 = never).")
@click.option("--now", "now_override", type=float, hidden=True, help="Evaluate ages at this epoch time.")
@_common
@_handled
def status_command(
    run: str | None,
    watch: bool,
    interval: float,
    count: int,
    now_override: float | None,
    url: str | None,
    schema: str | None,
    connect_timeout: float,
    as_json: bool,
) -> None:
    """Queue depth, running, succeeded / failed, throughput, and workers with their heartbeat age."""
    name = _need_run(run)
    with contextlib.closing(_open(url, schema, connect_timeout)) as database:
        if not watch:
            snapshot = _status_snapshot(database, name, now_override or time.time())
            _emit(as_json, snapshot, lambda c: c.print(_render_status(snapshot)))
            return
        shown = 0
        if as_json:
            while True:
                click.echo(json.dumps(_status_snapshot(database, name, now_override or time.time()), default=str))
                shown += 1
                if count and shown >= count:
                    return
                time.sleep(interval)
        from rich.live import Live

        with Live(_render_status(_status_snapshot(database, name, now_override or time.time())), console=_console()) as live:
            shown = 1
            try:
                while not count or shown < count:
                    time.sleep(interval)
                    live.update(_render_status(_status_snapshot(database, name, now_override or time.time())))
                    shown += 1
            except KeyboardInterrupt:
                pass


# --- rollouts, show, spans ----------------------------------------------------------------------------

_ROLLOUT_SORTS = {
    "start": "start_time",
    "end": "end_time",
    "duration": "duration_seconds",
    "reward": "final_reward",
    "attempts": "attempts",
    "id": "rollout_id",
}


@cli.command("rollouts")
@_run_option()
@click.option("--status", "statuses", multiple=True, help="Keep these statuses (repeatable).")
@click.option("--mode", type=click.Choice(["train", "val", "test"]), help="Keep this mode.")
@click.option("--worker", help="Keep rollouts whose latest attempt ran on this worker.")
@click.option("--resources-version", type=int, help="Keep rollouts created under this resources version.")
@click.option("--sort", type=click.Choice(sorted(_ROLLOUT_SORTS)), default="start", show_default=True)
@click.option("--desc", is_flag=True, help="Sort descending.")
@click.option("--limit", type=click.IntRange(min=0), default=50, show_default=True, help="0 = all.")
@_common
@_handled
def rollouts_command(
    run: str | None,
    statuses: tuple[str, ...],
    mode: str | None,
    worker: str | None,
    resources_version: int | None,
    sort: str,
    desc: bool,
    limit: int,
    url: str | None,
    schema: str | None,
    connect_timeout: float,
    as_json: bool,
) -> None:
    """Rollouts of a run (rollout_summary_v1): filter, sort, limit."""
    from sqlalchemy import select

    from lightning_sql.store.sql.views import VIEW_TABLES

    name = _need_run(run)
    view = VIEW_TABLES["rollout_summary_v1"]
    with contextlib.closing(_open(url, schema, connect_timeout)) as database:
        stmt = select(view).where(view.c.run_id == database.run_id(name))
        if statuses:
            stmt = stmt.where(view.c.status.in_(statuses))
        if mode:
            stmt = stmt.where(view.c.mode == mode)
        if worker:
            stmt = stmt.where(view.c.latest_worker_id == worker)
        if resources_version is not None:
            stmt = stmt.where(view.c.resources_version == resources_version)
        key = view.c[_ROLLOUT_SORTS[sort]]
        # NULLs last either way, on both dialects.
        stmt = stmt.order_by(key.is_(None), key.desc() if desc else key.asc(), view.c.rollout_id)
        if limit:
            stmt = stmt.limit(limit)
        records = _records(*database.rows(stmt))
    columns = ["rollout_id", "status", "mode", "resources_version", "attempts", "latest_worker_id",
               "duration_seconds", "final_reward"]
    _emit(as_json, records, lambda c: c.print(_table(f"rollouts of {name}", columns, records)))


def _span_tree(spans: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Nest spans under their parents (roots: no parent, or a parent not stored)."""
    nodes = {span["span_id"]: {**span, "children": []} for span in spans}
    roots: list[dict[str, Any]] = []
    for span in spans:
        node = nodes[span["span_id"]]
        parent = nodes.get(span["parent_id"]) if span["parent_id"] else None
        (parent["children"] if parent is not None and parent is not node else roots).append(node)
    return roots


@cli.command("show")
@click.argument("rollout_id")
@_run_option()
@_common
@_handled
def show_command(
    rollout_id: str, run: str | None, url: str | None, schema: str | None, connect_timeout: float, as_json: bool
) -> None:
    """One rollout: its summary, attempts and span tree."""
    from sqlalchemy import select

    from lightning_sql.store.sql import schema as s
    from lightning_sql.store.sql.views import VIEW_TABLES

    name = _need_run(run)
    summary, attempt_view, sp = VIEW_TABLES["rollout_summary_v1"], VIEW_TABLES["attempts_v1"], s.spans
    with contextlib.closing(_open(url, schema, connect_timeout)) as database:
        run_id = database.run_id(name)
        found = _records(*database.rows(select(summary).where(summary.c.run_id == run_id, summary.c.rollout_id == rollout_id)))
        if not found:
            _fail(as_json, f"rollout {rollout_id!r} not found in run {name!r}")
        attempts = _records(
            *database.rows(
                select(attempt_view)
                .where(attempt_view.c.run_id == run_id, attempt_view.c.rollout_id == rollout_id)
                .order_by(attempt_view.c.attempt_number)
            )
        )
        spans = _records(
            *database.rows(
                select(
                    sp.c.attempt_id, sp.c.sequence_id, sp.c.span_id, sp.c.parent_id, sp.c.name, sp.c.status_code,
                    sp.c.start_time, sp.c.end_time, sp.c.attributes,
                )
                .where(sp.c.run_id == run_id, sp.c.rollout_id == rollout_id)
                .order_by(sp.c.attempt_id, sp.c.sequence_id, sp.c.start_time, sp.c.id)
            )
        )
    for attempt in attempts:
        attempt["spans"] = _span_tree([x for x in spans if x["attempt_id"] == attempt["attempt_id"]])
    data = {"rollout": found[0], "attempts": attempts}

    def render(c: Console) -> None:
        r = found[0]
        c.print(
            f"[bold]{rollout_id}[/] run {name}: {r['status']} mode={r['mode']} "
            f"resources={r['resources_id']} v{r['resources_version']} attempts={r['attempts']} "
            f"duration={_fmt(r['duration_seconds'])}s final_reward={_fmt(r['final_reward'])}"
        )
        for attempt in attempts:
            label = (
                f"attempt {attempt['attempt_number']} {attempt['attempt_id']} [bold]{attempt['status']}[/] "
                f"on {attempt['worker_id']} ({_fmt(attempt['duration_seconds'])}s)"
            )
            if attempt["error_type"]:
                label += f" [red]{attempt['error_type']}: {attempt['error_message']}[/]"
            tree = Tree(label)

            def add(branch: Tree, node: dict[str, Any]) -> None:
                duration = (
                    node["end_time"] - node["start_time"]
                    if node["end_time"] is not None and node["start_time"] is not None
                    else None
                )
                child = branch.add(f"#{node['sequence_id']} {node['name']} ({_fmt(duration)}s) {node['span_id']}")
                for grandchild in node["children"]:
                    add(child, grandchild)

            for root in attempt["spans"]:
                add(tree, root)
            c.print(tree)

    _emit(as_json, data, render)


@cli.command("spans")
@_run_option()
@click.option("--rollout", "rollout_id", help="Spans of this rollout.")
@click.option("--attempt", "attempt_id", help="Spans of this attempt.")
@click.option("--name", "name_contains", help="Keep spans whose name contains this text.")
@click.option("--limit", type=click.IntRange(min=0), default=100, show_default=True, help="0 = all.")
@_common
@_handled
def spans_command(
    run: str | None,
    rollout_id: str | None,
    attempt_id: str | None,
    name_contains: str | None,
    limit: int,
    url: str | None,
    schema: str | None,
    connect_timeout: float,
    as_json: bool,
) -> None:
    """Spans of a run, in insertion order (filter by rollout, attempt, name)."""
    from sqlalchemy import select

    from lightning_sql.store.sql import dialect as d
    from lightning_sql.store.sql import schema as s

    name = _need_run(run)
    sp = s.spans
    with contextlib.closing(_open(url, schema, connect_timeout)) as database:
        run_id = database.run_id(name)

        def unit(ctx: Any) -> list[dict[str, Any]]:
            stmt = select(
                sp.c.id, sp.c.rollout_id, sp.c.attempt_id, sp.c.sequence_id, sp.c.span_id, sp.c.parent_id,
                sp.c.name, sp.c.status_code, sp.c.start_time, sp.c.end_time, sp.c.attributes,
            ).where(sp.c.run_id == run_id)
            if rollout_id:
                stmt = stmt.where(sp.c.rollout_id == rollout_id)
            if attempt_id:
                stmt = stmt.where(sp.c.attempt_id == attempt_id)
            if name_contains:
                stmt = stmt.where(d.contains(ctx, sp.c.name, name_contains))
            stmt = stmt.order_by(sp.c.id)
            if limit:
                stmt = stmt.limit(limit)
            result = ctx.conn.execute(stmt)
            return _records(list(result.keys()), [tuple(r) for r in result])

        records = database.read(unit)
    columns = ["rollout_id", "attempt_id", "sequence_id", "span_id", "parent_id", "name", "status_code"]
    _emit(as_json, records, lambda c: c.print(_table(f"spans of {name}", columns, records)))


# --- export -------------------------------------------------------------------------------------------

_DEFAULT_EXPORT = ("rollouts", "attempts", "spans", "resource_versions", "workers")


@cli.command("export")
@_run_option()
@click.option("--to", "directory", required=True, type=click.Path(file_okay=False), help="Output directory.")
@click.option("--format", "fmt", type=click.Choice(["jsonl", "csv", "parquet"]), default="jsonl", show_default=True)
@click.option("--table", "tables", multiple=True, help="Table or view to export (repeatable); default: the run's tables.")
@click.option("--views", is_flag=True, help="Also export the analysis views (*_v1).")
@click.option("--since", help="Rows from this time on (epoch seconds or ISO 8601).")
@click.option("--until", help="Rows before this time (epoch seconds or ISO 8601).")
@click.option("--chunk-rows", type=click.IntRange(min=1), default=5_000, show_default=True)
@_common
@_handled
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

    name = _need_run(run)
    chosen = list(tables) or list(_DEFAULT_EXPORT)
    if views:
        chosen += [v for v in VIEW_NAMES if v not in chosen]
    unknown = [t for t in chosen if t not in analysis.EXPORTABLE]
    if unknown:
        raise click.UsageError(f"unknown table(s) {', '.join(unknown)}; choose from {', '.join(analysis.EXPORTABLE)}")
    try:
        start, end = analysis.to_epoch(since), analysis.to_epoch(until)
    except ValueError as exc:
        raise click.UsageError(str(exc)) from exc
    with contextlib.closing(_open(url, schema, connect_timeout)) as database:
        try:
            result = analysis.export_run(
                database, name, directory, format=fmt, tables=chosen, since=start, until=end, chunk_rows=chunk_rows
            )
        except ImportError as exc:
            _fail(as_json, str(exc))
    data = {
        "run": name,
        "format": fmt,
        "files": {k: str(v) for k, v in result.files.items()},
        "rows": result.rows,
        "chunks": result.chunks,
    }
    records = [{"table": t, "rows": result.rows[t], "file": str(result.files[t])} for t in result.files]
    _emit(as_json, data, lambda c: c.print(_table(f"export of {name}", ["table", "rows", "file"], records)))


# --- sweep, check, gc -----------------------------------------------------------------------------------


def _writable_store(url: str | None, schema: str | None, connect_timeout: float, run: str | None) -> Any:
    from lightning_sql.store.sql.store import SqlLightningStore

    target = _target(url, schema)
    _require_existing_file(target)
    assert url is not None
    return SqlLightningStore(url, run=run, create_run=False, **_store_options(schema, connect_timeout))


@cli.command("sweep")
@_run_option()
@click.option("--all-runs", is_flag=True, help="Sweep every run of the database.")
@_common
@_handled
def sweep_command(
    run: str | None, all_runs: bool, url: str | None, schema: str | None, connect_timeout: float, as_json: bool
) -> None:
    """Expire dead attempts now (timeout / unresponsive -> requeue or fail)."""
    if not all_runs:
        run = _need_run(run)

    async def go() -> int:
        store = _writable_store(url, schema, connect_timeout, None if all_runs else run)
        try:
            return int(await store.sweep(all_runs=all_runs))
        finally:
            await store.close()

    expired = asyncio.run(go())
    data = {"run": None if all_runs else run, "expired_attempts": expired}
    _emit(as_json, data, lambda c: c.print(f"Expired {expired} attempt(s)."))


@cli.command("check")
@_run_option()
@_common
@_handled
def check_command(run: str | None, url: str | None, schema: str | None, connect_timeout: float, as_json: bool) -> None:
    """Check a run's invariants; exit 1 listing the violations."""
    name = _need_run(run)
    target = _target(url, schema)
    _require_existing_file(target)
    try:
        from lightning_sql.store.sql.check import check_url
    except ImportError as exc:
        _fail(as_json, f"the invariant checker is not available in this installation ({exc})")
    options: dict[str, Any] = {"connect_deadline_seconds": connect_timeout}
    if schema is not None:
        options["schema"] = schema
    assert url is not None
    violations = asyncio.run(check_url(url, name, **options))
    data = {"run": name, "ok": not violations, "violations": violations}

    def render(c: Console) -> None:
        for violation in violations:
            c.print(f"[red]{violation}[/]")
        c.print(f"[green]run {name}: all invariants hold[/]" if not violations else f"{len(violations)} violation(s)")

    _emit(as_json, data, render)
    if violations:
        raise click.exceptions.Exit(EXIT_FAILED)


def _delete_old_spans(ctx: Any, run_ids: list[int], cutoff: float, batch: int) -> int:
    from sqlalchemy import delete, select

    from lightning_sql.store.sql import schema as s

    sp = s.spans
    ids = [
        row[0]
        for row in ctx.conn.execute(
            select(sp.c.id).where(sp.c.run_id.in_(run_ids), sp.c.start_time < cutoff).order_by(sp.c.id).limit(batch)
        )
    ]
    if not ids:
        return 0
    ctx.conn.execute(delete(sp).where(sp.c.id.in_(ids)))
    return len(ids)


def _count_old_spans(ctx: Any, run_ids: list[int], cutoff: float) -> int:
    from sqlalchemy import func, select

    from lightning_sql.store.sql import schema as s

    sp = s.spans
    return int(
        ctx.conn.execute(
            select(func.count()).select_from(sp).where(sp.c.run_id.in_(run_ids), sp.c.start_time < cutoff)
        ).scalar_one()
    )


@cli.command("gc")
@click.option("--delete-run", "delete_run", metavar="NAME", help="Delete this run and everything in it.")
@click.option("--spans-before", metavar="TIME", help="Delete spans that started before TIME (epoch or ISO 8601).")
@_run_option(required=False)
@click.option("--all-runs", is_flag=True, help="With --spans-before: in every run.")
@click.option("--dry-run", is_flag=True, help="Count what would be deleted; delete nothing.")
@click.option("--yes", is_flag=True, help="Do not ask for confirmation.")
@click.option("--batch-rows", type=click.IntRange(min=1), default=GC_BATCH_ROWS, show_default=True)
@_common
@_handled
def gc_command(
    delete_run: str | None,
    spans_before: str | None,
    run: str | None,
    all_runs: bool,
    dry_run: bool,
    yes: bool,
    batch_rows: int,
    url: str | None,
    schema: str | None,
    connect_timeout: float,
    as_json: bool,
) -> None:
    """Delete a run, or old spans, in short batches that never hold writers up for long."""
    from lightning_sql import analysis

    if (delete_run is None) == (spans_before is None):
        raise click.UsageError("give exactly one of --delete-run NAME or --spans-before TIME")
    cutoff = 0.0
    if spans_before is not None:
        try:
            cutoff = analysis.to_epoch(spans_before) or 0.0
        except ValueError as exc:
            raise click.UsageError(str(exc)) from exc
        if not all_runs:
            run = _need_run(run)

    with contextlib.closing(_open(url, schema, connect_timeout)) as database:
        if delete_run is not None:
            overview = database.rows(analysis.run_overview(database.run_id(delete_run)))
            counts = _records(*overview)[0]
            run_ids: list[int] = []
        else:
            run_ids = (
                [int(r[0]) for r in database.rows(analysis.run_overview())[1]]
                if all_runs
                else [database.run_id(run or "")]
            )
            counts = {"spans": database.read(lambda ctx: _count_old_spans(ctx, run_ids, cutoff))}

    if dry_run:
        data = {"dry_run": True, "run": delete_run or run, "would_delete": counts}
        _emit(as_json, data, lambda c: c.print(f"Would delete: {counts}"))
        return
    what = f"run {delete_run!r} ({counts.get('rollouts', 0)} rollouts, {counts['spans']} spans)" if delete_run else (
        f"{counts['spans']} span(s) started before {spans_before}"
    )
    if not yes:
        click.confirm(f"Delete {what} from {mask_url(url or '')}?", abort=True)

    async def go() -> dict[str, Any]:
        store = _writable_store(url, schema, connect_timeout, None)
        try:
            if delete_run is not None:
                started = time.monotonic()
                deleted = await store.delete_run(delete_run)
                return {"deleted_run": delete_run if deleted else None, "seconds": round(time.monotonic() - started, 3)}
            worker, _ = await store._prepare(needs_run=False)
            total, batches = 0, 0
            while True:
                n = await store._submit(
                    worker, lambda ctx: _delete_old_spans(ctx, run_ids, cutoff, batch_rows), write=True
                )
                total += n
                batches += int(n > 0)
                if n < batch_rows:
                    break
            return {"deleted_spans": total, "batches": batches}
        finally:
            await store.close()

    data = asyncio.run(go())
    _emit(as_json, data, lambda c: c.print(f"Deleted {what}."))


# --- worker, demo -----------------------------------------------------------------------------------------


@cli.command("worker")
@_run_option()
@click.option("--agent", "agent_spec", required=True, help="The agent as module:attr.")
@click.option("-n", "n", type=click.IntRange(min=1), default=1, show_default=True, help="Runners in this process.")
@click.option("--worker-prefix", help="Worker id prefix (default <host>-<pid>).")
@click.option("--max-rollouts", type=click.IntRange(min=0), help="Stop each runner after this many rollouts.")
@_common
@_handled
def worker_command(
    run: str | None,
    agent_spec: str,
    n: int,
    worker_prefix: str | None,
    max_rollouts: int | None,
    url: str | None,
    schema: str | None,
    connect_timeout: float,
    as_json: bool,
) -> None:
    """Run N runners against an existing run (external workers, any host, shared PostgreSQL)."""
    name = _need_run(run)
    target = _target(url, schema)
    _require_existing_file(target)
    try:
        from lightning_sql.runtime.worker import run_worker
    except ImportError as exc:
        _fail(as_json, f"external workers are not available in this installation ({exc})")
    options = _store_options(schema, connect_timeout)
    if max_rollouts is not None:
        options["max_rollouts"] = max_rollouts
    assert url is not None
    completed = run_worker(url, name, agent_spec, n=n, worker_prefix=worker_prefix, **options)
    data = {"run": name, "completed_rollouts": completed}
    _emit(as_json, data, lambda c: c.print(f"Worker stopped after {completed} rollout(s)."))


@cli.command("demo")
@click.option("--url", envvar="LIGHTNING_SQL_URL", default="sqlite:///quickstart.db", show_default=True)
@click.option("--runners", type=int, default=4, show_default=True)
@click.option("--fresh", is_flag=True, help="Delete the demo run and start over.")
def demo_command(url: str, runners: int, fresh: bool) -> None:
    """Run the offline quickstart (examples/quickstart.py): a small run to explore with the other commands."""
    if not DEMO_SCRIPT.is_file():
        raise Failed(
            f"the demo needs examples/quickstart.py from a source checkout of lightning_sql (looked at {DEMO_SCRIPT})"
        )
    spec = importlib.util.spec_from_file_location("lightning_sql_quickstart", DEMO_SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    if not hasattr(module, "main"):
        raise Failed(f"{DEMO_SCRIPT} has no main()")
    argv = [str(DEMO_SCRIPT), "--url", url, "--runners", str(runners)] + (["--fresh"] if fresh else [])
    saved = sys.argv
    sys.argv = argv
    try:
        module.main()
    finally:
        sys.argv = saved


def main() -> None:
    """The ``lightning-sql`` entry point."""
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    cli(prog_name="lightning-sql")


if __name__ == "__main__":  # pragma: no cover
    main()
