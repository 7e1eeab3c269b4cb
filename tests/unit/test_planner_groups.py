"""The planner over a model with several KV cache groups (one full-attention
group, one sliding-window group): a hit is whole (every part it needs is in
a tier), a windowed group's parts load only within its window, stores skip
parts whose pages vLLM freed."""

from s3kv.kvgroups import FULL, SLIDING, GroupLayout, KVGroup, part_key
from s3kv.tiering.placement import Tier
from s3kv.tiering.plan import ScheduledRequest
from tests.unit.test_planner import BS, CT, KEYS, PROMPT, planner

# CT 64 tokens (2 blocks of 32); the window reaches 80 tokens back: a hit of
# k chunks needs the sliding group's blocks from (64k - 79) // 32 on.
LAYOUT = GroupLayout((KVGroup(FULL, (0, 1)), KVGroup(SLIDING, (2,), 80)), BS)
N = len(PROMPT)  # 300 tokens: 4 full chunks


def grouped(**kw):
    return planner(groups=LAYOUT, **kw)


def publish(index, keys):
    index.update(keys)


def part(c, g):
    return part_key(KEYS[c], g)


def test_windowed_parts_needed_only_near_the_hit_end():
    assert [LAYOUT.needs(1, c, CT, 4 * CT) for c in range(4)] == [False, False, True, True]
    assert LAYOUT.reach_start(1, 0, CT) == 0  # (64 - 39) // 32 = 0
    assert LAYOUT.reach_start(1, 3, CT) == 0
    tight = GroupLayout((KVGroup(FULL, (0,)), KVGroup(SLIDING, (1,), 20)), BS)
    assert (
        tight.reach_start(1, 2, CT) == 1
    )  # (192 - 19) // 32 - 4 = 1: the chunk's first page is out of reach
    assert part_key(KEYS[0], 0) == KEYS[0] and part_key(KEYS[0], 1) != KEYS[0]


def test_a_hit_is_whole_every_part_it_needs_is_held():
    p, index = grouped()
    publish(index, KEYS[:4])  # the full group's parts of 4 chunks, no sliding part
    assert p.lookup("r", PROMPT, N, 0) == (0, False)
    p, index = grouped()
    publish(index, KEYS[:4] + [part(2, 1), part(3, 1)])  # the window of a 4-chunk hit
    assert p.lookup("r", PROMPT, N, 0) == (4 * CT, True)
    p, index = grouped()  # chunk 3's sliding part missing: the 3-chunk hit needs chunks 1 and 2's
    publish(index, KEYS[:4] + [part(1, 1), part(2, 1)])
    assert p.lookup("r", PROMPT, N, 0) == (3 * CT, True)
    p, index = grouped()  # neither: no whole hit
    publish(index, KEYS[:4] + [part(0, 1), part(3, 1)])
    assert p.lookup("r", PROMPT, N, 0) == (CT, True)


def test_the_load_reads_full_parts_of_every_chunk_and_windowed_parts_of_the_window():
    p, index = grouped()
    publish(index, KEYS[:4] + [part(c, 1) for c in range(4)])
    assert p.lookup("r", PROMPT, N, 0) == (4 * CT, True)
    full_ids = list(range(1, 9))
    swa_ids = [0] * 5 + [21, 22, 23]  # vLLM's sliding group: null blocks below (256 - 79) // 32 = 5
    p.on_alloc("r", (full_ids, swa_ids), 4 * CT)
    (plan,) = p.plan_step([]).loads
    got = {(c.group, c.key): (c.block_ids, c.first_block, c.last_block) for c in plan.chunks}
    assert got == {
        **{(0, KEYS[c]): (tuple(full_ids[2 * c : 2 * c + 2]), 0, 2) for c in range(4)},
        (1, part(2, 1)): ((0, 21), 1, 2),
        (1, part(3, 1)): ((22, 23), 0, 2),
    }
    assert not plan.failed


