"""The NVMe tier's worker-side settings: its slice of the config, cut by
its spec (:meth:`NvmeSpec.settings`) and carried to each worker in
:attr:`EngineSettings.wings <s3kv.tiering.tiers.settings.EngineSettings.wings>`."""

from __future__ import annotations

from dataclasses import dataclass

from s3kv.config import DEFAULTS, S3KVConfig


@dataclass(frozen=True)
class NvmeSettings:
    """A worker's NVMe directory and how it writes there; tests and
    benchmarks may build one (the defaults are the config's)."""

    path: str
    """The directory (``disk_path``): the tier is on where a worker has these settings."""
    codec: str = DEFAULTS.disk_codec
    """The files' codec (``disk_codec``); a chunk in another is re-encoded on promotion."""
    fsync: bool = DEFAULTS.disk_fsync == "always"
    timeout_s: float = DEFAULTS.disk_timeout_s
    """A chunk read or write on the NVMe tier slower than this, from when a
    thread starts it, counts as a disk failure (a read falls back to S3). A
    read that waits this long for a thread goes to the next source, blaming
    the disk only if its threads are stuck (busy is not failing)."""

    @classmethod
    def from_config(cls, config: S3KVConfig) -> NvmeSettings | None:
        """The settings in ``config``, or None where it has no NVMe tier."""
        if config.disk_path is None:
            return None
        return cls(
            path=config.disk_path,
            codec=config.disk_codec,
            fsync=config.disk_fsync == "always",
            timeout_s=config.disk_timeout_s,
        )
