"""S3 clients side by side: aiobotocore (today's), obstore (arrow-rs
object_store) and awscrt (the AWS CRT), on one server, the same bytes, one run.

For each object size (2, 8, 32 MiB) and each operation (PUT, then GET of
what was put), every client moves the same set of objects with the same
concurrency; the clients take turns within each repeat, so the machine's
noise falls on all of them alike. Figures: MB/s (wall), the client's CPU
seconds per GB (this process: every thread, the native clients' own
included) and the server's (moto, or radosgw with ``--server radosgw``),
which on loopback shares the cores and bounds the wall figures.

    .venv/bin/python -m benchmarks.s3_clients [--quick] [--server moto|radosgw]

awscrt's GET hands each body piece to a Python callback (there is no
buffer to read into): that copy is part of what it costs a Python caller.
"""

from __future__ import annotations

import asyncio
import io
import os
import sys
import time
from pathlib import Path
from typing import Any

from benchmarks.common import Bar, Result, main_for, median, server_arg, start_server, verdict
from s3kv.config import DEFAULTS

NAME = "s3_clients"
TITLE = "S3 clients: aiobotocore vs obstore vs awscrt"
GOAL = (
    "the client s3kv ships is the one with the least CPU per GB among those within 0.9x of the best MB/s "
    "in every case"
)
MiB = 1 << 20
CONCURRENCY = 8
REGION = "us-east-1"


def _cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of process ``pid`` (and its reaped children)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return sum(int(x) for x in fields[11:15]) / os.sysconf("SC_CLK_TCK")


class Aiobotocore:
    name = "aiobotocore"

    def __init__(self, endpoint: str, bucket: str, creds: dict[str, str]) -> None:
        self.endpoint, self.bucket, self.creds = endpoint, bucket, creds

    async def open(self) -> None:
        from aiobotocore.config import AioConfig
        from aiobotocore.session import get_session

        config = AioConfig(
            region_name=REGION,
            max_pool_connections=CONCURRENCY * 2,
            retries={"mode": "standard", "max_attempts": 3},
            s3={"addressing_style": "path"},
        )
        self._ctx = get_session().create_client(
            "s3",
            endpoint_url=self.endpoint,
            config=config,
            aws_access_key_id=self.creds["AWS_ACCESS_KEY_ID"],
            aws_secret_access_key=self.creds["AWS_SECRET_ACCESS_KEY"],
        )
        self.client = await self._ctx.__aenter__()

    async def put(self, key: str, data: bytes) -> None:
        await self.client.put_object(Bucket=self.bucket, Key=key, Body=data)

    async def get(self, key: str) -> int:
        resp = await self.client.get_object(Bucket=self.bucket, Key=key)
        async with resp["Body"] as body:
            return len(await body.read())

    async def close(self) -> None:
        await self._ctx.__aexit__(None, None, None)


class Obstore:
    name = "obstore"

    def __init__(self, endpoint: str, bucket: str, creds: dict[str, str]) -> None:
        from obstore.store import S3Store

        self.store = S3Store(
            bucket,
            endpoint=endpoint,
            region=REGION,
            access_key_id=creds["AWS_ACCESS_KEY_ID"],
            secret_access_key=creds["AWS_SECRET_ACCESS_KEY"],
            virtual_hosted_style_request=False,
            client_options={"allow_http": True, "pool_max_idle_per_host": str(CONCURRENCY * 2)},
        )

    async def open(self) -> None:
        pass

    async def put(self, key: str, data: bytes) -> None:
        import obstore

        await obstore.put_async(self.store, key, data, use_multipart=False)

    async def get(self, key: str) -> int:
        import obstore

        result = await obstore.get_async(self.store, key)
        return len(memoryview(await result.bytes_async()))

    async def close(self) -> None:
        pass


