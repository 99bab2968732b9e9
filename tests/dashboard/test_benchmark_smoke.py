"""benchmarks/dashboard.py runs end to end at a tiny size (its figures are never asserted)."""

from __future__ import annotations

import pytest

from benchmarks import dashboard as bench
from tests.conftest import require_postgres

PAGES = ("runs", "run", "rollouts", "rollouts text", "rollout", "span", "resources + diff")


@pytest.mark.parametrize("backend", ["sqlite", "postgres"])
def test_dashboard_benchmark_runs(backend: str, capsys: pytest.CaptureFixture[str]) -> None:
    if backend == "postgres":
        require_postgres()
    assert bench.main(["--rollouts", "60", "--spans-per-rollout", "3", "--repeat", "1", "--backend", backend]) == 0
    out = capsys.readouterr().out
    assert f"{backend}: seeded 60 rollouts x 3 spans" in out
    lines = {line[:30].strip() for line in out.splitlines()}
    assert set(PAGES) <= lines
