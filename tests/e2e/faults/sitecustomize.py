"""Fault injection for end-to-end tests, loaded by every Python process that
has this directory on PYTHONPATH (vLLM's engine and worker processes too).

``S3KV_FAULT_DISK_BYTES=N``: the NVMe tier's writes fail with ENOSPC once N
bytes were written, as on a full file system (for machines where a test
cannot mount a tiny tmpfs).
"""

import os

_limit = os.environ.get("S3KV_FAULT_DISK_BYTES")
if _limit:
    import errno
    import threading

    from s3kv.tiering.tiers.nvme import files as _disk

    _written = [0]
    _lock = threading.Lock()
    _real_write = _disk.atomic_write

    def _atomic_write(path, data, **kw):
        with _lock:
            if _written[0] + len(data) > int(_limit):
                raise OSError(errno.ENOSPC, "No space left on device (injected)", str(path))
            _written[0] += len(data)
        return _real_write(path, data, **kw)

    _disk.atomic_write = _atomic_write

# ``S3KV_FAULT_DISK_READ_DELAY_S=S``: every NVMe tier read first waits S
# seconds, as on a disk that stopped answering in time; with
# ``S3KV_FAULT_DISK_READ_DELAY_AT=frame``, every frame's read does (inside
# the read, once its load let it in: a disk that hangs in the middle of a
# file), and the page cache holds none of the files (from there no read
# waits for the disk).
_delay = os.environ.get("S3KV_FAULT_DISK_READ_DELAY_S")
if _delay:
    import time as _time

    from s3kv.tiering.tiers.nvme import files as _disk_mod

    if os.environ.get("S3KV_FAULT_DISK_READ_DELAY_AT") == "frame":
        _real_preadv_all = _disk_mod.preadv_all

        def _slow_preadv_all(*args, **kwargs):
            _time.sleep(float(_delay))
            return _real_preadv_all(*args, **kwargs)

        _disk_mod.preadv_all = _slow_preadv_all
        _disk_mod.preadv_cached = lambda fd, buffers, offset: 0
    else:
        _real_read = _disk_mod.DiskTier.read

        def _slow_read(self, *args, **kwargs):
            _time.sleep(float(_delay))
            return _real_read(self, *args, **kwargs)

        _disk_mod.DiskTier.read = _slow_read
