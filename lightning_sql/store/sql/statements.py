"""A process-wide cache of prebuilt SQLAlchemy statements for the hot paths.

Building a Core statement (``select(...).where(...)``) costs ~100-200 µs of Python, several times
what SQLite needs to run it; a statement object built once with ``bindparam()`` placeholders is
compiled once (SQLAlchemy caches the compiled form on it) and executed with a parameter dict.
Keys name the statement and everything its shape depends on (dialect, column lists); values never
depend on data.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Hashable
from typing import Any, TypeVar

T = TypeVar("T")

_CACHE: dict[Hashable, Any] = {}
_lock = threading.Lock()
# ids of the statements kept in _CACHE (they live as long as the process, so their ids are stable):
# fastexec plans their execution once per dialect and schema.
_PREBUILT: set[int] = set()


def cached(key: Hashable, build: Callable[[], T]) -> T:
    """The statement stored under ``key``, built by ``build()`` on first use (two threads racing
    build equal statements and one wins)."""
    stmt = _CACHE.get(key)
    if stmt is None:
        built = build()
        with _lock:
            stmt = _CACHE.setdefault(key, built)
            for item in stmt if isinstance(stmt, tuple) else (stmt,):  # e.g. (page, count) pairs
                _PREBUILT.add(id(item))
    return stmt  # type: ignore[no-any-return]


def prebuilt(stmt: T) -> T:
    """Register a module-level statement built once at import (kept alive here) as prebuilt."""
    return cached(("prebuilt", id(stmt)), lambda: stmt)


def is_prebuilt(stmt: Any) -> bool:
    return id(stmt) in _PREBUILT
