"""``codec: auto``'s rule (:mod:`s3kv.tiering.codec_choice`), fed windows of
transfers and calibrations the test makes up, on clocks the test drives."""

import asyncio
import io

import numpy as np
import pytest

from s3kv.chunk_reader import PageFormat
from s3kv.tiering import codec_choice as cc
from s3kv.tiering.chunks import ChunkCodec
from s3kv.tiering.codec_choice import Calibration, Calibrations, TierChoice, Window

GB = 1e9
CAL = Calibration(raw_bytes=int(GB), compressed_bytes=int(GB / 1.45), none_cpu_s=0.4, compressed_cpu_s=1.0)
"""This machine as measured: check+copy 2.5 GB/s, blosc2 decode 1 GB/s a core, ratio 1.45."""


def choice(cores=2, machine_cores=2, calibrated=True, **kw):
    cals = Calibrations()
    if calibrated:
        cals.add(CAL)
    news = []
    c = TierChoice(
        "s3",
        cores=cores,
        level=1,
        machine_cores=machine_cores,
        calibrations=cals,
        notify=lambda ch, old: news.append(old),
        **kw,
    )
    c.news = news
    return c


def window(mb_per_s, *, busy=0.1, link_cpu_s_per_gb=0.75, machine_cores=2, stored=64 << 20):
    """A window of loads of codec none objects over a link of ``mb_per_s``
    that kept the machine ``busy``, costing this process
    ``link_cpu_s_per_gb`` per stored GB besides the objects' check and copy."""
    seconds = stored / (mb_per_s * 1e6)
    process = stored * link_cpu_s_per_gb / GB + stored / (CAL.raw_bytes / CAL.none_cpu_s)
    return Window(stored, seconds, process, busy * seconds * machine_cores, stored, 0)


def feed(c, n, *args, **kw):
    return [c.observe(window(*args, **kw)) for _ in range(n)]


def test_a_link_faster_than_the_decode_stays_uncompressed():
    # In-AZ at 100 Gbit/s with idle cores: the wire is not the bound, the CPU is.
    c = choice()
    assert feed(c, 10, 12_000, busy=0.3) == [None] * 10
    est = c.estimate()
    assert c.codec == "none" and not est.cpu_bound and est.none_s < est.compressed_s
    assert c.news == [None] * 10  # estimated each window, never switched


def test_a_cpu_bound_loopback_link_stays_uncompressed():
    # moto on this machine: ~635 MB/s with the cores ~80% busy. The wire is
    # not what limits it: only the CPU terms count, and the decode costs more
    # than the smaller objects save.
    c = choice()
    feed(c, 10, 635, busy=0.8)
    est = c.estimate()
    assert c.codec == "none" and est.cpu_bound
    assert est.compressed_s > est.none_s
    # The same throughput with idle cores would have been a wire to compress for.
    idle = choice()
    feed(idle, 10, 635, busy=0.3)
    assert idle.codec == "blosc2"


def test_a_slow_link_switches_to_compression_after_the_evidence_minimum():
    c = choice()
    got = feed(c, cc.MIN_WINDOWS, 100, busy=0.1)
    assert got == [None] * (cc.MIN_WINDOWS - 1) + ["blosc2"]  # not before MIN_WINDOWS windows
    assert c.codec == "blosc2" and c.switches == 1 and c.news[-1] == "none"
    est = c.last
    assert est.compressed_s == pytest.approx(10 / 1.45, rel=0.01)  # the wire: R / (r B)
    assert est.none_s == pytest.approx(10, rel=0.01)
    assert "ratio 1.45" in est.explain() and "100 MB/s" in est.explain()


def test_no_switch_without_a_calibration():
    c = choice(calibrated=False)
    assert feed(c, 10, 100) == [None] * 10
    assert c.codec == "none" and c.estimate() is None
    c.calibrations.add(CAL)
    assert c.decide() == "blosc2"  # the windows were kept


