"""The two halves every tier implements: a :class:`TierManager` on the scheduler side
(what the tier holds, where a chunk goes, what it evicts, its breaker) and a
:class:`TierHandler` in each worker (the bytes: read a chunk into a sink, write one).
"""

from __future__ import annotations

# -- scheduler side ---------------------------------------------------------------






# -- worker side -------------------------------------------------------------------