def test_a_part_vllm_wants_that_no_tier_holds_fails_its_blocks():
    p, index = grouped()
    publish(index, KEYS[:4] + [part(2, 1), part(3, 1)])
    assert p.lookup("r", PROMPT, N, 0) == (4 * CT, True)
    # vLLM shortened the hit to 3 chunks + 16 tokens: its window now reaches chunk 1
    swa_ids = [0, 0, 0, 21, 22, 23, 24]
    p.on_alloc("r", (list(range(1, 8)), swa_ids), 3 * CT + 16)
    (plan,) = p.plan_step([]).loads
    assert plan.failed == (21,)
    assert {(c.group, c.key) for c in plan.chunks} >= {(1, part(2, 1)), (1, part(3, 1))}


def test_stores_every_part_but_those_whose_pages_vllm_freed():
    p, index = grouped()
    assert p.lookup("r", PROMPT, N, 0) == (0, False)
    full_ids = list(range(1, 11))
    swa_ids = [0, 0, 13, 14, 15, 16, 17, 18, 19, 20]  # chunk 0's sliding blocks freed already
    plan = p.plan_step([ScheduledRequest("r", 0, N, lambda: (full_ids, swa_ids))])
    stores = {(s.group, s.key): s for s in plan.stores}
    assert set(stores) == {(0, KEYS[c]) for c in range(4)} | {(1, part(c, 1)) for c in (1, 2, 3)}
    assert stores[(1, part(2, 1))].block_ids == (15, 16)
    assert all(s.targets and s.targets[0].tier is Tier.S3 for s in plan.stores)


def test_a_prefetch_fetches_the_parts_a_hit_needs_and_its_lookup_waits_for_any():
    p, index = grouped(cpu_slots=16, chunk_bytes=1000, prefetch_bytes=16 * 1000)
    publish(index, KEYS[:4] + [part(c, 1) for c in range(4)])
    p.prefetch("r", PROMPT, N)
    (plan,) = p.plan_step([]).prefetch
    fetched = {(c.group, c.key) for c in plan.chunks}
    assert fetched == {(0, KEYS[c]) for c in range(4)} | {(1, part(2, 1)), (1, part(3, 1))}
    assert all(c.promote and c.promote[0].tier is Tier.CPU for c in plan.chunks)
    assert p.lookup("r", PROMPT, N, 0) == (None, False)  # waits for its parts


def test_a_chunked_local_group_needs_only_the_attention_chunk_of_the_hit_end():
    from s3kv.kvgroups import CHUNKED

    local = GroupLayout((KVGroup(FULL, (0,)), KVGroup(CHUNKED, (1,), 128)), BS)
    # Attention chunks of 128 tokens: a hit of 3 chunks (192 tokens) reads tokens 128.. of chunk 2 only.
    assert [local.needs(1, c, CT, 3 * CT) for c in range(3)] == [False, False, True]
    # A hit ending on an attention-chunk boundary reads none of the chunked group.
    assert [local.needs(1, c, CT, 4 * CT) for c in range(4)] == [False] * 4
    p, index = planner(groups=local)
    publish(index, KEYS[:4])
    assert p.lookup("r", PROMPT, N, 0) == (4 * CT, True)


def test_with_groups_a_cpu_tier_hit_loads_asynchronously():
    # vLLM takes a failed load of a model with several groups only as a whole
    # request waiting for its KV: a synchronous load could not fail safely.
    p, index = grouped(cpu_slots=16)
    from tests.unit.test_planner import put_cpu

    put_cpu(p, KEYS[:4] + [part(c, 1) for c in range(4)])
    assert p.lookup("r", PROMPT, N, 0) == (4 * CT, True)
    p.on_alloc("r", (list(range(1, 9)), [0] * 5 + [21, 22, 23]), 4 * CT)
    (plan,) = p.plan_step([]).loads
    assert not plan.sync and all(c.sources[0].tier is Tier.CPU for c in plan.chunks)


def test_kv_events_announce_a_chunk_by_its_first_groups_part_only():
    p, index = grouped(emit_events=True)
    assert p.lookup("r", PROMPT, N, 0) == (0, False)
    plan = p.plan_step([ScheduledRequest("r", 0, N, lambda: (list(range(1, 11)), list(range(11, 21))))])
    assert {s.group for s in plan.stores} == {0, 1}
    for s in plan.stores:
        p.stack.get(Tier.S3).complete_store(s.key, True)
    stored = [e.key for e in p.take_events() if e.stored]
    assert sorted(stored) == sorted(KEYS[:4])  # the chain's keys: no part of the sliding group
