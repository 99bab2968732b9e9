"""The store's own exceptions."""

from __future__ import annotations


class StoreUnavailableError(ConnectionError):
    """The database cannot be reached (or stayed unreachable past ``connect_deadline_seconds``).

    The message names the masked URL and the driver's reason.
    """
