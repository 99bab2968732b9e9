"""Initial schema: runs, rollouts, attempts, spans, resources, resource history, workers.

A frozen copy of ``lightning_sql/store/sql/schema.py`` as of release 0.1: column types and
constraint names are spelled out here, never imported, so later edits to schema.py cannot change
what this revision creates.  On PostgreSQL env.py maps the schema-less names onto the configured
schema (``schema_translate_map``).

Revision ID: 0001
Revises:
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects import postgresql

revision: str = "0001"
down_revision: str | None = None
branch_labels: str | None = None
depends_on: str | None = None

# Older code has nothing to be incompatible with.
compatible_with_older_code = True

# The column types of schema.py, frozen.
IdText = sa.Text().with_variant(sa.Text(collation="C"), "postgresql")
JsonValue = sa.JSON(none_as_null=True).with_variant(postgresql.JSONB(none_as_null=True), "postgresql")
EpochSeconds = sa.Float(precision=53)
SpanId = sa.BigInteger().with_variant(sa.Integer(), "sqlite")

POSITION_SEQUENCE = "lightning_sql_position_seq"


def upgrade() -> None:
    if op.get_context().dialect.name == "postgresql":
        op.execute(sa.schema.CreateSequence(sa.Sequence(POSITION_SEQUENCE, start=1)))

    op.create_table(
        "runs",
        sa.Column("run_id", sa.Integer(), primary_key=True, autoincrement=True),
        sa.Column("name", IdText, nullable=False),
        sa.Column("status", sa.String(16), nullable=False),
        sa.Column("created_at", EpochSeconds, nullable=False),
        sa.Column("finished_at", EpochSeconds),
        sa.Column("metadata", JsonValue),
        sa.Column("seq", sa.BigInteger(), nullable=False, server_default=sa.text("0")),
        sa.PrimaryKeyConstraint("run_id", name="pk_runs"),
        sa.UniqueConstraint("name", name="uq_runs_name"),
    )

    op.create_table(
        "rollouts",
        sa.Column("run_id", sa.Integer(), nullable=False),
        sa.Column("rollout_id", IdText, nullable=False),
        sa.Column("input", JsonValue),
        sa.Column("mode", sa.String(8)),
        sa.Column("resources_id", IdText),
        sa.Column("resources_version", sa.Integer()),
        sa.Column("status", sa.String(16), nullable=False),
        sa.Column("timeout_seconds", EpochSeconds),
        sa.Column("unresponsive_seconds", EpochSeconds),
        sa.Column("max_attempts", sa.Integer(), nullable=False),
        sa.Column("retry_condition", JsonValue, nullable=False),
        sa.Column("metadata", JsonValue),
        sa.Column("idempotency_key", IdText),
        sa.Column("start_time", EpochSeconds, nullable=False),
        sa.Column("end_time", EpochSeconds),
        sa.Column("queue_seq", sa.BigInteger()),
        sa.Column("span_seq", sa.BigInteger(), nullable=False, server_default=sa.text("0")),
        sa.Column("create_seq", sa.BigInteger(), nullable=False),
        sa.Column("attempt_count", sa.Integer(), nullable=False, server_default=sa.text("0")),
        sa.PrimaryKeyConstraint("run_id", "rollout_id", name="pk_rollouts"),
        sa.UniqueConstraint("run_id", "idempotency_key", name="uq_rollouts_run_id_idempotency_key"),
        sa.ForeignKeyConstraint(["run_id"], ["runs.run_id"], name="fk_rollouts_run_id_runs"),
    )
    # The queue IS this partial index (docs/architecture.md §3); the predicate must survive on both dialects.
    op.create_index(
        "ix_rollouts_queue",
        "rollouts",
        ["run_id", "queue_seq"],
        postgresql_where=sa.text("queue_seq IS NOT NULL"),
        sqlite_where=sa.text("queue_seq IS NOT NULL"),
    )
    op.create_index("ix_rollouts_run_id_create_seq", "rollouts", ["run_id", "create_seq"])
    op.create_index("ix_rollouts_run_id_status", "rollouts", ["run_id", "status"])

    op.create_table(
        "attempts",
        sa.Column("run_id", sa.Integer(), nullable=False),
        sa.Column("rollout_id", IdText, nullable=False),
        sa.Column("attempt_id", IdText, nullable=False),
        sa.Column("sequence_id", sa.Integer(), nullable=False),
        sa.Column("status", sa.String(16), nullable=False),
        sa.Column("worker_id", IdText),
        sa.Column("start_time", EpochSeconds, nullable=False),
        sa.Column("end_time", EpochSeconds),
        sa.Column("last_heartbeat_time", EpochSeconds),
        sa.Column("metadata", JsonValue),
        sa.PrimaryKeyConstraint("run_id", "rollout_id", "attempt_id", name="pk_attempts"),
        sa.UniqueConstraint(
            "run_id", "rollout_id", "sequence_id", name="uq_attempts_run_id_rollout_id_sequence_id"
        ),
        sa.ForeignKeyConstraint(
            ["run_id", "rollout_id"],
            ["rollouts.run_id", "rollouts.rollout_id"],
            name="fk_attempts_run_id_rollout_id_rollouts",
        ),
    )

    op.create_table(
        "spans",
        sa.Column("id", SpanId, primary_key=True, autoincrement=True),
        sa.Column("run_id", sa.Integer(), nullable=False),
        sa.Column("rollout_id", IdText, nullable=False),
        sa.Column("attempt_id", IdText, nullable=False),
        sa.Column("sequence_id", sa.BigInteger(), nullable=False),
        sa.Column("trace_id", IdText, nullable=False),
        sa.Column("span_id", IdText, nullable=False),
        sa.Column("parent_id", IdText),
        sa.Column("name", IdText, nullable=False),
        sa.Column("status_code", sa.String(8), nullable=False),
        sa.Column("start_time", EpochSeconds),
        sa.Column("end_time", EpochSeconds),
        sa.Column("attributes", JsonValue),
        sa.Column("events", JsonValue),
        sa.Column("links", JsonValue),
        sa.Column("resource", JsonValue),
        sa.Column("extra", JsonValue),
        sa.PrimaryKeyConstraint("id", name="pk_spans"),
        sa.UniqueConstraint(
            "run_id",
            "rollout_id",
            "attempt_id",
            "span_id",
            name="uq_spans_run_id_rollout_id_attempt_id_span_id",
        ),
        sa.ForeignKeyConstraint(
            ["run_id", "rollout_id", "attempt_id"],
            ["attempts.run_id", "attempts.rollout_id", "attempts.attempt_id"],
            name="fk_spans_run_id_rollout_id_attempt_id_attempts",
        ),
    )
    op.create_index(
        "ix_spans_run_id_rollout_id_attempt_id_sequence_id",
        "spans",
        ["run_id", "rollout_id", "attempt_id", "sequence_id"],
    )

    op.create_table(
        "resources",
        sa.Column("run_id", sa.Integer(), nullable=False),
        sa.Column("resources_id", IdText, nullable=False),
        sa.Column("version", sa.Integer(), nullable=False),
        sa.Column("create_time", EpochSeconds, nullable=False),
        sa.Column("update_time", EpochSeconds, nullable=False),
        sa.Column("resources", JsonValue, nullable=False),
        sa.Column("create_seq", sa.BigInteger(), nullable=False),
        sa.Column("touch_seq", sa.BigInteger(), nullable=False),
        sa.PrimaryKeyConstraint("run_id", "resources_id", name="pk_resources"),
        sa.ForeignKeyConstraint(["run_id"], ["runs.run_id"], name="fk_resources_run_id_runs"),
    )
    op.create_index("ix_resources_run_id_touch_seq", "resources", ["run_id", "touch_seq"])
    op.create_index("ix_resources_run_id_create_seq", "resources", ["run_id", "create_seq"])

    op.create_table(
        "resource_versions",
        sa.Column("run_id", sa.Integer(), nullable=False),
        sa.Column("resources_id", IdText, nullable=False),
        sa.Column("version", sa.Integer(), nullable=False),
        sa.Column("resources", JsonValue, nullable=False),
        sa.Column("time", EpochSeconds, nullable=False),
        sa.PrimaryKeyConstraint("run_id", "resources_id", "version", name="pk_resource_versions"),
        sa.ForeignKeyConstraint(["run_id"], ["runs.run_id"], name="fk_resource_versions_run_id_runs"),
    )

    op.create_table(
        "workers",
        sa.Column("run_id", sa.Integer(), nullable=False),
        sa.Column("worker_id", IdText, nullable=False),
        sa.Column("status", sa.String(16), nullable=False),
        sa.Column("heartbeat_stats", JsonValue),
        sa.Column("last_heartbeat_time", EpochSeconds),
        sa.Column("last_dequeue_time", EpochSeconds),
        sa.Column("last_busy_time", EpochSeconds),
        sa.Column("last_idle_time", EpochSeconds),
        sa.Column("current_rollout_id", IdText),
        sa.Column("current_attempt_id", IdText),
        sa.Column("create_seq", sa.BigInteger(), nullable=False),
        sa.PrimaryKeyConstraint("run_id", "worker_id", name="pk_workers"),
        sa.ForeignKeyConstraint(["run_id"], ["runs.run_id"], name="fk_workers_run_id_runs"),
    )
    op.create_index("ix_workers_run_id_create_seq", "workers", ["run_id", "create_seq"])


def downgrade() -> None:
    # Children before parents, so the foreign keys never dangle.
    op.drop_index("ix_workers_run_id_create_seq", table_name="workers")
    op.drop_table("workers")
    op.drop_table("resource_versions")
    op.drop_index("ix_resources_run_id_create_seq", table_name="resources")
    op.drop_index("ix_resources_run_id_touch_seq", table_name="resources")
    op.drop_table("resources")
    op.drop_index("ix_spans_run_id_rollout_id_attempt_id_sequence_id", table_name="spans")
    op.drop_table("spans")
    op.drop_table("attempts")
    op.drop_index("ix_rollouts_run_id_status", table_name="rollouts")
    op.drop_index("ix_rollouts_run_id_create_seq", table_name="rollouts")
    op.drop_index("ix_rollouts_queue", table_name="rollouts")
    op.drop_table("rollouts")
    op.drop_table("runs")
    if op.get_context().dialect.name == "postgresql":
        op.execute(sa.schema.DropSequence(sa.Sequence(POSITION_SEQUENCE)))
