"""The scheduler side's bookkeeping, without vLLM."""

from s3kv.index import ChunkIndex
from s3kv.keys import Namespace, chain_keys
from s3kv.tiering.planner import Planner, ScheduledRequest

NS = Namespace.from_fields({"model": "m"})
CT, BS = 64, 32  # 2 blocks a chunk
PROMPT = list(range(10, 10 + 300))  # 4 full chunks + 44 tokens
KEYS = chain_keys(NS, PROMPT, CT)


def planner(world_size=1, clock=None):
    index = ChunkIndex()
    kwargs = {"clock": clock} if clock else {}
    return Planner(
        namespace=NS, chunk_tokens=CT, block_size=BS, index=index, world_size=world_size, **kwargs
    ), index


def sched(req_id, computed, scheduled, blocks):
    return ScheduledRequest(req_id, computed, scheduled, lambda: blocks)


def test_lookup_counts_leading_hits_beyond_local():
    p, index = planner()
    assert p.lookup("r", PROMPT, len(PROMPT), 0) == 0
    index.update(KEYS[:3])
    assert p.lookup("r", PROMPT, len(PROMPT), 0) == 3 * CT
    assert p.lookup("r", PROMPT, len(PROMPT), 2 * BS) == 3 * CT - 2 * BS
    assert p.lookup("r", PROMPT, len(PROMPT), 4 * BS * 2) == 0  # local hit is longer
    index.discard(KEYS[1])  # a gap ends the hit
    assert p.lookup("r", PROMPT, len(PROMPT), 0) == CT


def test_load_plan_skips_blocks_valid_locally():
    p, index = planner()
    index.update(KEYS[:3])
    local = 3 * BS  # one and a half chunks held locally
    n = p.lookup("r", PROMPT, len(PROMPT), local)
    blocks = list(range(100, 110))
    p.on_alloc("r", blocks, n)
    plan = p.plan_step([])
    (load,) = plan.loads
    assert load.req_id == "r"
    assert [(c.key, c.block_ids, c.first_block) for c in load.chunks] == [
        (KEYS[1], (102, 103), 1),
        (KEYS[2], (104, 105), 0),
    ]
    assert p.plan_step([]).loads == []  # handed out once


def test_stores_new_full_chunks_once_across_steps_and_requests():
    p, index = planner()
    blocks = list(range(10))
    p.lookup("a", PROMPT, len(PROMPT), 0)
    p.lookup("b", PROMPT, len(PROMPT), 0)
    # Chunked prefill: 100 tokens, then the rest.
    s1 = p.plan_step([sched("a", 0, 100, blocks)])
    assert [s.key for s in s1.stores] == [KEYS[0]] and s1.stores[0].block_ids == (0, 1)
    s2 = p.plan_step([sched("a", 100, 200, blocks), sched("b", 0, 300, list(range(20, 30)))])
    # b shares a's prefix: chunks a plans are not planned again for b.
    assert [s.key for s in s2.stores] == KEYS[1:4]
    assert p.plan_step([sched("a", 300, 1, blocks)]).stores == []


def test_known_chunks_are_not_stored_and_reports_update_the_index():
    p, index = planner(world_size=2)
    index.add(KEYS[0])
    p.lookup("a", PROMPT, len(PROMPT), 0)
    plan = p.plan_step([sched("a", 0, 300, list(range(10)))])
    assert [s.key for s in plan.stores] == KEYS[1:4]
    p.on_stored({KEYS[1]: 1})
    assert KEYS[1] not in index  # one of two ranks so far
    p.on_stored({KEYS[1]: 1, KEYS[2]: 2})
    assert KEYS[1] in index and KEYS[2] in index
    p.on_missing([KEYS[0]])
    assert KEYS[0] not in index


def test_failed_or_stale_stores_are_planned_again():
    now = [0.0]
    p, index = planner(clock=lambda: now[0])
    p.lookup("a", PROMPT, len(PROMPT), 0)
    p.lookup("b", PROMPT, len(PROMPT), 0)
    p.lookup("c", PROMPT, len(PROMPT), 0)
    assert len(p.plan_step([sched("a", 0, 300, list(range(10)))]).stores) == 4
    p.on_store_failed([KEYS[0]])
    assert [s.key for s in p.plan_step([sched("b", 0, 300, list(range(10)))]).stores] == [KEYS[0]]
    now[0] = 1000.0  # never reported: retried after store_retry_s
    assert len(p.plan_step([sched("c", 0, 300, list(range(10)))]).stores) == 4


def test_finished_requests_are_forgotten():
    p, _ = planner()
    p.lookup("a", PROMPT, len(PROMPT), 0)
    assert p.knows("a")
    p.on_finished("a")
    assert not p.knows("a")
    assert p.plan_step([sched("a", 0, 300, list(range(10)))]).stores == []


def test_extras_change_keys_per_chunk():
    p, index = planner()
    index.update(KEYS)
    assert (
        p.lookup(
            "salted", PROMPT, len(PROMPT), 0, extras=lambda s, e: ("cache_salt", "x") if s == 0 else None
        )
        == 0
    )
    assert p.lookup("plain", PROMPT, len(PROMPT), 0, extras=lambda s, e: None) == 4 * CT


def test_failed_request_gets_no_more_hits():
    p, index = planner()
    index.update(KEYS)
    assert p.lookup("r", PROMPT, len(PROMPT), 0) == 4 * CT
    p.on_load_results({"r"}, loaded=0, unavailable=0)
    assert p.lookup("r", PROMPT, len(PROMPT), 0) == 0  # vLLM asks again after a failure
    assert p.lookup("other", PROMPT, len(PROMPT), 0) == 4 * CT


def test_unreachable_store_pauses_hits_with_growing_backoff():
    now = [0.0]
    p, index = planner(clock=lambda: now[0])
    index.update(KEYS)
    p.on_load_results(set(), loaded=0, unavailable=1)
    assert p.paused and p.lookup("a", PROMPT, len(PROMPT), 0) == 0
    now[0] = 5.1
    assert p.lookup("b", PROMPT, len(PROMPT), 0) == 4 * CT
    p.on_load_results(set(), loaded=0, unavailable=1)  # still down: 10 s now
    now[0] = 14.0
    assert p.paused
    now[0] = 15.2
    assert not p.paused
    p.on_load_results(set(), loaded=3, unavailable=0)  # back: next pause is short again
    p.on_load_results(set(), loaded=0, unavailable=1)
    now[0] = 20.3
    assert not p.paused
