"""The tiers, nearest first: the one list the scheduler side builds its
managers from and each worker its handlers, and generic code asks a tier's
facts of (cost priors, vLLM's names for it, its worker settings). A new tier
is a wing (a package beside cpu/, nvme/, s3/ with its spec, manager and
handler), one line here and its name in the wire enum
(:class:`~s3kv.tiering.placement.Tier`)."""

from __future__ import annotations

from s3kv.tiering.tiers.cpu.spec import CpuSpec
from s3kv.tiering.tiers.nvme.spec import NvmeSpec
from s3kv.tiering.tiers.s3.spec import S3Spec
from s3kv.tiering.tiers.spec import TierSpec

TIERS: tuple[TierSpec, ...] = (CpuSpec(), NvmeSpec(), S3Spec())
"""Every tier, nearest first."""
