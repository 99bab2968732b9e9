"""A process-wide cache of SQLAlchemy statements built once.

Building a Core statement (``select(...).where(...)``) costs more Python than SQLite needs to run
it; a statement object built once with ``bindparam()`` placeholders is
compiled once (SQLAlchemy caches the compiled form by the statement's structure) and executed with a
parameter dict.  Keys name the statement and everything its shape depends on (dialect, column
lists); values never depend on data.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Hashable
from typing import Any, TypeVar

T = TypeVar("T")

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
