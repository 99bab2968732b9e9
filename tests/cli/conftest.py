from __future__ import annotations

import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.analysis.fixtures import BACKENDS, Populated, build
from tests.conftest import PG_URL, require_postgres
from tests.helpers import FakeClock, drop_pg_schema


@pytest.fixture(scope="module", params=BACKENDS)
def populated(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Populated]:
    """The quickstart-like dataset, written once per test module and backend (read-only tests)."""
    yield from build(request.param, tmp_path_factory.mktemp("populated"))


@pytest.fixture(params=BACKENDS)
def fresh(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Populated]:
    """An empty database (no schema yet)."""
    if request.param == "postgres":
        require_postgres()
        spec = Populated("postgres", PG_URL, f"t_{uuid.uuid4().hex[:12]}", {}, FakeClock(1_000_000_000.0))
    else:
        spec = Populated("sqlite", f"sqlite:///{tmp_path / 'fresh.db'}", None, {}, FakeClock(1_000_000_000.0))
    try:
        yield spec
    finally:
        spec.clock.remove()
        if spec.schema is not None:
            drop_pg_schema(PG_URL, spec.schema)
