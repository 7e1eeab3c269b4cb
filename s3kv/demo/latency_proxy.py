"""A loopback HTTP proxy in front of an S3 server that holds back the first
byte of every object GET by a fixed delay, as a distant bucket would: for the
tests and benchmarks of the load policy (a short prefix on a slow S3 is
computed, a long one loaded).

Everything else (PUTs, listings, HEADs, deletes) passes straight through,
keep-alive connections included. The delay is :attr:`LatencyProxy.delay_s`
and may be changed while it runs. Path-style addressing only (what s3kv
uses with ``endpoint_url``); request signatures go through untouched, so
the server behind must not check them against its own host name (moto
does not). Not for production traffic.
"""

from __future__ import annotations

import http.client
import http.server
import threading
import time
import urllib.parse
from typing import Any

from s3kv.demo.loopback_s3 import free_port

_HOP_BY_HOP = {
    "connection",
    "keep-alive",
    "proxy-authenticate",
    "proxy-authorization",
    "te",
    "trailers",
    "transfer-encoding",
    "upgrade",
}


class LatencyProxy:
    """``http://127.0.0.1:port`` forwarding to ``upstream`` (``http://host:port``)."""

    def __init__(self, upstream: str, delay_s: float = 0.0, port: int | None = None) -> None:
        parsed = urllib.parse.urlsplit(upstream)
        if parsed.scheme != "http" or parsed.hostname is None or parsed.port is None:
            raise ValueError(f"upstream must be http://host:port, got {upstream!r}")
        self.upstream = (parsed.hostname, parsed.port)
        self.delay_s = delay_s
        self.port = free_port() if port is None else port
        self.delayed = 0
        """Object GETs held back so far."""
        self._server: http.server.ThreadingHTTPServer | None = None
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()

    @property
    def endpoint_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> LatencyProxy:
        proxy = self

        class Handler(_Forward):
            owner = proxy

        self._server = http.server.ThreadingHTTPServer(("127.0.0.1", self.port), Handler)
        self._server.daemon_threads = True
        self._thread = threading.Thread(target=self._server.serve_forever, name="latency-proxy", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None

    def __enter__(self) -> LatencyProxy:
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.stop()

    def _hold(self, method: str, path: str) -> None:
        """Hold an object GET (``/bucket/key``, not a listing) back."""
        if method != "GET":
            return
        parts = urllib.parse.urlsplit(path)
        segments = [s for s in parts.path.split("/") if s]
        if len(segments) < 2 or "list-type" in parts.query:
            return
        delay = self.delay_s
        if delay > 0:
            with self._lock:
                self.delayed += 1
            time.sleep(delay)


class _Forward(http.server.BaseHTTPRequestHandler):
    owner: LatencyProxy
    protocol_version = "HTTP/1.1"

    def log_message(self, format: str, *args: Any) -> None:  # quiet
        pass

    def _body(self) -> bytes:
        if self.headers.get("Transfer-Encoding", "").lower() == "chunked":
            out = bytearray()
            while True:
                size = int(self.rfile.readline().split(b";")[0].strip(), 16)
                if size == 0:
                    while self.rfile.readline() not in (b"\r\n", b"\n", b""):
                        pass  # trailers
                    return bytes(out)
                out += self.rfile.read(size)
                self.rfile.readline()
        n = int(self.headers.get("Content-Length") or 0)
        return self.rfile.read(n) if n else b""

    def _upstream(self) -> http.client.HTTPConnection:
        conn = getattr(self, "_conn", None)
        if conn is None:
            conn = self._conn = http.client.HTTPConnection(*self.owner.upstream, timeout=300)
        return conn

    def _forward(self) -> None:
        body = self._body()
        self.owner._hold(self.command, self.path)
        headers = {k: v for k, v in self.headers.items() if k.lower() not in _HOP_BY_HOP}
        if body or self.command in ("PUT", "POST"):
            headers["Content-Length"] = str(len(body))
        for attempt in (0, 1):  # a kept-alive upstream connection the server closed: once more
            conn = self._upstream()
            try:
                conn.request(self.command, self.path, body=body, headers=headers)
                resp = conn.getresponse()
                data = resp.read()
                break
            except (http.client.HTTPException, OSError):
                conn.close()
                self._conn = None
                if attempt:
                    raise
        self.send_response_only(resp.status, resp.reason)
        for k, v in resp.getheaders():
            if k.lower() not in _HOP_BY_HOP and k.lower() != "content-length":
                self.send_header(k, v)
        length = resp.getheader("Content-Length") if self.command == "HEAD" else str(len(data))
        if length is not None:
            self.send_header("Content-Length", length)
        self.end_headers()
        if self.command != "HEAD" and data:
            self.wfile.write(data)

    do_GET = do_PUT = do_POST = do_DELETE = do_HEAD = _forward
