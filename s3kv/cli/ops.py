"""``s3kv ls``, ``stats``, ``inspect``, ``verify`` and ``gc``: looking after a shared bucket."""

from __future__ import annotations

import asyncio
import re
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any, TypeVar

import click

from s3kv.auth import FleetKeys, load_keys
from s3kv.cli import output as out
from s3kv.cli.settings import (
    DURATION,
    EXIT_CODES_HELP,
    EXIT_OK,
    EXIT_PARTIAL,
    EXIT_PROBLEMS,
    SIZE,
    Settings,
    store_options,
)
from s3kv.errors import ConfigError, NotFound, S3KVError, StorageProblem
from s3kv.keys import namespace_prefix
from s3kv.ops import gc as gcmod
from s3kv.ops import report
from s3kv.ops.inventory import Inventory, list_namespaces, scan
from s3kv.ops.lock import held
from s3kv.ops.verify import delete_corrupt as delete_corrupt_objects
from s3kv.ops.verify import inspect_object, verify
from s3kv.stores.base import ObjectStore
from s3kv.stores.factory import make_store
from s3kv.stores.memory import MemoryStore

T = TypeVar("T")


def run(settings: Settings, body: Callable[[ObjectStore], Awaitable[T]]) -> T:
    """Open the configured bucket (checking credentials and access first), run ``body``."""

    async def main() -> T:
        store = make_store(settings.config)
        try:
            try:
                await store.check_access()
            except (ConfigError, S3KVError) as e:
                raise StorageProblem(f"s3://{settings.config.bucket}: {e}") from e
            return await body(store)
        finally:
            await store.close()

    return asyncio.run(main())


async def _scan(
    store: ObjectStore, s: Settings, namespaces: tuple[str, ...] = (), read_access: bool = True
) -> Inventory:
    with out.bar(s.progress, "listing") as b:
        return await scan(
            store,
            s.config.prefix,
            namespaces=namespaces or None,
            concurrency=s.concurrency,
            progress=b.advance,
            read_access=read_access,
            keys=s.keys,
            manifest_max_bytes=s.config.manifest_max_bytes,
        )


# -- ls ----------------------------------------------------------------------------


@click.command("ls", epilog=EXIT_CODES_HELP)
@store_options
def ls_cmd(s: Settings) -> int:
    """Namespaces in the bucket: model, layout, chunks, bytes, write and access times."""

    async def body(store: ObjectStore) -> Inventory:
        return await _scan(store, s)

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


# -- stats -------------------------------------------------------------------------


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
        inv = await _scan(store, s, namespaces)
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


# -- inspect -----------------------------------------------------------------------

_KEY_RE = re.compile(r"^(?P<key>[0-9a-f]{32})(?:\.r(?P<rank>\d+))?$")


async def _find_chunk(store: ObjectStore, prefix: str, key: str, rank: str | None) -> list[str]:
    namespaces, _ = await list_namespaces(store, prefix)
    names: list[str] = []
    for ns in namespaces:
        shard = f"{namespace_prefix(prefix, ns)}{key[:2]}/"
        base = f"{shard}{key}.r" + (rank or "")
        # A directory bucket lists only prefixes that end with '/'.
        names += [n for n in await store.list_keys(shard if store.directory else base) if n.startswith(base)]
    return [n for n in names if rank is None or n.endswith(f".r{rank}")]


async def _inspect(store: ObjectStore, name: str, check: bool, keys: FleetKeys | None) -> dict[str, Any]:
    """inspect_object, with a damaged object reported as its problem."""
    from s3kv.errors import CorruptChunk, CorruptManifest

    try:
        return await inspect_object(store, name, check_frames=check, keys=keys)
    except NotFound as e:
        raise ValueError(f"no object {name!r} in the bucket") from e
    except (CorruptChunk, CorruptManifest) as e:
        return {"object": name, "type": "unreadable", "problems": [str(e)]}


