"""A loopback HTTP proxy in front of an S3 server that holds back the first
byte of every object GET by a fixed delay, as a distant bucket would: for the
tests and benchmarks of the load policy (a short prefix on a slow S3 is
computed, a long one loaded).

Everything else (PUTs, listings, HEADs, deletes) passes straight through,
keep-alive connections included. With ``directory=True`` the bucket behind
answers listings as an S3 Express One Zone directory bucket does: each
page's objects in a random order, StartAfter ignored (and counted in
:attr:`LatencyProxy.start_after_ignored`), and a 400 to a prefix that does
not end with '/'; it also answers CreateSession (``GET /bucket?session``)
with session credentials that expire in five minutes, counting them
(:attr:`LatencyProxy.sessions`) and the requests signed with one. For the
tests of s3kv on directory buckets. The delay is :attr:`LatencyProxy.delay_s`
and may be changed while it runs. Path-style addressing only (what s3kv
uses with ``endpoint_url``); request signatures go through untouched, so
the server behind must not check them against its own host name (moto
does not). It counts the requests in flight through it
(:attr:`LatencyProxy.peak_in_flight`: the test of ``max_connections``).
With ``bytes_per_s`` it also caps the link: the bodies of all requests
share that many bytes a second each way (a full-duplex link: responses
paced as they are sent, request bodies as they are read, so the client's
TCP window fills), as a distant or throttled bucket's link would; it may
be changed while it runs (:attr:`LatencyProxy.bytes_per_s`, None: uncapped).
Not for production traffic.
"""

from __future__ import annotations

import http.client
import http.server
import random
import re
import threading
import time
import urllib.parse
from typing import Any

from s3kv.testing.loopback_s3 import free_port

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

    def __init__(
        self,
        upstream: str,
        delay_s: float = 0.0,
        port: int | None = None,
        *,
        directory: bool = False,
        bytes_per_s: float | None = None,
    ) -> None:
        parsed = urllib.parse.urlsplit(upstream)
        if parsed.scheme != "http" or parsed.hostname is None or parsed.port is None:
            raise ValueError(f"upstream must be http://host:port, got {upstream!r}")
        self.upstream = (parsed.hostname, parsed.port)
        self.delay_s = delay_s
        self.bytes_per_s = bytes_per_s
        """The link's cap each way, bytes a second shared by every request (None: uncapped)."""
        self._links = {"down": _Pacer(), "up": _Pacer()}
        self.port = free_port() if port is None else port
        self.delayed = 0
        """Object GETs held back so far."""
        self.directory = directory
        self.listings = 0
        """Listings answered (``directory``)."""
        self.shuffled = 0
        """Listings whose objects came in another order than the server's (``directory``)."""
        self.start_after_ignored = 0
        """Listings that asked for StartAfter, answered without it (``directory``)."""
        self.prefixes_refused: list[str] = []
        """Listing prefixes refused for not ending with '/' (``directory``)."""
        self.sessions = 0
        """CreateSession requests answered (``directory``)."""
        self.in_flight = 0
        """Requests received and not yet answered."""
        self.peak_in_flight = 0
        """The most requests in flight at once so far."""
        self.session_signed = 0
        """Requests that carried a session token of ours (``directory``)."""
        self._tokens: set[str] = set()
        self._random = random.Random(0)
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

    def pace(self, direction: str, nbytes: int) -> None:
        """Hold the caller until ``nbytes`` more fit the link ``direction``
        ("down": to the client, "up": from it) at :attr:`bytes_per_s`."""
        rate = self.bytes_per_s
        if rate:
            self._links[direction].wait(nbytes, rate)

    def _count(self, n: int) -> None:
        with self._lock:
            self.in_flight += n
            self.peak_in_flight = max(self.peak_in_flight, self.in_flight)

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

    def is_listing(self, method: str, path: str) -> bool:
        """A ListObjectsV2 that this proxy answers as a directory bucket?"""
        return self.directory and method == "GET" and "list-type" in urllib.parse.urlsplit(path).query

    def _listing(self, path: str) -> tuple[str, bytes | None]:
        """(the path to forward, or a refusal's body) of a listing
        (:meth:`is_listing`), as a directory bucket takes it: StartAfter
        dropped, a prefix not ending with '/' refused."""
        parts = urllib.parse.urlsplit(path)
        query = urllib.parse.parse_qsl(parts.query, keep_blank_values=True)
        with self._lock:
            self.listings += 1
            prefix = dict(query).get("prefix", "")
            if prefix and not prefix.endswith("/"):
                self.prefixes_refused.append(prefix)
                return path, (
                    b"<?xml version='1.0' encoding='UTF-8'?><Error><Code>InvalidArgument</Code>"
                    b"<Message>Prefixes must end in a delimiter (/) on a directory bucket</Message></Error>"
                )
            if any(k == "start-after" for k, _ in query):
                self.start_after_ignored += 1
        kept = [(k, v) for k, v in query if k != "start-after"]
        return urllib.parse.urlunsplit(parts._replace(query=urllib.parse.urlencode(kept))), None

    def _session(self, method: str, path: str, headers: Any) -> bytes | None:
        """A CreateSession's answer (``directory``), else None; counts the
        requests signed with a session this proxy handed out."""
        if not self.directory:
            return None
        token = headers.get("x-amz-s3session-token")
        parts = urllib.parse.urlsplit(path)
        create = method == "GET" and "session" in urllib.parse.parse_qs(parts.query, keep_blank_values=True)
        with self._lock:
            if token is not None and token in self._tokens:
                self.session_signed += 1
            if not create:
                return None
            self.sessions += 1
            token = f"s3kv-proxy-session-{self.sessions}"
            self._tokens.add(token)
        expires = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(time.time() + SESSION_S))
        return (
            '<?xml version="1.0" encoding="UTF-8"?>'
            '<CreateSessionResult xmlns="http://s3.amazonaws.com/doc/2006-03-01/"><Credentials>'
            f"<SessionToken>{token}</SessionToken><SecretAccessKey>proxy-session-secret</SecretAccessKey>"
            f"<AccessKeyId>PROXYSESSION{self.sessions:08d}</AccessKeyId><Expiration>{expires}</Expiration>"
            "</Credentials></CreateSessionResult>"
        ).encode()

    def _shuffle(self, data: bytes) -> bytes:
        """A listing page with its objects in a random order."""
        items = _CONTENTS.findall(data)
        if len(items) < 2:
            return data
        with self._lock:
            order = items[:]
            self._random.shuffle(order)
            if order != items:
                self.shuffled += 1
        start, end = data.index(items[0]), data.rindex(items[-1]) + len(items[-1])
        between = _CONTENTS.sub(b"", data[start:end])
        return data[:start] + b"".join(order) + between + data[end:]


