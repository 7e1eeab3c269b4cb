"""The NVMe wing's files (:mod:`s3kv.tiering.tiers.nvme.files`, opened at
start-up by :func:`~s3kv.tiering.tiers.nvme.directory.open_disk`, read by
its handler): scan at start-up, stale partials (named by
:mod:`s3kv.stores.local`), the lock, what a writer killed mid-write leaves
behind, and reads that refuse what s3kv did not write."""

from __future__ import annotations

import errno
import os
import random
import select
import signal
import socket
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from s3kv.chunk_reader import PageFormat
from s3kv.errors import CorruptChunk, NotFound
from s3kv.frame_sinks import PageTarget
from s3kv.keys import KEY_BYTES
from s3kv.stores.local import (
    FOREIGN_PARTIAL_MAX_AGE_S,
    OWN_PARTIAL_MAX_AGE_S,
    is_stale_partial,
    partial_path,
    partial_writer,
    writer_namespace,
)
from s3kv.testing.pages import Frames, Pages
from s3kv.tiering.chunks import ChunkData
from s3kv.tiering.plan import LoadChunk
from s3kv.tiering.tiers.nvme import files as disk
from s3kv.tiering.tiers.nvme import residency
from s3kv.tiering.tiers.nvme.directory import open_disk, release_lock
from s3kv.tiering.tiers.nvme.files import DiskTier
from s3kv.tiering.tiers.nvme.handler import NvmeHandler
from tests.tiers.conformance import NAMESPACE, Calls, key_of, make_chunk, make_codec, read_raw

BUSY_BOUND_S = 120
"""How long a test waits for a child process or a call that should be quick:
a bound for a busy machine, not a time the test expects to take."""

REPO = Path(__file__).resolve().parents[2]


def through_handler(files: DiskTier) -> Calls:
    """``files`` read as a worker reads them: through the NVMe tier's handler."""
    return Calls(NvmeHandler(files, timeout_s=60, write_queue_s=60))


def write_shard(root: Path, key: bytes, rank: int, mtime: float, namespace: str = NAMESPACE) -> int:
    chunk_codec = make_codec(namespace=namespace, rank=rank)
    size = DiskTier(root, chunk_codec).write(key, make_chunk(chunk_codec, key))
    os.utime(disk.shard_path(root, namespace, key, rank), (mtime, mtime))
    return size


def partial_name(root: Path, key: bytes, pid: int | str, rank: int = 0, *, writer: str | None = None) -> Path:
    """Named as s3kv.stores.local.partial_path names a writer's temporary, by
    a writer in this pid namespace, in the pid namespace ``writer``, or
    (``writer=""``) with an old-style name that names only the pid."""
    target = disk.shard_path(root, NAMESPACE, key, rank)
    target.parent.mkdir(parents=True, exist_ok=True)
    writer = writer_namespace() if writer is None else writer
    tag = f"{writer}-{pid}" if writer else f"{pid}"
    return target.with_name(f".{target.name}.{tag}-{uuid.uuid4().hex[:12]}.partial")


def age(path: Path, seconds: float) -> None:
    then = time.time() - seconds
    os.utime(path, (then, then), follow_symlinks=False)


def dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def test_scan_finds_complete_chunks_oldest_first(tmp_path):
    root = tmp_path / "disk"
    whole, old, half, foreign = (key_of(i) for i in range(4))
    whole_size = write_shard(root, whole, 0, 1000) + write_shard(root, whole, 1, 1005)
    old_size = write_shard(root, old, 0, 500) + write_shard(root, old, 1, 400)
    half_size = write_shard(root, half, 0, 700)
    other_ns = "ab" * 16
    foreign0 = write_shard(root, foreign, 0, 600, namespace=other_ns)
    foreign1 = write_shard(root, foreign, 1, 650, namespace=other_ns)
    extra_rank = write_shard(root, whole, 2, 800)  # beyond the 2 shards
    # Not chunk files: ignored.
    (root / NAMESPACE / "stray").write_bytes(b"x")
    (root / NAMESPACE / whole.hex()[:2] / "notes.txt").write_bytes(b"x")
    (root / NAMESPACE / whole.hex()[:2] / f"{'ab' * (KEY_BYTES - 1)}.r0").write_bytes(b"x")
    (root / "short").mkdir()
    (root / "short" / "x").write_bytes(b"x")

    result = disk.scan(root, NAMESPACE, shards=2)
    assert result.chunks == [(old, old_size, 500), (whole, whole_size, 1005)]

    def rel(ns: str, key: bytes, rank: int) -> str:
        return os.path.relpath(disk.shard_path(root, ns, key, rank), root)

    assert result.other == [
        (rel(other_ns, foreign, 0), foreign0, 600),
        (rel(other_ns, foreign, 1), foreign1, 650),
        (rel(NAMESPACE, half, 0), half_size, 700),
        (rel(NAMESPACE, whole, 2), extra_rank, 800),
    ]
    assert result.removed_partials == 0
    assert result.skipped_reasons == {
        disk.SKIP_STRAY_FILE: 1,  # stray
        disk.SKIP_NOT_CHUNK: 2,  # notes.txt, the short key
        disk.SKIP_UNKNOWN_DIR: 1,  # short/
    }
    assert result.skipped == 4 and result.root_error is None
    # With one shard, every .r0 file of the namespace is a complete chunk.
    single = disk.scan(root, NAMESPACE, shards=1)
    assert [c[0] for c in single.chunks] == [old, half, whole]
    assert disk.scan(tmp_path / "absent", NAMESPACE, 1).chunks == []


def test_scan_and_delete_count_a_chunks_shards_whichever_rank_wrote_them(tmp_path):
    """A part cut into 4 shards by KV head (a TP 2 replica's ranks write two
    each) is whole with its 4 files; stored once (MLA), with its one. A file
    of a shard the namespace's parts do not have is not a chunk's."""
    root = tmp_path / "disk"
    whole, three, beyond = (key_of(i) for i in range(3))
    whole_size = sum(write_shard(root, whole, s, 100 + s) for s in range(4))
    three_sizes = [write_shard(root, three, s, 200 + s) for s in range(3)]
    extra = write_shard(root, beyond, 4, 300)  # no part of 4 shards has a shard 4
    four = disk.scan(root, NAMESPACE, shards=4)
    assert four.chunks == [(whole, whole_size, 103)]

    def rel(key: bytes, shard: int) -> str:
        return os.path.relpath(disk.shard_path(root, NAMESPACE, key, shard), root)

    assert four.other == [
        *((rel(three, s), three_sizes[s], 200 + s) for s in range(3)),
        (rel(beyond, 4), extra, 300),
    ]
    one = disk.scan(root, NAMESPACE, shards=1)
    assert [c[0] for c in one.chunks] == [whole, three]  # each has its .r0
    assert {o[0] for o in one.other} == {
        *(rel(whole, s) for s in (1, 2, 3)),
        rel(three, 1),
        rel(three, 2),
        rel(beyond, 4),
    }

    disk.delete_chunk(root, NAMESPACE, whole, 4)  # every shard's file, not one a rank of TP 2
    disk.delete_chunk(root, NAMESPACE, three, 1)  # its one shard; files past it are not its
    assert not any(disk.shard_path(root, NAMESPACE, whole, s).exists() for s in range(4))
    assert [disk.shard_path(root, NAMESPACE, three, s).exists() for s in range(3)] == [False, True, True]


def deny_listing(monkeypatch, directory: Path) -> None:
    """Make listing ``directory`` fail with PermissionError: by its mode
    (writable, not readable) where that stops this process, else (root) by
    making os.scandir refuse it. The caller gives the directory its mode back."""
    directory.chmod(0o300)
    try:
        os.listdir(directory)
    except PermissionError:
        return
    directory.chmod(0o755)
    real_scandir = os.scandir

    def scandir(path="."):
        if os.path.abspath(os.fspath(path)) == str(directory):
            raise PermissionError(13, "Permission denied", str(directory))
        return real_scandir(path)

    monkeypatch.setattr(os, "scandir", scandir)