@click.command("inspect", epilog=EXIT_CODES_HELP)
@store_options
@click.argument("target", metavar="KEY|OBJECT")
@click.option("--check", is_flag=True, help="Also read and decode every frame (MACs too, with the secret).")
@click.option(
    "--frames", is_flag=True, help="Show the frame table (offset, stored, raw, checksum per layer)."
)
def inspect_cmd(s: Settings, target: str, check: bool, frames: bool) -> int:
    """Decode and show one object's header: a chunk key (32 hex digits, optionally
    .rN), an object name in the bucket, or a local file (an NVMe tier file)."""
    path = Path(target)
    if path.is_file():
        mem = MemoryStore()

        async def local() -> list[dict[str, Any]]:
            await mem.put(f"file/{path.name}", path.read_bytes())
            return [await _inspect(mem, f"file/{path.name}", check, load_keys(None))]  # S3KV_AUTH_KEY

        docs = asyncio.run(local())
    else:

        async def body(store: ObjectStore) -> list[dict[str, Any]]:
            m = _KEY_RE.match(target.lower())
            if m:
                names = await _find_chunk(store, s.config.prefix, m["key"], m["rank"])
                if not names:
                    raise NotFound(target, "no object holds this chunk key in any namespace")
            else:
                names = [target]
                if s.config.prefix and not target.startswith(s.config.prefix + "/"):
                    try:
                        await store.head(target)
                    except NotFound:
                        names = [f"{s.config.prefix}/{target}"]
            return [await _inspect(store, n, check, s.keys) for n in names]

        docs = run(s, body)
    if s.as_json:
        out.print_json(docs if len(docs) > 1 else docs[0])
    else:
        con = out.stdout()
        for d in docs:
            rows = [[k, v] for k, v in d.items() if k not in ("frame_table", "problems", "notes", "header")]
            if "header" in d:
                rows.append(["header", d["header"]])
            rows.append(["problems", "; ".join(d.get("problems", ())) or "none"])
            if d.get("notes"):
                rows.append(["notes", "; ".join(d["notes"])])
            con.print(out.table(None, ["field", "value"], rows))
            if frames and d.get("frame_table"):
                con.print(
                    out.table(
                        "frames",
                        ["layer", "offset", "stored", "raw", "xxh3"],
                        [[i, *f] for i, f in enumerate(d["frame_table"])],
                        right=["offset", "stored", "raw"],
                    )
                )
    return EXIT_PROBLEMS if any(d.get("problems") for d in docs) else EXIT_OK


# -- verify ------------------------------------------------------------------------


