"""lightning_sql: a persistent, SQL-backed coordination store for training AI agents.

The public API, re-exported: the models of ``lightning_sql.types``, the store and its errors, and
(when imported) the runtime.
"""

from lightning_sql.store import LightningStore, SqlLightningStore, StoreUnavailableError
from lightning_sql.types import *  # noqa: F403
from lightning_sql.types import __all__ as _types_all

__version__ = "0.1.0"

__all__ = ["LightningStore", "SqlLightningStore", "StoreUnavailableError", *_types_all]
