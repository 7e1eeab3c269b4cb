"""What the S3 tier's handlers tell its manager beyond the generic report."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Self

from s3kv.tiering.plan import TierSection


@dataclass
class S3Report(TierSection):
    bad: dict[tuple[bytes, int], str | None] = field(default_factory=dict)
    """(key, rank) -> ETag of a corrupt object the rank could not delete:
    the fleet hears it is bad (quarantined in the manifest)."""
    existing: set[bytes] = field(default_factory=set)
    """Keys whose create-only store found the object already there (a 412)."""

    def merge(self, other: Self) -> Self:
        return type(self)({**self.bad, **other.bad}, self.existing | other.existing)

    def __bool__(self) -> bool:
        return bool(self.bad) or bool(self.existing)