@click.command("verify", epilog=EXIT_CODES_HELP)
@store_options
@click.option(
    "--sample",
    type=click.IntRange(1),
    default=100,
    show_default=True,
    help="Check this many chunk objects chosen at random.",
)
@click.option(
    "--all", "check_all", is_flag=True, help="Check every object (chunks, manifest objects, descriptors)."
)
@click.option(
    "--namespace", "namespaces", multiple=True, metavar="NS", help="Only this namespace; repeatable."
)
@click.option(
    "--delete-corrupt",
    is_flag=True,
    help="Delete corrupt objects (every rank of a corrupt chunk) and tell replicas.",
)
@click.option("--seed", type=int, default=None, help="Seed of the random sample (for a reproducible sample).")
@click.option(
    "--wait",
    type=DURATION,
    default="10m",
    show_default=True,
    help="With --delete-corrupt: how long to wait for another gc's lease (one nobody renews is "
    "taken over after 2 minutes unchanged).",
)
def verify_cmd(
    s: Settings,
    sample: int,
    check_all: bool,
    namespaces: tuple[str, ...],
    delete_corrupt: bool,
    seed: int | None,
    wait: float,
) -> int:
    """Check chunk headers and checksums, decode every frame (and, with the fleet secret, check
    MACs); report corrupt and unsigned objects, and objects s3kv did not write."""

    async def body(store: ObjectStore) -> Any:
        inv = await _scan(store, s, namespaces, read_access=False)
        with out.bar(s.progress, "verifying") as b:
            rep = await verify(
                store,
                inv,
                sample=None if check_all else sample,
                seed=seed,
                concurrency=s.concurrency,
                progress=b.advance,
                keys=s.keys,
                manifest_max_bytes=s.config.manifest_max_bytes,
            )
        if delete_corrupt and rep.corrupt:
            async with held(store, s.config.prefix, wait_s=wait) as lease:
                rep.deleted = await delete_corrupt_objects(
                    store, inv, rep, lease=lease, skew_s=s.config.manifest_clock_skew_s, keys=s.keys
                )
        return rep

    rep = run(s, body)
    if s.as_json:
        out.print_json(rep.as_dict())
    else:
        con = out.stdout()
        con.print(
            f"checked {rep.checked} of {rep.population} objects ({out.size(rep.checked_bytes)})"
            + (f"; {rep.vanished} vanished while reading" if rep.vanished else "")
        )
        if rep.problems:
            con.print(
                out.table(
                    "problems",
                    ["object", "problem", "reason"],
                    [[p.key, p.kind, p.reason] for p in rep.problems],
                )
            )
        con.print(
            f"{len(rep.corrupt) - len(rep.unsigned)} corrupt, "
            + (f"{len(rep.unsigned)} unsigned or badly signed, " if s.keys is not None else "")
            + f"{len(rep.foreign)} foreign"
            + (f", {len(rep.unreadable)} unreadable (checked again the next run)" if rep.unreadable else "")
            + (f", {len(rep.oversized)} oversized" if rep.oversized else "")
            + (f"; deleted {len(rep.deleted)}" if rep.deleted else "")
        )
    return EXIT_PROBLEMS if rep.problems else EXIT_OK


# -- gc ----------------------------------------------------------------------------


