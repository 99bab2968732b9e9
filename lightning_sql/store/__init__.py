"""Store contract and its SQL implementation."""

from lightning_sql.store.base import LightningStore, PersistentStore
from lightning_sql.store.sql.errors import StoreUnavailableError
from lightning_sql.store.sql.instance import outage_patience
from lightning_sql.store.sql.store import SqlLightningStore

__all__ = ["LightningStore", "PersistentStore", "SqlLightningStore", "StoreUnavailableError", "outage_patience"]
