"""The bytes of one manifest object (s3kv.manifest.format): a round trip,
and every corruption caught. (Signing: tests/unit/test_auth.py.)"""

import numpy as np
import pytest

from s3kv.errors import CorruptManifest
from s3kv.manifest import format as mf


def fps(*values):
    return np.array(values, dtype=np.uint64)


def test_object_format_roundtrip_and_every_corruption_is_caught():
    obj = mf.ManifestObject("segment", fps(3, 1, 2, 3), fps(9), {"writer": "w"})
    blob = mf.encode(obj)
    back = mf.decode(blob)
    assert back.kind == "segment" and back.added.tolist() == [1, 2, 3] and back.removed.tolist() == [9]
    assert back.meta == {"writer": "w"}
    for i in range(len(blob)):
        bad = bytearray(blob)
        bad[i] ^= 0x10
        with pytest.raises(CorruptManifest):
            mf.decode(bytes(bad))
    for cut in (0, 10, len(blob) - 1):
        with pytest.raises(CorruptManifest):
            mf.decode(blob[:cut])
