"""s3kv's tier changes as vLLM's own KV cache event classes."""

import pytest

pytest.importorskip("vllm")

from vllm.distributed.kv_events import BlockRemoved, BlockStored  # noqa: E402
from vllm.v1.core.kv_cache_utils import maybe_convert_block_hash  # noqa: E402

from s3kv.connector.connector import HIT_SOURCES, event_medium, kv_events  # noqa: E402
from s3kv.tiering.placement import Tier  # noqa: E402
from s3kv.tiering.plan import TierEvent  # noqa: E402
from s3kv.tiering.tiers.nvme.spec import NvmeSpec  # noqa: E402

K0, K1 = b"\x01" * 16, b"\x02" * 16


def test_events_name_the_tier_and_carry_the_chunk():
    out = kv_events(
        [
            TierEvent(True, Tier.CPU, K1, K0, (5, 6)),
            TierEvent(True, Tier.S3, K0, None, (3, 4)),
            TierEvent(False, Tier.DISK, K1),
        ],
        chunk_tokens=2,
    )
    stored_cpu, stored_s3, removed = out
    assert isinstance(stored_cpu, BlockStored) and isinstance(removed, BlockRemoved)
    assert (stored_cpu.medium, stored_cpu.locality, stored_cpu.ownership) == ("CPU", "LOCAL", "s3kv:cpu")
    assert (stored_s3.medium, stored_s3.locality, stored_s3.ownership) == ("STORAGE", "REMOTE", "s3kv:s3")
    h0, h1 = maybe_convert_block_hash(K0), maybe_convert_block_hash(K1)  # ints or bytes, as vLLM is set
    assert stored_cpu.block_hashes == [h1] and stored_cpu.parent_block_hash == h0
    assert stored_cpu.token_ids == [5, 6] and stored_cpu.block_size == 2
    assert stored_s3.parent_block_hash is None
    assert (removed.block_hashes, removed.medium, removed.locality) == ([h1], "STORAGE", "LOCAL")


def test_a_tier_names_vllm_media_and_hit_sources_by_its_spec():
    from vllm.v1.metrics.cache_hit_source import CacheHitSource

    assert HIT_SOURCES == {
        Tier.CPU: CacheHitSource.HOST,
        Tier.DISK: CacheHitSource.DISK,
        Tier.S3: CacheHitSource.EXTERNAL_UNSPECIFIED,
    }

    class Tape(NvmeSpec):
        medium = "TAPE"

    with pytest.raises(ValueError, match="disk: medium 'TAPE' is none of vLLM's"):
        event_medium(Tape())
