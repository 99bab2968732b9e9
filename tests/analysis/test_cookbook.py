"""docs/analysis.md: every SQL block runs on SQLite and PostgreSQL and answers with rows.

Blocks fenced ```sql run on both dialects; ```sql sqlite / ```sql postgresql only on theirs.  The data
is the quickstart-like dataset of tests/analysis/dataset.py (runs `quickstart` and `quickstart-b`).
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from lightning_sql import analysis
from tests.analysis.fixtures import Populated

DOC = Path(__file__).resolve().parents[2] / "docs" / "analysis.md"
FENCE = re.compile(r"^```sql(?P<dialect>[ \w]*)\n(?P<body>.*?)^```", re.S | re.M)
MIN_QUESTIONS = 12


def blocks() -> list[tuple[str, str, str]]:
    """(id, dialect or "both", sql) of every SQL block, numbered by section."""
    out = []
    section = "intro"
    text = DOC.read_text()
    headings = [(m.start(), m.group(1)) for m in re.finditer(r"^## (\d+)\.", text, re.M)]
    for m in FENCE.finditer(text):
        for start, number in headings:
            if start < m.start():
                section = number
        dialect = m.group("dialect").strip() or "both"
        out.append((f"q{section}-{dialect}-{len(out)}", dialect, m.group("body")))
    return out


BLOCKS = blocks()


def test_the_cookbook_answers_enough_questions() -> None:
    sections = {block_id.split("-")[0] for block_id, _, _ in BLOCKS}
    assert len(sections) >= MIN_QUESTIONS
    # A dialect-specific block always comes with its twin.
    for dialect in ("sqlite", "postgresql"):
        assert {b[0].split("-")[0] for b in BLOCKS if b[1] == dialect} == {
            b[0].split("-")[0] for b in BLOCKS if b[1] in ("sqlite", "postgresql")
        }
    assert {b[1] for b in BLOCKS} <= {"both", "sqlite", "postgresql"}


@pytest.mark.parametrize(("block_id", "dialect", "sql"), BLOCKS, ids=[b[0] for b in BLOCKS])
def test_cookbook_query(populated: Populated, block_id: str, dialect: str, sql: str) -> None:
    backend = "postgresql" if populated.is_postgres else "sqlite"
    if dialect not in ("both", backend):
        pytest.skip(f"{block_id} is the {dialect} spelling")
    with analysis.AnalysisDatabase(populated.url, schema=populated.schema) as database:
        columns, rows = database.raw(sql.strip().rstrip(";"))
    assert columns
    assert rows, f"{block_id} returned no rows:\n{sql}"


def test_cookbook_answers_are_right(populated: Populated) -> None:
    """Spot checks of the numbers against what the dataset wrote."""
    facts = populated.facts
    with analysis.AnalysisDatabase(populated.url, schema=populated.schema) as database:
        _, glance = database.raw(
            "SELECT ru.name, COUNT(ro.rollout_id) FROM runs ru LEFT JOIN rollouts ro ON ro.run_id = ru.run_id "
            "GROUP BY ru.name ORDER BY ru.name"
        )
        assert dict(glance) == {name: f.rollouts for name, f in facts.items()}
        _, slowest = database.raw(
            "SELECT latency_seconds FROM llm_calls_v1 WHERE run_name = 'quickstart' "
            "ORDER BY latency_seconds DESC LIMIT 1"
        )
        assert slowest[0][0] == pytest.approx(max(facts["quickstart"].llm_latency.values()))
        _, reasons = database.raw(
            "SELECT error_type, COUNT(*) FROM attempts_v1 WHERE run_name = 'quickstart' "
            "AND error_type IS NOT NULL GROUP BY error_type ORDER BY error_type"
        )
        expected: dict[str, int] = {}
        for error_type in facts["quickstart"].error_types.values():
            expected[error_type] = expected.get(error_type, 0) + 1
        assert dict(reasons) == expected
