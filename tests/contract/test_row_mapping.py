"""Every model field is read from one declared column, and every column is either a field or
declared as none (``rows.py``): a new column or a new field cannot silently take a default."""

from __future__ import annotations

import pytest

from lightning_sql.store.sql import rows
from lightning_sql.store.sql import schema as s
from lightning_sql.types import Attempt, Rollout, RolloutConfig, Span, Worker

CASES = [
    (Rollout, {**rows.ROLLOUT_FIELDS, "config": None}, s.rollouts, [*rows.ROLLOUT_FIELDS.values(), *rows.CONFIG_FIELDS.values()]),
    (RolloutConfig, rows.CONFIG_FIELDS, None, []),
    (Attempt, rows.ATTEMPT_FIELDS, s.attempts, list(rows.ATTEMPT_FIELDS.values())),
    (Worker, rows.WORKER_FIELDS, s.workers, list(rows.WORKER_FIELDS.values())),
    (Span, {**rows.SPAN_FIELDS, **dict.fromkeys(rows.SPAN_EXTRA_FIELDS)}, s.spans, list(rows.SPAN_FIELDS.values())),
]


@pytest.mark.parametrize(("model", "declared", "table", "columns"), CASES, ids=lambda c: getattr(c, "__name__", ""))
def test_each_field_has_its_declared_column_and_each_column_a_field(model, declared, table, columns) -> None:
    assert set(declared) == set(model.model_fields), f"{model.__name__}: fields without a column, or columns without a field"
    for name, column in declared.items():
        if column is not None:
            assert column.name == name, f"{model.__name__}.{name} is read from {column.name}"
    if table is not None:
        accounted = {c.name for c in columns} | set(rows.NOT_FIELDS[table.name])
        assert accounted == {c.name for c in table.c}, f"{table.name}: columns neither read into a field nor declared as none"


def test_a_row_becomes_the_model_it_was_written_from() -> None:
    """Every declared field travels: a row of the declared columns rebuilds each field's value."""
    attempt = Attempt(rollout_id="ro-1", attempt_id="at-1", sequence_id=2, start_time=1.0, end_time=2.0, status="failed",
                      worker_id="w", last_heartbeat_time=1.5, metadata={"k": 1})
    assert rows.attempt_from_row(attempt.model_dump()) == attempt
    worker = Worker(worker_id="w", status="busy", heartbeat_stats={"cpu": 1}, last_heartbeat_time=1.0, last_dequeue_time=2.0,
                    last_busy_time=3.0, last_idle_time=4.0, current_rollout_id="ro-1", current_attempt_id="at-1")
    assert rows.worker_from_row(worker.model_dump()) == worker
