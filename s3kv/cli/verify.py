"""``s3kv verify``: check the bucket's objects, report what replicas would refuse, and
delete the corrupt on request."""

from __future__ import annotations

from typing import Any

import click

from s3kv.cli import output as out
from s3kv.cli.ops import run, scan_bucket
from s3kv.cli.settings import DURATION, EXIT_CODES_HELP, EXIT_OK, EXIT_PROBLEMS, Settings, store_options
from s3kv.ops.lock import held
from s3kv.ops.verify import delete_corrupt as delete_corrupt_objects
from s3kv.ops.verify import verify
from s3kv.stores.base import ObjectStore


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
    help="Delete corrupt objects (every shard of a corrupt chunk) and tell replicas.",
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
        inv = await scan_bucket(store, s, namespaces, read_access=False)
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
