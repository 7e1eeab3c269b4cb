"""``codec: auto``: a tier's writer picks, from what this process measures,
between storing chunks uncompressed and in the compressed codec (blosc2).

The rule, per tier. Loading ``R`` raw KV bytes costs about

- uncompressed: ``max(R / B, (c·R + R / D_none) / k)``
- compressed:   ``max(R / (r·B), (c·R / r + R / D_comp) / k)``

where ``B`` is the link's throughput in stored bytes a second (as this
worker's loads and stores of the tier see it: bytes over the time at least
one transfer was in flight), ``c`` the CPU seconds this process spends per
byte moved over it (its client: HTTP, TLS, buffers; the decode taken out),
``D_none`` and ``D_comp`` the raw bytes a CPU second checks and copies
(codec none) or decodes (the compressed codec) into pages on this machine,
``r`` the ratio raw / compressed of this engine's own chunks, and ``k`` the
cores the codec threads may use. A link whose transfers added most of this
machine's cores to what it ran while the link was idle (:data:`CPU_BOUND`,
every process counted: a server on this machine, as moto on loopback, is
the link's too) was waiting on the CPU, not on the wire: its throughput
says nothing of the wire, so ``B`` drops out and the CPU terms alone decide
(compress only where the link's CPU that the smaller object saves pays for
the decode). Work that runs whether the link moves bytes or not (a
forward, other processes) is the machine's baseline, measured in the
link's idle gaps, and not counted as the link's (on a machine that other
work keeps saturated a link's own CPU cannot be told from the wire's: the
other work yields its cores, and the rule sees the wire). The writer switches only when the other codec is clearly faster (:data:`MARGIN`
hysteresis) and only on fresh evidence (:data:`MIN_WINDOWS` windows of
transfers since the last switch, and a calibration): so it does not flap.

``D`` and ``r`` come from a calibration on the engine's own chunks: the
first chunk a store encodes (and one in :data:`CALIBRATE_EVERY` after it)
is encoded in the compressed codec as well and decoded both ways into the
thread's scratch buffer, timed with the thread's CPU clock. ``B`` and ``c`` come from
the transfers themselves (:class:`TierChoice.transfer`). Readers decode
whatever codec an object's header names, so a bucket that holds both loads
as any other, and a switch never touches what is stored.

Who decides: each worker, for its own objects (the encode is on its store
path, and its loads and stores are the link it measures). The scheduler
side's cost model (:mod:`s3kv.tiering.scheduler.cost`) hears only rank 0's
per-load timings in raw KV bytes with the decode inside them, which cannot
tell the wire from the CPU.

Nothing here imports vLLM or does I/O beyond reading ``/proc/stat``.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import statistics
import time
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass

import numpy as np

from s3kv.tiering.chunks import ChunkCodec

log = logging.getLogger("s3kv.codec")

AUTO = "auto"
NONE = "none"
COMPRESSED = "blosc2"
"""The codec ``auto`` compresses with (at ``zstd_level``)."""
START = NONE
"""``auto``'s choice until the evidence says otherwise: the one that costs no
CPU; compression has to earn its decode."""
MARGIN = 0.15
"""Switch only when the other codec's estimate is at least this much lower."""
MIN_WINDOWS = 4
"""Windows of transfers needed since the last switch (or start) before a switch."""
WINDOW_BYTES = 8 << 20
"""Stored bytes one window of transfers gathers (a busy period shorter than
this adds to the next)."""
BUSY_WINDOW_BYTES = 8 * WINDOW_BYTES
"""A window closes when the link goes idle; one that stays busy closes once
it gathered this much. A transfer's bytes count when it ends, and the
transfers of a load end together: a window closed while many are in
flight would time bytes it does not count yet."""
KEEP = 16
"""Windows and calibrations kept; their medians are the estimates."""
CPU_BOUND = 0.6
"""A link whose windows added this much of the machine's cores (a fraction of
all of them, every process counted, over the baseline of the link's idle
gaps) waited on the CPU, not on the wire."""
MIN_IDLE_S = 0.05
"""An idle gap of the link this long or longer measures the machine's baseline."""
CALIBRATE_EVERY = 64
"""After the first, one calibration in this many stores (the data drifts)."""
COMPRESSED_BELOW = 0.97
"""A load that read fewer than this fraction of its raw bytes read a compressed object."""


