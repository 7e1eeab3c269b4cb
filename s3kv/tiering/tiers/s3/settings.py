"""The S3 tier's worker-side settings: its slice of the config, cut by its
spec (:meth:`S3Spec.settings`) and carried to each worker in
:attr:`EngineSettings.wings <s3kv.tiering.tiers.settings.EngineSettings.wings>`.

The bucket's prefix and the fleet secret stay in EngineSettings: the
manifest and every tier's chunk checks use them too."""

from __future__ import annotations

from dataclasses import dataclass

from s3kv.config import DEFAULTS, S3KVConfig


@dataclass(frozen=True)
class S3Settings:
    """How a worker reads chunk objects; tests and benchmarks may build one
    (the defaults are the config's)."""

    range_bytes: int = DEFAULTS.range_bytes
    """The target size of one ranged GET (``range_bytes``): a chunk's frames
    are fetched in groups of about this size."""

    @classmethod
    def from_config(cls, config: S3KVConfig) -> S3Settings:
        """The settings in ``config`` (every config has a bucket)."""
        return cls(range_bytes=config.range_bytes)
