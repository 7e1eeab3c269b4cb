"""Several vLLM engines, alive at once, taking turns at a list of requests:
variants of a benchmark measured interleaved, so that the machine's drift
over a run falls on each alike (engines started one after another, minutes
apart, drift 20% here).

    python -m benchmarks._multi_runner SPEC.json RESULT.json

SPEC:

- ``engines``: name -> ``{"model", "engine_args", "kv_transfer_config"}``
  (s3kv.testing.replica's keys), each run by a process of its own (its
  own Prometheus registry: vLLM's metrics are per process), started one
  after another; an engine not at work is idle; with
  ``"reset_prefix_cache": true`` vLLM's own prefix cache is emptied before
  each of its turns (the connector's tiers kept), so that a repeated
  prompt is a hit of the connector's, not of vLLM's cache;
- ``max_tokens``: tokens generated per request (EOS ignored, greedy);
- ``turns``: a list of ``{"engine": name, "prompts": [...]}``, run in
  order: the prompts (token ids, or ``{"prompt": [...], "max_tokens": n}``)
  are submitted to that engine at once (one ``generate`` call; a single
  prompt is a request on an idle engine, several a burst that queues in
  its scheduler).

After each turn the engine's ranks drain (s3kv_drain: the copies and
uploads the turn left finish before the next turn starts, on any engine).

RESULT: ``turns``, one per SPEC turn: ``engine``, ``ttft_s`` (vLLM's
first_token_latency, from each request's arrival), ``outputs``,
``num_cached_tokens`` and ``workers``, the s3kv worker counters the turn
moved (summed over ranks); ``engines``: name -> ``metrics`` (s3kv's and
vLLM's prefix-cache counters at the end, after a flush request),
``workers`` (each rank's totals) and ``startup_s``.
"""

from __future__ import annotations

import multiprocessing
import sys
import time
from multiprocessing.connection import Connection
from typing import Any

FLUSH_PROMPT = [7] * 8
"""Under a chunk: run after the last turn so that Prometheus sees what the
last steps counted (figures reach it with the step after)."""


def _delta(after: list[dict[str, Any]], before: list[dict[str, Any]]) -> dict[str, float]:
    out: dict[str, float] = {}
    for a, b in zip(after, before):
        for k, v in a.items():
            if isinstance(v, (int, float)) and not isinstance(v, bool):
                d = v - b.get(k, 0)
                if d:
                    out[k] = out.get(k, 0) + d
    return out


def _engine(conn: Connection, spec: dict[str, Any], max_tokens: int) -> None:
    """One engine's process: build it, then run the turns the parent sends."""
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    from s3kv.connector.replica import DRAIN_TIMEOUT_S, WORKER_EXTENSION, metrics

    args = dict(spec.get("engine_args", {}))
    s3kv = bool(spec.get("kv_transfer_config"))
    reset = bool(spec.get("reset_prefix_cache"))
    if s3kv:
        args.setdefault("worker_extension_cls", WORKER_EXTENSION)
    t0 = time.perf_counter()
    llm = LLM(
        model=spec["model"],
        skip_tokenizer_init=True,
        disable_log_stats=False,
        kv_transfer_config=spec.get("kv_transfer_config"),
        **args,
    )
    conn.send(time.perf_counter() - t0)
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)

    def drain() -> list[dict[str, Any]]:
        return llm.collective_rpc("s3kv_drain", args=(DRAIN_TIMEOUT_S,)) if s3kv else []

    def request(entry: Any) -> tuple[dict[str, Any], Any]:
        if isinstance(entry, dict):
            p = params.clone()
            p.max_tokens = int(entry.get("max_tokens", max_tokens))
            return {"prompt_token_ids": list(entry["prompt"])}, p
        return {"prompt_token_ids": list(entry)}, params

    def reset_prefix_cache() -> None:
        # vLLM refuses while blocks are held (a store's blocks until the
        # scheduler hears it finished): a step of the flush prompt lets it hear.
        for _ in range(3):
            if llm.reset_prefix_cache():
                return
            llm.generate(TokensPrompt(prompt_token_ids=FLUSH_PROMPT), params, use_tqdm=False)
        raise RuntimeError("vLLM did not reset its prefix cache (blocks still held)")

    while True:
        prompts = conn.recv()
        if prompts is None:  # the last turn was run
            workers = drain()
            llm.generate([{"prompt_token_ids": FLUSH_PROMPT}], params, use_tqdm=False)
            conn.send({"metrics": metrics(llm), "workers": workers})
            break
        if reset:  # the last turn's stores drained at its end
            reset_prefix_cache()
        before = drain()
        inputs, sampling = zip(*(request(entry) for entry in prompts))
        outs = llm.generate(list(inputs), list(sampling), use_tqdm=False)
        conn.send(
            {
                "ttft_s": [(o.metrics.first_token_latency if o.metrics else 0.0) for o in outs],
                "outputs": [list(o.outputs[0].token_ids) for o in outs],
                "num_cached_tokens": [int(o.num_cached_tokens or 0) for o in outs],
                "workers": _delta(drain(), before),
            }
        )
    llm.llm_engine.engine_core.shutdown()


def run(spec: dict[str, Any]) -> dict[str, Any]:
    ctx = multiprocessing.get_context("spawn")
    max_tokens = int(spec.get("max_tokens", 16))
    engines: dict[str, tuple[Any, Connection]] = {}
    startup: dict[str, float] = {}
    try:
        for name, e in spec["engines"].items():  # one at a time: start-up takes the cores
            parent, child = ctx.Pipe()
            proc = ctx.Process(target=_engine, args=(child, e, max_tokens), name=f"engine-{name}")
            proc.start()
            engines[name] = (proc, parent)
            startup[name] = parent.recv()
        turns = []
        for turn in spec["turns"]:
            name = turn["engine"]
            conn = engines[name][1]
            conn.send(turn["prompts"])
            turns.append({"engine": name, **conn.recv()})
        result: dict[str, Any] = {"turns": turns, "engines": {}}
        for name, (_proc, conn) in engines.items():
            conn.send(None)
            result["engines"][name] = {**conn.recv(), "startup_s": startup[name]}
        return result
    finally:
        for proc, _conn in engines.values():
            proc.join(timeout=120)
            if proc.is_alive():
                proc.kill()


if __name__ == "__main__":
    from s3kv.testing.replica import main

    sys.exit(main(run_spec=run, prog="benchmarks._multi_runner"))