class _Pacer:
    """One direction of a capped link: bytes pass in the order asked, each
    slice when the ones before it have had their time (a token bucket with
    no burst)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._free_at = 0.0

    def wait(self, nbytes: int, rate: float) -> None:
        with self._lock:
            now = time.monotonic()
            self._free_at = max(self._free_at, now) + nbytes / rate
            until = self._free_at
        delay = until - time.monotonic()
        if delay > 0:
            time.sleep(delay)


SLICE_BYTES = 64 << 10
"""Bytes a capped link passes at a time."""

_CONTENTS = re.compile(rb"<Contents>.*?</Contents>", re.S)
SESSION_S = 300
"""How long a CreateSession's credentials last (S3 Express: five minutes)."""


class _Forward(http.server.BaseHTTPRequestHandler):
    owner: LatencyProxy
    protocol_version = "HTTP/1.1"

    def log_message(self, format: str, *args: Any) -> None:  # quiet
        pass

    def _request(self) -> None:
        """One request, counted in flight until its answer begins (before
        the client can have it and send the next: no count overlaps)."""
        self._open = True
        self.owner._count(1)
        try:
            self._forward()
        finally:
            self._answered()

    def _answered(self) -> None:
        if getattr(self, "_open", False):
            self._open = False
            self.owner._count(-1)

    def send_response_only(self, code: int, message: str | None = None) -> None:
        self._answered()
        super().send_response_only(code, message)

    def _body(self) -> bytes:
        if self.headers.get("Transfer-Encoding", "").lower() == "chunked":
            out = bytearray()
            while True:
                size = int(self.rfile.readline().split(b";")[0].strip(), 16)
                if size == 0:
                    while self.rfile.readline() not in (b"\r\n", b"\n", b""):
                        pass  # trailers
                    return bytes(out)
                out += self._read(size)
                self.rfile.readline()
        n = int(self.headers.get("Content-Length") or 0)
        return self._read(n) if n else b""

    def _read(self, n: int) -> bytes:
        """``n`` bytes of the request body, at the link's pace."""
        if not self.owner.bytes_per_s:
            return self.rfile.read(n)
        out = bytearray()
        while len(out) < n:
            part = self.rfile.read(min(SLICE_BYTES, n - len(out)))
            if not part:
                break
            self.owner.pace("up", len(part))
            out += part
        return bytes(out)

    def _upstream(self) -> http.client.HTTPConnection:
        conn = getattr(self, "_conn", None)
        if conn is None:
            conn = self._conn = http.client.HTTPConnection(*self.owner.upstream, timeout=300)
        return conn

    def _forward(self) -> None:
        body = self._body()
        self.owner._hold(self.command, self.path)
        session = self.owner._session(self.command, self.path, self.headers)
        if session is not None:
            self._answer(200, "OK", session)
            return
        listing = self.owner.is_listing(self.command, self.path)
        path, refused = self.owner._listing(self.path) if listing else (self.path, None)
        if refused is not None:
            self._answer(400, "Bad Request", refused)
            return
        headers = {k: v for k, v in self.headers.items() if k.lower() not in _HOP_BY_HOP}
        if body or self.command in ("PUT", "POST"):
            headers["Content-Length"] = str(len(body))
        for attempt in (0, 1):  # a kept-alive upstream connection the server closed: once more
            conn = self._upstream()
            try:
                conn.request(self.command, path, body=body, headers=headers)
                resp = conn.getresponse()
                data = resp.read()
                break
            except (http.client.HTTPException, OSError):
                conn.close()
                self._conn = None
                if attempt:
                    raise
        if listing and resp.status == 200:
            data = self.owner._shuffle(data)
        self.send_response_only(resp.status, resp.reason)
        for k, v in resp.getheaders():
            if k.lower() not in _HOP_BY_HOP and k.lower() != "content-length":
                self.send_header(k, v)
        length = resp.getheader("Content-Length") if self.command == "HEAD" else str(len(data))
        if length is not None:
            self.send_header("Content-Length", length)
        self.end_headers()
        if self.command != "HEAD" and data:
            if not self.owner.bytes_per_s:
                self.wfile.write(data)
                return
            view = memoryview(data)
            for i in range(0, len(view), SLICE_BYTES):
                self.owner.pace("down", len(view[i : i + SLICE_BYTES]))
                self.wfile.write(view[i : i + SLICE_BYTES])

    def _answer(self, status: int, reason: str, body: bytes) -> None:
        """An answer of the proxy's own (not the server's)."""
        self.send_response_only(status, reason)
        self.send_header("Content-Type", "application/xml")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    do_GET = do_PUT = do_POST = do_DELETE = do_HEAD = _request
