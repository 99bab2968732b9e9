"""Statements built once, and compiled once per dialect and schema for the driver connection.

Building a Core statement (``select(...).where(...)``) costs more Python than SQLite needs to run
it, so statements with ``bindparam()`` placeholders are built once (``cached``).  The hot paths go
further (``compiled``): SQLAlchemy compiles a statement once per dialect and schema into its SQL
text and the order of its parameters, and the batches run that text on the driver connection
(``sqlite3``, asyncpg) with plain values: no per-execution work of SQLAlchemy at all.  Keys name the
statement and everything its shape depends on; values never depend on data.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Hashable, Mapping
from dataclasses import dataclass
from typing import Any, TypeVar

from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.engine import Dialect

T = TypeVar("T")

# Every statement a batch runs is logged here at DEBUG with its parameters (the engines' ``echo``
# does not see the driver connection).
statement_log = logging.getLogger("lightning_sql.sql")

_CACHE: dict[Hashable, Any] = {}
_lock = threading.Lock()


def cached(key: Hashable, build: Callable[[], T]) -> T:
    """The statement stored under ``key``, built by ``build()`` on first use (two threads racing
    build equal statements and one wins)."""
    stmt = _CACHE.get(key)
    if stmt is None:
        built = build()
        with _lock:
            stmt = _CACHE.setdefault(key, built)
    return stmt  # type: ignore[no-any-return]


# Positional parameters on both: sqlite3 binds ``?`` several times faster than ``:name``.
_DIALECTS: dict[str, Dialect] = {
    "sqlite": sqlite.dialect(),
    "postgresql": postgresql.asyncpg.dialect(),  # type: ignore[attr-defined]
}


@dataclass(frozen=True)
class Compiled:
    """A statement's SQL text for one dialect and schema, and how its parameters are passed."""

    sql: str
    names: tuple[str, ...]  # the parameters in their positional order
    defaults: Mapping[str, Any]  # values of the statement's own literals

    def positional(self, params: Mapping[str, Any]) -> list[Any]:
        """The parameters in the statement's order."""
        defaults = self.defaults
        return [params[name] if name in params else defaults[name] for name in self.names]


_COMPILED: dict[tuple[str, str | None, Hashable], Compiled] = {}


def compiled(dialect: str, schema: str | None, key: Hashable, build: Callable[[], Any]) -> Compiled:
    """The statement ``build()`` (cached under ``key``) compiled for ``dialect`` with its tables in
    ``schema`` (PostgreSQL; None: the default search path)."""
    full_key = (dialect, schema, key)
    found = _COMPILED.get(full_key)
    if found is not None:
        return found
    stmt = cached(key, build)
    options: dict[str, Any] = {}
    if schema is not None:
        options = {"schema_translate_map": {None: schema}, "render_schema_translate": True}
    compiled_stmt = stmt.compile(dialect=_DIALECTS[dialect], **options)
    defaults = {name: bind.value for name, bind in compiled_stmt.binds.items() if not bind.required}
    result = Compiled(compiled_stmt.string, tuple(compiled_stmt.positiontup or ()), defaults)
    with _lock:
        return _COMPILED.setdefault(full_key, result)
