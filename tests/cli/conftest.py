from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.analysis.fixtures import BACKENDS, Populated, build


@pytest.fixture(scope="module", params=BACKENDS)
def populated(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Populated]:
    """The quickstart-like dataset, written once per test module and backend (read-only tests)."""
    yield from build(request.param, tmp_path_factory.mktemp("populated"))
