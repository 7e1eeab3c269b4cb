"""``s3kv inspect``: one object's header (a chunk's or a manifest object's), by chunk key,
object name or local file, its frames checked on request; or what a namespace's
descriptor says (its KV cache groups among it), by namespace id or object name."""

from __future__ import annotations

import asyncio
import re
from pathlib import Path
from typing import Any

import click

from s3kv.auth import FleetKeys, load_keys
from s3kv.cli import output as out
from s3kv.cli.ops import run
from s3kv.cli.settings import EXIT_CODES_HELP, EXIT_OK, EXIT_PROBLEMS, Settings, store_options
from s3kv.descriptor import NAME as DESCRIPTOR
from s3kv.errors import NotFound
from s3kv.keys import namespace_prefix
from s3kv.ops.described import short_names
from s3kv.ops.inventory import list_namespaces
from s3kv.ops.verify import inspect_object
from s3kv.stores.base import ObjectStore
from s3kv.stores.memory import MemoryStore

_KEY_RE = re.compile(r"^(?P<key>[0-9a-f]{32})(?:\.r(?P<shard>\d+))?$")


async def _find_chunk(store: ObjectStore, prefix: str, key: str, shard: str | None) -> list[str]:
    """The objects of chunk ``key`` (of shard ``shard``) in any namespace; none:
    namespace ``key``'s descriptor, if ``key`` is a namespace's id."""
    namespaces, _ = await list_namespaces(store, prefix)
    names: list[str] = []
    for ns in namespaces:
        directory = f"{namespace_prefix(prefix, ns)}{key[:2]}/"
        base = f"{directory}{key}.r" + (shard or "")
        # A directory bucket lists only prefixes that end with '/'.
        names += [
            n for n in await store.list_keys(directory if store.directory else base) if n.startswith(base)
        ]
    names = [n for n in names if shard is None or n.endswith(f".r{shard}")]
    if not names and shard is None and key in namespaces:
        names = [namespace_prefix(prefix, key) + DESCRIPTOR]
    return names


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
@click.argument("target", metavar="KEY|NAMESPACE|OBJECT")
@click.option("--check", is_flag=True, help="Also read and decode every frame (MACs too, with the secret).")
@click.option(
    "--frames", is_flag=True, help="Show the frame table (offset, stored, raw, checksum per layer)."
)
@click.option(
    "--members",
    is_flag=True,
    help="Show an epoch object's members (each segment it covers: writer, keys added and removed).",
)
def inspect_cmd(s: Settings, target: str, check: bool, frames: bool, members: bool) -> int:
    """Decode and show one object's header: a chunk key (32 hex digits, optionally
    .rN: its shard N), an object name in the bucket, or a local file (an NVMe tier file). A
    namespace id (or its namespace.json) shows what its descriptor says: model,
    chunk size, TP size or shards, the frames of each object, and its KV cache groups.
    A manifest epoch object (manifest/ep/...) shows its epoch, who aggregated it, and
    how many segments and keys it holds (--members: each segment)."""
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
                names = await _find_chunk(store, s.config.prefix, m["key"], m["shard"])
                if not names:
                    raise NotFound(
                        target,
                        "no object holds this chunk key in any namespace, and no namespace has this id",
                    )
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
            skip = ("frame_table", "member_table", "problems", "notes", "header", "kv_groups", "fields")
            rows = [[k, v] for k, v in d.items() if k not in skip]
            if "header" in d:
                rows.append(["header", d["header"]])
            rows.append(["problems", "; ".join(d.get("problems", ())) or "none"])
            if d.get("notes"):
                rows.append(["notes", "; ".join(d["notes"])])
            con.print(out.table(None, ["field", "value"], rows))
            if d.get("kv_groups"):
                con.print(
                    out.table(
                        "KV cache groups (one part object of every chunk each)",
                        ["group", "kind", "window", "layers", "names"],
                        [
                            [
                                g["group"],
                                g["kind"],
                                g["window"] or "-",
                                g["layers"],
                                short_names(g["layer_names"]),
                            ]
                            for g in d["kv_groups"]
                        ],
                        right=["group", "window", "layers"],
                    )
                )
            if members and d.get("member_table"):
                con.print(
                    out.table(
                        "members (the segments the epoch covers)",
                        ["segment", "writer", "added", "removed"],
                        [[m["segment"], m["writer"], m["added"], m["removed"]] for m in d["member_table"]],
                        right=["added", "removed"],
                    )
                )
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
