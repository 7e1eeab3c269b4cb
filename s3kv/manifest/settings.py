"""The manifest loop's settings (:class:`SyncSettings`), apart from the loop
(:mod:`s3kv.manifest.sync`) so that its parts (:mod:`s3kv.manifest.chain`)
can name them without importing it."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from s3kv.config import DEFAULTS, MANIFEST_PROTOCOLS, S3KVConfig
from s3kv.manifest.snapshots import SNAPSHOTS_KEPT

Offload = Callable[..., Awaitable[Any]]
"""Runs ``f(*args)`` off the event loop: :func:`asyncio.to_thread`, or
inline where the loop's time is virtual (the fleet model)."""


@dataclass(frozen=True)
class SyncSettings:
    """The manifest loop's settings, cut from the config by :meth:`from_config`;
    tests may build one (the defaults are the config's, or not config keys)."""

    publish_s: float = DEFAULTS.manifest_publish_s
    refresh_s: float = DEFAULTS.manifest_refresh_s
    skew_s: float = DEFAULTS.manifest_clock_skew_s
    """Replicas' clocks may disagree by this much without missing segments."""
    snapshot_every: int = 256
    """Segments past the newest snapshot before a replica writes a new one..."""
    snapshot_interval_s: float = 600.0
    """... and no sooner than this after the newest snapshot."""
    snapshots_kept: int = SNAPSHOTS_KEPT
    fetch_concurrency: int = 64
    max_object_bytes: int = DEFAULTS.manifest_max_bytes
    """A segment or snapshot larger than this is refused unread (``manifest_max_bytes``)."""
    get_attempts: int = 3
    """GETs of one object that fail otherwise (not denied, missing or
    corrupt: throttled, reset, timed out) before it is skipped."""
    protocol: str = "segments"
    """How other replicas' segments are read (``manifest_protocol``):
    "epochs" (through epoch objects, :mod:`s3kv.manifest.epochs`) or
    "segments" (each one, every ``refresh_s``). The config's default is
    "epochs"; a settings object built by hand reads segments."""
    settle_s: float = 1.0
    """Epochs: an epoch is read (and aggregated, by the first candidate) this
    long after its end, so that the PUTs of its segments have landed."""
    grace_step_s: float = 1.0
    """Epochs: each next candidate aggregates an epoch still missing this much later."""
    max_rank: int = 8
    """Epochs: candidates beyond this rank spread over a few more grace steps."""
    snapshot_epochs: int = 60
    """Epochs: the aggregator of every epoch whose number is a multiple of
    this writes a snapshot (snapshots by count, whatever the fleet's size)."""
    epoch_retry_s: float = 0.5
    """Epochs: an epoch not there yet is asked for again this soon."""
    probe_every: int = 4
    """Epochs: one epoch in this many, a replica that has just read one asks
    for the next at once (and again at each epoch while that finds one). A
    replica whose clock is behind and that reads late cannot tell from the
    stamps it reads (none is later than its clock when it reads them); an
    epoch that is there before it expected says so."""

    def __post_init__(self) -> None:
        if self.protocol not in MANIFEST_PROTOCOLS:
            raise ValueError(
                f"manifest protocol {self.protocol!r}: must be one of {', '.join(MANIFEST_PROTOCOLS)}"
            )

    @classmethod
    def from_config(cls, config: S3KVConfig) -> SyncSettings:
        """The ``manifest_*`` keys of ``config``; the rest are not keys."""
        return cls(
            publish_s=config.manifest_publish_s,
            refresh_s=config.manifest_refresh_s,
            skew_s=config.manifest_clock_skew_s,
            max_object_bytes=config.manifest_max_bytes,
            protocol=config.manifest_protocol,
        )
