"""The CPU tier: host pool slots (scheduler side: the slot index; worker side: the pinned pool).
"""

from __future__ import annotations

# -- scheduler side ---------------------------------------------------------------






# -- worker side -------------------------------------------------------------------
