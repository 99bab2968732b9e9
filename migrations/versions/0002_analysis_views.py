"""Analysis views and the reward-span index: rollout_summary_v1, rewards_v1, llm_calls_v1, attempts_v1.

The views are created from ``lightning_sql.store.sql.views``: their ``_v1`` definitions are frozen by
policy (a different shape gets a new name in a new revision), so importing them here is as stable
as spelling them out.  The index is spelled out, as in 0001.  On PostgreSQL the views are created
in the configured schema (env.py maps it through ``schema_translate_map``).

Revision ID: 0002
Revises: 0001
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import sqlalchemy as sa
from alembic import op

from lightning_sql.store.sql import views

revision: str = "0002"
down_revision: str | None = "0001"
branch_labels: str | None = None
depends_on: str | None = None

# Additive: older code neither knows nor minds the views and the index.
compatible_with_older_code = True

REWARD_INDEX = "ix_spans_reward"
REWARD_PREDICATE = sa.text("name = 'agentlightning.annotation'")


def _run(statements: Callable[[Any, str | None], list[str]]) -> None:
    context = op.get_context()
    if context.as_sql:
        # Offline (--sql): env.py points search_path at the schema; names stay unqualified.
        for statement in statements(context.dialect, None):
            op.execute(statement)
        return
    bind = op.get_bind()
    for statement in statements(bind.dialect, views.connection_schema(bind)):
        bind.exec_driver_sql(statement)


def upgrade() -> None:
    op.create_index(
        REWARD_INDEX,
        "spans",
        ["run_id", "rollout_id", "attempt_id", "sequence_id"],
        postgresql_where=REWARD_PREDICATE,
        sqlite_where=REWARD_PREDICATE,
    )
    _run(views.create_statements)


def downgrade() -> None:
    _run(views.drop_statements)
    op.drop_index(REWARD_INDEX, table_name="spans")
