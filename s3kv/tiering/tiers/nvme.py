"""The NVMe tier: a local directory of chunk files (scheduler side: the byte-bounded index; worker side: the files).
"""

from __future__ import annotations

# -- scheduler side ---------------------------------------------------------------






# -- worker side -------------------------------------------------------------------
