"""Running the ``s3kv`` CLI against a seeded bucket, in-process or as a process."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from typing import Any

from s3kv.cli import main
from tests.ops.dataset import PREFIX


def store_args(s3, bucket: str) -> list[str]:
    return [
        "--bucket",
        bucket,
        "--endpoint-url",
        s3.endpoint_url,
        "--region",
        "us-east-1",
        "--prefix",
        PREFIX,
    ]


def run_json(capsys, s3, bucket: str, command: str, *args: str) -> tuple[int, Any]:
    """``s3kv COMMAND --json ...`` in this process: (exit code, parsed stdout)."""
    capsys.readouterr()
    rc = main([command, *store_args(s3, bucket), "--json", *args])
    text = capsys.readouterr().out
    return rc, (json.loads(text) if text.strip() else None)


def run_process(
    *args: str, env: dict[str, str | None] | None = None, timeout: float = 300
) -> subprocess.CompletedProcess:
    """``s3kv ARGS`` as its own process (``python -m s3kv.cli``); ``env``
    entries set to None are removed from the environment."""
    merged = {**os.environ, **(env or {})}
    return subprocess.run(
        [sys.executable, "-m", "s3kv.cli", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env={k: v for k, v in merged.items() if v is not None},
    )
