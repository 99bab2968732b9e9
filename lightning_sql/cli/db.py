"""``lightning-sql db``: upgrade, downgrade, current and check the schema."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import click
from rich.console import Console

from lightning_sql.cli.options import EXIT_FAILED, Failed, common_options, database, fail, handled
from lightning_sql.cli.output import emit, markup
from lightning_sql.store.sql.urls import DatabaseTarget, mask_url


@click.group()
def db() -> None:
    """Schema migrations: upgrade, downgrade, current, check."""


@contextlib.contextmanager
def sqlite_connection(target: DatabaseTarget, *, migrating: bool, timeout: float) -> Iterator[Any]:
    """A SQLite connection in one transaction, opened the store's way (``sqlite_executor``)."""
    from lightning_sql.store.sql.sqlite_executor import sqlite_connection as open_sqlite

    assert target.path is not None
    with open_sqlite(target.path, migrating=migrating, busy_timeout_s=timeout) as conn:
        yield conn


def with_connection(
    url: str | None, schema: str | None, timeout: float, fn: Callable[[Any, str | None], Any], *, migrating: bool
) -> Any:
    """Run ``fn(conn, schema)`` in one committed transaction on the database."""
    from lightning_sql.store.sql.schema import DEFAULT_PG_SCHEMA

    db_ = database(url, schema)
    target = db_.target
    if target.dialect == "sqlite":
        if not migrating:
            db_.require_existing_file()
        try:
            with sqlite_connection(target, migrating=migrating, timeout=timeout) as conn:
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


@db.command("upgrade")
@click.argument("revision", default="head")
@common_options
@handled
def db_upgrade(revision: str, url: str | None, schema: str | None, connect_timeout: float, as_json: bool) -> None:
    """Upgrade the schema to REVISION (default: head); creates it on an empty database."""
    from lightning_sql.store.sql import migrate

    def work(conn: Any, sch: str | None) -> tuple[Any, str | None]:
        status = migrate.schema_status(conn, sch)
        if status.is_newer:  # Alembic cannot start from a revision this code does not ship
            return status, status.revision
        migrate.upgrade(conn, sch, revision)
        return status, migrate.current_revision(conn, sch)

    status, after = with_connection(url, schema, connect_timeout, work, migrating=True)
    if status.state == "newer, incompatible":
        fail(as_json, status.describe(), revision=status.revision, head=migrate.HEAD_REVISION)
    data = {"from": status.revision, "to": after, "head": migrate.HEAD_REVISION, "url": mask_url(database(url, schema).url)}
    if status.is_newer:
        data["message"] = status.describe()

    def render(c: Console) -> None:
        if status.is_newer:
            c.print(f"Nothing to upgrade: {markup(status.describe())}.")
        else:
            c.print(f"Schema at revision [bold]{markup(after)}[/] (was {markup(status.revision or 'empty')}).")

    emit(as_json, data, render)


@db.command("downgrade")
@click.argument("revision")
@click.option("--yes", is_flag=True, help="Do not ask for confirmation.")
@common_options
@handled
def db_downgrade(
    revision: str, yes: bool, url: str | None, schema: str | None, connect_timeout: float, as_json: bool
) -> None:
    """Downgrade the schema to REVISION (e.g. 0001; `base` drops every table and its data)."""
    from lightning_sql.store.sql import migrate

    masked = mask_url(database(url, schema).url)
    if not yes:
        click.confirm(f"Downgrade {masked} to revision {revision}?", abort=True)

    def work(conn: Any, sch: str | None) -> tuple[str | None, str | None]:
        before = migrate.current_revision(conn, sch)
        migrate.downgrade(conn, sch, revision)
        return before, migrate.current_revision(conn, sch)

    before, after = with_connection(url, schema, connect_timeout, work, migrating=True)
    data = {"from": before, "to": after, "head": migrate.HEAD_REVISION}
    emit(as_json, data, lambda c: c.print(f"Schema at revision [bold]{markup(after or 'base')}[/] (was {markup(before)})."))


@db.command("current")
@common_options
@handled
def db_current(url: str | None, schema: str | None, connect_timeout: float, as_json: bool) -> None:
    """Show the schema revision of the database and this code's head."""
    from lightning_sql.store.sql import migrate

    status = with_connection(url, schema, connect_timeout, migrate.schema_status, migrating=False)
    data = {"revision": status.revision, "head": migrate.HEAD_REVISION, "state": status.state}

    def render(c: Console) -> None:
        c.print(f"revision {markup(status.revision or '<empty>')} (code head {migrate.HEAD_REVISION}): {status.state}")
        if status.is_newer:
            c.print(markup(status.describe()))

    emit(as_json, data, render)


@db.command("check")
@common_options
@handled
def db_check(url: str | None, schema: str | None, connect_timeout: float, as_json: bool) -> None:
    """Exit 1 unless this code can use the schema: at head and matching the models (no autogenerate
    diff), or newer and declared compatible with this code."""
    from lightning_sql.store.sql import migrate

    def work(conn: Any, sch: str | None) -> tuple[Any, list[Any]]:
        status = migrate.schema_status(conn, sch)
        # A newer schema differs from this code's models by design; its compat marker is the answer.
        return status, [] if status.is_newer else migrate.check(conn, sch)

    status, diffs = with_connection(url, schema, connect_timeout, work, migrating=False)
    ok = (status.state == "up to date" and not diffs) or status.state == "newer, compatible"
    data = {
        "ok": ok,
        "revision": status.revision,
        "head": migrate.HEAD_REVISION,
        "state": status.state,
        "differences": [repr(diff) for diff in diffs],
    }

    def render(c: Console) -> None:
        c.print(f"revision {markup(status.revision or '<empty>')}, code head {migrate.HEAD_REVISION}")
        for diff in diffs:
            c.print(f"  [red]{markup(repr(diff))}[/]")
        if status.is_newer:
            c.print(f"[green]schema OK[/]: {markup(status.describe())}" if ok else f"[red]{markup(status.describe())}[/]")
        elif ok:
            c.print("[green]schema OK[/]")
        elif status.state == "up to date":
            c.print("[red]schema differs[/] from this code's models at the same revision: it was changed by hand")
        else:
            c.print(f"[red]schema differs[/]: run `{migrate.UPGRADE_COMMAND}`")

    emit(as_json, data, render)
    if not ok:
        raise click.exceptions.Exit(EXIT_FAILED)
