"""The SQL implementation of the store (SQLite and PostgreSQL)."""