def test_hysteresis_a_near_tie_does_not_switch_and_the_choice_does_not_flap():
    # Link CPU so cheap that compressed loses on CPU; the wire term decides.
    # At B where compressed is only ~10% faster: below the margin, no switch.
    c = choice(cores=1)
    # none: max(R/B, (c + 0.4) s) with c = 0; compressed: max(R/(1.45 B), 1.0 s).
    # B = 900 MB/s: none 1.11 s, compressed 1.0 s: 10% better.
    feed(c, 10, 900, busy=0.1, link_cpu_s_per_gb=0.0)
    est = c.estimate()
    assert est.compressed_s < est.none_s < est.compressed_s / (1 - cc.MARGIN)
    assert c.codec == "none"
    # A slow link: switch; then a link just fast enough for none to be ahead
    # by less than the margin: stays compressed.
    feed(c, cc.KEEP, 100, busy=0.1, link_cpu_s_per_gb=0.0)
    assert c.codec == "blosc2" and c.switches == 1
    feed(c, cc.KEEP, 2_000, busy=0.1, link_cpu_s_per_gb=0.0)  # none 0.5 s, compressed 1.0 s (its decode)
    assert c.codec == "none" and c.switches == 2  # clearly faster: back
    feed(c, cc.KEEP, 900, busy=0.1, link_cpu_s_per_gb=0.0)
    assert c.codec == "none" and c.switches == 2  # the near tie again: kept


def test_after_a_switch_fresh_evidence_is_needed_before_the_next():
    c = choice()
    feed(c, cc.KEEP, 100)
    assert c.codec == "blosc2"
    # A fast link now: the median still has slow windows, and then the
    # minimum of fresh windows counts from the switch.
    got = feed(c, cc.KEEP, 12_000, busy=0.3)
    first = got.index("none")
    assert first >= cc.MIN_WINDOWS - 1 and c.codec == "none" and c.switches == 2


class Feeds:
    """The clocks a choice reads: wall time, this process's CPU, the machine's."""

    def __init__(self):
        self.now = self.process = self.machine = 0.0

    def step(self, seconds, process_cores=0.5, machine_cores=0.5):
        self.now += seconds
        self.process += seconds * process_cores
        self.machine += seconds * machine_cores