@click.command("gc", epilog=EXIT_CODES_HELP)
@store_options
@click.option(
    "--max-age",
    type=DURATION,
    help="Delete chunks not used for this long (access records, else write time), e.g. 14d.",
)
@click.option(
    "--max-bytes", type=SIZE, help="Then delete least recently used chunks until the rest fits, e.g. 2TiB."
)
@click.option(
    "--namespace",
    "namespaces",
    multiple=True,
    metavar="NS",
    help="Act only on this namespace (id or unique prefix); repeatable.",
)
@click.option(
    "--keep-namespace",
    "keep",
    multiple=True,
    metavar="NS",
    help="Retire every namespace in scope except this one; repeatable.",
)
@click.option(
    "--retire",
    is_flag=True,
    help="Retire the --namespace namespaces: delete all their chunks, then their manifest.",
)
@click.option(
    "--min-age",
    type=DURATION,
    default="1h",
    show_default=True,
    help="Never delete a chunk written or used more recently than this.",
)
@click.option(
    "--abort-uploads-older-than",
    "abort_after",
    type=DURATION,
    default="1d",
    show_default=True,
    help="Abort incomplete multipart uploads older than this.",
)
@click.option(
    "--compact/--no-compact",
    default=True,
    show_default=True,
    help="Snapshot each namespace's manifest, drop merged segments, merge old access records.",
)
@click.option(
    "--segment-min-age",
    type=DURATION,
    default="10m",
    show_default=True,
    help="Segments a snapshot covers are dropped once this old.",
)
@click.option(
    "--dry-run",
    is_flag=True,
    help="Print exactly what would be deleted, and the bytes and monthly cost it frees; change nothing.",
)
@click.option(
    "--wait",
    type=DURATION,
    default="10m",
    show_default=True,
    help="How long to wait while another gc holds the lease (one nobody renews is taken over "
    "after 2 minutes unchanged).",
)
@click.option(
    "--price-per-gib-month",
    type=click.FloatRange(0),
    default=gcmod.DEFAULT_PRICE_PER_GIB_MONTH,
    show_default=True,
    help="Storage price for the cost estimate (USD; S3 Standard us-east-1).",
)
def gc_cmd(
    s: Settings,
    max_age: float | None,
    max_bytes: int | None,
    namespaces: tuple[str, ...],
    keep: tuple[str, ...],
    retire: bool,
    min_age: float,
    abort_after: float,
    compact: bool,
    segment_min_age: float,
    dry_run: bool,
    wait: float,
    price_per_gib_month: float,
) -> int:
    """Delete chunks by age, by byte budget (least recently used first) or by namespace;
    abort abandoned uploads; compact the manifest. Safe while replicas serve and
    while another gc runs (they take turns on a lease in the bucket)."""
    if retire and not namespaces:
        raise click.UsageError("--retire needs --namespace (which namespaces to retire)")
    if retire and keep:
        raise click.UsageError("--retire and --keep-namespace do not go together")
    floor = 2 * s.config.manifest_clock_skew_s
    if compact and segment_min_age < floor:
        raise click.UsageError(
            f"--segment-min-age {segment_min_age:g}s is too short: replicas may not have read those segments "
            f"yet; use at least {floor:g}s (twice manifest_clock_skew_s)"
        )

    async def body(store: ObjectStore) -> tuple[gcmod.Plan, gcmod.Result | None, gcmod.BadFound]:
        async def once(lease: Any) -> tuple[gcmod.Plan, gcmod.Result | None, gcmod.BadFound]:
            inv = await _scan(store, s, namespaces)
            bad = await gcmod.find_bad(
                store,
                inv,
                keys=s.keys,
                concurrency=min(s.concurrency, 16),
                manifest_max_bytes=s.config.manifest_max_bytes,
            )
            kept = tuple(inv.resolve(keep))
            policy = gcmod.Policy(
                max_age_s=max_age,
                max_bytes=max_bytes,
                namespaces=tuple(inv.namespaces),
                keep_namespaces=kept,
                retire=retire,
                min_age_s=min_age,
                abort_uploads_after_s=abort_after,
                compact=compact,
                segment_min_age_s=segment_min_age,
                skew_s=s.config.manifest_clock_skew_s,
                manifest_max_bytes=s.config.manifest_max_bytes,
            )
            uploads = await store.list_uploads(f"{s.config.prefix}/" if s.config.prefix else "")
            p = gcmod.plan(inv, policy, time.time(), uploads)
            if dry_run:
                return p, None, bad
            with out.bar(s.progress, "deleting", total=len(p.objects)) as b:
                res = await gcmod.execute(
                    store,
                    inv,
                    p,
                    lease=lease,
                    concurrency=min(s.concurrency, 16),
                    progress=b.advance,
                    keys=s.keys,
                    bad=bad.objects,
                )
            return p, res, bad

        if dry_run:
            return await once(None)
        async with held(store, s.config.prefix, wait_s=wait) as lease:
            return await once(lease)

    p, res, bad = run(s, body)
    _print_gc(s, p, res, bad, price_per_gib_month)
    return EXIT_PARTIAL if res is not None and res.failed else EXIT_OK


