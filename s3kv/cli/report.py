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


def _grouped(row: dict[str, Any]) -> bool:
    """A namespace of several KV cache groups: its chunk keys are parts, one a group."""
    return (row["groups"] or 1) > 1


def _chunks(row: dict[str, Any]) -> str:
    if _grouped(row):
        return f"~{row['chunks_estimate']} ({row['chunks']} parts)"
    return str(row["chunks"])


def _estimate(row: dict[str, Any]) -> str:
    return "?" if row["chunks_estimate"] is None else str(row["chunks_estimate"])


def _epochs(row: dict[str, Any]) -> str:
    """A namespace's epoch objects: how many, and how far the newest is behind now."""
    if not row["epochs"]:
        return "-"
    return f"{row['epochs']} (#{row['newest_epoch']}, {out.ago(row['newest_epoch_behind_s'])} behind)"


@click.command("ls", epilog=EXIT_CODES_HELP)
@store_options
def ls_cmd(s: Settings) -> int:
    """Namespaces in the bucket: model, layout, chunks, bytes, write and access times,
    and the manifest's epoch objects (how many; the newest and how far behind now it is).
    A namespace of several KV cache groups stores a part object of each chunk per
    group: its layout names the groups, its chunks are about parts / groups."""

    async def body(store: ObjectStore) -> Inventory:
        return await scan_bucket(store, s)

    inv = run(s, body)
    now = time.time()
    rows = [report.namespace_row(info, now) for info in inv.namespaces.values()]
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
                "epochs",
            ],
            [
                [
                    r["namespace"],
                    r["model"],
                    r["layout"],
                    _chunks(r),
                    out.size(r["bytes"]),
                    out.when(r["oldest_write"]),
                    out.when(r["newest_write"]),
                    out.when(r["last_access"]),
                    _epochs(r),
                ]
                for r in rows
            ],
            right=["chunks", "bytes"],
        )
    )
    total = sum(r["bytes"] for r in rows)
    keys = sum(r["chunks"] for r in rows)
    if any(_grouped(r) for r in rows):
        whole = sum(r["chunks_estimate"] if _grouped(r) else r["chunks"] for r in rows)
        con.print(
            f"{len(rows)} namespace(s), ~{whole} chunks in {keys} chunk and part keys, {out.size(total)}"
        )
    else:
        con.print(f"{len(rows)} namespace(s), {keys} chunks, {out.size(total)}")
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
    """Chunks by namespace (with its KV cache groups), size and age histograms,
    compression ratio, and the manifest's segments, snapshots and epochs."""

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
            "chunks by namespace",
            ["namespace", "KV cache groups", "chunk keys", "objects", "bytes", "~ chunks"],
            [
                [ns, r["groups"] or "?", r["chunks"], r["objects"], out.size(r["bytes"]), _estimate(r)]
                for ns, r in st["by_namespace"].items()
            ],
            right=["KV cache groups", "chunk keys", "objects", "bytes", "~ chunks"],
        )
    )
    if any(_grouped(r) for r in st["by_namespace"].values()):
        con.print(
            "a namespace of several KV cache groups stores each chunk as one part object per group "
            "(and shard): its chunk keys are parts, about chunks x groups"
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
                _epochs(m),
                out.size(m["epoch_bytes"]),
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
                "epochs",
                "epoch bytes",
            ],
            rows,
            right=["segments", "bytes", "after snapshot", "snapshots", "epoch bytes"],
        )
    )
    chains = [(ns, c) for ns, m in st["manifest"].items() for c in m["epoch_chains"]]
    if len(chains) > len({ns for ns, _ in chains}):  # replicas of another publish interval: a chain each
        con.print(
            out.table(
                "epoch chains (one per publish interval the fleet's replicas run with)",
                ["namespace", "epoch length", "epochs", "bytes", "newest epoch", "behind"],
                [
                    [
                        ns,
                        f"{c['e_ms']} ms",
                        c["epochs"],
                        out.size(c["bytes"]),
                        c["newest_epoch"],
                        out.ago(c["behind_s"]),
                    ]
                    for ns, c in chains
                ],
                right=["epochs", "bytes", "newest epoch"],
            )
        )
    return EXIT_OK