def test_transfers_are_timed_over_busy_time_and_gather_into_windows():
    f = Feeds()
    c = choice(clock=lambda: f.now, process_cpu=lambda: f.process, machine_cpu=lambda: f.machine)
    half = cc.WINDOW_BYTES // 2
    with c.transfer() as moved:  # 1 s for half a window
        f.step(1.0)
        moved[:] = [half, half]
    assert not c.windows  # gathering
    f.step(100.0, 0.0, 0.0)  # idle: not the link's time
    with c.transfer() as a:
        with c.transfer() as b:  # two at once: the busy time counts once
            f.step(1.0)
            b[:] = [half // 2, half]
        f.step(1.0)
        a[:] = [half - half // 2, half]
    (w,) = c.windows
    assert w.stored_bytes == cc.WINDOW_BYTES and w.seconds == pytest.approx(3.0)
    assert w.process_cpu_s == pytest.approx(1.5) and w.machine_cpu_s == pytest.approx(1.5)
    assert w.raw_none == half and w.raw_compressed == 2 * half  # a and b read smaller objects than their KV
    with c.transfer():  # failed: its time goes into the next window, no bytes
        f.step(1.0)
    assert len(c.windows) == 1


def test_a_long_busy_period_closes_windows_while_transfers_are_in_flight():
    f = Feeds()
    c = choice(clock=lambda: f.now, process_cpu=lambda: f.process, machine_cpu=lambda: f.machine)
    with c.transfer():
        for _ in range(3):
            with c.transfer() as m:
                f.step(1.0)
                m[:] = [cc.BUSY_WINDOW_BYTES, 0]
            with c.transfer() as m:  # under a busy window's bytes: kept for the next
                f.step(1.0)
                m[:] = [cc.WINDOW_BYTES, 0]
    # the last window closes when the link goes idle, with what it gathered
    assert [w.seconds for w in c.windows] == [pytest.approx(s) for s in (1.0, 2.0, 2.0, 1.0)]
    big, small = cc.BUSY_WINDOW_BYTES, cc.WINDOW_BYTES
    assert [w.stored_bytes for w in c.windows] == [big, big + small, big + small, small]


def test_work_that_runs_while_the_link_is_idle_is_the_baseline_not_the_links():
    # A capped link on a machine busy with other work: 1.9 of its 2 cores run
    # whether the link moves bytes or not. Counted whole, the link would look
    # CPU-bound; over the baseline of its idle gaps it adds little: the wire decides.
    def run(idle_cores):
        f = Feeds()
        c = choice(clock=lambda: f.now, process_cpu=lambda: f.process, machine_cpu=lambda: f.machine)
        for _ in range(cc.MIN_WINDOWS):
            f.step(1.0, 0.0, idle_cores)  # idle gap
            with c.transfer() as moved:
                f.step(cc.WINDOW_BYTES / 100e6, 0.1, 1.95)  # 100 MB/s
                moved[:] = [cc.WINDOW_BYTES, cc.WINDOW_BYTES]
        return c

    busy_box = run(idle_cores=1.9)
    est = busy_box.estimate()
    assert est.baseline == pytest.approx(0.95) and est.busy == pytest.approx(0.025)
    assert not est.cpu_bound and busy_box.codec == "blosc2"
    # The same transfers on an idle machine: they were the CPU's, not the wire's.
    quiet = run(idle_cores=0.0)
    assert quiet.estimate().cpu_bound and quiet.codec == "none"


def test_calibration_measures_the_ratio_on_the_chunk_itself():
    fmt = PageFormat(dtype="bfloat16", itemsize=2, page_shape=(64, 64), tokens=64, layer_bytes=8192)
    base = ChunkCodec("n" * 32, 0, 2, fmt, "none")
    rng = np.random.default_rng(0)
    # bf16 of normal values: the exponent bytes compress, the mantissas do not.
    layers = [
        rng.standard_normal(4096)
        .astype(np.float32)
        .view(np.uint32)
        .__rshift__(16)
        .astype(np.uint16)
        .view(np.uint8)
        for _ in range(2)
    ]
    cal = cc.calibrate(b"k" * 16, layers, base, level=1)
    assert cal.raw_bytes == 2 * 8192 and 1.1 < cal.raw_bytes / cal.compressed_bytes < 2.5
    assert cal.none_cpu_s > 0 and cal.compressed_cpu_s > 0


def test_calibrations_are_due_first_then_one_in_every():
    cals = Calibrations()
    due = [cals.due() for _ in range(2 * cc.CALIBRATE_EVERY)]
    assert due[0] and due[cc.CALIBRATE_EVERY] and sum(due) == 2


def test_the_chunk_codec_follows_the_choice():
    fmt = PageFormat(dtype="uint8", itemsize=1, page_shape=(8,), tokens=8, layer_bytes=8)
    base = ChunkCodec("n" * 32, 0, 1, fmt, "none")
    c = choice()
    assert c.chunk_codec(base) is base
    c.codec = "blosc2"
    assert c.chunk_codec(base).codec == "blosc2" and c.chunk_codec(base).level == 1


# -- the store path under codec: auto, through the transfer engine ---------------------------


def slow_link(c):
    """Windows of a 100 MB/s link with idle cores: the rule picks compression."""
    for _ in range(cc.MIN_WINDOWS):
        c.observe(window(100))


def compressible_layers(seed, n, nbytes):
    rng = np.random.default_rng(seed)
    f32 = rng.standard_normal(nbytes // 2).astype(np.float32)
    return [(f32.view(np.uint32) >> 16).astype(np.uint16).view(np.uint8).copy() for _ in range(n)]


@pytest.mark.parametrize("tier", ["s3", "disk"])
def test_a_store_under_auto_writes_the_chosen_codec_and_a_mixed_tier_loads(tmp_path, tier):
    from s3kv import codec
    from s3kv.stores.memory import MemoryStore
    from s3kv.testing.chunks import chunk_id
    from s3kv.testing.pages import Pages
    from s3kv.tiering.placement import Tier
    from tests.unit import test_transfer as t

    store = MemoryStore()
    t_ = Tier.S3 if tier == "s3" else Tier.DISK
    kw = {"codec": "auto"} if tier == "s3" else {"disk_codec": "auto"}
    e = t.engine(store, disk_path=tmp_path, **kw)
    choice = e.codec_choices[t_]
    assert set(e.codec_choices) == {t_} and choice.codec == "none"

    def stored_codec(key):
        if t_ is Tier.S3:
            blob = asyncio.run(store.get(chunk_id(e, key).object_key))
        else:
            blob = t.files(e).path(key).read_bytes()
        return codec.parse_header(blob).codec

    data = {bytes([i]) * 16: compressible_layers(i, t.LAYERS, t.PAGE) for i in range(2)}
    first, second = data
    e.submit_store(t.job(first, data[first], **{tier: True}))
    t.wait_for(e, lambda a: first in a.written.get(t_, {}))
    assert stored_codec(first) == "none"  # the starting choice
    assert len(e.calibrations.samples) == 1  # the first store calibrated on its own chunk
    assert e.counters.totals()[f"codec_compressed_{tier}"] == 0

    e.calibrations.samples[0] = CAL  # this machine's figures for a real chunk, not a 2 KiB toy's
    slow_link(choice)
    assert choice.codec == "blosc2"
    totals = e.counters.totals()
    assert totals[f"codec_switches_{tier}"] == 1 and totals[f"codec_compressed_{tier}"] == 1
    assert totals[f"codec_link_bytes_per_second_{tier}"] == pytest.approx(100e6, rel=0.01)

    e.submit_store(t.job(second, data[second], **{tier: True}))
    t.wait_for(e, lambda a: second in a.written.get(t_, {}))
    assert stored_codec(second) == "blosc2"
    assert stored_codec(first) == "none"  # what was stored is never encoded again

    got = {}
    e.submit_load("job", [t.chunk(k, t_) for k in data], Pages(t.collect(got)))
    acc = t.wait_for(e, lambda a: "job" in a.finished_loads)
    assert acc.finished_loads["job"] == []
    for key, ls in data.items():
        for i in range(t.LAYERS):
            assert (got[(key, i)] == ls[i]).all()
    e.close()


def test_loads_feed_the_tiers_choice_with_what_they_read():
    from s3kv.stores.memory import MemoryStore
    from s3kv.testing.pages import Pages
    from s3kv.tiering.placement import Tier
    from tests.unit import test_transfer as t

    e = t.engine(MemoryStore(), codec="auto")
    choice = e.codec_choices[Tier.S3]
    keys = [bytes([i]) * 16 for i in range(3)]
    for i, key in enumerate(keys):
        e.submit_store(t.store_job(key, i))
    t.wait_for(e, lambda a: len(a.written.get(Tier.S3, {})) == 3)
    stored = choice._acc[0]
    assert stored > 0  # the stores' PUTs (not a full window: small chunks)
    e.submit_load("job", [t.chunk(k) for k in keys], Pages(t.collect({})))
    t.wait_for(e, lambda a: "job" in a.finished_loads)
    t.settle(e)
    assert choice._acc[0] > stored + 3 * t.PAGE * t.LAYERS  # each object: its KV and a header
    assert choice._acc[4] == 3 * t.PAGE * t.LAYERS  # raw bytes of uncompressed objects read
    e.close()


def test_a_promoted_object_is_written_in_the_codec_the_tier_asks_for_not_the_one_it_came_in(tmp_path):
    # S3's choice starts at none (the engine's codec), then switches: new S3
    # objects are blosc2. A load's promotion to a disk_codec none NVMe tier
    # must store none (the disk's direct read into pages), not the object as is.
    from s3kv import codec
    from s3kv.stores.memory import MemoryStore
    from s3kv.testing.chunks import chunk_id
    from s3kv.testing.pages import Frames, Pages
    from s3kv.tiering.placement import Tier
    from tests.unit import test_transfer as t

    store = MemoryStore()
    e = t.engine(store, disk_path=tmp_path, codec="auto", disk_codec="none")
    choice = e.codec_choices[Tier.S3]
    assert e.codec.codec == "none"
    e.calibrations.add(CAL)
    slow_link(choice)
    assert choice.codec == "blosc2"
    key = b"q" * 16
    ls = compressible_layers(3, t.LAYERS, t.PAGE)
    e.submit_store(t.job(key, ls, s3=True))
    t.wait_for(e, lambda a: key in a.written.get(Tier.S3, {}))
    assert codec.parse_header(asyncio.run(store.get(chunk_id(e, key).object_key))).codec == "blosc2"

    e.submit_load("j", [t.chunk(key, Tier.S3, promote_disk=True)], Pages(t.collect({})))
    acc = t.wait_for(e, lambda a: "j" in a.finished_loads and key in a.written.get(Tier.DISK, {}))
    assert acc.finished_loads["j"] == []
    assert codec.parse_header(t.files(e).path(key).read_bytes()).codec == "none"
    got = {}
    t.files(e).read(key, Frames(lambda i, a: got.__setitem__(i, a.copy())))
    assert all((got[i] == d).all() for i, d in enumerate(ls))
    e.close()


def test_a_chunk_known_as_an_object_is_judged_by_its_header_even_once_its_layers_are_decoded():
    from s3kv import codec
    from s3kv.tiering.chunks import ChunkData

    fmt = PageFormat(dtype="uint8", itemsize=1, page_shape=(64,), tokens=64, layer_bytes=4096)
    none = ChunkCodec("n" * 32, 0, 2, fmt, "none")
    comp = ChunkCodec("n" * 32, 0, 2, fmt, "blosc2", level=1)
    ls = compressible_layers(4, 2, 4096)
    key = b"k" * 16
    blob = comp.encode(key, ls)
    for decoded_first in (False, True):
        chunk = ChunkData(key, none, blob=blob)  # built with the engine's codec, not the object's
        if decoded_first:
            assert all((a == b).all() for a, b in zip(chunk.layers, ls))
        assert chunk.blob_for(comp) is blob  # already blosc2: as it is
        as_none = chunk.blob_for(none)
        assert codec.parse_header(as_none).codec == "none"
        out = [None, None]
        none.decode(key, as_none, out.__setitem__, "test")
        assert all((a == b).all() for a, b in zip(out, ls))
    # A chunk encoded here is in its own codec.
    mine = ChunkData(key, none, layers=ls)
    assert mine.blob_for(none) is mine.blob and codec.parse_header(mine.blob).codec == "none"


def test_a_failed_calibration_costs_a_sample_never_the_store(monkeypatch, caplog):
    from s3kv.stores.memory import MemoryStore
    from s3kv.tiering.placement import Tier
    from tests.unit import test_transfer as t

    def no_memory(*a, **kw):
        raise MemoryError("calibration")

    monkeypatch.setattr(cc, "calibrate", no_memory)
    monkeypatch.setattr(cc, "CALIBRATE_EVERY", 1)  # every store calibrates
    store = MemoryStore()
    e = t.engine(store, codec="auto")
    keys = [bytes([i]) * 16 for i in range(3)]
    with caplog.at_level("DEBUG", logger="s3kv.transfer"):
        for i, key in enumerate(keys):
            e.submit_store(t.store_job(key, i, s3=True))
        acc = t.wait_for(e, lambda a: len(a.written.get(Tier.S3, {})) + len(a.failed.get(Tier.S3, {})) == 3)
    assert not acc.failed.get(Tier.S3) and len(acc.written[Tier.S3]) == 3
    assert not e.calibrations.samples
    failed = [r for r in caplog.records if "calibration" in r.getMessage()]
    assert len(failed) == 3 and [r.levelname for r in failed].count("WARNING") == 1  # logged once
    assert not [r for r in caplog.records if "encoding chunk" in r.getMessage()]
    e.close()


def test_machine_cpu_falls_back_to_the_process_when_proc_stat_is_not_as_expected(monkeypatch):
    monkeypatch.setattr(cc, "open", lambda *a, **kw: io.BytesIO(b"cpu  1 2 3 4\n"), raising=False)
    monkeypatch.setattr(cc.time, "process_time", lambda: 42.0)
    assert cc.machine_cpu_seconds() == 42.0


def test_the_chunk_codec_is_made_once_per_codec():
    fmt = PageFormat(dtype="uint8", itemsize=1, page_shape=(8,), tokens=8, layer_bytes=8)
    base = ChunkCodec("n" * 32, 0, 1, fmt, "blosc2", level=3)
    c = choice()
    assert c.chunk_codec(base) is c.chunk_codec(base) and c.chunk_codec(base).codec == "none"
    c.codec = "blosc2"
    assert c.chunk_codec(base) is c.chunk_codec(base) and c.chunk_codec(base).level == 1