def test_scan_skips_and_counts_whatever_else_the_directory_holds(tmp_path, monkeypatch):
    root = tmp_path / "disk"
    a, b, half = key_of(0), key_of(1), key_of(2)
    a_size = write_shard(root, a, 0, 100) + write_shard(root, a, 1, 110)
    b_size = write_shard(root, b, 0, 200) + write_shard(root, b, 1, 210)
    half_size = write_shard(root, half, 0, 300)
    other_ns = "ab" * 16
    foreign = write_shard(root, a, 0, 50, namespace=other_ns)
    ns_dir = root / NAMESPACE
    shard = disk.shard_path(root, NAMESPACE, a, 0).parent
    lock_fd = disk.try_lock(root)
    (root / disk.PROBE_NAME).write_bytes(b"ok")  # left by a crash in check_writable: s3kv's own
    elsewhere = tmp_path / "elsewhere"  # what symlinks point to: never followed
    elsewhere_shard = elsewhere / a.hex()[:2]
    elsewhere_shard.mkdir(parents=True)
    (elsewhere_shard / f"{a.hex()}.r0").write_bytes(disk.shard_path(root, NAMESPACE, a, 0).read_bytes())

    def looks_like_chunk(i: int) -> str:
        """A valid chunk file name for ``shard``, of no real chunk."""
        return f"{a.hex()[:2]}{key_of(100 + i).hex()[2:]}.r0"

    wrong_shard = next(key_of(i) for i in range(3, 100) if key_of(i).hex()[:2] != a.hex()[:2])
    expected = {
        disk.SKIP_STRAY_FILE: [root / "notes.txt", ns_dir / "stray", root / ("cd" * 16)],
        disk.SKIP_UNKNOWN_DIR: [
            root / "short",
            root / ("AB" * 16),
            root / ("ab" * 17),
            ns_dir / "zz",
            ns_dir / "abc",
            shard / looks_like_chunk(0),
        ],
        disk.SKIP_SYMLINK: [
            root / ("ef" * 16),
            ns_dir / "cd",
            shard / looks_like_chunk(1),
            shard / looks_like_chunk(2),
            shard / f".{looks_like_chunk(3)}.{os.getpid()}-x.partial",
            root / "link-to-file",
        ],
        disk.SKIP_SPECIAL: [root / "fifo", shard / looks_like_chunk(4), shard / looks_like_chunk(5)],
        disk.SKIP_NOT_CHUNK: [
            shard / name
            for name in (
                "notes.txt",
                f"{'ab' * (KEY_BYTES - 1)}.r0",
                f"{a.hex().upper()}.r0",
                f"{a.hex()}.r01",
                f"{a.hex()}.r",
                f"{a.hex()}.r\u00b2",
                f"{a.hex()}.r\u0663",
                f"{a.hex()}.rx",
                f"{a.hex()}.r0.bak",
                f"{a.hex()}r0",
                f"{a.hex()}.R0",
                f"{wrong_shard.hex()}.r0",  # a valid key, in the wrong shard directory
            )
        ]
        + [disk.shard_path(root, other_ns, a, 0).parent / "readme"],
        disk.SKIP_UNREADABLE: [ns_dir / "ef", shard / looks_like_chunk(6)],
        disk.SKIP_VANISHED: [shard / looks_like_chunk(7)],
    }
    for path in expected[disk.SKIP_STRAY_FILE] + expected[disk.SKIP_NOT_CHUNK]:
        path.write_bytes(b"junk")
    for path in expected[disk.SKIP_UNKNOWN_DIR]:
        path.mkdir()
        (path / "x.r0").write_bytes(b"junk")  # never looked at
    links = expected[disk.SKIP_SYMLINK]
    links[0].symlink_to(ns_dir, target_is_directory=True)  # a namespace name, to a real namespace
    links[1].symlink_to(elsewhere_shard, target_is_directory=True)  # a shard name, to a shard
    links[2].symlink_to(elsewhere_shard / f"{a.hex()}.r0")  # a chunk name, to a valid chunk file
    links[3].symlink_to(tmp_path / "nothing")  # dangling
    links[4].symlink_to(elsewhere_shard / f"{a.hex()}.r0")  # a stale partial's name: not removed
    links[5].symlink_to(tmp_path / "nothing")
    age(links[4], 10 * OWN_PARTIAL_MAX_AGE_S)
    os.mkfifo(expected[disk.SKIP_SPECIAL][0])
    os.mkfifo(expected[disk.SKIP_SPECIAL][1])  # named as a chunk: opening it would block
    monkeypatch.chdir(shard)  # a socket's path must be short
    sock = socket.socket(socket.AF_UNIX)
    sock.bind(expected[disk.SKIP_SPECIAL][2].name)
    monkeypatch.chdir(tmp_path)
    unreadable_dir, unstattable = expected[disk.SKIP_UNREADABLE]
    unreadable_dir.mkdir()
    (unreadable_dir / f"{'ef' * KEY_BYTES}.r0").write_bytes(b"unseen")
    vanishing = expected[disk.SKIP_VANISHED][0]
    for path in (unstattable, vanishing):
        path.write_bytes(disk.shard_path(root, NAMESPACE, a, 0).read_bytes())
    # A name that is not UTF-8.
    bad_bytes = os.fsencode(shard) + b"/\xff\xfe.r0"
    with open(bad_bytes, "wb") as f:
        f.write(b"junk")
    expected[disk.SKIP_NOT_CHUNK].append(Path(os.fsdecode(bad_bytes)))

    deny_listing(monkeypatch, unreadable_dir)
    real_lstat = os.lstat

    def lstat(path, *args, **kwargs):
        if os.fspath(path) == str(unstattable):
            raise OSError(5, "Input/output error", str(path))
        if os.fspath(path) == str(vanishing):
            os.unlink(vanishing)  # gone between the listing and the look
        return real_lstat(path, *args, **kwargs)

    monkeypatch.setattr(os, "lstat", lstat)
    try:
        result = disk.scan(root, NAMESPACE, shards=2)
    finally:
        monkeypatch.setattr(os, "lstat", real_lstat)
        unreadable_dir.chmod(0o755)
        sock.close()
        os.close(lock_fd)

    assert result.chunks == [(a, a_size, 110), (b, b_size, 210)]
    rel = os.path.relpath
    assert result.other == [
        (rel(disk.shard_path(root, other_ns, a, 0), root), foreign, 50),
        (rel(disk.shard_path(root, NAMESPACE, half, 0), root), half_size, 300),
    ]
    assert result.skipped_reasons == {reason: len(paths) for reason, paths in expected.items()}
    assert result.skipped == sum(len(paths) for paths in expected.values())
    assert result.removed_partials == 0 and result.root_error is None
    # Nothing skipped was touched, and nothing a link points to.
    for path in links:
        assert path.is_symlink()
    assert (elsewhere_shard / f"{a.hex()}.r0").is_file()
    assert expected[disk.SKIP_SPECIAL][1].exists() and unstattable.exists()


def test_scan_and_open_disk_survive_an_unreadable_root(tmp_path, monkeypatch, caplog):
    root = tmp_path / "disk"
    write_shard(root, key_of(0), 0, 100)
    deny_listing(monkeypatch, root)
    try:
        result = disk.scan(root, NAMESPACE, shards=1)
        assert result.chunks == [] and result.other == [] and result.root_error
        assert "Permission" in result.root_error
        with caplog.at_level("WARNING", logger="s3kv.tiers"):
            setup, evicted = open_disk(str(root), NAMESPACE, 1, 1 << 20)
    finally:
        root.chmod(0o755)
    assert setup is None and evicted == []
    assert "cannot be listed" in caplog.text and "NVMe tier is off" in caplog.text
    fd = disk.try_lock(root)  # open_disk let go of the lock
    assert fd is not None
    os.close(fd)


def test_open_disk_reports_what_it_skipped(tmp_path, caplog):
    root = tmp_path / "disk"
    size = write_shard(root, key_of(0), 0, 100)
    (root / "notes.txt").write_bytes(b"x")
    (root / "link").symlink_to(root / "notes.txt")
    os.mkfifo(root / "fifo")
    with caplog.at_level("INFO", logger="s3kv.tiers"):
        setup, evicted = open_disk(str(root), NAMESPACE, 1, 1 << 20)
    assert setup is not None and evicted == []
    try:
        assert (setup.found_chunks, setup.found_bytes, setup.skipped) == (1, size, 3)
        assert key_of(0) in setup.index
    finally:
        release_lock(setup.lock_fd)
    assert "3 entries skipped (1 special file, 1 stray file, 1 symlink)" in caplog.text


def test_open_disk_without_a_lock_file_it_can_open(tmp_path, caplog):
    root = tmp_path / "disk"
    write_shard(root, key_of(0), 0, 100)
    (root / disk.LOCK_NAME).mkdir()  # open() fails: EISDIR
    with caplog.at_level("WARNING", logger="s3kv.tiers"):
        setup, _ = open_disk(str(root), NAMESPACE, 1, 1 << 20)
    assert setup is not None and setup.lock_fd is None and setup.found_chunks == 1
    assert "cannot open the lock file" in caplog.text


def test_scan_removes_stale_partials_only(tmp_path):
    root = tmp_path / "disk"
    k = key_of(0)
    write_shard(root, k, 0, 1000)
    dead = partial_name(root, k, dead_pid())
    junk = partial_name(root, k, "nopid")
    live = partial_name(root, k, os.getpid())
    old_live = partial_name(root, k, os.getpid())
    for p in (dead, junk, live, old_live):
        p.write_bytes(b"half a chunk")
    long_ago = time.time() - 7200
    os.utime(old_live, (long_ago, long_ago))
    result = disk.scan(root, NAMESPACE, shards=1)
    assert result.removed_partials == 3
    assert not dead.exists() and not junk.exists() and not old_live.exists()
    assert live.exists()
    assert [c[0] for c in result.chunks] == [k] and result.other == []
    assert disk.scan(root, NAMESPACE, shards=1).removed_partials == 0


