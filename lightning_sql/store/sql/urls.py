"""Store URLs: which backend serves a URL, and how a URL is shown with its password masked."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from sqlalchemy import URL, make_url


def mask_url(url: URL | str) -> str:
    """The URL as text with its password replaced by ``***``."""
    if isinstance(url, str):
        try:
            url = make_url(url)
        except Exception:
            return "<unparseable url>"
    return url.render_as_string(hide_password=True)


# --- URL normalisation ------------------------------------------------------------------------

_PG_DRIVERS = ("psycopg2", "psycopg", "asyncpg", "pg8000")
_PG_DRIVER_ALIASES = {"postgresql", "postgres", *(f"postgresql+{driver}" for driver in _PG_DRIVERS)}
# libpq query options asyncpg takes under another name in its URL; connect_timeout and
# application_name become connection arguments instead (seconds as a number; a server setting).
_LIBPQ_TRANSLATIONS = {"sslmode": "ssl"}


@dataclass(frozen=True)
class DatabaseTarget:
    """A normalised database location: which worker kind serves it and with which URL."""

    kind: str  # "sqlite" (writer thread), "sqlite-memory", "aiosqlite", "postgresql"
    url: URL
    path: str | None = None  # SQLite file path (absolute)
    # Store options given as URL query parameters (``?pool_size=8``), taken out of the driver's URL.
    options: dict[str, Any] = field(default_factory=dict, compare=False)

    @property
    def dialect(self) -> str:
        return "postgresql" if self.kind == "postgresql" else "sqlite"

    @property
    def masked(self) -> str:
        return mask_url(self.url)


URL_FORMS = (
    "a store URL looks like sqlite:///runs.db (a file relative to the current folder), "
    "sqlite:////abs/path/runs.db (an absolute path), sqlite:// (in memory) or "
    "postgresql://user:password@host:5432/database"
)


def normalise_url(raw: str | URL) -> DatabaseTarget:
    """Map a user's URL onto the backend that serves it; a URL that names no backend, or a SQLite
    URL whose file would be read as a host name, is refused with the forms a store URL takes."""
    if isinstance(raw, str) and "://" not in raw:
        raise ValueError(f"{mask_url(raw)!r} is not a database URL: {URL_FORMS}")
    try:
        url = make_url(raw) if isinstance(raw, str) else raw
    except Exception as exc:
        raise ValueError(f"Invalid database URL {mask_url(str(raw))!r} ({exc}): {URL_FORMS}") from None
    driver = url.drivername
    if driver in ("sqlite", "sqlite+pysqlite", "sqlite+aiosqlite"):
        if url.host:
            # sqlite://runs.db parses as a host "runs.db" and no database: an in-memory store that
            # silently keeps nothing.
            raise ValueError(
                f"{mask_url(url)!r} names no SQLite file (two slashes make {url.host!r} a host name): "
                f"use sqlite:///{url.host}{('/' + url.database) if url.database else ''} for a file in the "
                f"current folder or sqlite:////abs/path.db for an absolute path"
            )
        database = url.database or ""
        if database in ("", ":memory:") or database.startswith("file::memory:"):
            if driver == "sqlite+aiosqlite":
                raise ValueError(
                    f"In-memory databases are served by the plain sqlite:// URL, not {mask_url(url)!r}"
                )
            return DatabaseTarget("sqlite-memory", url.set(drivername="sqlite", database=":memory:"))
        path = str(Path(database).expanduser().resolve())
        if driver == "sqlite+aiosqlite":
            # Served by the same SQLite executor as sqlite:// (its writer thread and readers).
            return DatabaseTarget("aiosqlite", url.set(drivername="sqlite", database=path), path)
        return DatabaseTarget("sqlite", url.set(drivername="sqlite", database=path), path)
    if driver in _PG_DRIVER_ALIASES:
        query = dict(url.query)
        options: dict[str, Any] = {}
        if "pool_size" in query:
            options["pool_size"] = _number(query, "pool_size", int, "an integer", url)
            if options["pool_size"] < 1:
                raise ValueError(f"pool_size in {mask_url(url)!r} must be >= 1, got {options['pool_size']!r}")
        for key in list(query):
            if key in _LIBPQ_TRANSLATIONS:
                query[_LIBPQ_TRANSLATIONS[key]] = query.pop(key)
        connect_args: dict[str, Any] = {}
        if "connect_timeout" in query:
            connect_args["timeout"] = _number(query, "connect_timeout", float, "seconds", url)
        if "application_name" in query:
            value = query.pop("application_name")
            connect_args["server_settings"] = {"application_name": value if isinstance(value, str) else value[-1]}
        if connect_args:
            options["connect_args"] = connect_args
        return DatabaseTarget("postgresql", url.set(drivername="postgresql+asyncpg", query=query), options=options)
    raise ValueError(f"Unsupported database URL {mask_url(url)!r}: {URL_FORMS}")


def _number(query: dict[str, Any], key: str, kind: type[int] | type[float], what: str, url: URL) -> Any:
    """The URL query option ``key`` (taken out of ``query``; the last of repeated ones) as a number."""
    value = query.pop(key)
    try:
        return kind(value if isinstance(value, str) else value[-1])
    except ValueError:
        raise ValueError(f"{key} in {mask_url(url)!r} must be {what}, got {value!r}") from None
