"""The manifest protocol: how every writer (replicas, their ranks, gc,
verify) names and stamps manifest objects, and how readers find them.

Under ``{prefix}/{namespace}/manifest/`` (:func:`manifest_prefix`):

- ``seg/{ts}-{writer}-{seq}``: a *segment*, immutable: the fingerprints a
  writer stored since its last segment, and removals (tombstones). On a
  directory bucket (S3 Express One Zone: listings in no order, no
  StartAfter) ``seg/{minute}/{ts}-{writer}-{seq}``, ``minute`` being
  ``ts // 60000`` in :data:`MINUTE_DIGITS` digits: readers list the minutes
  from their floor on, each whole (:mod:`s3kv.manifest.listing`). Names
  sort by time in both layouts.
- ``snap/{ts}-{writer}``: a *snapshot*: every live fingerprint as of the
  segments its :class:`Horizon` covers, so a new replica loads the manifest
  with one listing and a few GETs.
- ``access/{yyyymmddhh}/{ts}-{writer}-{seq}``: *access records*:
  fingerprints of chunks used in that hour (UTC), for gc's
  least-recently-used policy.
- ``ep/{e_ms}/{e}``: an *epoch* (protocol "epochs",
  :mod:`s3kv.manifest.epochs`): every segment stamped up to the end of
  epoch ``e`` (stamps ``[e*e_ms, (e+1)*e_ms)``) that no earlier epoch
  covered, merged into one object by one replica (:func:`epoch_name`).
  ``e_ms`` is six digits (more for epochs over 1000 s), ``e`` twelve; replicas configured with another
  ``e_ms`` form a chain of their own.

``ts`` is milliseconds since the epoch, zero-padded, so names sort by time.
A writer stamps with a :class:`HybridClock`: ``max(its clock, newest ts it
has seen + 1)``. Readers list segments from a :func:`segment_floor`, a
margin (the clock skew) before the newest stamp they have seen, so writers
whose clocks disagree by less than the margin never miss each other's
segments. Writer ids are ``[0-9A-Za-z_]{1,64}``: a replica's
(:func:`new_writer_id`), a rank publisher's (:func:`rank_writer`), gc's
(:func:`gc_writer_id`).

This module does no I/O; :mod:`s3kv.manifest.format` owns the bytes.
"""

from __future__ import annotations

import functools
import os
import re
import threading
import time
import uuid
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

from s3kv.config import DEFAULTS

TS_DIGITS = 13
MINUTE_MS = 60_000
MINUTE_DIGITS = 9
HOUR_MS = 3_600_000
SEGMENTS = "seg/"
SNAPSHOTS = "snap/"
ACCESS = "access/"
EPOCHS = "ep/"
EPOCH_DIGITS = 12
EPOCH_MS_DIGITS = 6


# -- names -----------------------------------------------------------------------


def manifest_prefix(prefix: str, namespace: str) -> str:
    return f"{prefix}/{namespace}/manifest/" if prefix else f"{namespace}/manifest/"


def stamp(ts_ms: int) -> str:
    return f"{ts_ms:0{TS_DIGITS}d}"


def segment_dir(base: str, ts_ms: int) -> str:
    """The minute prefix a directory bucket's segment stamped ``ts_ms`` goes under."""
    return f"{base}{SEGMENTS}{ts_ms // MINUTE_MS:0{MINUTE_DIGITS}d}/"


def segment_name(base: str, ts_ms: int, writer: str, seq: int, *, directory: bool = False) -> str:
    where = segment_dir(base, ts_ms) if directory else base + SEGMENTS
    return f"{where}{stamp(ts_ms)}-{writer}-{seq:06d}"


def snapshot_name(base: str, ts_ms: int, writer: str) -> str:
    return f"{base}{SNAPSHOTS}{stamp(ts_ms)}-{writer}"


def epoch_ms(publish_s: float) -> int:
    """The length of an epoch (ms) for replicas publishing every ``publish_s``."""
    return max(1, round(publish_s * 1000))


def epoch_of(ts_ms: int, e_ms: int) -> int:
    """The epoch a stamp falls in."""
    return ts_ms // e_ms


def epoch_start(e: int, e_ms: int) -> int:
    """The first stamp of epoch ``e``."""
    return e * e_ms


def epoch_end(e: int, e_ms: int) -> int:
    """The last stamp of epoch ``e`` (inclusive): the epoch covers segments stamped up to it."""
    return (e + 1) * e_ms - 1


def epoch_name(base: str, e: int, e_ms: int) -> str:
    """The epoch object of epoch ``e`` of the chain of ``e_ms``-long epochs."""
    return f"{base}{EPOCHS}{e_ms:0{EPOCH_MS_DIGITS}d}/{e:0{EPOCH_DIGITS}d}"


def parse_epoch(base: str, key: str) -> tuple[int, int] | None:
    """(e, e_ms) of an epoch object's name, or None for any other name."""
    if not key.startswith(base + EPOCHS):
        return None
    m = _EPOCH.fullmatch(key[len(base) + len(EPOCHS) :])
    if m is None or int(m.group(1)) == 0:
        return None
    e, e_ms = int(m.group(2)), int(m.group(1))
    return (e, e_ms) if epoch_name(base, e, e_ms) == key else None  # one name per epoch