FOREIGN = "0123456789ab"
"""A writer namespace that is not this process's (another container)."""


def test_partial_names_name_their_writer(tmp_path):
    ours = writer_namespace()
    assert len(ours) == 12 and ours != FOREIGN and writer_namespace() == ours
    target = tmp_path / f"{key_of(0).hex()}.r0"
    made = partial_path(target)
    assert made.parent == tmp_path and made.name.startswith(f".{target.name}.")
    assert partial_writer(made.name) == (ours, os.getpid())
    # The test helper names partials exactly as partial_path does.
    helper = partial_name(tmp_path, key_of(0), os.getpid())
    assert partial_writer(helper.name) == (ours, os.getpid())
    assert helper.name[: -len("0123456789ab.partial")] == made.name[: -len("0123456789ab.partial")]
    assert partial_writer(partial_name(tmp_path, key_of(0), 42, writer=FOREIGN).name) == (FOREIGN, 42)
    assert partial_writer(partial_name(tmp_path, key_of(0), 42, writer="").name) == (None, 42)
    for bad in (
        "x.partial",
        ".a.r0.-1-abc.partial",
        ".a.r0.0-abc.partial",
        ".a.r0.ABCDEF012345-7-abc.partial",
        ".a.r0.12-34-56-78.partial",
        ".a.r0.\u0663-abc.partial",
        f".a.r0.{2**40}-abc.partial",
        ".a.r0",
    ):
        assert partial_writer(bad) is None, bad


def test_stale_partial_bounds():
    now = 1_000_000.0
    ours, dead = writer_namespace(), dead_pid()
    mine = f".k.r0.{ours}-{os.getpid()}-abc.partial"
    other = f".k.r0.{FOREIGN}-{os.getpid()}-abc.partial"
    old_style = f".k.r0.{os.getpid()}-abc.partial"
    assert FOREIGN_PARTIAL_MAX_AGE_S < OWN_PARTIAL_MAX_AGE_S
    # Ours: the pid decides, up to the upper bound.
    assert not is_stale_partial(mine, now - OWN_PARTIAL_MAX_AGE_S + 1, now_s=now)
    assert is_stale_partial(mine, now - OWN_PARTIAL_MAX_AGE_S - 1, now_s=now)
    assert is_stale_partial(f".k.r0.{ours}-{dead}-abc.partial", now, now_s=now)
    # Another namespace's and old-style names: the age alone, whatever the pid is here.
    for name in (other, old_style, f".k.r0.{FOREIGN}-{dead}-abc.partial", f".k.r0.{dead}-abc.partial"):
        assert not is_stale_partial(name, now, now_s=now), name
        assert not is_stale_partial(name, now - FOREIGN_PARTIAL_MAX_AGE_S + 1, now_s=now), name
        assert is_stale_partial(name, now - FOREIGN_PARTIAL_MAX_AGE_S - 1, now_s=now), name
        # A stamp as far in the future was not set by a live writer either.
        assert is_stale_partial(name, now + FOREIGN_PARTIAL_MAX_AGE_S + 1, now_s=now), name
    assert is_stale_partial(mine, now + OWN_PARTIAL_MAX_AGE_S + 1, now_s=now)
    # A name that names no writer, at once; a file that is no partial, never.
    assert is_stale_partial(f".k.r0.{ours}-nopid-abc.partial", now, now_s=now)
    assert not is_stale_partial("k.r0", now - 10 * OWN_PARTIAL_MAX_AGE_S, now_s=now)


def test_scan_cleans_partials_of_other_containers_by_age(tmp_path):
    root = tmp_path / "disk"
    k = key_of(0)
    write_shard(root, k, 0, 1000)
    dead = dead_pid()
    ours_dead = partial_name(root, k, dead)
    ours_live_aging = partial_name(root, k, os.getpid())  # past the foreign bound, within ours
    foreign_young_dead = partial_name(root, k, dead, writer=FOREIGN)  # alive in its own container
    foreign_old_live = partial_name(root, k, os.getpid(), writer=FOREIGN)  # a pid alive here means nothing
    old_style_young_dead = partial_name(root, k, dead, writer="")
    old_style_old_live = partial_name(root, k, os.getpid(), writer="")
    for p in (
        ours_dead,
        ours_live_aging,
        foreign_young_dead,
        foreign_old_live,
        old_style_young_dead,
        old_style_old_live,
    ):
        p.write_bytes(b"half a chunk")
    age(ours_live_aging, FOREIGN_PARTIAL_MAX_AGE_S + 120)
    age(foreign_young_dead, 120)
    age(foreign_old_live, FOREIGN_PARTIAL_MAX_AGE_S + 120)
    age(old_style_young_dead, 120)
    age(old_style_old_live, FOREIGN_PARTIAL_MAX_AGE_S + 120)

    result = disk.scan(root, NAMESPACE, shards=1)
    assert result.removed_partials == 3
    assert not ours_dead.exists() and not foreign_old_live.exists() and not old_style_old_live.exists()
    assert ours_live_aging.exists() and foreign_young_dead.exists() and old_style_young_dead.exists()
    assert [c[0] for c in result.chunks] == [k] and result.other == [] and result.skipped == 0
    # Once they age past the bound, the young ones go too.
    for p in (foreign_young_dead, old_style_young_dead):
        age(p, FOREIGN_PARTIAL_MAX_AGE_S + 1)
    assert disk.scan(root, NAMESPACE, shards=1).removed_partials == 2
    assert not foreign_young_dead.exists() and not old_style_young_dead.exists() and ours_live_aging.exists()


