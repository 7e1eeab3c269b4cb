"""``gc.plan``, the pure function: what each policy deletes, decided from
small hand-built inventories and one instant ``now`` (no bucket, no clock)."""

from __future__ import annotations

from s3kv.keys import namespace_prefix, object_key
from s3kv.manifest import protocol as mp
from s3kv.ops import gc
from s3kv.ops.inventory import Chunk, Inventory, NamespaceInfo
from s3kv.stores.base import ObjectMeta, Upload

PREFIX = "fleet"
NOW = 1_700_000_000.0
MIN, HOUR, DAY = 60, 3600, 86400
A, B, C = "a" * 32, "b" * 32, "c" * 32


def chunk(ns: str, n: int, *, written: float, used: float | None = None, sizes=(100,)) -> Chunk:
    """Chunk ``n`` of ``ns``: written ``written`` s before NOW (every rank
    object of ``sizes`` bytes), last used ``used`` s before NOW (None: never)."""
    key = n.to_bytes(16, "big")
    objects = [ObjectMeta(object_key(PREFIX, ns, key, r), s, NOW - written) for r, s in enumerate(sizes)]
    return Chunk(key, objects, None if used is None else NOW - used)


def inventory(*chunks: Chunk, namespaces=(A, B, C)) -> Inventory:
    infos = {ns: NamespaceInfo(ns, namespace_prefix(PREFIX, ns)) for ns in namespaces}
    for c in chunks:
        ns = c.objects[0].key.split("/")[1]
        infos[ns].chunks[c.key] = c
    return Inventory(PREFIX, infos, [], NOW)


def deleted(p: gc.Plan) -> dict[tuple[str, int], str]:
    """(namespace, chunk number) -> the reason it goes."""
    return {(d.ns, int.from_bytes(d.chunk.key, "big")): d.reason for d in p.deletions}


def objects(inv: Inventory, *chunks: tuple[str, int]) -> set[str]:
    return {o.key for ns, n in chunks for o in inv.namespaces[ns].chunks[n.to_bytes(16, "big")].objects}


def without(inv: Inventory, p: gc.Plan) -> Inventory:
    """The inventory once the plan was carried out."""
    for d in p.deletions:
        inv.namespaces[d.ns].chunks.pop(d.chunk.key)
    return inv


def test_max_age_deletes_chunks_idle_longer_than_it_by_use_else_write():
    inv = inventory(
        chunk(A, 1, written=2 * DAY),  # idle 2 days
        chunk(A, 2, written=20 * DAY, used=10 * DAY),  # used 10 days ago
        chunk(A, 3, written=20 * DAY),  # never used: its write counts
        chunk(A, 4, written=30 * DAY, used=1 * DAY),  # old, but used yesterday
        chunk(A, 5, written=7 * DAY),  # exactly max-age idle: kept
        chunk(B, 6, written=8 * DAY, sizes=(100, 120)),  # both ranks go
        chunk(B, 7, written=10 * MIN),
    )
    p = gc.plan(inv, gc.Policy(max_age_s=7 * DAY), NOW)
    assert deleted(p) == {(A, 2): "max-age", (A, 3): "max-age", (B, 6): "max-age"}
    assert {o.key for o in p.objects} == objects(inv, (A, 2), (A, 3), (B, 6))
    assert p.bytes == 100 + 100 + 220 and p.bytes_in_scope == 100 * 6 + 220
    assert p.by_namespace() == {
        A: {"chunks": 2, "objects": 2, "bytes": 200},
        B: {"chunks": 1, "objects": 2, "bytes": 220},
    }
    assert p.guarded == {} and p.retired == []
    # Carried out, the same policy finds nothing more to do.
    assert gc.plan(without(inv, p), gc.Policy(max_age_s=7 * DAY), NOW).deletions == []


def test_the_guard_keeps_chunks_written_or_used_within_min_age():
    inv = inventory(
        chunk(A, 1, written=10 * MIN),  # written recently
        chunk(A, 2, written=30 * DAY, used=30 * MIN),  # used recently
        chunk(A, 3, written=HOUR),  # exactly min-age: not guarded
        chunk(A, 4, written=30 * DAY),
    )
    p = gc.plan(inv, gc.Policy(max_age_s=0), NOW)
    assert deleted(p) == {(A, 3): "max-age", (A, 4): "max-age"}
    assert p.guarded == {A: 2}
    p = gc.plan(inv, gc.Policy(max_age_s=0, min_age_s=0), NOW)
    assert set(deleted(p)) == {(A, 1), (A, 2), (A, 3), (A, 4)} and p.guarded == {}