def machine_cpu_seconds() -> float:
    """CPU seconds every process on this machine has run (``/proc/stat``:
    user, nice, system, irq, softirq, steal); this process's where that
    cannot be read."""
    try:
        with open("/proc/stat", "rb") as f:
            fields = f.readline().split()
        user, nice, system, _idle, _iowait, irq, softirq, steal = (int(x) for x in fields[1:9])
    except (OSError, ValueError):  # unreadable, or not the line this expects: never fail the transfer timed
        return time.process_time()
    return (user + nice + system + irq + softirq + steal) / os.sysconf("SC_CLK_TCK")


def default_machine_cores() -> int:
    return os.cpu_count() or 1


@dataclass(frozen=True)
class Calibration:
    """One chunk decoded both ways on this machine."""

    raw_bytes: int
    compressed_bytes: int
    none_cpu_s: float
    """CPU seconds to check and copy the uncompressed object into pages."""
    compressed_cpu_s: float
    """CPU seconds to check and decode the compressed object into pages."""


def calibrate(key: bytes, layers: Sequence[np.ndarray], base: ChunkCodec, level: int) -> Calibration:
    """Encode ``layers`` uncompressed and compressed and decode each into
    this thread's scratch buffer (checked, then copied or decompressed in
    one pass, as a load into a chunk's consecutive pages), timing the
    decodes with this thread's CPU clock."""
    none = dataclasses.replace(base, codec=NONE)
    comp = dataclasses.replace(base, codec=COMPRESSED, level=level)
    blobs = (none.encode(key, layers), comp.encode(key, layers))

    def sink(i: int, data: np.ndarray) -> None:
        pass  # decoded into the thread's scratch buffer: one pass, as into a chunk's consecutive pages

    cpu = []
    for codec, blob in zip((none, comp), blobs):
        t0 = time.thread_time()
        codec.decode(key, blob, sink, "calibration", scratch=True)
        cpu.append(time.thread_time() - t0)
    return Calibration(sum(a.nbytes for a in layers), len(blobs[1]), max(cpu[0], 1e-6), max(cpu[1], 1e-6))


@dataclass(frozen=True)
class Window:
    """Transfers of one tier over busy time."""

    stored_bytes: int
    seconds: float
    """Time at least one transfer was in flight."""
    process_cpu_s: float
    machine_cpu_s: float
    raw_none: int
    """Raw bytes of the uncompressed objects loaded (their check and copy is in the CPU)."""
    raw_compressed: int
    """Raw bytes of the compressed objects loaded (their decode is in the CPU)."""


@dataclass(frozen=True)
class Estimate:
    """What the rule saw and what it gives, per GB of raw KV loaded."""

    none_s: float
    compressed_s: float
    link_bytes_per_s: float
    """Measured throughput of the link (stored bytes a second over its busy time)."""
    cpu_bound: bool
    """The link's transfers added at least :data:`CPU_BOUND` of the machine's cores: ``B`` left out."""
    busy: float
    """The machine's cores the link's transfers added (a fraction of all), over :attr:`baseline`."""
    baseline: float
    """The machine's cores busy while the link was idle (a fraction of all)."""
    link_cpu_s_per_gb: float
    ratio: float
    decode_none_gb_s: float
    decode_compressed_gb_s: float
    cores: int

    @property
    def best(self) -> str:
        return COMPRESSED if self.compressed_s < self.none_s else NONE

    def explain(self) -> str:
        link = (
            f"link {self.link_bytes_per_s / 1e6:.0f} MB/s adding {self.busy:.0%} of the machine's cores to "
            f"{self.baseline:.0%} busy without it"
        ) + (" (CPU-bound: the wire is not the limit)" if self.cpu_bound else "")
        return (
            f"a GB of KV loads in ~{self.none_s:.2f} s uncompressed, ~{self.compressed_s:.2f} s compressed "
            f"({link}; link CPU {self.link_cpu_s_per_gb:.2f} s/GB; ratio {self.ratio:.2f}; check+copy "
            f"{self.decode_none_gb_s:.2f} GB/s, decode {self.decode_compressed_gb_s:.2f} GB/s per core x "
            f"{self.cores} cores)"
        )


