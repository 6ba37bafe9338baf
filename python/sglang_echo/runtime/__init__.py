"""Single-node serving runtime: token tables, batching engine (and later scheduler, server)."""
