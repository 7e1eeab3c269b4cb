"""``s3kv ls`` and ``s3kv stats``: what the bucket holds, from a listing of it."""

from __future__ import annotations

import time
from typing import Any

import click

from s3kv.cli import output as out
from s3kv.cli.ops import run, scan_bucket
from s3kv.cli.settings import EXIT_CODES_HELP, EXIT_OK, Settings, store_options
from s3kv.ops import report
from s3kv.ops.inventory import Inventory
from s3kv.stores.base import ObjectStore


@click.command("ls", epilog=EXIT_CODES_HELP)
@store_options
def ls_cmd(s: Settings) -> int:
    """Namespaces in the bucket: model, layout, chunks, bytes, write and access times."""

    async def body(store: ObjectStore) -> Inventory:
        return await scan_bucket(store, s)

    inv = run(s, body)
    rows = [report.namespace_row(info) for info in inv.namespaces.values()]
    if s.as_json:
        out.print_json(
            {"prefix": s.config.prefix, "namespaces": rows, "foreign_objects": [m.key for m in inv.foreign]}
        )
        return EXIT_OK
    con = out.stdout()
    con.print(
        out.table(
            f"s3://{s.config.bucket}/{s.config.prefix}",
            [
                "namespace",
                "model",
                "layout",
                "chunks",
                "bytes",
                "oldest write",
                "newest write",
                "last access",
            ],
            [
                [
                    r["namespace"],
                    r["model"],
                    r["layout"],
                    r["chunks"],
                    out.size(r["bytes"]),
                    out.when(r["oldest_write"]),
                    out.when(r["newest_write"]),
                    out.when(r["last_access"]),
                ]
                for r in rows
            ],
            right=["chunks", "bytes"],
        )
    )
    total = sum(r["bytes"] for r in rows)
    con.print(f"{len(rows)} namespace(s), {sum(r['chunks'] for r in rows)} chunks, {out.size(total)}")
    if inv.foreign:
        con.print(f"{len(inv.foreign)} object(s) under the prefix are not s3kv's (`s3kv verify` lists them)")
    return EXIT_OK


@click.command("stats", epilog=EXIT_CODES_HELP)
@store_options
@click.option(
    "--namespace",
    "namespaces",
    multiple=True,
    metavar="NS",
    help="Only this namespace (id or unique prefix); repeatable.",
)
@click.option(
    "--sample",
    type=click.IntRange(0),
    default=64,
    show_default=True,
    help="Chunk headers read to estimate the compression ratio.",
)
def stats_cmd(s: Settings, namespaces: tuple[str, ...], sample: int) -> int:
    """Size and age histograms, compression ratio, and the manifest's segments and snapshots."""

    async def body(store: ObjectStore) -> dict[str, Any]:
        inv = await scan_bucket(store, s, namespaces)
        return await report.stats(store, inv, time.time(), sample=sample)

    st = run(s, body)
    if s.as_json:
        out.print_json(st)
        return EXIT_OK
    con = out.stdout()
    con.print(
        f"{st['namespaces']} namespace(s), {st['chunks']} chunks in {st['objects']} objects, {out.size(st['bytes'])}"
    )
    con.print(
        out.table(
            "object sizes",
            ["size", "objects", "bytes"],
            [[r["range"], r["objects"], out.size(r["bytes"])] for r in st["size_histogram"]],
            right=["objects", "bytes"],
        )
    )
    for key, title in (
        ("age_histogram", "chunk age (since written)"),
        ("idle_histogram", "idle (since last use)"),
    ):
        con.print(
            out.table(
                title,
                ["age", "chunks", "bytes"],
                [[r["range"], r["chunks"], out.size(r["bytes"])] for r in st[key]],
                right=["chunks", "bytes"],
            )
        )
    c = st["compression"]
    ratio = f"{c['ratio']:.2f}x" if c["ratio"] else "-"
    con.print(
        f"compression: {ratio} (raw {out.size(c['raw_bytes'])} / stored {out.size(c['stored_bytes'])}, "
        f"{c['sampled']} headers sampled; codecs {c['codecs'] or '-'})"
    )
    rows = []
    for ns, m in st["manifest"].items():
        newest = m["snapshots"][-1] if m["snapshots"] else None
        rows.append(
            [
                ns,
                m["segments"],
                out.size(m["segment_bytes"]),
                m["segments_after_snapshot"],
                len(m["snapshots"]),
                f"{newest.get('keys', '?')} keys, {out.ago(newest['age_s'])} old" if newest else "-",
                f"{m['access_records']} in {m['access_hours']} h",
            ]
        )
    con.print(
        out.table(
            "manifest",
            [
                "namespace",
                "segments",
                "bytes",
                "after snapshot",
                "snapshots",
                "newest snapshot",
                "access records",
            ],
            rows,
            right=["segments", "bytes", "after snapshot", "snapshots"],
        )
    )
    return EXIT_OK
