"""Store URLs: which backend serves a URL, and how a URL is shown with its password masked."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

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

_PG_DRIVER_ALIASES = {
    "postgresql",
    "postgres",
    "postgresql+psycopg2",
    "postgresql+psycopg",
    "postgresql+asyncpg",
    "postgresql+pg8000",
}
# libpq query options that asyncpg takes under another name (or not at all).
_LIBPQ_TRANSLATIONS = {"sslmode": "ssl", "connect_timeout": "timeout", "application_name": None}


@dataclass(frozen=True)
class DatabaseTarget:
    """A normalised database location: which worker kind serves it and with which URL."""

    kind: str  # "sqlite" (writer thread), "sqlite-memory", "aiosqlite", "postgresql"
    url: URL
    path: str | None = None  # SQLite file path (absolute)

    @property
    def dialect(self) -> str:
        return "postgresql" if self.kind == "postgresql" else "sqlite"

    @property
    def masked(self) -> str:
        return mask_url(self.url)


def normalise_url(raw: str | URL) -> DatabaseTarget:
    """Map a user's URL onto the backend that serves it (contract §4 URL normalisation)."""
    try:
        url = make_url(raw) if isinstance(raw, str) else raw
    except Exception as exc:
        raise ValueError(f"Invalid database URL {mask_url(str(raw))!r}: {exc}") from None
    driver = url.drivername
    if driver in ("sqlite", "sqlite+pysqlite", "sqlite+aiosqlite"):
        database = url.database or ""
        if database in ("", ":memory:") or database.startswith("file::memory:"):
            if driver == "sqlite+aiosqlite":
                raise ValueError(
                    f"In-memory databases are served by the plain sqlite:// URL, not {mask_url(url)!r}"
                )
            return DatabaseTarget("sqlite-memory", url.set(drivername="sqlite", database=":memory:"))
        path = str(Path(database).expanduser().resolve())
        if driver == "sqlite+aiosqlite":
            return DatabaseTarget("aiosqlite", url.set(database=path), path)
        return DatabaseTarget("sqlite", url.set(drivername="sqlite", database=path), path)
    if driver in _PG_DRIVER_ALIASES:
        query = dict(url.query)
        for key in list(query):
            if key in _LIBPQ_TRANSLATIONS:
                new_key = _LIBPQ_TRANSLATIONS[key]
                value = query.pop(key)
                if new_key is not None:
                    query[new_key] = value
        return DatabaseTarget("postgresql", url.set(drivername="postgresql+asyncpg", query=query))
    raise ValueError(
        f"Unsupported database URL {mask_url(url)!r}: use sqlite:///path.db, sqlite+aiosqlite:///path.db "
        "or postgresql://user@host/db"
    )
