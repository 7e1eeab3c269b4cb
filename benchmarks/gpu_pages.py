"""H2D of KV pages on a CUDA device: s3kv's load path (a pinned target per
layer frame, committed as one H2D copy into device scratch and one kernel
that puts the pages in place, on the side stream) against torch's own copy of the same bytes from pinned memory into
one contiguous device tensor. Needs CUDA (not in the suite: these machines
have none); run it where the device tool lends one:

    python -m benchmarks.gpu_pages [--quick]
"""

from __future__ import annotations

import random
import sys
import time
from pathlib import Path

from benchmarks.common import Result, main_for, median

NAME = "gpu_pages"
TITLE = "GPU path: H2D of loaded pages vs torch's pinned copy"
GOAL = "s3kv's H2D >= 0.9x torch's own pinned copy (no goal in the issue; reported)"
LAYERS = 32
BLOCKS_PER_CHUNK = 16
SHAPE = (2, 4096, 16, 8, 128)  # K/V, blocks, block size, KV heads, head size: 64 KiB bf16 pages


def run(work: Path, quick: bool) -> Result:
    import numpy as np
    import torch

    if not torch.cuda.is_available():
        raise SystemExit("gpu_pages: needs a CUDA device")
    from s3kv.connector.pages import PageIO

    caches = {f"l{i}": torch.zeros(SHAPE, dtype=torch.bfloat16, device="cuda") for i in range(LAYERS)}
    io = PageIO(caches, list(caches), SHAPE[1])
    chunks = 8 if quick else 32
    rng = random.Random(0)
    rows, ratios = [], []
    for consecutive in (True, False):
        ids = []
        for _ in range(chunks):
            if consecutive:
                b = rng.randrange(SHAPE[1] - BLOCKS_PER_CHUNK)
                ids.append(list(range(b, b + BLOCKS_PER_CHUNK)))
            else:
                ids.append(rng.sample(range(SHAPE[1]), BLOCKS_PER_CHUNK))
        frame = io.layers[0].page_bytes * BLOCKS_PER_CHUNK
        targets = [[io.target(i, c, 0, BLOCKS_PER_CHUNK) for i in range(LAYERS)] for c in ids]
        for per_chunk in targets:
            for t in per_chunk:
                t.buffers[0][:] = 7
        total = frame * LAYERS * chunks
        plain_src = torch.empty(total, dtype=torch.uint8, pin_memory=True)
        plain_dst = torch.empty(total, dtype=torch.uint8, device="cuda")
        ours_s, plain_s = [], []
        for _ in range(3 if quick else 9):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            for per_chunk in targets:
                for t in per_chunk:
                    t.commit()
            io.synchronize()
            ours_s.append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            plain_dst.copy_(plain_src, non_blocking=True)
            torch.cuda.synchronize()
            plain_s.append(time.perf_counter() - t0)
        ours, plain = total / median(ours_s) / 1e9, total / median(plain_s) / 1e9
        ratios.append(ours / plain)
        rows.append(
            [
                "consecutive" if consecutive else "scattered",
                total >> 20,
                round(ours, 1),
                round(plain, 1),
                round(ours / plain, 2),
            ]
        )
        assert bool((caches["l0"].view(torch.uint8)[:, ids[0]] == 7).all())
    met = min(ratios) >= 0.9
    return Result(
        name=NAME,
        title=TITLE,
        goal=GOAL,
        columns=["blocks", "MiB", "s3kv H2D GB/s", "torch pinned GB/s", "ratio"],
        rows=rows,
        verdict="met" if met else f"missed ({min(ratios):.2f}x)",
        notes=[
            f"{chunks} chunks x {LAYERS} layers x {BLOCKS_PER_CHUNK} blocks of {SHAPE} bf16 pages; "
            "pinned targets filled beforehand (the reads' part is not timed); median of repeats.",
            f"torch {torch.__version__}, {torch.cuda.get_device_name()}; numpy {np.__version__}.",
        ],
    )


if __name__ == "__main__":
    sys.exit(main_for(run, "s3kv-bench-gpu-pages"))
