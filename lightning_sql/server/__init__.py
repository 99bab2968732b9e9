"""``lightning-sql serve``: the HTTP server over a store (dashboard, APIs)."""
