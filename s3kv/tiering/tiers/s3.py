"""The S3 tier: the shared bucket (scheduler side: the manifest, its breaker and the stores in flight; worker side: GETs and PUTs through the store).
"""

from __future__ import annotations

# -- scheduler side ---------------------------------------------------------------






# -- worker side -------------------------------------------------------------------
