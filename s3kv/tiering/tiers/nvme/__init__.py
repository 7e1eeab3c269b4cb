"""The NVMe tier: chunk files on a local disk, one directory per namespace."""
