"""${message}

Revision ID: ${up_revision}
Revises: ${down_revision | comma,n}
Create Date: ${create_date}

Revisions must run on SQLite and PostgreSQL: alter tables through `op.batch_alter_table(...)`
(SQLite rebuilds the table), use schema-less names (env.py maps them onto the PostgreSQL schema),
name every constraint and index explicitly, and spell column types out rather than importing them
from lightning_sql (a revision is frozen). Additive changes only (expand now, contract in a later
release); a revision that older code cannot run against sets compatible_with_older_code = False.
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op
${imports if imports else ""}

revision: str = ${repr(up_revision)}
down_revision: str | None = ${repr(down_revision)}
branch_labels: str | None = ${repr(branch_labels)}
depends_on: str | None = ${repr(depends_on)}

# False when code that does not know this revision must refuse the database (docs/store-contract.md §4).
compatible_with_older_code = True


def upgrade() -> None:
    ${upgrades if upgrades else "pass"}


def downgrade() -> None:
    ${downgrades if downgrades else "pass"}