class Awscrt:
    name = "awscrt"

    def __init__(self, endpoint: str, bucket: str, creds: dict[str, str]) -> None:
        from awscrt.auth import AwsCredentialsProvider
        from awscrt.io import ClientBootstrap, DefaultHostResolver, EventLoopGroup
        from awscrt.s3 import S3Client, S3RequestTlsMode

        self.host = endpoint.split("://", 1)[1].rstrip("/")
        self.bucket = bucket
        loops = EventLoopGroup()
        bootstrap = ClientBootstrap(loops, DefaultHostResolver(loops))
        provider = AwsCredentialsProvider.new_static(
            creds["AWS_ACCESS_KEY_ID"], creds["AWS_SECRET_ACCESS_KEY"]
        )
        self.client = S3Client(
            bootstrap=bootstrap,
            region=REGION,
            tls_mode=S3RequestTlsMode.DISABLED,
            credential_provider=provider,
            part_size=8 * MiB,
            multipart_upload_threshold=64 * MiB,  # one PUT per object, as the others send
            throughput_target_gbps=10.0,
        )

    async def open(self) -> None:
        pass

    def _request(self, method: str, key: str, headers: list[tuple[str, str]], body: Any = None) -> Any:
        from awscrt.http import HttpHeaders, HttpRequest

        return HttpRequest(
            method, f"/{self.bucket}/{key}", HttpHeaders([("Host", self.host), *headers]), body_stream=body
        )

    async def _run(self, kind: Any, request: Any, on_body: Any = None) -> None:
        loop = asyncio.get_running_loop()
        done: asyncio.Future[None] = loop.create_future()

        def on_done(error: BaseException | None = None, status_code: int | None = None, **_: Any) -> None:
            def finish() -> None:
                if error is not None:
                    done.set_exception(error)
                elif status_code is not None and status_code >= 300:
                    done.set_exception(RuntimeError(f"HTTP {status_code}"))
                else:
                    done.set_result(None)

            loop.call_soon_threadsafe(finish)

        self.client.make_request(type=kind, request=request, on_done=on_done, on_body=on_body)
        await done

    async def put(self, key: str, data: bytes) -> None:
        from awscrt.s3 import S3RequestType

        request = self._request("PUT", key, [("Content-Length", str(len(data)))], io.BytesIO(data))
        await self._run(S3RequestType.PUT_OBJECT, request)

    async def get(self, key: str) -> int:
        from awscrt.s3 import S3RequestType

        got = bytearray()

        def on_body(chunk: Any, offset: int, **_: Any) -> None:
            got[offset : offset + len(chunk)] = chunk

        await self._run(S3RequestType.GET_OBJECT, self._request("GET", key, []), on_body)
        return len(got)

    async def close(self) -> None:
        pass


CLIENTS = (Aiobotocore, Obstore, Awscrt)


async def _batch(client: Any, op: str, keys: list[str], data: bytes) -> None:
    sem = asyncio.Semaphore(CONCURRENCY)

    async def one(key: str) -> None:
        async with sem:
            if op == "PUT":
                await client.put(key, data)
            else:
                n = await client.get(key)
                if n != len(data):
                    raise RuntimeError(f"{client.name} GET {key}: {n} bytes, expected {len(data)}")

    await asyncio.gather(*(one(k) for k in keys))