def test_max_bytes_deletes_least_recently_used_first_until_the_rest_fits():
    inv = inventory(
        chunk(A, 1, written=40 * DAY, sizes=(300,)),
        chunk(A, 2, written=40 * DAY, used=2 * DAY, sizes=(200,)),
        chunk(B, 3, written=30 * DAY, sizes=(100, 100)),
        chunk(A, 4, written=30 * DAY, sizes=(50,)),  # same last use as B 3: A sorts first
        chunk(B, 5, written=5 * DAY, sizes=(400,)),
        chunk(B, 6, written=10 * MIN, sizes=(1000,)),  # least recently used by size, but guarded
        chunk(A, 7, written=60 * DAY, used=20 * MIN, sizes=(10,)),  # used recently: guarded
    )
    total = 300 + 200 + 200 + 50 + 400 + 1000 + 10
    budget = 1500
    p = gc.plan(inv, gc.Policy(max_bytes=budget), NOW)
    # Oldest use first: A 1 (40 d), A 4 and B 3 (30 d: by namespace), B 5
    # (5 d); then the rest (2160 - 300 - 50 - 200 - 400 = 1210 bytes) fits.
    assert [(d.ns, int.from_bytes(d.chunk.key, "big")) for d in p.deletions] == [
        (A, 1),
        (A, 4),
        (B, 3),
        (B, 5),
    ]
    assert all(d.reason == "max-bytes" for d in p.deletions)
    assert total - p.bytes <= budget
    assert p.guarded == {}  # it stopped before the recent ones
    # Every chunk kept was used more recently than every chunk deleted.
    gone = {id(d.chunk) for d in p.deletions}
    kept = [c for info in inv.namespaces.values() for c in info.chunks.values() if id(c) not in gone]
    assert max(d.chunk.last_used for d in p.deletions) <= min(c.last_used for c in kept)
    assert gc.plan(without(inv, p), gc.Policy(max_bytes=budget), NOW).deletions == []


def test_max_bytes_skips_guarded_chunks_and_counts_only_what_it_deletes():
    inv = inventory(
        chunk(A, 1, written=10 * MIN, sizes=(500,)),  # guarded
        chunk(A, 2, written=10 * DAY, sizes=(100,)),
        chunk(A, 3, written=20 * DAY, sizes=(100,)),
    )
    p = gc.plan(inv, gc.Policy(max_bytes=0), NOW)
    assert deleted(p) == {(A, 3): "max-bytes", (A, 2): "max-bytes"}
    assert p.guarded == {A: 1}


def test_policies_combine_within_the_scope_and_each_chunk_goes_once():
    """--max-age 7d --max-bytes 0 on two namespaces (the second named by a
    prefix): everything in scope goes but what the guard keeps."""
    inv = inventory(
        chunk(A, 1, written=20 * DAY),  # max-age and max-bytes both select it: once, for max-age
        chunk(A, 2, written=2 * DAY),  # only max-bytes selects it
        chunk(A, 3, written=10 * MIN),  # guarded
        chunk(B, 4, written=3 * DAY, used=30 * MIN),  # guarded
        chunk(B, 5, written=9 * DAY),
        chunk(C, 6, written=90 * DAY),  # out of scope
    )
    scope = tuple(inv.resolve([A, B[:8]]))
    assert scope == (A, B)
    p = gc.plan(inv, gc.Policy(max_age_s=7 * DAY, max_bytes=0, namespaces=scope), NOW)
    assert deleted(p) == {(A, 1): "max-age", (B, 5): "max-age", (A, 2): "max-bytes"}
    assert p.scope == [A, B] and p.guarded == {A: 1, B: 1}
    assert sum(p.guarded.values()) == 2  # the fresh chunks in scope, each counted once
    assert p.bytes_in_scope == 500


def test_retiring_keeps_guarded_chunks_and_the_namespace_they_are_in():
    inv = inventory(
        chunk(A, 1, written=30 * DAY), chunk(A, 2, written=10 * MIN), chunk(B, 3, written=30 * DAY)
    )
    p = gc.plan(inv, gc.Policy(namespaces=(A,), retire=True), NOW)
    assert deleted(p) == {(A, 1): "retired"}
    assert p.guarded == {A: 1}
    assert p.retired == [] and p.namespace_objects == []  # a replica may still be writing there


