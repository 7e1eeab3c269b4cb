"""Lookup latency of an 8k-token prompt against a hot manifest of 1M and 10M keys.

    .venv/bin/python benchmarks/manifest_lookup.py [--sizes 1000000 10000000]

What vLLM's ``get_num_new_matched_tokens`` costs s3kv in the scheduling loop:
the planner's lookup of a prompt's chain of chunk keys (256-token chunks, so
32 of them) in the manifest, every chunk present (the longest answer). Two
figures per size: the *first* lookup of a request (it also hashes the prompt
into chunk keys) and a *repeat* (vLLM asks again while a load is pending).
Measured right after a merge and with 32k recent changes pending (half the
merge threshold, the average between merges). Memory is the manifest's own
bytes per key, after a merge. Goals (issue 4): <= 20 us and <= 10 bytes/key.
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from s3kv.keys import Namespace, chain_keys  # noqa: E402
from s3kv.manifest import Manifest, fingerprints  # noqa: E402
from s3kv.tiering.planner import Planner  # noqa: E402

CHUNK, BLOCK, TOKENS = 256, 16, 8192


def measure(n_keys: int, pending: int = 0, rounds: int = 2000) -> dict[str, float]:
    ns = Namespace.from_fields({"bench": 1})
    rng = np.random.default_rng(n_keys)
    prompts = [[random.randrange(50000) for _ in range(TOKENS)] for _ in range(64)]
    manifest = Manifest()
    background = rng.integers(0, 2**64 - 1, n_keys, dtype=np.uint64, endpoint=True)
    own = np.concatenate([fingerprints(chain_keys(ns, p, CHUNK)) for p in prompts])
    manifest.fps.replace(np.unique(np.concatenate([background, own])))
    bytes_per_key = manifest.fps.nbytes / len(manifest)  # after a merge: the array alone
    for fp in rng.integers(0, 2**63, pending, dtype=np.uint64).tolist():
        manifest.fps.add(fp)
    planner = Planner(namespace=ns, chunk_tokens=CHUNK, block_size=BLOCK, s3=manifest)
    first, repeat = [], []
    for i in range(rounds):
        prompt = prompts[i % len(prompts)]
        rid = f"r{i}"
        t0 = time.perf_counter_ns()
        n, _ = planner.lookup(rid, prompt, TOKENS, 0)
        t1 = time.perf_counter_ns()
        planner.lookup(rid, prompt, TOKENS, 0)
        t2 = time.perf_counter_ns()
        assert n == TOKENS // CHUNK * CHUNK  # every chunk found
        first.append((t1 - t0) / 1000)
        repeat.append((t2 - t1) / 1000)
        planner._requests.pop(rid)  # as vLLM finishing the request would
    return {
        "keys": len(manifest),
        "first_us": statistics.median(first),
        "repeat_us": statistics.median(repeat),
        "bytes_per_key": bytes_per_key,
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sizes", type=int, nargs="+", default=[1_000_000, 10_000_000])
    args = ap.parse_args()
    print(f"{TOKENS}-token prompt, {TOKENS // CHUNK} chunks of {CHUNK} tokens; medians of 2000 lookups")
    for size in args.sizes:
        for pending in (0, 32768):
            r = measure(size, pending)
            print(
                f"  {r['keys']:>10,} keys, {pending:>5} pending: first lookup {r['first_us']:6.1f} us "
                f"(hashes the prompt), repeat {r['repeat_us']:5.1f} us, {r['bytes_per_key']:.2f} bytes/key"
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
