"""A throwaway S3 server on loopback for the demo, the tests and the benchmarks.

:class:`LoopbackS3` runs moto's S3 server (``moto[server]``, a test
dependency) in a child process bound to 127.0.0.1: objects live in that
process's memory and go with it. It checks no credentials unless told to by
moto's own environment variables, which the child inherits. It is not a
store for production data.
"""

from __future__ import annotations

import socket
import subprocess
import sys
import time
from typing import Any

START_TIMEOUT_S = 120.0
"""How long :meth:`LoopbackS3.start` waits for the server to accept
connections; a server that exits is reported at once."""
STOP_TIMEOUT_S = 10.0
"""How long :meth:`LoopbackS3.stop` waits after SIGTERM before SIGKILL."""


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class LoopbackS3:
    """moto's S3 server in a child process on ``127.0.0.1:port`` (a free
    port by default). :meth:`start` returns once it accepts connections;
    :meth:`stop` ends it, and a later :meth:`start` begins an empty one on
    the same port. Also a context manager (start, then stop)."""

    def __init__(self, port: int | None = None, region: str = "us-east-1") -> None:
        self.port = free_port() if port is None else port
        self.region = region
        self.proc: subprocess.Popen | None = None
        """The server process while it runs (tests stop or pause it by pid)."""

    @property
    def endpoint_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self, timeout_s: float = START_TIMEOUT_S) -> LoopbackS3:
        """Start the server (environment: this process's) and wait until it
        accepts connections; RuntimeError if it exits or ``timeout_s`` passes."""
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(self.port)],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                socket.create_connection(("127.0.0.1", self.port), timeout=0.5).close()
                return self
            except OSError:
                if self.proc.poll() is not None:
                    self.proc = None
                    raise RuntimeError(
                        "the loopback S3 server exited at start-up (is moto[server] installed?)"
                    ) from None
                if time.monotonic() > deadline:
                    self.stop()
                    raise RuntimeError(
                        f"the loopback S3 server did not accept connections within {timeout_s:.0f} s"
                    ) from None
                time.sleep(0.1)

    def stop(self) -> None:
        """End the server (SIGTERM, then SIGKILL); nothing if it is not running."""
        if self.proc is None:
            return
        self.proc.terminate()
        try:
            self.proc.wait(STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self.proc = None

    def client(self) -> Any:
        """A boto3 S3 client for this server (credentials from the environment)."""
        import boto3

        return boto3.client("s3", endpoint_url=self.endpoint_url, region_name=self.region)

    def create_bucket(self, name: str) -> str:
        """Create bucket ``name`` and return it."""
        self.client().create_bucket(Bucket=name)
        return name

    def __enter__(self) -> LoopbackS3:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
