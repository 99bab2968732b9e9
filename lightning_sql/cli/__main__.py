"""``python -m lightning_sql.cli``: the same as the ``lightning-sql`` command."""

from lightning_sql.cli import main

main()
