"""``python -m lightning_sql.server ...``: the same as ``lightning-sql serve ...``."""

from lightning_sql.server.command import main

main()
