"""The one error hierarchy of s3kv.

Every failure s3kv raises is an :class:`S3KVError`; backends map their own
errors (botocore, OSError) onto these names in one place each. Only
:class:`Transient` is worth retrying.
"""

from __future__ import annotations


class S3KVError(Exception):
    """Base of every error s3kv raises."""


class ConfigError(S3KVError, ValueError):
    """A configuration key is unknown, missing or has a bad value."""


class IdentityError(S3KVError):
    """The model's identity cannot be established (its files cannot be read,
    a hub model is not in the local cache): the replica must not share KV."""


class StorageProblem(S3KVError):
    """The bucket cannot be used: no credentials, no bucket, no access, unreachable."""


class NotFound(S3KVError, FileNotFoundError):
    """The object (or bucket) does not exist."""

    def __init__(self, key: str, detail: str = "") -> None:
        self.key = key
        super().__init__(f"not found: {key}" + (f" ({detail})" if detail else ""))


class AlreadyExists(S3KVError, FileExistsError):
    """A create-only write found the object already there."""

    def __init__(self, key: str) -> None:
        self.key = key
        super().__init__(f"already exists: {key}")


class Precondition(S3KVError):
    """A conditional write or delete found the object changed (ETag mismatch)."""

    def __init__(self, key: str) -> None:
        self.key = key
        super().__init__(f"changed since it was read: {key}")


class RangeNotSatisfiable(S3KVError, ValueError):
    """A ranged read started past the end of the object (HTTP 416)."""


class PermissionDenied(S3KVError, PermissionError):
    """The store refused this operation.

    ``credentials``: it refused the caller itself (keys unknown or expired, a
    signature or token it rejects, an account or bucket closed to it), so
    every request will fail alike: the tier is unusable. Otherwise it refused
    this object only (a bucket policy or KMS key for its prefix): the tier
    works, this object is not ours to use."""

    def __init__(self, message: str, *, credentials: bool = False) -> None:
        self.credentials = credentials
        super().__init__(message)


class Transient(S3KVError):
    """A failure that may pass: timeouts, throttling, connection errors, 5xx.

    The S3 store has already retried these (botocore's retry config) by the
    time this is raised.
    """


class Throttled(Transient):
    """The store asked us to slow down (SlowDown, 503, a throttling code)."""


class StorageFull(S3KVError, OSError):
    """The local filesystem is out of space (ENOSPC, EDQUOT)."""


class CorruptChunk(S3KVError):
    """A chunk object failed validation: bad magic, version, checksum or MAC,
    truncation, a frame that would not decode to its page, or it names
    another namespace or key than was asked for.

    ``etag``: the ETag of the object read, where the store gave one, so that
    it is deleted only if it was not rewritten since."""

    etag: str | None = None


class Unsigned(CorruptChunk):
    """A chunk object, sound otherwise, without a valid MAC under the fleet's
    keys (unsigned, signed with an unknown key, or a MAC that fails): with
    the fleet secret set, replicas refuse it as they refuse corrupt ones."""


class UnsupportedVersion(S3KVError, RuntimeError):
    """The installed vLLM is not one s3kv supports."""


class UnsupportedFormat(CorruptChunk):
    """A chunk object of a format version this s3kv does not read (a newer
    s3kv wrote it). Unusable here, like a corrupt one, but nothing is wrong
    with it: a load from S3 treats it as missing and never deletes it, and
    ``s3kv verify`` reports it apart (a CorruptChunk still, so that code
    unaware of versions refuses it; an NVMe copy is deleted like a bad one)."""

    def __init__(self, version: int, reads: tuple[int, ...]) -> None:
        self.version = version
        super().__init__(
            f"chunk format version {version}; this s3kv reads versions {', '.join(map(str, reads))}"
        )


class Unchecked(UnsupportedFormat):
    """A chunk object the ops commands do not decode, because deciding would
    cost more than a chunk of its namespace may: its frames are not the pages
    the namespace's descriptor names (a chunk of another ``chunk_tokens``),
    or, with no descriptor to say, they claim more page bytes than the ops
    commands decode for one chunk. Like one of a newer format it is reported
    apart and never deleted; nor does gc publish it."""

    def __init__(self, message: str) -> None:
        CorruptChunk.__init__(self, message)


class CorruptManifest(S3KVError):
    """A manifest object failed validation."""


class UnsignedManifest(CorruptManifest):
    """With the fleet secret set: a manifest object without a valid MAC."""


class UnsupportedManifestVersion(CorruptManifest):
    """A manifest object of a newer format version than this s3kv reads:
    skipped like a corrupt one, but never deleted as one."""


class TooLarge(S3KVError):
    """A manifest object is larger than ``max_object_bytes``."""


class UnsignedWrite(ConfigError):
    """gc has no fleet secret for a namespace whose manifest is signed."""


class LockBusy(S3KVError):
    """Another process holds the lease and did not let go in time."""


class LockLost(S3KVError):
    """Our lease expired and another process took it over."""


class GaveUp(Transient):
    """A transfer abandoned because another one on its tier failed for the
    tier's sake, it waited too long for a thread, or its load's deadline
    came first. Not itself news to the tier's breaker."""