def test_writer_in_another_pid_namespace_names_another_writer(tmp_path):
    """Really in another pid namespace, where the kernel lets this test make one."""
    code = "from s3kv.stores.local import writer_namespace; print(writer_namespace())"
    try:
        proc = subprocess.run(
            ["unshare", "--pid", "--fork", sys.executable, "-c", code],
            cwd=REPO,
            capture_output=True,
            text=True,
            timeout=BUSY_BOUND_S,
        )
    except FileNotFoundError:
        pytest.skip("no unshare(1) here")
    if proc.returncode != 0:
        pytest.skip(f"cannot make a pid namespace here: {proc.stderr.strip()[-200:]}")
    theirs = proc.stdout.strip()
    assert len(theirs) == 12 and theirs != writer_namespace()
    same = subprocess.run(
        [sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=BUSY_BOUND_S
    )
    assert same.stdout.strip() == writer_namespace()


def test_writer_namespace_without_proc(monkeypatch):
    import s3kv.stores.local as local

    with_proc = writer_namespace()
    monkeypatch.setattr(local, "_BOOT_ID", Path("/nonexistent/boot_id"))
    monkeypatch.setattr(local, "_PID_NAMESPACE", Path("/nonexistent/ns/pid"))
    monkeypatch.setattr(local.socket, "gethostname", lambda: "host-a")
    local.writer_namespace.cache_clear()
    try:
        host_a = writer_namespace()
        local.writer_namespace.cache_clear()
        monkeypatch.setattr(local.socket, "gethostname", lambda: "host-b")
        host_b = writer_namespace()
    finally:
        local.writer_namespace.cache_clear()
    assert len(host_a) == 12 and host_a != host_b
    if Path("/proc/self/ns/pid").exists():
        assert with_proc not in (host_a, host_b)


def test_check_writable(tmp_path):
    root = tmp_path / "a" / "b"
    disk.check_writable(root)
    assert root.is_dir() and os.listdir(root) == []
    afile = tmp_path / "afile"
    afile.write_bytes(b"not a directory")
    with pytest.raises(OSError):
        disk.check_writable(afile / "sub")
    with pytest.raises(OSError):
        disk.check_writable(afile)


def test_try_lock_conflicts_within_a_process(tmp_path):
    fd = disk.try_lock(tmp_path)
    assert fd is not None
    try:
        assert disk.try_lock(tmp_path) is None  # another open file description
    finally:
        os.close(fd)
    again = disk.try_lock(tmp_path)
    assert again is not None
    os.close(again)


def test_try_lock_held_by_another_process(tmp_path):
    holder = (
        "import fcntl, os, sys\n"
        "fd = os.open(sys.argv[1], os.O_RDWR | os.O_CREAT)\n"
        "fcntl.flock(fd, fcntl.LOCK_EX)\n"
        "print('locked', flush=True)\n"
        "sys.stdin.read()\n"  # holds the lock until killed
    )
    proc = subprocess.Popen(
        [sys.executable, "-c", holder, str(tmp_path / disk.LOCK_NAME)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert proc.stdout.readline() == "locked\n"
        assert disk.try_lock(tmp_path) is None
    finally:
        proc.kill()
        proc.wait()
    fd = disk.try_lock(tmp_path)
    assert fd is not None
    os.close(fd)


# -- a writer killed with SIGKILL mid-write -------------------------------------
CRASH_LAYERS, CRASH_LAYER_BYTES, CRASH_KEYS = 8, 256 << 10, 16
CRASH_FMT = PageFormat("bfloat16", 2, (2, 1, 32, 2048), 32, CRASH_LAYER_BYTES)


def crash_codec():
    return make_codec("zstd", num_layers=CRASH_LAYERS, fmt=CRASH_FMT)


def crash_layers(key: bytes) -> list[np.ndarray]:
    rng = np.random.default_rng(int.from_bytes(key, "little"))
    return [np.frombuffer(rng.bytes(CRASH_LAYER_BYTES), dtype=np.uint8) for _ in range(CRASH_LAYERS)]


def crash_writer(root: str, start: int) -> None:
    """The child: write chunks into ``root`` forever, saying so after each.
    Blobs are encoded once, so that most of the time goes to writing files."""
    tier = DiskTier(root, crash_codec(), fsync=False)
    blobs: dict[bytes, bytes] = {}
    for i in range(start, start + 10**6):
        key = key_of(i % CRASH_KEYS)
        if key not in blobs:
            blobs[key] = ChunkData(key, tier.codec, layers=crash_layers(key)).blob
        tier.write(key, ChunkData(key, tier.codec, blob=blobs[key]))
        print(i, flush=True)


def run_and_kill(root: Path, start: int, rng: random.Random) -> None:
    code = f"from tests.unit.test_nvme_files import crash_writer; crash_writer({str(root)!r}, {start})"
    proc = subprocess.Popen([sys.executable, "-c", code], cwd=REPO, stdout=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + BUSY_BOUND_S
        written = 0
        while written < 2:  # let it get going
            ready, _, _ = select.select([proc.stdout], [], [], max(0.0, deadline - time.monotonic()))
            assert ready and proc.stdout.readline(), "the writer did not start writing"
            written += 1
        time.sleep(rng.uniform(0.0, 0.2))  # the moment of the kill: random, as a crash's is
    finally:
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
    assert proc.returncode == -signal.SIGKILL


def test_writer_killed_mid_write_leaves_no_file_loaded_as_valid(tmp_path):
    root = tmp_path / "disk"
    rng = random.Random(os.getpid())
    for round_ in range(5):
        run_and_kill(root, start=3 * round_, rng=rng)
    partials = list(root.rglob("*.partial"))
    result = disk.scan(root, NAMESPACE, shards=1)
    assert result.removed_partials == len(partials)
    assert list(root.rglob("*.partial")) == []

    tier = DiskTier(root, crash_codec())
    valid, corrupt = [], []
    for path in root.rglob("*.r0"):
        key = bytes.fromhex(path.name.removesuffix(".r0"))
        assert key in {key_of(i) for i in range(CRASH_KEYS)}
        try:
            got = read_raw(through_handler(tier), key, None)
        except CorruptChunk:
            corrupt.append(key)
            continue
        assert got == [a.tobytes() for a in crash_layers(key)], key.hex()
        valid.append(key)
    assert corrupt == []
    assert len(valid) >= 2
    assert sorted(c[0] for c in result.chunks) == sorted(valid) and result.other == []


# -- reading a chunk file: only a regular file of at most a chunk's size, never a link -----------


def returned_within(timeout_s: float, fn: Any, *args: Any) -> Any:
    """``fn(*args)`` in a daemon thread: what it returned or raised;
    AssertionError if it is still running after ``timeout_s`` (it blocks)."""
    outcome: dict[str, Any] = {}

    def call() -> None:
        try:
            outcome["value"] = fn(*args)
        except BaseException as e:
            outcome["error"] = e

    thread = threading.Thread(target=call, daemon=True)
    thread.start()
    thread.join(timeout_s)
    assert not thread.is_alive(), f"{fn.__name__} still blocked after {timeout_s:.0f} s"
    if "error" in outcome:
        raise outcome["error"]
    return outcome.get("value")


def _tier_with_chunk(root: Path) -> tuple[DiskTier, bytes, bytes]:
    chunk_codec = make_codec()
    tier = DiskTier(root, chunk_codec)
    key = key_of(7)
    tier.write(key, make_chunk(chunk_codec, key))
    return tier, key, tier.path(key).read_bytes()


def test_a_disk_read_never_follows_a_symlink(tmp_path):
    tier, key, good = _tier_with_chunk(tmp_path / "disk")
    target = tmp_path / "elsewhere"
    target.write_bytes(good)  # a valid chunk, but not the tier's file
    path = tier.path(key)
    path.unlink()
    path.symlink_to(target)
    with pytest.raises(CorruptChunk, match="symlink"):
        read_raw(through_handler(tier), key, None)
    assert path.is_symlink() and target.read_bytes() == good  # left alone, as the scan leaves it


@pytest.mark.parametrize("kind", ["fifo", "directory", "socket"])
def test_a_disk_read_refuses_what_is_not_a_regular_file_without_blocking(tmp_path, kind, monkeypatch):
    tier, key, _ = _tier_with_chunk(tmp_path / "disk")
    path = tier.path(key)
    path.unlink()
    sock = None
    if kind == "fifo":
        os.mkfifo(path)  # no writer: a plain open() would block here for ever
    elif kind == "directory":
        path.mkdir()
    else:
        sock = socket.socket(socket.AF_UNIX)
        monkeypatch.chdir(path.parent)  # a socket's path must be short
        sock.bind(path.name)
    try:
        with pytest.raises(CorruptChunk, match="not a regular file"):
            returned_within(BUSY_BOUND_S, read_raw, through_handler(tier), key, None)
        assert path.exists()
    finally:
        if sock is not None:
            sock.close()


def test_a_disk_file_larger_than_a_chunk_is_deleted_unread(tmp_path, monkeypatch):
    tier, key, good = _tier_with_chunk(tmp_path / "disk")
    path = tier.path(key)
    limit = tier.codec.max_object
    with open(path, "ab") as f:
        f.truncate(limit + 1)  # sparse: costs no disk
    reads = []
    real_read, real_pread, real_preadv = os.read, os.pread, os.preadv
    monkeypatch.setattr(os, "read", lambda fd, n: reads.append(n) or real_read(fd, n))
    monkeypatch.setattr(os, "pread", lambda fd, n, off: reads.append(n) or real_pread(fd, n, off))
    monkeypatch.setattr(os, "preadv", lambda fd, bufs, off: reads.append(bufs) or real_preadv(fd, bufs, off))
    with pytest.raises(CorruptChunk, match=f"{limit + 1} bytes, more than a chunk's {limit}"):
        read_raw(through_handler(tier), key, None)
    assert reads == [] and not path.exists()


def test_a_corrupt_disk_file_is_deleted_after_the_failed_read(tmp_path):
    tier, key, good = _tier_with_chunk(tmp_path / "disk")
    path = tier.path(key)
    bad = bytearray(good)
    bad[-10] ^= 1
    path.write_bytes(bytes(bad))
    with pytest.raises(CorruptChunk, match="checksum mismatch"):
        read_raw(through_handler(tier), key, None)
    assert not path.exists()
    with pytest.raises(NotFound):  # the next read is a plain miss
        read_raw(through_handler(tier), key, None)
    tier.write(key, make_chunk(tier.codec, key))
    assert read_raw(through_handler(tier), key, None) == [
        a.tobytes() for a in make_chunk(tier.codec, key).layers
    ]


# -- codec none: frames read with preadv into one reused buffer, checked there ------


def _none_tier(root: Path, keys=None) -> tuple[DiskTier, bytes]:
    import dataclasses

    chunk_codec = dataclasses.replace(make_codec("none"), keys=keys)
    tier = DiskTier(root, chunk_codec)
    key = key_of(8)
    tier.write(key, make_chunk(chunk_codec, key))
    return tier, key


def _corrupt_frame_1(path: Path) -> tuple[bytes, Any]:
    """Flip a bit inside frame 1 of the file at ``path``: its new bytes, and the frame."""
    from s3kv import codec

    data = bytearray(path.read_bytes())
    f = codec.parse_header(bytes(data)).frames[1]
    data[f.offset + 5] ^= 0x40
    path.write_bytes(bytes(data))
    return bytes(data), f


def test_a_none_file_is_read_frame_by_frame_into_one_reused_buffer(tmp_path, monkeypatch):
    tier, key = _none_tier(tmp_path / "disk")
    expected = [a.tobytes() for a in make_chunk(tier.codec, key).layers]
    preadv = []
    real = os.preadv
    monkeypatch.setattr(os, "preadv", lambda fd, bufs, off: preadv.append(off) or real(fd, bufs, off))
    monkeypatch.setattr(os, "read", lambda fd, n: pytest.fail("a none file is not read whole"))
    seen: list[tuple[int, bytes, np.ndarray]] = []
    tier.read(key, Frames(lambda i, a: seen.append((i, a.tobytes(), a))))
    assert [s[1] for s in seen] == expected and [s[0] for s in seen] == list(range(len(expected)))
    assert all(s[2] is seen[0][2] for s in seen)  # one buffer, reused for every frame
    assert len(preadv) == len(expected)


def test_a_none_file_corrupted_after_its_header_fails_at_that_frame_and_is_deleted(tmp_path):
    """The header checks out; frame 1's bytes do not. Frame 0 reached the
    sink (verified), frame 1 never did: the read fails and the file goes."""
    tier, key = _none_tier(tmp_path / "disk")
    path = tier.path(key)
    _corrupt_frame_1(path)
    seen: list[int] = []
    with pytest.raises(CorruptChunk, match="frame 1: checksum mismatch"):
        tier.read(key, Frames(lambda i, a: seen.append(i)))
    assert seen == [0] and not path.exists()


def test_out_of_memory_while_checking_a_none_file_keeps_it(tmp_path, monkeypatch):
    """A MemoryError while a frame is checked is the host's, not the file's
    (as for an S3 object, :func:`~s3kv.chunk_reader.as_corrupt`): the read
    fails with it and the file stays."""
    from s3kv import codec

    tier, key = _none_tier(tmp_path / "disk")
    path = tier.path(key)

    def out_of_memory(*a, **kw):
        raise MemoryError

    monkeypatch.setattr(codec, "check_frame_parts", out_of_memory)
    with pytest.raises(MemoryError):
        tier.read(key, Frames(lambda i, a: None))
    assert path.exists()


def test_a_none_file_cut_short_or_signed_with_another_key_is_refused(tmp_path):
    from s3kv.auth import FleetKeys

    tier, key = _none_tier(tmp_path / "a")
    path = tier.path(key)
    path.write_bytes(path.read_bytes()[:-7])
    with pytest.raises(CorruptChunk, match="its header says"):
        tier.read(key, Frames(lambda i, a: None))
    assert not path.exists()
    ours, theirs = (
        FleetKeys(["disk-test-secret-0123456789abcdef-ours"]),
        FleetKeys(["disk-test-secret-theirs-0123456789abcdef"]),
    )
    signed, key = _none_tier(tmp_path / "b", ours)
    got: list[bytes] = []
    signed.read(key, Frames(lambda i, a: got.append(a.tobytes())))  # MACs checked in the buffer
    assert got == [a.tobytes() for a in make_chunk(signed.codec, key).layers]
    other, _ = _none_tier(tmp_path / "c", theirs)
    other.root = signed.root
    with pytest.raises(CorruptChunk, match="not one of the fleet's keys"):
        other.read(key, Frames(lambda i, a: None))


# -- codec none, read into the destination (Gate.read_into) ---------------------------

CHUNK = LoadChunk(b"k" * 16, (0,), 0, 1, ())
"""The chunk a test's Gate loads (its pages are the test's functions)."""


def _split_target(nbytes: int, pieces: int, private: bool = False) -> tuple[PageTarget, list[int]]:
    """A target of ``pieces`` buffers (uneven sizes), and its commit log;
    ``private``: a staging buffer of its own (a device's), else the pages."""
    cuts = sorted(random.Random(nbytes + pieces).sample(range(1, nbytes), pieces - 1))
    sizes = [b - a for a, b in zip([0, *cuts], [*cuts, nbytes])]
    commits: list[int] = []
    buffers = [np.zeros(n, np.uint8) for n in sizes]
    return PageTarget(buffers, lambda: commits.append(1), private=private), commits


def _needs_page_cache_reads(tier: DiskTier) -> None:
    """Skip unless reads from the page cache that never wait for the device
    (``RWF_NOWAIT``) work where ``tier`` keeps its files (not on tmpfs, nor
    before Linux 5.9)."""
    probe = tier.root / "probe"
    probe.write_bytes(b"x" * 4096)
    fd = os.open(probe, os.O_RDONLY)
    try:
        got = disk.preadv_cached(fd, [np.zeros(4096, np.uint8)], 0) if disk.NOWAIT_READS else None
    finally:
        os.close(fd)
        probe.unlink()
    if got != 4096:
        pytest.skip(f"no reads from the page cache without waiting here ({got})")


def _recorded_preadv(monkeypatch, calls: list, nowait=None) -> None:
    """Record every os.preadv as (buffers, offset, flags); ``nowait(fd,
    buffers, offset, flags)`` stands in for the kernel's RWF_NOWAIT reads."""
    real = os.preadv

    def preadv(fd, buffers, offset, *flags):
        calls.append((list(buffers), offset, flags))
        if flags and nowait is not None:
            return nowait(fd, buffers, offset, *flags)
        return real(fd, buffers, offset, *flags)

    monkeypatch.setattr(os, "preadv", preadv)


def _gate_into(targets, promoted: list, pages_sink: list | None = None):
    from s3kv.tiering.worker.gate import Gate

    sink = pages_sink if pages_sink is not None else []
    return Gate(
        Pages(lambda c, i, a: sink.append(i), lambda c, i: targets[i]),
        CHUNK,
        [lambda i, a: promoted.append((i, a.tobytes()))],
    )


@pytest.mark.parametrize("private", [False, True], ids=["pages", "staging"])
@pytest.mark.parametrize("signed", [False, True])
def test_a_cached_none_file_is_read_straight_into_its_pages_in_one_pass(
    tmp_path, monkeypatch, signed, private
):
    """A file the page cache holds: one preadv(RWF_NOWAIT) for the whole
    chunk, from its first frame, into every frame's target buffers
    themselves (the pages on the host: no copy of our own), each frame
    checked there (checksum or MAC), then committed and promoted in order."""
    from s3kv import codec
    from s3kv.auth import FleetKeys

    keys = FleetKeys(["disk-test-secret-0123456789abcdef-ours"]) if signed else None
    tier, key = _none_tier(tmp_path / "disk", keys)
    _needs_page_cache_reads(tier)
    expected = [a.tobytes() for a in make_chunk(tier.codec, key).layers]
    targets, commits = zip(*(_split_target(len(e), 3, private) for e in expected))
    calls: list[Any] = []
    _recorded_preadv(monkeypatch, calls)
    pages_sink: list[int] = []
    promoted: list[tuple[int, bytes]] = []
    tier.read(key, _gate_into(targets, promoted, pages_sink))
    assert [b"".join(b.tobytes() for b in t.buffers) for t in targets] == expected
    assert all(c == [1] for c in commits) and pages_sink == []
    assert promoted == list(enumerate(expected))
    ((buffers, offset, flags),) = calls  # one read for the chunk
    assert flags == (os.RWF_NOWAIT,)
    assert offset == codec.parse_header(tier.path(key).read_bytes()).frames[0].offset
    pages = [b for t in targets for b in t.buffers]
    assert len(buffers) == len(pages) and all(g is b for g, b in zip(buffers, pages))


_REAL_PREADV = os.preadv


def _short(limit: int):
    """A RWF_NOWAIT read that finds only the first ``limit`` bytes cached."""
    real = _REAL_PREADV

    def nowait(fd, buffers, offset, flags):
        cut, left = [], limit
        for b in buffers:
            if left <= 0:
                break
            cut.append(memoryview(b)[:left])
            left -= len(cut[-1])
        return real(fd, cut, offset, flags)

    return nowait


def _eagain(fd, buffers, offset, flags):
    raise BlockingIOError(errno.EAGAIN, "not in the page cache")


@pytest.mark.parametrize("private", [False, True], ids=["pages", "staging"])
@pytest.mark.parametrize("cached", ["none (EAGAIN)", "frame 0 and part of 1"])
def test_what_the_page_cache_lacks_is_read_aside_from_where_it_stopped(
    tmp_path, monkeypatch, private, cached
):
    """The one pass gets frame 0 and part of frame 1 (a short read), or
    nothing (EAGAIN): the rest is read from where it stopped (the file in
    order, as the kernel's readahead wants it) with reads that may stall,
    into buffers of the read's own (this thread's, not the pages; a
    staging buffer is the target's own), and copied into the pages under
    the lock; frame 1 is checked whole once its rest is there. Every frame
    arrives, is committed and promoted once, in order."""
    from s3kv import codec

    tier, key = _none_tier(tmp_path / "disk")
    expected = [a.tobytes() for a in make_chunk(tier.codec, key).layers]
    frames = codec.parse_header(tier.path(key).read_bytes()).frames
    targets, commits = zip(*(_split_target(len(e), 3, private) for e in expected))
    partly = 700 if cached.startswith("frame 0") else 0
    first_aside = 1 if partly else 0
    calls: list[Any] = []
    _recorded_preadv(monkeypatch, calls, _short(len(expected[0]) + partly) if partly else _eagain)
    promoted: list[tuple[int, bytes]] = []
    tier.read(key, _gate_into(targets, promoted))
    assert [b"".join(b.tobytes() for b in t.buffers) for t in targets] == expected
    assert all(c == [1] for c in commits) and promoted == list(enumerate(expected))
    (nowait, *aside) = calls
    assert nowait[2] == (os.RWF_NOWAIT,) and nowait[1] == frames[0].offset
    starts = [frames[first_aside].offset + partly] + [f.offset for f in frames[first_aside + 1 :]]
    assert [(off, flags) for _, off, flags in aside] == [(at, ()) for at in starts]
    assert [sum(len(b) for b in buffers) for buffers, _, _ in aside] == [
        f.length - (partly if i == 0 else 0) for i, f in enumerate(frames[first_aside:])
    ]
    for (buffers, _, _), t in zip(aside, targets[first_aside:]):
        shared = [any(np.shares_memory(g.obj, b) for b in t.buffers) for g in buffers]
        if private:  # the very buffers
            assert all(shared)
        else:  # this thread's own, not the pages
            assert len(buffers) == 1 and not any(shared)


@pytest.mark.parametrize("why", ["EOPNOTSUPP", "not the owner", "kernel"])
def test_where_reads_cannot_skip_the_device_every_frame_is_read_aside(tmp_path, monkeypatch, why):
    """A file system without RWF_NOWAIT (tmpfs; EOPNOTSUPP: the tier stops
    asking), a file this user may not open with O_NOATIME (a read would
    update its access time, and may wait for the journal), a kernel before
    5.9 (its RWF_NOWAIT may start readahead): every frame is read aside,
    and the chunk still loads. A control read first shows the one pass."""
    tier, key = _none_tier(tmp_path / "disk")
    _needs_page_cache_reads(tier)
    expected = [a.tobytes() for a in make_chunk(tier.codec, key).layers]
    calls: list[Any] = []

    def load() -> list[tuple]:
        calls.clear()
        targets, _ = zip(*(_split_target(len(e), 2) for e in expected))
        promoted: list[tuple[int, bytes]] = []
        tier.read(key, _gate_into(targets, promoted))
        assert [b"".join(b.tobytes() for b in t.buffers) for t in targets] == expected
        return [flags for _, _, flags in calls]

    real, unsupported = os.preadv, [False]

    def nowait(fd, buffers, offset, flags):
        if unsupported[0]:
            raise OSError(errno.EOPNOTSUPP, "Operation not supported")
        return real(fd, buffers, offset, flags)

    _recorded_preadv(monkeypatch, calls, nowait)
    assert load() == [(os.RWF_NOWAIT,)]  # the control: one pass from the page cache
    if why == "EOPNOTSUPP":
        unsupported[0] = True
        assert load() == [(os.RWF_NOWAIT,)] + [()] * len(expected)
        assert not tier.direct.nowait
    elif why == "not the owner":
        real_open = os.open

        def open_(path, flags, *a, **kw):
            if flags & disk.O_NOATIME:
                raise PermissionError(errno.EPERM, "Operation not permitted")
            return real_open(path, flags, *a, **kw)

        monkeypatch.setattr(os, "open", open_)
    else:
        monkeypatch.setattr(
            os, "uname", lambda: os.uname_result(("Linux", "h", "5.8.18-100", "#1", "x86_64"))
        )
        assert not disk._kernel_at_least(5, 9)
        monkeypatch.setattr(disk, "NOWAIT_READS", disk._kernel_at_least(5, 9))
        tier = DiskTier(tier.root, tier.codec)
    assert load() == [()] * len(expected)


@pytest.mark.parametrize(
    "release, at_least",
    [("5.9.0", True), ("5.10.1-arch", True), ("6.18.44-fc-v1272", True), ("5.8.18", False), ("4.19", False)],
)
def test_reads_skip_the_device_from_linux_5_9(monkeypatch, release, at_least):
    monkeypatch.setattr(os, "uname", lambda: os.uname_result(("Linux", "h", release, "#1", "x86_64")))
    assert disk._kernel_at_least(5, 9) == at_least


@pytest.mark.parametrize("private", [False, True], ids=["pages", "staging"])
@pytest.mark.parametrize("signed", [False, True])
def test_a_none_file_is_read_into_its_own_buffer_checked_there_then_committed(
    tmp_path, monkeypatch, signed, private
):
    """What the page cache does not hold: preadv writes each frame into a
    buffer of the read's own: a target's
    private staging buffer itself (no copy), else this thread's reused
    buffer, copied into the pages (the target's buffers) once its checksum
    or MAC passed there; the commit follows, and the promotions (the gate's
    other sinks) get the checked frame."""
    from s3kv.auth import FleetKeys
    from s3kv.tiering.worker.gate import Gate

    keys = FleetKeys(["disk-test-secret-0123456789abcdef-ours"]) if signed else None
    tier, key = _none_tier(tmp_path / "disk", keys)
    monkeypatch.setattr(disk, "preadv_cached", lambda fd, buffers, offset: 0)  # none of it cached
    expected = [a.tobytes() for a in make_chunk(tier.codec, key).layers]
    targets, commits = zip(*(_split_target(len(e), 3, private) for e in expected))
    reads: list[list[Any]] = []
    real = os.preadv
    monkeypatch.setattr(os, "preadv", lambda fd, bufs, off: reads.append(list(bufs)) or real(fd, bufs, off))
    pages_sink: list[int] = []
    promoted: list[tuple[int, bytes]] = []
    gate = Gate(
        Pages(lambda c, i, a: pages_sink.append(i), lambda c, i: targets[i]),
        CHUNK,
        [lambda i, a: promoted.append((i, a.tobytes()))],
    )
    tier.read(key, gate)
    assert [b"".join(b.tobytes() for b in t.buffers) for t in targets] == expected
    assert all(c == [1] for c in commits)
    assert pages_sink == []  # the target took the pages' place
    assert promoted == list(enumerate(expected))
    assert len(reads) == len(expected)
    for got, t in zip(reads, targets):
        shared = [np.shares_memory(np.frombuffer(g, np.uint8), b) for g in got for b in t.buffers]
        if private:  # the very buffers, not copies
            assert len(got) == 3 and shared == [i == j for i in range(3) for j in range(3)]
        else:  # one buffer, not the pages
            assert len(got) == 1 and not any(shared)
    if not private:
        assert all(r[0].obj is reads[0][0].obj for r in reads)  # the thread's, reused


@pytest.mark.parametrize("cached", [False, True], ids=["from the disk", "page cache"])
@pytest.mark.parametrize("private", [False, True], ids=["pages", "staging"])
def test_a_frame_that_fails_its_check_is_not_committed_and_the_load_fails(
    tmp_path, monkeypatch, private, cached
):
    """Frame 1 fails its check: it is not committed and nothing after it
    is promoted; the read raises CorruptChunk (a load error: vLLM
    recomputes those blocks, or the next source writes them again) and the
    file goes. Read from the disk, its bad bytes never reach the pages
    (checked in the read's own buffer: a private staging buffer gets them,
    but is never committed). Read from the page cache they were read
    straight into the pages, and checked there: blocks of this load only
    (:meth:`Gate.read_into`'s contract), which the failed load gives up."""
    from s3kv import codec
    from s3kv.tiering.worker.gate import Gate

    tier, key = _none_tier(tmp_path / "disk")
    if cached:
        _needs_page_cache_reads(tier)
    else:
        monkeypatch.setattr(disk, "preadv_cached", lambda fd, buffers, offset: 0)
    path = tier.path(key)
    data, f = _corrupt_frame_1(path)
    targets, commits = zip(
        *(_split_target(fr.raw_length, 2, private) for fr in codec.parse_header(bytes(data)).frames)
    )
    promoted: list[int] = []
    with pytest.raises(CorruptChunk, match="frame 1: checksum mismatch"):
        tier.read(
            key,
            Gate(
                Pages(lambda c, i, a: None, lambda c, i: targets[i]), CHUNK, [lambda i, a: promoted.append(i)]
            ),
        )
    got = b"".join(b.tobytes() for b in targets[1].buffers)
    assert got == (bytes(data[f.offset : f.end]) if private or cached else bytes(f.raw_length))
    assert list(commits[:3]) == [[1], [], []] and promoted == [0]
    assert not path.exists()


def test_a_closed_gate_reads_nothing_more():
    from s3kv.tiering.worker.gate import Gate

    gate = Gate(Pages(lambda c, i, a: pytest.fail("closed"), lambda c, i: pytest.fail("closed")), CHUNK)
    gate.close()
    gate.read_into(0, 16, lambda out: pytest.fail("closed"))
    gate.read_into(0, 16, lambda out: pytest.fail("closed"), may_stall=True)


@pytest.mark.parametrize("private", [False, True], ids=["pages", "staging"])
def test_a_read_that_may_stall_holds_no_lock_and_a_late_one_lands_nowhere(private):
    """A disk read that hangs holds nothing close() (the engine's loop)
    needs; when it returns after the gate closed, its bytes reach neither
    the pages nor a sink, and nothing is committed."""
    from s3kv.tiering.worker.gate import Gate

    target, commits = _split_target(64, 2, private)
    sunk: list[int] = []
    gate = Gate(
        Pages(lambda c, i, a: sunk.append(i), lambda c, i: target), CHUNK, [lambda i, a: sunk.append(i)]
    )
    reading, resume = threading.Event(), threading.Event()

    def hung_read(out: list[np.ndarray]) -> None:
        reading.set()
        resume.wait()
        for b in out:
            b[:] = 0xEE  # what the disk answers at last

    reader = threading.Thread(target=gate.read_into, args=(0, 64, hung_read), kwargs={"may_stall": True})
    reader.start()
    try:
        assert reading.wait(30)
        closer = threading.Thread(target=gate.close)
        closer.start()
        closer.join(30)
        assert not closer.is_alive()  # close() did not wait for the hung read
    finally:
        resume.set()
        reader.join(30)
    assert not reader.is_alive() and sunk == [] and commits == []
    pages = b"".join(b.tobytes() for b in target.buffers)
    assert pages == (b"\xee" * 64 if private else bytes(64))  # a private buffer is the read's own


def test_preadv_all_continues_short_reads_and_splits_at_iov_max(tmp_path, monkeypatch):
    path = tmp_path / "f"
    payload = bytes(range(256)) * 40
    path.write_bytes(payload)
    bufs = [np.zeros(n, np.uint8) for n in (100, 1, 3000, 7, 2000, 4000)]  # 9108 of 10240 bytes
    monkeypatch.setattr(disk, "IOV_MAX", 2)
    calls: list[int] = []
    real = os.preadv
    monkeypatch.setattr(  # at most 1000 bytes a call: every read is short
        os,
        "preadv",
        lambda fd, b, off: calls.append(len(b)) or real(fd, [memoryview(b[0])[:1000], *b[1:]][:1], off),
    )
    fd = os.open(path, os.O_RDONLY)
    try:
        assert disk.preadv_all(fd, bufs, 50) == sum(b.nbytes for b in bufs)
        assert b"".join(b.tobytes() for b in bufs) == payload[50 : 50 + 9108]
        assert max(calls) <= 2
        tail = [np.zeros(500, np.uint8), np.zeros(500, np.uint8)]
        assert disk.preadv_all(fd, tail, len(payload) - 600) == 600  # the file's end
    finally:
        os.close(fd)


def test_preadv_cached_splits_at_iov_max_and_stops_where_the_page_cache_does(tmp_path, monkeypatch):
    path = tmp_path / "f"
    payload = bytes(range(256)) * 40
    path.write_bytes(payload)
    tier = DiskTier(tmp_path, make_codec("none"))
    _needs_page_cache_reads(tier)
    monkeypatch.setattr(disk, "IOV_MAX", 2)
    calls: list[Any] = []
    cached = [4000]  # what the page cache holds of each call's bytes

    def nowait(fd, buffers, offset, flags):
        n = cached.pop(0) if cached else 10**9
        if n == 0:
            raise BlockingIOError(errno.EAGAIN, "not cached")
        return _short(n)(fd, buffers, offset, flags)

    _recorded_preadv(monkeypatch, calls, nowait)
    fd = os.open(path, os.O_RDONLY)
    try:
        bufs = [np.zeros(n, np.uint8) for n in (100, 1, 3000, 7, 2000, 4000)]
        cached[:] = [10**9, 10**9, 10**9]
        assert disk.preadv_cached(fd, bufs, 50) == 9108  # three calls of two buffers
        assert [len(c[0]) for c in calls] == [2, 2, 2]
        assert b"".join(b.tobytes() for b in bufs) == payload[50 : 50 + 9108]
        calls.clear()
        cached[:] = [10**9, 1000]  # the second call is short: no third
        assert (
            disk.preadv_cached(fd, [np.zeros(n, np.uint8) for n in (100, 1, 3000, 7, 2000, 4000)], 0) == 1101
        )
        assert len(calls) == 2
        calls.clear()
        cached[:] = [10**9, 0]  # EAGAIN at the second: what the first got
        assert disk.preadv_cached(fd, [np.zeros(n, np.uint8) for n in (100, 1, 3000, 7)], 0) == 101
        cached[:] = [0]
        assert disk.preadv_cached(fd, [np.zeros(10, np.uint8)], 0) == 0
    finally:
        os.close(fd)


class _StallingFrames:
    """A chunk of ``len(data)`` frames whose one pass gets frame 0 and part
    of frame 1, and whose read of frame 1 hangs until ``resume``, then
    answers ``late`` (what the disk holds by then); checks pass for
    ``data``'s bytes only."""

    def __init__(self, data: list[bytes], late: bytes) -> None:
        self.data = data
        self.nbytes = [len(d) for d in data]
        self.late = late
        self.reading, self.resume = threading.Event(), threading.Event()

    def cached(self, buffers):
        flat = np.frombuffer(b"".join(self.data), np.uint8)
        n, at = self.nbytes[0] + self.nbytes[1] // 2, 0
        for b in buffers:
            k = min(b.nbytes, n - at)
            if k <= 0:
                break
            b[:k] = flat[at : at + k]
            at += k
        return n

    def read(self, frame, out, start=0):
        data = self.data[frame]
        if frame == 1:
            self.reading.set()
            self.resume.wait()
            data = self.late
        flat = np.frombuffer(data, np.uint8)
        at = start
        for b in out:
            b[:] = flat[at : at + b.nbytes]
            at += b.nbytes

    def check(self, frame, parts):
        if b"".join(bytes(p) for p in parts) != self.data[frame]:
            raise CorruptChunk(f"frame {frame}: checksum mismatch")


@pytest.mark.parametrize("private", [False, True], ids=["pages", "staging"])
def test_a_chunk_read_that_stalls_after_the_page_cache_holds_no_lock_and_lands_nowhere(private):
    """The one pass got frame 0 (committed, promoted) and part of frame 1;
    frame 1's read from the disk hangs. close() (the engine's loop, on the
    load's timeout) does not wait for it; when it returns after the gate
    closed, nothing more is committed or promoted, its bytes (the disk's
    late answer, checked or not) never reach the pages, and frame 2 is
    never read."""
    from s3kv.tiering.worker.gate import Gate

    data = [bytes([i + 1]) * 64 for i in range(3)]
    frames = _StallingFrames(data, late=data[1])
    targets, commits = zip(*(_split_target(64, 2, private) for _ in data))
    promoted: list[int] = []
    gate = Gate(
        Pages(lambda c, i, a: promoted.append(-1), lambda c, i: targets[i]),
        CHUNK,
        [lambda i, a: promoted.append(i)],
    )
    reader = threading.Thread(target=gate.read_chunk_into, args=(frames,))
    reader.start()
    try:
        assert frames.reading.wait(30)
        assert list(commits) == [[1], [], []] and promoted == [0]
        closer = threading.Thread(target=gate.close)
        closer.start()
        closer.join(30)
        assert not closer.is_alive()  # close() did not wait for the hung read
    finally:
        frames.resume.set()
        reader.join(30)
    assert not reader.is_alive()
    assert list(commits) == [[1], [], []] and promoted == [0]
    pages = [b"".join(b.tobytes() for b in t.buffers) for t in targets]
    assert pages[0] == data[0] and pages[2] == bytes(64)
    if private:  # a private buffer is the read's own: the late answer stays there
        assert pages[1] == data[1]
    else:  # the pages keep the one pass's part of frame 1 (this load's blocks, never committed)
        assert pages[1] == data[1][:32] + bytes(32)


# -- reads under the gate's lock: only what the page cache holds whole, from a steady disk --


def _probe_fakes(starts_io: bool, refused: bool = False):
    """A kernel's RWF_NOWAIT read of the probe's evicted page (EAGAIN; where
    ``starts_io``, readahead of the file after it; ``refused``: EOPNOTSUPP)
    and the residency check that sees it: (preadv, resident, calls)."""
    cached = [0]
    calls: list[str] = []

    def preadv(fd, buffers, offset, flags):
        calls.append("read")
        assert flags == os.RWF_NOWAIT
        if refused:
            raise OSError(errno.EOPNOTSUPP, "Operation not supported")
        if starts_io:
            cached[0] = 32
        raise BlockingIOError(errno.EAGAIN, "not in the page cache")

    def resident(fd, size):
        calls.append("resident")
        return cached[0]

    return preadv, resident, calls


@pytest.mark.parametrize("starts_io", [True, False], ids=["starts I/O", "no I/O"])
def test_the_probe_keeps_the_residency_check_whether_or_not_a_nowait_read_starts_io(tmp_path, starts_io):
    """In the tier's directory: a probe file, its pages dropped, one
    RWF_NOWAIT read, then its pages counted. Readahead there (this
    kernel's kind) or none (older kernels, where a read meeting a readahead
    marker may still start it): every read under the lock asks the check
    first; the reason says which. The probe leaves no file."""
    preadv, resident, calls = _probe_fakes(starts_io)
    got = residency.probe_direct(tmp_path / "disk", preadv=preadv, resident=resident)
    assert got.nowait
    assert got.resident is resident
    assert got.why == ("NOWAIT starts readahead" if starts_io else "no readahead seen")
    assert calls[:3] == ["resident", "read", "resident"]
    assert list((tmp_path / "disk").iterdir()) == []


def test_the_probe_turns_reads_under_the_lock_off_where_it_cannot_tell(tmp_path):
    """No residency check here (no cachestat, mincore failing), or a file
    system that refuses RWF_NOWAIT (tmpfs), or pages that would not drop
    (then the check is kept): every read goes aside, or is checked."""
    preadv, resident, _ = _probe_fakes(starts_io=False)
    assert not residency.probe_direct(tmp_path, preadv=preadv, resident=None).nowait
    assert not residency.probe_direct(tmp_path, preadv=preadv, resident=lambda fd, size: None).nowait
    preadv, resident, _ = _probe_fakes(starts_io=False, refused=True)
    assert not residency.probe_direct(tmp_path, preadv=preadv, resident=resident).nowait
    preadv, _, _ = _probe_fakes(starts_io=False)
    stayed = residency.probe_direct(tmp_path, preadv=preadv, resident=lambda fd, size: 1)
    assert stayed.nowait and stayed.resident is not None
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("check", ["cachestat", "mincore"])
def test_the_residency_check_sees_evicted_pages(tmp_path, check):
    """The real checks (cachestat, Linux 6.5+; mincore over an mmap): a
    file the page cache holds whole passes; evicted, it fails."""
    tier, key = _none_tier(tmp_path / "disk")
    _needs_page_cache_reads(tier)
    path = tier.path(key)
    fd = os.open(path, os.O_RDONLY)
    try:
        made = (residency._cachestat_fn if check == "cachestat" else residency._mincore_fn)()
        fn = made if made is not None and made(fd, 1) is not None else None
        if fn is None:
            pytest.skip("no residency check here")
        size = os.fstat(fd).st_size
        direct = residency.DirectReads(True, fn)
        os.pread(fd, size, 0)
        assert direct.all_cached(fd, size)
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        assert fn(fd, size) == 0 and not direct.all_cached(fd, size)
    finally:
        os.close(fd)


def _locked_reads(monkeypatch, gate_of) -> list[tuple[int, tuple, bool]]:
    """Record every os.preadv as (offset, flags, whether the gate's lock is
    held), the gate being ``gate_of()``'s."""
    calls: list[tuple[int, tuple, bool]] = []
    real = os.preadv

    def preadv(fd, buffers, offset, *flags):
        calls.append((offset, flags, gate_of()._lock.locked()))
        return real(fd, buffers, offset, *flags)

    monkeypatch.setattr(os, "preadv", preadv)
    return calls


def _load(tier: DiskTier, key: bytes, monkeypatch) -> list[tuple[int, tuple, bool]]:
    """Load ``key`` through a Gate into split targets (the pages); its
    preadv calls as :func:`_locked_reads` records them."""
    expected = [a.tobytes() for a in make_chunk(tier.codec, key).layers]
    targets, commits = zip(*(_split_target(len(e), 2) for e in expected))
    promoted: list[tuple[int, bytes]] = []
    gate = _gate_into(targets, promoted)
    calls = _locked_reads(monkeypatch, lambda: gate)
    tier.read(key, gate)
    monkeypatch.undo()
    assert [b"".join(b.tobytes() for b in t.buffers) for t in targets] == expected
    assert all(c == [1] for c in commits) and promoted == list(enumerate(expected))
    return calls


@pytest.mark.parametrize("how", ["a fake check", "evicted (this kernel's check)"])
def test_a_file_the_page_cache_does_not_hold_whole_is_never_read_under_the_gate_lock(
    tmp_path, monkeypatch, how
):
    """Where a RWF_NOWAIT read starts I/O, the residency check comes first:
    a file that lacks a page (a fake check saying one short; or evicted
    just before the real check) gets no read at all under the gate's lock, every frame is
    read aside and the chunk loads. The control: all of it cached, one
    read under the lock."""
    tier, key = _none_tier(tmp_path / "disk")
    _needs_page_cache_reads(tier)
    n_frames = len(make_chunk(tier.codec, key).layers)
    if how == "a fake check":
        short = [False]
        tier.direct = residency.DirectReads(
            True, lambda fd, size: residency.pages_of(size) - (1 if short[0] else 0)
        )
        assert _load(tier, key, monkeypatch) == [(_first_offset(tier, key), (os.RWF_NOWAIT,), True)]
        short[0] = True
    else:
        real = tier.direct.resident
        if real is None:
            pytest.skip(f"no residency check on this machine ({tier.direct.why})")

        def evicted_first(fd, size):  # the header's read brought the file in: out it goes
            os.fsync(fd)  # written, not yet on the disk: its pages would not drop
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            return real(fd, size)

        tier.direct = residency.DirectReads(True, evicted_first)
    calls = _load(tier, key, monkeypatch)
    assert len(calls) == n_frames
    assert all(flags == () and not locked for _, flags, locked in calls)


def _first_offset(tier: DiskTier, key: bytes) -> int:
    from s3kv import codec

    return codec.parse_header(tier.path(key).read_bytes()).frames[0].offset


def test_a_disk_that_is_not_answering_in_time_gets_no_read_under_the_gate_lock(tmp_path, monkeypatch):
    """A read or write on the disk's threads past the tier's timeout, or a
    transfer that failed for the disk's sake (the breaker's pause) since
    the last success: the page cache's pass is skipped, every frame read
    aside. A read that goes well clears the failure."""
    from s3kv.tiering.placement import Tier
    from s3kv.tiering.plan import Place
    from s3kv.tiering.tiers.handler import Began
    from tests.tiers.conformance import _loop

    tier, key = _none_tier(tmp_path / "disk")
    _needs_page_cache_reads(tier)
    tier.direct = residency.DirectReads(True, None)  # the pass runs whenever it may
    handler = NvmeHandler(tier, timeout_s=5, write_queue_s=5)
    now = [100.0]
    handler.clock = lambda: now[0]
    n_frames = len(make_chunk(tier.codec, key).layers)
    one_pass = [(_first_offset(tier, key), (os.RWF_NOWAIT,), True)]
    assert _load(tier, key, monkeypatch) == one_pass

    async def began_at(at: float) -> Began:
        job = Began(handler._running[True], handler.clock)
        job.at = at
        return job

    stuck = _loop().run(began_at(now[0]), timeout=60)
    handler._running[True].add(stuck)  # a write under way for 5 s: not yet overdue
    now[0] += 5
    assert _load(tier, key, monkeypatch) == one_pass
    now[0] += 0.5  # overdue
    assert all(flags == () and not locked for _, flags, locked in _load(tier, key, monkeypatch))
    handler._running[True].discard(stuck)
    assert _load(tier, key, monkeypatch) == one_pass

    handler.failing()  # a transfer timed out: the breaker pauses the tier
    calls = _load(tier, key, monkeypatch)
    assert len(calls) == n_frames and all(flags == () and not locked for _, flags, locked in calls)
    gate = _gate_into(*_targets_for(tier, key))
    _loop().run(handler.read(Place(Tier.DISK), key, gate), timeout=60)  # the probe read goes well
    assert _load(tier, key, monkeypatch) == one_pass
    handler.close()


def _targets_for(tier: DiskTier, key: bytes):
    expected = [a.tobytes() for a in make_chunk(tier.codec, key).layers]
    targets, _ = zip(*(_split_target(len(e), 2) for e in expected))
    return targets, []


def test_the_page_cache_probe_runs_on_the_disks_threads_never_the_callers(tmp_path, monkeypatch):
    """A handler is made on vLLM's thread (when a step first carries the
    namespace): its probe of page-cache reads (a write, an fsync, a read) runs
    on the disk's own threads, so a disk that stalls then holds no forward.
    Reads go aside until the probe is done, then as it decided."""
    tier, key = _none_tier(tmp_path / "disk")
    _needs_page_cache_reads(tier)
    expected = residency.probe_direct(tmp_path / "other")
    release, ran_on = threading.Event(), []
    real = disk.probe_direct

    def stalled(root, **kw):
        ran_on.append(threading.current_thread().name)
        assert release.wait(60)
        return real(root, **kw)

    monkeypatch.setattr(disk, "probe_direct", stalled)
    tier.direct = residency.DIRECT_OFF
    handler = NvmeHandler(tier, timeout_s=5, write_queue_s=5, probe_reads=True)  # returns: the disk stalls
    assert handler.probe is not None and not handler.probe.done()
    calls = _load(tier, key, monkeypatch)
    assert calls and all(flags == () and not locked for _, flags, locked in calls)
    release.set()
    handler.probe.result(60)
    assert len(ran_on) == 1 and ran_on[0].startswith("s3kv-disk-write")
    assert tier.direct.nowait == expected.nowait
    if expected.nowait:
        assert _load(tier, key, monkeypatch) == [(_first_offset(tier, key), (os.RWF_NOWAIT,), True)]
    handler.close()