def access_hour(ts_ms: int) -> str:
    """The hour (UTC, ``yyyymmddhh``) an access record stamped ``ts_ms`` is filed under."""
    return time.strftime("%Y%m%d%H", time.gmtime(ts_ms / 1000))


def access_name(base: str, ts_ms: int, writer: str, seq: int) -> str:
    return f"{base}{ACCESS}{access_hour(ts_ms)}/{stamp(ts_ms)}-{writer}-{seq:06d}"


def record_hour(base: str, name: str) -> str:
    """The hour directory access record ``name`` is filed under."""
    return name[len(base) + len(ACCESS) :].split("/", 1)[0]


def access_hour_end(name: str, now: float) -> float:
    """When a chunk in access record ``name`` was last used, at the latest
    (seconds since the epoch): replicas record a key once per hour, at its
    first use, so a record of hour H stands for use until the end of H (or
    ``now``)."""
    ts = (name_ts(name) or 0) / 1000.0
    return min(now, (ts // 3600 + 1) * 3600)


def name_ts(name: str) -> int | None:
    """The millisecond stamp a segment, snapshot or access record name starts with."""
    leaf = name.rsplit("/", 1)[-1]
    head = leaf.split("-", 1)[0]
    return int(head) if len(head) == TS_DIGITS and head.isascii() and head.isdigit() else None


@dataclass(frozen=True)
class ManifestName:
    """What a manifest object's name says."""

    kind: str
    """segment, snapshot, access or epoch"""
    ts: int
    """Milliseconds since the epoch (an epoch object: its :func:`epoch_end`)."""
    writer: str
    """"" for an epoch object (its writer is in its header)."""
    seq: int | None
    """None for a snapshot; the epoch number for an epoch object."""


_WRITER = r"([0-9A-Za-z_]{1,64})"
# ASCII digits only: \d would take other scripts' digits, which int() reads
# and which sort after every name s3kv writes.
_NAMES = {
    SEGMENTS[:-1]: (
        "segment",
        re.compile(rf"(?:([0-9]{{{MINUTE_DIGITS}}})/)?([0-9]{{{TS_DIGITS}}})-{_WRITER}-([0-9]{{6,12}})"),
    ),
    SNAPSHOTS[:-1]: ("snapshot", re.compile(rf"([0-9]{{{TS_DIGITS}}})-{_WRITER}")),
    ACCESS[:-1]: ("access", re.compile(rf"[0-9]{{10}}/([0-9]{{{TS_DIGITS}}})-{_WRITER}-([0-9]{{6,12}})")),
}


_EPOCH = re.compile(rf"([0-9]{{{EPOCH_MS_DIGITS},9}})/([0-9]{{{EPOCH_DIGITS}}})")


@functools.lru_cache(maxsize=16384)
def parse_name(base: str, key: str, *, directory: bool | None = None) -> ManifestName | None:
    """The segment, snapshot, access record or epoch ``key`` names under the
    manifest prefix ``base``, or None: a folder marker, another directory,
    or a name s3kv does not write (which nobody should GET).

    ``directory`` is the bucket's kind: a segment must be in that kind's
    layout (filed under its minute on a directory bucket, flat on a
    general-purpose one), as names compare as strings only within one
    layout; None takes either (tools that show any name).

    Cached (the answer is immutable): a replica parses each name it reads
    several times (listed, in an epoch, applied), and under protocol epochs
    the same N names an interval."""
    if not key.startswith(base):
        return None
    epoch = parse_epoch(base, key)
    if epoch is not None:
        e, e_ms = epoch
        return ManifestName("epoch", epoch_end(e, e_ms), "", e)
    folder, _, rest = key[len(base) :].partition("/")
    kind, pattern = _NAMES.get(folder, ("", None))
    m = pattern.fullmatch(rest) if pattern is not None else None
    if m is None:
        return None
    groups = m.groups()
    if kind == "segment":
        minute, groups = groups[0], groups[1:]
        if minute is not None and int(minute) != int(groups[0]) // MINUTE_MS:
            return None  # filed under another minute than its stamp's: not s3kv's
        if directory is not None and (minute is not None) != directory:
            return None  # the other kind of bucket's layout: not this fleet's
    seq = int(groups[2]) if len(groups) == 3 else None
    return ManifestName(kind, int(groups[0]), groups[1], seq)


def is_segment(base: str, key: str, *, directory: bool | None = None) -> bool:
    name = parse_name(base, key, directory=directory)
    return name is not None and name.kind == "segment"


# -- writers -----------------------------------------------------------------------


def new_writer_id() -> str:
    """A replica's writer id: random, with the process id's last two digits."""
    return f"{uuid.uuid4().hex[:10]}{os.getpid() % 100:02d}"


def gc_writer_id() -> str:
    """The writer id of an ``s3kv gc`` (or ``verify --delete``) run."""
    return "gc" + new_writer_id()


def rank_writer(writer: str, rank: int) -> str:
    """The writer id of a replica's rank publisher."""
    return f"{writer}r{rank}"


_RANK_SUFFIX = re.compile(r"r\d+j?$")


def replica_of(writer: str) -> str:
    """The replica a writer id belongs to: a rank publisher's id is its
    scheduler side's with ``r{rank}`` appended (and ``j`` when its front end
    published its journal, :mod:`s3kv.manifest.journal`)."""
    return _RANK_SUFFIX.sub("", writer)


# -- stamps ------------------------------------------------------------------------


class HybridClock:
    """A writer's stamps (ms): never before the newest stamp it has seen or
    issued, so a late clock cannot hide an object below other readers'
    listing floors. Thread-safe."""

    def __init__(self, clock: Callable[[], float] = time.time, seen_ms: int = 0) -> None:
        self._clock = clock
        self._lock = threading.Lock()
        self.seen_ms = seen_ms
        """The newest stamp seen or issued."""
        self.last_ms = 0
        """The last stamp issued (0: none yet)."""

    def now_ms(self) -> int:
        return int(self._clock() * 1000)

    def observe(self, ts_ms: int) -> None:
        """Another writer's stamp, seen: never stamp before it."""
        with self._lock:
            self.seen_ms = max(self.seen_ms, ts_ms)

    def next(self, now_ms: int | None = None) -> int:
        """A new stamp: ``now_ms`` (default: the clock's now), unless that is
        not after every stamp seen."""
        with self._lock:
            ts = max(self.now_ms() if now_ms is None else now_ms, self.seen_ms + 1)
            self.seen_ms = self.last_ms = ts
            return ts


class Stamps(HybridClock):
    """The stamps of a writer that lists before it writes (gc, verify):
    after every segment and snapshot name it listed (:meth:`seen`), so that
    a slow clock cannot hide its tombstones below the replicas' floors.

    Names stamped beyond now + ``skew_s`` are not counted: replicas do not
    apply them while they are in the future, and a junk name must not carry
    the writer's stamps (and tombstones) there with it."""

    def __init__(
        self,
        writer: str,
        names: Iterable[str] = (),
        *,
        skew_s: float = DEFAULTS.manifest_clock_skew_s,
        clock: Callable[[], float] = time.time,
    ) -> None:
        super().__init__(clock)
        self.writer = writer
        self.seq = 0
        self.skew_s = skew_s
        self.max_listed = 0
        """The newest stamp among the names listed (not those issued)."""
        self.seen(names)

    def in_future(self, name: str) -> bool:
        return (name_ts(name) or 0) > self._clock() * 1000 + self.skew_s * 1000

    def seen(self, names: Iterable[str]) -> None:
        for name in names:
            if self.in_future(name):
                continue
            ts = name_ts(name) or 0
            self.observe(ts)
            self.max_listed = max(self.max_listed, ts)

    def next_seq(self) -> int:
        self.seq += 1
        return self.seq

    def next(self, now_ms: int | None = None) -> int:
        self.next_seq()
        return super().next(now_ms)


def segment_floor(base: str, ts_ms: int, margin_ms: int, *, directory: bool = False) -> str:
    """The name to list segments after (S3's StartAfter; on a directory
    bucket, the name the minutes' listings are cut at): ``margin_ms``
    before ``ts_ms``, the newest stamp the reader has seen."""
    ts = max(0, ts_ms - margin_ms)
    return (segment_dir(base, ts) if directory else base + SEGMENTS) + stamp(ts)


@dataclass(frozen=True)
class Horizon:
    """The segments a snapshot covers: every one named up to ``last``, and
    ``recent`` ones stamped within the skew margin before it, which a
    reader starting from the snapshot counts as read (it lists segments
    from a floor that margin before ``last``). A snapshot's header holds
    both (:meth:`meta`)."""

    last: str = ""
    """The newest segment covered; "" for none."""
    recent: frozenset[str] = frozenset()

    @classmethod
    def over(cls, names: Iterable[str], skew_ms: int) -> Horizon:
        """The horizon of a snapshot of the segments ``names``."""
        names = list(names)
        last = max(names, default="")
        last_ts = name_ts(last) or 0
        return cls(last, frozenset(n for n in names if n <= last and (name_ts(n) or 0) >= last_ts - skew_ms))

    @staticmethod
    def last_of(meta: dict[str, Any]) -> str:
        """The newest segment a snapshot covers, from its header."""
        return str(meta.get("horizon", ""))

    @classmethod
    def of(cls, meta: dict[str, Any]) -> Horizon:
        """A snapshot's horizon, from its header."""
        return cls(cls.last_of(meta), frozenset(str(n) for n in meta.get("recent", ())))

    def meta(self) -> dict[str, Any]:
        return {"horizon": self.last, "recent": sorted(self.recent)}

    def covers(self, segment: str) -> bool:
        return segment <= self.last or segment in self.recent
