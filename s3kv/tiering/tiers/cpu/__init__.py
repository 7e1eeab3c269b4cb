"""The CPU tier: a pinned host pool, per worker, indexed by the scheduler side."""
