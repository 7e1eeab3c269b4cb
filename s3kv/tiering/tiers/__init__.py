"""The tiers below vLLM's KV cache, a wing (package) each: cpu/, nvme/, s3/.

A new tier is one wing here with a manager and a handler: its handler
registers in :data:`HANDLERS`, its manager in the list the scheduler side
builds (``s3kv.connector.scheduler``), both nearest tier first.
"""

from s3kv.tiering.tiers.cpu.handler import CpuHandler
from s3kv.tiering.tiers.handler import TierHandler
from s3kv.tiering.tiers.nvme.handler import NvmeHandler
from s3kv.tiering.tiers.s3.handler import S3Handler

HANDLERS: tuple[type[TierHandler], ...] = (CpuHandler, NvmeHandler, S3Handler)
"""The tiers a worker may hold, nearest first."""
