"""The stores one server process works through: one ``SqlLightningStore`` per run it serves.

A ``SqlLightningStore`` is bound to one run; the server works on its configured run unless a request
names another, so it keeps one store per run name, opened on first use.  Only a write that stores
something opens the store of a run that does not exist yet (and so creates the run).  Instances share the
process's I/O worker for the database, so a store per run costs a few objects, not connections.
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING, Any

from lightning_sql.server.config import ServerConfig

if TYPE_CHECKING:
    from lightning_sql.store import SqlLightningStore

logger = logging.getLogger(__name__)

# Distinct runs one process serves; a client naming more gets a 400 rather than growing the process.
MAX_RUNS = 256


def _check_existing_sqlite(url: str) -> None:
    """A read-only server never creates anything: not even the file of a SQLite URL."""
    from pathlib import Path

    from lightning_sql.store.sql.urls import normalise_url

    target = normalise_url(url)
    if target.dialect == "sqlite" and target.path is not None and not Path(target.path).is_file():
        raise ValueError(f"no SQLite database at {target.path}: --read-only serves an existing database and creates none")


class TooManyRunsError(ValueError):
    """A request named a run beyond ``MAX_RUNS`` distinct runs of this process."""


class StorePool:
    """Stores by run name for one database (read-only ones under ``read_only``)."""

    def __init__(self, config: ServerConfig) -> None:
        if config.read_only:
            _check_existing_sqlite(config.url)
        self.config = config
        self._stores: dict[str, SqlLightningStore] = {}
        self._existing: set[str] = set()
        self._started = time.monotonic()
        self.store()  # checks the URL and options now (no I/O): a bad one fails at start, not per call

    def _options(self) -> dict[str, Any]:
        options: dict[str, Any] = {}
        if self.config.schema is not None:
            options["schema"] = self.config.schema
        return options

    def store(self, run: str | None = None) -> SqlLightningStore:
        """The store of ``run`` (the server's run by default), opened on first use.

        Writable stores create their run on first write; read-only ones never create anything.
        """
        from lightning_sql.store import SqlLightningStore
        from lightning_sql.types import check_text

        name = self.config.run if run is None else run
        found = self._stores.get(name)
        if found is not None:
            return found
        if not isinstance(name, str) or not name:
            raise ValueError("the run name must be a non-empty string")
        check_text(name, "run")
        if len(self._stores) >= MAX_RUNS:
            raise TooManyRunsError(f"this server already serves {MAX_RUNS} runs; restart it to serve others")
        created = SqlLightningStore(
            self.config.url,
            run=name,
            create_run=not self.config.read_only,
            read_only=self.config.read_only,
            connect_deadline_seconds=self.config.connect_timeout,
            **self._options(),
        )
        self._stores[name] = created
        return created

    def opened_runs(self) -> list[str]:
        return list(self._stores)

    def uptime(self) -> float:
        return time.monotonic() - self._started

    async def run_exists(self, name: str) -> bool:
        """Whether the database holds run ``name`` (looked up without creating it; a run never
        disappears while it is served, so a found one is remembered)."""
        if name in self._existing:
            return True
        if not isinstance(name, str) or not name:
            raise ValueError("the run name must be a non-empty string")
        found = await self.store().get_run(name) is not None
        if found:
            self._existing.add(name)
        return found

    async def healthy(self) -> tuple[bool, str]:
        """Whether the database answers a trivial read (looking the server's run up), and why not.

        A writable server's first call also brings a new database to the current schema revision.
        """
        try:
            await self.store().get_run(self.config.run)
        except Exception as exc:  # noqa: BLE001 - any failure means "not ready", with its reason
            logger.warning("Health check failed: %s: %s", type(exc).__name__, exc)
            return False, f"database not answering ({type(exc).__name__})"
        return True, "ok"

    async def close(self) -> None:
        stores = list(self._stores.values())
        self._stores.clear()
        for store in stores:
            try:
                await store.close()
            except Exception:  # noqa: BLE001 - closing the rest matters more
                logger.warning("Closing a store failed", exc_info=True)
