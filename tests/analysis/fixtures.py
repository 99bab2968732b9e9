"""A populated database (``dataset.populate``) per test module and backend: SQLite file, PostgreSQL."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from lightning_sql import SqlLightningStore
from tests.analysis.dataset import RunFacts, populate
from tests.conftest import PG_URL, require_postgres
from tests.helpers import FakeClock, drop_pg_schema

BACKENDS = ["sqlite", pytest.param("postgres", marks=pytest.mark.postgres)]


@dataclass
class Populated:
    kind: str
    url: str
    schema: str | None
    facts: dict[str, RunFacts]
    clock: FakeClock

    @property
    def is_postgres(self) -> bool:
        return self.kind == "postgres"

    def options(self) -> dict[str, Any]:
        return {"schema": self.schema} if self.schema is not None else {}

    def cli_args(self) -> list[str]:
        args = ["--url", self.url]
        if self.schema is not None:
            args += ["--schema", self.schema]
        return args

    def open(self, **kwargs: Any) -> SqlLightningStore:
        return SqlLightningStore(self.url, clock=self.clock, clock_sync=False, scan_debounce_seconds=0,
                                 **self.options(), **kwargs)


def build(kind: str, directory: Path) -> Iterator[Populated]:
    if kind == "postgres":
        require_postgres()
        url, schema = PG_URL, f"t_{uuid.uuid4().hex[:12]}"
    else:
        url, schema = f"sqlite:///{directory / 'quickstart.db'}", None
    clock = FakeClock(1_800_000_000.0)
    populated = Populated(kind, url, schema, {}, clock)

    async def write() -> dict[str, RunFacts]:
        stores: list[SqlLightningStore] = []

        def open_store(**kwargs: Any) -> SqlLightningStore:
            store = populated.open(**kwargs)
            stores.append(store)
            return store

        try:
            return await populate(open_store, clock)
        finally:
            for store in stores:
                await store.close()

    try:
        populated.facts = asyncio.run(write())
        yield populated
    finally:
        clock.remove()
        if schema is not None:
            drop_pg_schema(PG_URL, schema)
