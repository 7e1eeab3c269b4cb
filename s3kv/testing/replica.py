"""The replica tool: one vLLM engine runs a list of token prompts and reports
what happened, as JSON.

    python -m s3kv.testing.replica SPEC.json RESULT.json

The demo, the end-to-end tests and the benchmarks start each replica as a
fresh process with it (:func:`run_replica` does). This module is the tool's
harness: the command (:func:`main`) and the process around it. The engine
it drives is :func:`s3kv.connector.replica.run`, in the connector package
because it imports vLLM. Prompts run one at a time, greedily, so that each
request's TTFT is its own and a later prompt may hit what an earlier one
stored.

SPEC, a JSON object:

- ``model``: the model path or hub name (no tokenizer is loaded).
- ``engine_args``: more keyword arguments of ``vllm.LLM`` (optional).
- ``kv_transfer_config``: vLLM's ``--kv-transfer-config`` as an object, or
  null: no connector (the baseline).
- ``prompts``: each a list of token ids, or ``{"after": i, "append": [...]}``,
  the next turn of a chat: prompt i, its output, then ``append``, or
  ``{"prompt": [...], "kv_transfer_params": {...}, "skip_reading_prefix_cache":
  true, "max_tokens": n}``: token ids sent with vLLM's per-request connector
  parameters, computed whatever any cache holds, and/or generating their
  own number of tokens (all optional).
- ``max_tokens``: tokens generated per prompt (default 16, EOS ignored).
- ``logprobs``: how many of the likeliest tokens to report at each
  generated position (optional; RESULT's ``logprobs``).
- ``flush_prompt``: a prompt run after the drain (optional), so that
  Prometheus sees what the drained uploads counted.
- ``bursts``: optional; a list of bursts, each a list of prompts (token
  ids, or ``{"prompt": ...}`` objects as above) submitted at once (one
  ``generate`` call: they queue in vLLM's scheduler), one burst after
  another once ``prompts`` ran. Their results follow the prompts' in
  RESULT's lists, in order (``ttft_s``: from each request's arrival).
- ``in_flight``: optional; with it, a burst's requests reach the engine
  no more than this many at once, the next as one finishes (a client
  keeping that many requests in flight) instead of all at once.

RESULT, a JSON object:

- ``outputs``: each prompt's generated token ids.
- ``ttft_s``: each prompt's time to first token (vLLM's, else the wall time).
- ``num_cached_tokens``: each prompt's prefix-cache hit, in tokens.
- ``logprobs`` (with SPEC's ``logprobs``): each prompt's, per generated
  token, ``[token, logprob]`` pairs, likeliest first.
- ``metrics``: see :func:`s3kv.connector.replica.metrics`.
- ``workers``: with a connector, each rank's s3kv totals
  (``Counters.totals()``) and ``drained``, after waiting up to
  :data:`s3kv.connector.replica.DRAIN_TIMEOUT_S` for its pending uploads;
  ``{}`` for a rank whose connector is not s3kv's.
- ``kv_cache``: each rank's KV cache, ``{"num_blocks": n, "groups": [spec
  class names]}`` (vLLM's hybrid KV cache manager makes one group per
  attention kind and layer pattern).
- ``startup_s``: seconds to build the engine.
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

MODULE = "s3kv.testing.replica"
"""The module :func:`run_replica` runs by default: this tool."""


def main(
    argv: list[str] | None = None,
    run_spec: Callable[[dict[str, Any]], dict[str, Any]] | None = None,
    prog: str = MODULE,
) -> int:
    """``python -m PROG SPEC.json RESULT.json``: ``run_spec`` (default
    :func:`s3kv.connector.replica.run`) on the spec, its return value written
    as RESULT. Other runners with their own SPEC and RESULT reuse it
    (benchmarks/_batch_runner.py)."""
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 2:
        print(f"usage: python -m {prog} SPEC.json RESULT.json", file=sys.stderr)
        return 2
    if run_spec is None:
        from s3kv.connector.replica import run

        run_spec = run
    with open(args[0]) as f:
        spec = json.load(f)
    result = run_spec(spec)
    with open(args[1], "w") as f:
        json.dump(result, f)
    return 0


def run_replica(
    workdir: Path,
    name: str,
    spec: dict[str, Any],
    module: str = MODULE,
    cwd: Path | None = None,
) -> dict[str, Any]:
    """Run ``spec`` in a fresh engine process (``python -m module SPEC RESULT``,
    formats above) and return its RESULT. Its spec, result and log are
    ``workdir/name.*``; SystemExit, with the log's end, if it fails."""
    spec_path, out_path, log_path = (workdir / f"{name}.{ext}" for ext in ("spec.json", "result.json", "log"))
    spec_path.write_text(json.dumps(spec))
    print(f"  starting replica {name} (a new vLLM engine; log: {log_path}) ...", flush=True)
    with open(log_path, "w") as log:
        rc = subprocess.call(
            [sys.executable, "-m", module, str(spec_path), str(out_path)],
            cwd=cwd,
            stdout=log,
            stderr=subprocess.STDOUT,
        )
    if rc != 0:
        tail = "".join(log_path.read_text().splitlines(keepends=True)[-30:])
        raise SystemExit(f"replica {name} failed (exit {rc}); end of its log:\n{tail}")
    return json.loads(out_path.read_text())


def worker_total(result: dict[str, Any], name: str) -> float:
    """A worker counter of a replica's RESULT, summed over its ranks."""
    return sum(w.get(name, 0) for w in result["workers"])


if __name__ == "__main__":
    sys.exit(main())
