"""What the NVMe tier's handlers tell its manager beyond the generic report."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Self

from s3kv.tiering.plan import TierSection


@dataclass
class NvmeReport(TierSection):
    sizes: dict[bytes, int] = field(default_factory=dict)
    """Key -> bytes of the files written, summed over ranks (an entry takes
    its real size once every rank wrote it)."""
    full: bool = False
    """A write found the disk full below ``disk_bytes``: the index shrinks."""

    def merge(self, other: Self) -> Self:
        sizes = dict(self.sizes)
        for key, n in other.sizes.items():
            sizes[key] = sizes.get(key, 0) + n
        return type(self)(sizes, self.full or other.full)

    def __bool__(self) -> bool:
        return bool(self.sizes) or self.full