def test_retiring_whole_namespaces_takes_their_manifest_and_descriptor():
    inv = inventory(
        chunk(A, 1, written=30 * DAY), chunk(B, 2, written=10 * MIN), chunk(C, 3, written=30 * DAY)
    )
    month_ago = NOW - 30 * DAY
    for info in inv.namespaces.values():
        base, ts_ms = info.manifest_base, int(month_ago * 1000)
        info.segments = [ObjectMeta(mp.segment_name(base, ts_ms, "w0", 1), 10, month_ago)]
        info.snapshots = [ObjectMeta(mp.snapshot_name(base, ts_ms + 1, "w0"), 10, month_ago)]
        info.access = [ObjectMeta(mp.access_name(base, ts_ms, "w0", 2), 10, month_ago)]
        info.descriptor_meta = ObjectMeta(info.base + "namespace.json", 10, NOW - 100 * DAY)
    p = gc.plan(inv, gc.Policy(keep_namespaces=(C,), min_age_s=0), NOW)
    assert deleted(p) == {(A, 1): "retired", (B, 2): "retired"}  # no guard: the fresh chunk too
    assert p.retired == [A, B]
    assert {o.key for o in p.namespace_objects} == {
        o.key
        for ns in (A, B)
        for o in (*inv.namespaces[ns].manifest_objects, inv.namespaces[ns].descriptor_meta)
    }
    # A segment or access record newer than the guard: a replica is writing
    # there, so its manifest and descriptor stay, though its chunks go.
    info = inv.namespaces[A]
    recent = NOW - 10 * MIN
    info.access.append(
        ObjectMeta(mp.access_name(info.manifest_base, int(recent * 1000), "w1", 1), 10, recent)
    )
    p = gc.plan(inv, gc.Policy(namespaces=(A,), retire=True, min_age_s=HOUR), NOW)
    assert deleted(p) == {(A, 1): "retired"} and p.retired == []


def test_incomplete_uploads_older_than_the_bound_under_the_scope_are_aborted():
    inv = inventory()
    uploads = [
        Upload(f"{PREFIX}/{A}/ab/upload0.r0", "u0", NOW - 2 * DAY),
        Upload(f"{PREFIX}/{B}/ab/upload1.r0", "u1", NOW - 2 * DAY),
        Upload(f"{PREFIX}/{A}/ab/upload2.r0", "u2", NOW - HOUR),  # too young
        Upload("other-app/big-file", "u3", NOW - 9 * DAY),  # not ours
    ]
    assert [u.upload_id for u in gc.plan(inv, gc.Policy(), NOW, uploads).uploads] == ["u0", "u1"]
    assert [u.upload_id for u in gc.plan(inv, gc.Policy(namespaces=(B,)), NOW, uploads).uploads] == ["u1"]
    assert gc.plan(inv, gc.Policy(abort_uploads_after_s=None), NOW, uploads).uploads == []


def test_execute_reports_the_bad_objects_it_failed_to_delete_beside_the_chunks():
    """``execute`` is not pure, but its result's ``failed`` is the plan's
    bookkeeping: a reported-bad object whose delete failed (no ETag to delete
    it by) stays listed after the chunk deletions that follow succeed."""
    import asyncio

    from s3kv.ops.reported import BadObject
    from s3kv.stores.memory import MemoryStore

    old = chunk(A, 1, written=30 * DAY)
    inv = inventory(old, chunk(A, 2, written=30 * DAY))
    store = MemoryStore()
    for c in inv.namespaces[A].chunks.values():
        for o in c.objects:
            asyncio.run(store.put(o.key, b"x" * o.size))
    p = gc.plan(inv, gc.Policy(max_age_s=DAY, min_age_s=0, compact=False), NOW)
    assert deleted(p) == {(A, 1): "max-age", (A, 2): "max-age"}
    bad_name = f"{PREFIX}/{A}/bad/object.r0"
    bad = [BadObject(A, b"\x09" * 16, bad_name, None, "checksum")]
    result = asyncio.run(gc.execute(store, inv, p, lease=None, clock=lambda: NOW, bad=bad))
    assert result.failed == [bad_name]
    assert result.deleted[A]["chunks"] == 2 and not asyncio.run(store.exists(old.objects[0].key))