def _print_gc(
    s: Settings, p: gcmod.Plan, res: gcmod.Result | None, found: gcmod.BadFound, price: float
) -> None:
    bad = found.objects
    deleted = p.by_namespace() if res is None else res.deleted
    freed = sum(r["bytes"] for r in deleted.values())
    objects = [o.key for o in p.objects]
    failed = set(res.failed) if res is not None else set()
    done = [k for k in objects if k not in failed]
    doc = {
        "dry_run": res is None,
        "namespaces": deleted,
        "objects": done,
        "bytes_freed": freed,
        "monthly_cost_freed_usd": round(gcmod.monthly_cost(freed, price), 6),
        "bytes_in_scope": p.bytes_in_scope,
        "guarded_chunks": p.guarded,
        "retired_namespaces": p.retired,
        "namespace_objects": [o.key for o in p.namespace_objects] if p.retired else [],
        "uploads_to_abort": [u.key for u in p.uploads],
        "bad_objects": [{"object": b.name, "reason": b.reason} for b in bad],
        "bad_objects_skipped": found.skipped,
        "bad_report_segments_skipped": found.segments_skipped,
        "unreadable_descriptors": p.unread_descriptors,
        "unread_access_records": p.unread_access,
        **({"result": res.as_dict()} if res is not None else {}),
    }
    if s.as_json:
        out.print_json(doc)
        return
    con = out.stdout()
    verb = "would delete" if res is None else "deleted"
    reasons: dict[str, dict[str, int]] = {}
    for d in p.deletions:
        reasons.setdefault(d.ns, {}).setdefault(d.reason, 0)
        reasons[d.ns][d.reason] += 1
    con.print(
        out.table(
            f"gc ({verb})",
            ["namespace", "chunks", "objects", "bytes", "why", "kept by --min-age"],
            [
                [
                    ns,
                    r["chunks"],
                    r["objects"],
                    out.size(r["bytes"]),
                    ", ".join(f"{k} {v}" for k, v in reasons.get(ns, {}).items()),
                    p.guarded.get(ns, 0),
                ]
                for ns, r in deleted.items()
            ],
            right=["chunks", "objects", "bytes"],
        )
    )
    con.print(
        f"{verb} {len(done)} objects, {out.size(freed)} of {out.size(p.bytes_in_scope)}: "
        f"{out.dollars(gcmod.monthly_cost(freed, price))}/month at ${price}/GiB-month"
    )
    if p.retired:
        con.print(f"{'would retire' if res is None else 'retired'} namespaces: {', '.join(p.retired)}")
    if p.uploads:
        con.print(
            f"{'would abort' if res is None else 'aborted'} {len(p.uploads)} incomplete multipart upload(s)"
        )
    if bad:
        n = len(bad) if res is None else res.bad_deleted
        con.print(f"{'would delete' if res is None else 'deleted'} {n} object(s) replicas reported bad")
    for ns, why in p.unread_descriptors.items():
        con.print(
            f"namespace {ns}: its descriptor could not be read ({why}); none of its orphan chunks is "
            "published this run"
        )
    for ns, n in p.unread_access.items():
        con.print(
            f"namespace {ns}: {n} access record(s) not read (corrupt, larger than manifest_max_bytes, "
            "or unsigned): the uses they record do not count"
        )
    if found.skipped or found.segments_skipped:
        con.print(
            f"{found.skipped} object(s) replicas reported bad not checked, {found.segments_skipped} segment(s) "
            "of such reports not read: gc may not read them, or reading failed (read again the next run)"
        )
    if res is not None:
        con.print(
            f"manifest: {res.tombstones} tombstone segment(s), {res.snapshots_written} snapshot(s) written, "
            f"{res.segments_deleted} segment(s) and {res.snapshots_deleted} snapshot(s) dropped, "
            f"{res.access_merged} access record(s) merged"
        )
        for ns, why in res.compactions_skipped.items():
            con.print(
                f"namespace {ns}: compaction skipped ({why}): a manifest object it needs could not be read; "
                "nothing pruned (compacted again the next run)"
            )
        if res.access_skipped:
            con.print(
                f"{res.access_skipped} access record(s) not merged: gc may not read them, reading failed, "
                "or larger than manifest_max_bytes (merged again the next run)"
            )
        if res.unsigned:
            con.print(
                f"{len(res.unsigned)} unsigned or badly signed manifest object(s) ignored (s3kv verify lists them)"
            )
        if res.failed:
            con.print(f"{len(res.failed)} deletes failed (run gc again): {', '.join(res.failed[:5])}")
    if res is None and (objects or p.retired or p.uploads or bad):
        con.print("objects that would be deleted:")
        for k in (
            objects
            + [b.name for b in bad]
            + [o.key for o in p.namespace_objects]
            + [f"upload {u.key} {u.upload_id}" for u in p.uploads]
        ):
            con.print(k, markup=False, highlight=False)
