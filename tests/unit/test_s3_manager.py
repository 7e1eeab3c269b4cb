"""The S3 wing's scheduler-side manager
(:mod:`s3kv.tiering.tiers.s3.manager`): stores in flight, the retry of a key
whose object was bad, and the bad objects its ranks report."""

import numpy as np

from s3kv.keys import Namespace, chain_keys, fingerprint, object_key
from s3kv.manifest import Manifest
from s3kv.stats import Counters
from s3kv.tiering.placement import Tier
from s3kv.tiering.plan import Place, TierReport
from s3kv.tiering.scheduler.stack import TierStack
from s3kv.tiering.tiers.manager import TierEvents, store_owner
from s3kv.tiering.tiers.s3.manager import BAD_KEY_RETRY_S, S3TierManager
from s3kv.tiering.tiers.s3.report import S3Report

KEYS = chain_keys(Namespace.from_fields({"m": "tiers"}), list(range(256)), 64)


def stack(*tiers, events=False):
    return TierStack(tiers, Counters(), TierEvents(events))


def test_s3_store_in_flight_and_bad_key_retry():
    now = [0.0]
    s3 = S3TierManager(Manifest(), store_retry_s=100.0, clock=lambda: now[0])
    stack(s3)
    assert s3.prepare_store(KEYS[0], store_owner(KEYS[0])) == Place(Tier.S3)
    assert s3.prepare_store(KEYS[0], store_owner(KEYS[0])) is None  # in flight
    now[0] = 100.0
    assert s3.prepare_store(KEYS[0], store_owner(KEYS[0])) == Place(Tier.S3)  # never reported: again
    s3.manifest.quarantine(KEYS[0], "p/bad", '"e"')
    s3.complete_store(KEYS[0], False)  # a store that found the bad object in the way
    now[0] += BAD_KEY_RETRY_S - 1
    assert s3.prepare_store(KEYS[0], store_owner(KEYS[0])) is None
    now[0] += 1
    assert s3.prepare_store(KEYS[0], store_owner(KEYS[0])) == Place(Tier.S3)
    s3.complete_store(KEYS[0], True)
    assert KEYS[0] in s3.manifest
    s3.down = True
    assert s3.paused and not s3.allows("r", take=False)
    s3.forget(KEYS[0])
    assert KEYS[0] not in s3.manifest and s3.counters.totals()["manifest_dropped"] == 1


def test_the_s3_manager_tells_the_fleet_of_bad_objects_its_ranks_reported():
    """Corrupt objects a rank could not delete arrive in the S3 wing's own
    section of the report: the manager quarantines them in the manifest,
    under the object's name in the namespace it was activated for, before
    it decides the stores of the same report (a 412 on a bad object is not
    published)."""
    told = []

    class Sync:  # what the manifest tells the fleet (the Sync protocol)
        def stored(self, fp):
            told.append(("stored", fp))

        def used(self, fps):
            pass

        def bad(self, fp, name, etag):
            told.append(("bad", fp, name, etag))

    manifest = Manifest()
    manifest.sync = Sync()
    s3 = S3TierManager(manifest, prefix="p/")
    stack(s3)
    assert s3.activate("ns0")
    assert s3.prepare_store(KEYS[0], store_owner(KEYS[0])) == Place(Tier.S3)
    report = TierReport(
        written={(Tier.S3, KEYS[0]): 1},
        sections={Tier.S3: S3Report(bad={(KEYS[0], 1): '"e"'}, existing={KEYS[0]})},
    )
    s3.on_report(report, [(KEYS[0], True)], [])
    assert manifest.is_bad(KEYS[0]) and KEYS[0] not in manifest  # the 412 found the bad object: not published
    assert told == [("bad", fingerprint(KEYS[0]), object_key("p/", "ns0", KEYS[0], 1), '"e"')]


def test_lookup_trusts_keys_seen_present_until_a_removal():
    """A new prefix (nothing of it trusted) and one partly trusted give the
    manifest's answer; present keys are trusted, missing ones asked again,
    and a removal (a new epoch) forgets the trust."""
    manifest = Manifest()
    s3 = S3TierManager(manifest)
    keys = [bytes([i]) * 16 for i in range(8)]
    fps = np.array([fingerprint(k) for k in keys], dtype=np.uint64)
    for k in keys[1:6]:
        manifest.add(k, publish=False)
    assert s3.lookup(keys, fps, 1, 4) == [True, True, True]
    assert set(s3._verified) == set(keys[1:4])
    assert s3.lookup(keys, fps, 0, 8) == [False] + [True] * 5 + [False, False]
    assert set(s3._verified) == set(keys[1:6])
    manifest.add(keys[0], publish=False)
    assert s3.lookup(keys, fps, 0, 2) == [True, True]  # the missing key is asked again
    manifest.discard(keys[1])
    assert s3.lookup(keys, fps, 0, 3) == [True, False, True]  # trust forgotten
    assert set(s3._verified) == {keys[0], keys[2]}