class TierChoice:
    """One tier's codec under ``auto``: fed its transfers and calibrations,
    it says which codec the writer uses now (:attr:`codec`). Used from one
    thread (the transfer engine's event loop); calibrations are made on
    others and handed in."""

    def __init__(
        self,
        label: str,
        *,
        cores: int,
        level: int,
        clock: Callable[[], float] = time.monotonic,
        process_cpu: Callable[[], float] = time.process_time,
        machine_cpu: Callable[[], float] = machine_cpu_seconds,
        machine_cores: int | None = None,
        calibrations: Calibrations | None = None,
        notify: Callable[[TierChoice, str | None], None] | None = None,
        start: str = START,
    ) -> None:
        self.label = label
        self.cores = max(1, cores)
        self.level = level
        self.clock = clock
        self.process_cpu = process_cpu
        self.machine_cpu = machine_cpu
        self.machine_cores = machine_cores or default_machine_cores()
        self.calibrations = calibrations if calibrations is not None else Calibrations()
        self.notify = notify
        """Told after each estimate (with the old codec when it switched): gauges, counters."""
        self.codec = start
        self.switches = 0
        self.windows: deque[Window] = deque(maxlen=KEEP)
        self.fresh = 0
        """Windows since the last switch (or start)."""
        self.last: Estimate | None = None
        self._inflight = 0
        self._since: tuple[float, float, float] | None = None
        self._idle_since: tuple[float, float] | None = None
        self.baseline: deque[float] = deque(maxlen=KEEP)
        """The machine's busy cores in the link's idle gaps of :data:`MIN_IDLE_S` or more."""
        self._acc = [0, 0.0, 0.0, 0.0, 0, 0]  # bytes, seconds, process CPU, machine CPU, raw none, raw comp
        self._base: ChunkCodec | None = None
        self._made: dict[str, ChunkCodec] = {}
        """:meth:`chunk_codec`'s codecs for :attr:`_base`, by codec name."""

    def chunk_codec(self, base: ChunkCodec) -> ChunkCodec:
        """``base`` as the writer encodes now: made once per codec (and
        ``base``), so a store does not build a codec and its reader each time."""
        if base is not self._base:
            self._base, self._made = base, {}
        made = self._made.get(self.codec)
        if made is None:
            if self.codec == NONE:
                made = base if base.codec == NONE else dataclasses.replace(base, codec=NONE)
            elif base.codec == self.codec and base.level == self.level:
                made = base
            else:
                made = dataclasses.replace(base, codec=self.codec, level=self.level)
            self._made[self.codec] = made
        return made

    # -- feeds -----------------------------------------------------------------------
    @contextmanager
    def transfer(self) -> Iterator[list[int]]:
        """Time the block as one transfer on the link; it sets ``[stored
        bytes, raw bytes]`` in the list it yields when it succeeds (a load:
        raw bytes decoded; a store: raw 0). A failed one counts its time only."""
        now = self.clock()
        if self._inflight == 0:
            machine = self.machine_cpu()
            if self._idle_since is not None and now - self._idle_since[0] >= MIN_IDLE_S:
                self.baseline.append((machine - self._idle_since[1]) / (now - self._idle_since[0]))
            self._idle_since = None
            self._since = (now, self.process_cpu(), machine)
        self._inflight += 1
        moved = [0, 0]
        try:
            yield moved
        finally:
            self._inflight -= 1
            self._ended(moved[0], moved[1])

    def _ended(self, stored: int, raw: int) -> None:
        acc = self._acc
        acc[0] += stored
        if raw:
            acc[5 if stored < raw * COMPRESSED_BELOW else 4] += raw
        if self._since is None or (self._inflight and acc[0] < BUSY_WINDOW_BYTES):
            return
        now, pcpu, mcpu = self.clock(), self.process_cpu(), self.machine_cpu()
        t0, p0, m0 = self._since
        acc[1] += now - t0
        acc[2] += pcpu - p0
        acc[3] += mcpu - m0
        self._since = (now, pcpu, mcpu) if self._inflight else None
        if not self._inflight:
            self._idle_since = (now, mcpu)
        if acc[0] >= WINDOW_BYTES and acc[1] > 0:
            self.windows.append(Window(int(acc[0]), acc[1], acc[2], acc[3], int(acc[4]), int(acc[5])))
            self.fresh += 1
            self._acc = [0, 0.0, 0.0, 0.0, 0, 0]
            self.decide()

    def observe(self, window: Window) -> str | None:
        """A window measured elsewhere (tests, tools); then :meth:`decide`."""
        self.windows.append(window)
        self.fresh += 1
        return self.decide()

    # -- the rule --------------------------------------------------------------------
    def estimate(self) -> Estimate | None:
        """The rule's figures from the windows and calibrations kept; None before any."""
        cal = self.calibrations
        if not self.windows or not cal.samples:
            return None
        ratio, d_none, d_comp = cal.ratio, cal.none_bytes_per_cpu_s, cal.compressed_bytes_per_cpu_s
        b = statistics.median(w.stored_bytes / w.seconds for w in self.windows)
        base = statistics.median(self.baseline) if self.baseline else 0.0
        busy = (
            statistics.median(w.machine_cpu_s / w.seconds - base for w in self.windows) / self.machine_cores
        )
        c = statistics.median(
            max(0.0, w.process_cpu_s - w.raw_none / d_none - w.raw_compressed / d_comp) / w.stored_bytes
            for w in self.windows
        )
        cpu_bound = busy >= CPU_BOUND
        raw = 1e9
        wire_none = 0.0 if cpu_bound else raw / b
        none_s = max(wire_none, (c * raw + raw / d_none) / self.cores)
        comp_s = max(wire_none / ratio, (c * raw / ratio + raw / d_comp) / self.cores)
        return Estimate(
            none_s,
            comp_s,
            b,
            cpu_bound,
            max(0.0, busy),
            base / self.machine_cores,
            c * 1e9,
            ratio,
            d_none / 1e9,
            d_comp / 1e9,
            self.cores,
        )

    def decide(self) -> str | None:
        """Apply the rule: the new codec if it switched, else None."""
        est = self.estimate()
        if est is None:
            return None
        self.last = est
        now_s, other_s = (
            (est.none_s, est.compressed_s) if self.codec == NONE else (est.compressed_s, est.none_s)
        )
        if self.fresh < MIN_WINDOWS or other_s > (1 - MARGIN) * now_s:
            if self.notify is not None:
                self.notify(self, None)
            return None
        old, self.codec = self.codec, COMPRESSED if self.codec == NONE else NONE
        self.switches += 1
        self.fresh = 0
        log.info("s3kv: %s codec %s -> %s: %s", self.label, old, self.codec, est.explain())
        if self.notify is not None:
            self.notify(self, old)
        return self.codec


class Calibrations:
    """The calibrations of one engine (shared by its tiers' choices): the
    medians of the last :data:`KEEP`, and when the next one is due."""

    def __init__(self) -> None:
        self.samples: deque[Calibration] = deque(maxlen=KEEP)
        self._stores = 0

    def due(self) -> bool:
        """Count a store; True if it should calibrate (the first, then one in :data:`CALIBRATE_EVERY`)."""
        due = self._stores % CALIBRATE_EVERY == 0
        self._stores += 1
        return due

    def add(self, cal: Calibration) -> None:
        self.samples.append(cal)

    @property
    def ratio(self) -> float:
        return statistics.median(c.raw_bytes / c.compressed_bytes for c in self.samples)

    @property
    def none_bytes_per_cpu_s(self) -> float:
        return statistics.median(c.raw_bytes / c.none_cpu_s for c in self.samples)

    @property
    def compressed_bytes_per_cpu_s(self) -> float:
        return statistics.median(c.raw_bytes / c.compressed_cpu_s for c in self.samples)
