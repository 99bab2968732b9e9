"""What every command shares: the common options, the database a command talks to, and how the
store's and the database's errors become messages and exit codes."""

from __future__ import annotations

import functools
import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import click

from lightning_sql.cli.output import printable
from lightning_sql.store.sql.urls import DatabaseTarget, normalise_url

F = TypeVar("F", bound=Callable[..., Any])

EXIT_OK = 0
EXIT_FAILED = 1
EXIT_USAGE = 2

# How long a command waits for an unreachable database before saying so.
DEFAULT_CONNECT_TIMEOUT_S = 10.0


class Failed(click.ClickException):
    """A command that ran but failed: exit code 1, message on stderr (and as JSON with --json)."""

    exit_code = EXIT_FAILED

    def __init__(self, message: str, **details: Any) -> None:
        super().__init__(printable(message, multiline=True))  # messages quote stored names: no raw ESC to the terminal
        self.details = details


def common_options(func: F) -> F:
    """``--url``, ``--schema``, ``--connect-timeout`` and ``--json``."""
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
    func = click.option(
        "--url",
        envvar="LIGHTNING_SQL_URL",
        help="Database URL (or LIGHTNING_SQL_URL; default: the Trainer's default store sqlite:///lightning_sql.db).",
    )(func)
    return func


def run_option(required: bool = True) -> Callable[[F], F]:
    """``--run NAME`` (or ``LIGHTNING_SQL_RUN``); commands that need it call :func:`need_run`."""
    return click.option(
        "--run",
        envvar="LIGHTNING_SQL_RUN",
        required=False,
        help="Run name (or LIGHTNING_SQL_RUN)." + ("" if required else " Optional."),
    )


def handled(func: F) -> F:
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
            fail(as_json, str(exc), runs=exc.known)
        except SchemaError as exc:
            fail(as_json, str(exc))
        except StoreUnavailableError as exc:
            fail(as_json, str(exc))
        except ValueError as exc:
            message = str(exc)
            if "does not exist in this database" in message:  # the store's unknown-run error
                fail(as_json, message)
            raise click.UsageError(printable(message, multiline=True)) from exc

    return wrapper  # type: ignore[return-value]


def fail(as_json: bool, message: str, **details: Any) -> None:
    """Exit 1 with ``message`` (also printed as a JSON object with ``--json``)."""
    if as_json:
        click.echo(json.dumps({"error": message, **details}, default=str))
    raise Failed(message, **details)


def need_run(run: str | None) -> str:
    if not run:
        raise click.UsageError("no run: pass --run NAME or set LIGHTNING_SQL_RUN (`lightning-sql runs` lists them)")
    return run


# --- the database a command talks to -------------------------------------------------------------------


@dataclass(frozen=True)
class Database:
    """The URL a command was given (or the default store) and where it points."""

    url: str
    target: DatabaseTarget
    is_default: bool  # neither --url nor LIGHTNING_SQL_URL: the Trainer's default store

    def require_existing_file(self) -> None:
        """Fail, creating nothing, when a SQLite URL names a file that does not exist."""
        if self.target.path is not None and not Path(self.target.path).exists():
            hint = " (the default store: pass --url URL or set LIGHTNING_SQL_URL)" if self.is_default else ""
            raise Failed(f"no database at {self.target.path} ({self.target.masked}){hint}")


def default_store_url() -> str:
    """The Trainer's default SQLite file (``--url`` has already read ``LIGHTNING_SQL_URL``)."""
    from lightning_sql.runtime.trainer import DEFAULT_STORE_URL

    return DEFAULT_STORE_URL


def database(url: str | None, schema: str | None) -> Database:
    """The database of ``--url`` (the default store without one); usage errors for unusable URLs."""
    is_default = not url
    resolved = url or default_store_url()
    try:
        target = normalise_url(resolved)
    except ValueError as exc:
        raise click.UsageError(str(exc)) from exc
    if target.kind == "sqlite-memory":
        raise click.UsageError("an in-memory SQLite database holds nothing to inspect: pass a file URL")
    if target.dialect == "sqlite" and schema is not None:
        raise click.UsageError(f"--schema {schema!r} applies to PostgreSQL only; a SQLite file has no schemas")
    return Database(resolved, target, is_default)


def open_existing(url: str | None, schema: str | None, connect_timeout: float) -> Any:
    """A read-only :class:`~lightning_sql.analysis.AnalysisDatabase` on an existing database."""
    from lightning_sql.analysis import AnalysisDatabase

    db = database(url, schema)
    db.require_existing_file()
    return AnalysisDatabase(db.url, schema=schema, connect_deadline_seconds=connect_timeout)


def store_options(schema: str | None, connect_timeout: float) -> dict[str, Any]:
    """Options for a writing store: never migrates."""
    options: dict[str, Any] = {"connect_deadline_seconds": connect_timeout, "auto_migrate": False}
    if schema is not None:
        options["schema"] = schema
    return options


def writable_store(url: str | None, schema: str | None, connect_timeout: float, run: str | None) -> Any:
    """A store on an existing database that never creates a run and never migrates."""
    from lightning_sql.store.sql.store import SqlLightningStore

    db = database(url, schema)
    db.require_existing_file()
    return SqlLightningStore(db.url, run=run, create_run=False, **store_options(schema, connect_timeout))
