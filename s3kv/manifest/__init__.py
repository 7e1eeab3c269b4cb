"""The hot manifest: which chunks the shared bucket holds, in memory on the
scheduler side and kept in step with the fleet through small immutable
objects in S3 (see :mod:`s3kv.manifest.protocol`)."""

from s3kv.manifest.keyset import FingerprintSet, Manifest, fingerprints
from s3kv.manifest.sync import ManifestSync, SyncSettings

__all__ = ["FingerprintSet", "Manifest", "ManifestSync", "SyncSettings", "fingerprints"]
