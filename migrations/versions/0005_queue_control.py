"""Queue control (docs/queue.md): priorities, retry back-off and pausing a run.

``rollouts`` gains ``priority`` (higher is claimed first, FIFO within one priority), ``not_before``
(a requeue's back-off: not claimable before it) and the back-off settings of its ``RolloutConfig``
(``retry_backoff_seconds``, ``retry_backoff_factor``, ``retry_backoff_max_seconds``).  The queue
index ``ix_rollouts_queue`` becomes ``(run_id, priority DESC, queue_seq)`` over the claimable rows
only (queued, no ``not_before``), and ``ix_rollouts_delayed`` ``(run_id, not_before)`` holds the
queued rows in back-off, so a claim reads the head of each and never steps over a delayed rollout.
``runs`` gains ``paused`` (1: the run's claims take nothing).  Existing rows get priority 0, no delay
and an unpaused run: they are claimed in the order they were before.

Older code must not run against this revision: its claim ignores ``not_before`` (it would claim
rollouts in back-off) and can no longer read its queue through an index.

Revision ID: 0005
Revises: 0004
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision: str = "0005"
down_revision: str | None = "0004"
branch_labels: str | None = None
depends_on: str | None = None

compatible_with_older_code = False

QUEUE = "ix_rollouts_queue"
DELAYED = "ix_rollouts_delayed"
_SECONDS = sa.Float(precision=53)


def upgrade() -> None:
    # In place on both dialects (SQLite's ADD COLUMN and, from 3.35, DROP COLUMN): no table rebuild.
    op.add_column("rollouts", sa.Column("retry_backoff_seconds", _SECONDS))
    op.add_column("rollouts", sa.Column("retry_backoff_factor", _SECONDS, nullable=False, server_default=sa.text("2")))
    op.add_column("rollouts", sa.Column("retry_backoff_max_seconds", _SECONDS))
    op.add_column("rollouts", sa.Column("priority", sa.Integer(), nullable=False, server_default=sa.text("0")))
    op.add_column("rollouts", sa.Column("not_before", _SECONDS))
    op.add_column("runs", sa.Column("paused", sa.Integer(), nullable=False, server_default=sa.text("0")))
    op.drop_index(QUEUE, table_name="rollouts")
    claimable = sa.text("queue_seq IS NOT NULL AND not_before IS NULL")
    delayed = sa.text("queue_seq IS NOT NULL AND not_before IS NOT NULL")
    op.create_index(
        QUEUE, "rollouts", ["run_id", sa.text("priority DESC"), "queue_seq"],
        postgresql_where=claimable, sqlite_where=claimable,
    )
    op.create_index(DELAYED, "rollouts", ["run_id", "not_before"], postgresql_where=delayed, sqlite_where=delayed)


def downgrade() -> None:
    op.drop_index(DELAYED, table_name="rollouts")
    op.drop_index(QUEUE, table_name="rollouts")
    queued = sa.text("queue_seq IS NOT NULL")
    op.create_index(QUEUE, "rollouts", ["run_id", "queue_seq"], postgresql_where=queued, sqlite_where=queued)
    op.drop_column("runs", "paused")
    for column in ("not_before", "priority", "retry_backoff_max_seconds", "retry_backoff_factor", "retry_backoff_seconds"):
        op.drop_column("rollouts", column)
