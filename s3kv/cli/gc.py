"""``s3kv gc``: delete chunks by age, byte budget or namespace, abort abandoned uploads,
compact the manifest; and its report."""

from __future__ import annotations

import time
from typing import Any

import click

from s3kv.cli import output as out
from s3kv.cli.ops import run, scan_bucket
from s3kv.cli.settings import DURATION, EXIT_CODES_HELP, EXIT_OK, EXIT_PARTIAL, SIZE, Settings, store_options
from s3kv.ops import gc as gcmod
from s3kv.ops.lock import held
from s3kv.stores.base import ObjectStore


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
    help="Snapshot each namespace's manifest, drop merged segments and old epochs, merge old access records.",
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
            inv = await scan_bucket(store, s, namespaces)
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
                    carried=bad.carried,
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
            f"{res.segments_deleted} segment(s), {res.snapshots_deleted} snapshot(s) and "
            f"{res.epochs_deleted} epoch(s) dropped, "
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