def run(work: Path, quick: bool, server_kind: str = "moto") -> Result:
    import boto3

    sizes = (2, 8, 32)
    total = (64 if quick else 128) * MiB
    repeats = 2 if quick else 3
    server, creds, pids = start_server(server_kind, work)
    rows: list[list[Any]] = []
    bars: list[Bar] = []
    summary: dict[tuple[str, str], dict[str, tuple[float, float]]] = {}
    try:
        admin = boto3.client(
            "s3",
            endpoint_url=server.endpoint_url,
            region_name=REGION,
            aws_access_key_id=creds["AWS_ACCESS_KEY_ID"],
            aws_secret_access_key=creds["AWS_SECRET_ACCESS_KEY"],
        )
        bucket = "s3-clients-bench"
        admin.create_bucket(Bucket=bucket)

        async def measure() -> None:
            clients = [cls(server.endpoint_url, bucket, creds) for cls in CLIENTS]
            for c in clients:
                await c.open()
            try:
                for size_mib in sizes:
                    data = os.urandom(size_mib * MiB)
                    n = max(2, total // len(data))
                    for op in ("PUT", "GET"):
                        wall: dict[str, list[float]] = {c.name: [] for c in clients}
                        cpu: dict[str, list[float]] = {c.name: [] for c in clients}
                        srv: dict[str, list[float]] = {c.name: [] for c in clients}
                        for rep in range(repeats):
                            order = clients[rep % len(clients) :] + clients[: rep % len(clients)]
                            for c in order:
                                keys = [f"{c.name}/{size_mib}/{i}" for i in range(n)]
                                if op == "GET" and rep == 0:
                                    pass  # the PUTs of this size left them there
                                s0 = sum(_cpu_seconds(p) for p in pids)
                                t0, c0 = time.perf_counter(), time.process_time()
                                await _batch(c, op, keys, data)
                                wall[c.name].append(time.perf_counter() - t0)
                                cpu[c.name].append(time.process_time() - c0)
                                srv[c.name].append(sum(_cpu_seconds(p) for p in pids) - s0)
                        gb = n * len(data) / 1e9
                        for c in clients:
                            mbps = n * len(data) / 1e6 / median(wall[c.name])
                            cpu_gb = median(cpu[c.name]) / gb
                            srv_gb = median(srv[c.name]) / gb
                            rows.append(
                                [size_mib, op, c.name, round(mbps), round(cpu_gb, 2), round(srv_gb, 2)]
                            )
                            summary.setdefault((op, c.name), {})[str(size_mib)] = (mbps, cpu_gb)
                            if size_mib == 8:
                                bars.append(Bar(f"{op} {c.name}", round(cpu_gb, 2)))
                        print(f"{size_mib} MiB {op}: done", file=sys.stderr, flush=True)
            finally:
                for c in clients:
                    await c.close()

        asyncio.run(measure())
    finally:
        server.stop()

    # The choice: per client, its CPU and speed over every size and both ops
    # relative to the best client of each case.
    names = [c.name for c in CLIENTS]
    score: dict[str, list[float]] = {n: [] for n in names}
    speed: dict[str, list[float]] = {n: [] for n in names}
    for size_mib in sizes:
        for op in ("PUT", "GET"):
            case = {n: summary[(op, n)][str(size_mib)] for n in names}
            best = max(v[0] for v in case.values())
            least = min(v[1] for v in case.values())
            for n, (mbps, cpu_gb) in case.items():
                speed[n].append(mbps / best)
                score[n].append(cpu_gb / least)
    fair = [n for n in names if min(speed[n]) >= 0.9]
    chosen = min(fair, key=lambda n: median(score[n])) if fair else None
    shipped = DEFAULTS.s3_client
    per_op = {
        (op, n): min(
            summary[(op, n)][str(m)][0] / max(summary[(op, c)][str(m)][0] for c in names) for m in sizes
        )
        for op in ("GET", "PUT")
        for n in names
    }
    if chosen is None:
        outcome = (
            "no client is within 0.9x of the best MB/s in every case ("
            + ", ".join(f"{n} {min(speed[n]):.2f}x" for n in names)
            + ")"
        )
    else:
        outcome = f"the rule picks {chosen}"
    notes = [
        f"Server: {server_kind} on loopback; {CONCURRENCY} requests at a time; "
        f"{total // MiB} MiB per case; median of {repeats} repeats; clients take turns within each repeat.",
        "Client CPU is this process's (all threads: the native clients work on their own threads); "
        "server CPU is the server's processes', which share this machine's cores.",
        "Relative to the best client of each case (min over cases of MB/s ratio; median of CPU ratio): "
        + "; ".join(f"{n} {min(speed[n]):.2f}x speed, {median(score[n]):.2f}x CPU" for n in names),
        "Worst MB/s relative to the best client, by operation: "
        + "; ".join(
            f"{op} " + ", ".join(f"{n} {per_op[(op, n)]:.2f}x" for n in names) for op in ("GET", "PUT")
        ),
        f"The rule (the least CPU per GB among clients within 0.9x of the best MB/s in every case): {outcome}. "
        f"s3kv ships {shipped} (s3_client's default) for chunk GETs and PUTs.",
    ]
    met = chosen == shipped
    why = f"{outcome}; s3kv ships {shipped}"
    return Result(
        name=NAME,
        title=f"{TITLE} ({server_kind})",
        goal=GOAL,
        columns=["MiB", "op", "client", "MB/s", "client CPU s/GB", "server CPU s/GB"],
        rows=rows,
        verdict=verdict(met, why) if not met else f"met: the rule picks {shipped}, which s3kv ships",
        notes=notes,
        bars=bars,
        ylabel="client CPU s/GB (8 MiB objects)",
    )


def _main() -> int:
    server = "moto"
    server = server_arg()
    return main_for(lambda work, quick: run(work, quick, server), "s3kv-bench-s3-clients")


if __name__ == "__main__":
    sys.exit(_main())
