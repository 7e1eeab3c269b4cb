"""The replica tool: one vLLM engine runs a list of token prompts and reports
what happened, as JSON.

    python -m s3kv.connector.replica SPEC.json RESULT.json

The demo, the end-to-end tests and the benchmarks start each replica as a
fresh process with it (:func:`s3kv.demo.run_replica` does). Prompts run one
at a time, greedily, so that each request's TTFT is its own and a later
prompt may hit what an earlier one stored.

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
- ``metrics``: see :func:`metrics`.
- ``workers``: with a connector, each rank's s3kv totals
  (``Counters.totals()``) and ``drained``, after waiting up to
  :data:`DRAIN_TIMEOUT_S` for its pending uploads; ``{}`` for a rank whose
  connector is not s3kv's.
- ``startup_s``: seconds to build the engine.

With a connector, the engine gets ``worker_extension_cls``
:class:`S3KVWorkerExtension` unless the spec names its own.
"""

from __future__ import annotations

import json
import sys
import time
from typing import Any

DRAIN_TIMEOUT_S = 60.0
"""How long each rank waits for its pending uploads before it reports."""
WORKER_EXTENSION = "s3kv.connector.replica.S3KVWorkerExtension"
"""``worker_extension_cls`` of an engine with s3kv's connector."""


class S3KVWorkerExtension:
    """Mixed into vLLM's worker class (``worker_extension_cls``) so that
    ``collective_rpc("s3kv_drain")`` reaches each worker's s3kv side."""

    def s3kv_drain(self, timeout_s: float) -> dict[str, Any]:
        """Wait up to ``timeout_s`` for this rank's pending uploads, then
        return its s3kv totals and ``drained``; ``{}`` without s3kv's connector."""
        # vLLM's per-process accessor of the connector: the only way into a
        # worker's connector from outside it.
        from vllm.distributed.kv_transfer import get_kv_transfer_group, has_kv_transfer_group

        from s3kv.connector.connector import S3KVConnector

        if not has_kv_transfer_group():
            return {}
        connector = get_kv_transfer_group()
        if not isinstance(connector, S3KVConnector):
            return {}
        side = connector.worker
        drained = side.drain(timeout_s)
        return {"drained": drained, **side.counters.totals()}


def metrics(llm: Any) -> dict[str, float]:
    """vLLM's prefix-cache counters (hits by tier as
    ``vllm:prompt_tokens_cached_by_source{source=host}`` etc.) and s3kv's
    metrics, summed over engines: a labelled family under its flat names
    (``vllm:s3kv_hit_tokens_cpu``) and its total (``vllm:s3kv_hit_tokens``);
    histograms as ``..._count`` and ``..._sum``. ``llm`` is a ``vllm.LLM``."""
    from s3kv.connector.stats import PROM_PREFIX
    from s3kv.stats import FAMILIES

    labels = {PROM_PREFIX + f.name: f.label for f in FAMILIES}
    out: dict[str, float] = {}

    def add(name: str, value: float) -> None:
        out[name] = out.get(name, 0) + value

    for m in llm.get_metrics():
        name = m.name
        if name == "vllm:prompt_tokens_cached_by_source":
            name = f"{name}{{source={m.labels.get('source')}}}"
        elif not m.name.startswith(PROM_PREFIX) and m.name not in (
            "vllm:external_prefix_cache_hits",
            "vllm:external_prefix_cache_queries",
            "vllm:prefix_cache_hits",
            "vllm:prefix_cache_queries",
        ):
            continue
        label = labels.get(name)
        names = [name] + ([f"{name}_{m.labels[label]}"] if label and label in m.labels else [])
        for n in names:
            if hasattr(m, "buckets"):  # a histogram
                add(f"{n}_count", m.count)
                add(f"{n}_sum", m.sum)
            elif isinstance(getattr(m, "value", None), (int, float)):
                add(n, m.value)
    return out


def _prompt(entry: Any, prompts: list[Any], outputs: list[list[int]]) -> list[int]:
    """A prompt: a list of token ids, or a next chat turn
    ``{"after": i, "append": [...]}`` = prompt i + its output + ``append``."""
    if isinstance(entry, dict) and "prompt" in entry:
        return list(entry["prompt"])
    if isinstance(entry, dict):
        i = int(entry["after"])
        return _prompt(prompts[i], prompts, outputs) + outputs[i] + list(entry["append"])
    return list(entry)


def _params(params: Any, entry: Any) -> Any:
    """``params`` with what a ``{"prompt": ...}`` entry asks for its request."""
    if not (isinstance(entry, dict) and "prompt" in entry):
        return params
    request_params = params.clone()
    if "kv_transfer_params" in entry:
        request_params.extra_args = {"kv_transfer_params": dict(entry["kv_transfer_params"])}
    if entry.get("skip_reading_prefix_cache"):
        request_params.skip_reading_prefix_cache = True
    if "max_tokens" in entry:
        request_params.max_tokens = int(entry["max_tokens"])
    return request_params


def _in_flight(llm: Any, name: str, burst: list[Any], params: Any, limit: int) -> list[Any]:
    """``burst``'s outputs, in order, its requests added to ``llm``'s engine
    no more than ``limit`` at a time: the next as one finishes."""
    engine = llm.llm_engine
    waiting = list(enumerate(burst))[::-1]
    index: dict[str, int] = {}
    outs: list[Any] = [None] * len(burst)
    while waiting or index:
        while waiting and len(index) < limit:
            i, entry = waiting.pop()
            prompt = {"prompt_token_ids": _prompt(entry, [], [])}
            engine.add_request(f"{name}-{i}", prompt, _params(params, entry))
            index[f"{name}-{i}"] = i  # the id its outputs carry (vLLM's own adds a suffix)
        for out in engine.step():
            if out.finished:
                outs[index.pop(out.request_id)] = out
    return outs


def run(spec: dict[str, Any]) -> dict[str, Any]:
    """Run SPEC in this process and return RESULT (both in the module docstring)."""
    from vllm import LLM, SamplingParams

    engine_args = dict(spec.get("engine_args", {}))
    if spec.get("kv_transfer_config"):
        engine_args.setdefault("worker_extension_cls", WORKER_EXTENSION)
    started = time.perf_counter()
    llm = LLM(
        model=spec["model"],
        skip_tokenizer_init=True,
        disable_log_stats=False,
        kv_transfer_config=spec.get("kv_transfer_config"),
        **engine_args,
    )
    startup_s = time.perf_counter() - started
    logprobs = spec.get("logprobs")
    params = SamplingParams(
        max_tokens=int(spec.get("max_tokens", 16)),
        temperature=0.0,
        ignore_eos=True,
        logprobs=None if logprobs is None else int(logprobs),
    )
    outputs: list[list[int]] = []
    ttft: list[float] = []
    cached: list[int] = []
    tops: list[list[list[list[float]]]] = []

    def record(out: Any, wall: float) -> None:
        outputs.append(list(out.outputs[0].token_ids))
        latency = getattr(out.metrics, "first_token_latency", 0.0) if out.metrics else 0.0
        ttft.append(latency or wall)
        cached.append(int(out.num_cached_tokens or 0))
        if logprobs is not None:
            tops.append(
                [
                    sorted(([t, lp.logprob] for t, lp in step.items()), key=lambda p: -p[1])
                    for step in out.outputs[0].logprobs or ()
                ]
            )

    for entry in spec["prompts"]:
        prompt = _prompt(entry, spec["prompts"], outputs)
        t0 = time.perf_counter()
        (out,) = llm.generate([{"prompt_token_ids": prompt}], _params(params, entry), use_tqdm=False)
        record(out, time.perf_counter() - t0)
    in_flight = spec.get("in_flight")
    for b, burst in enumerate(spec.get("bursts", ())):
        t0 = time.perf_counter()
        if in_flight:
            outs = _in_flight(llm, f"burst{b}", burst, params, int(in_flight))
        else:
            batch = [{"prompt_token_ids": _prompt(entry, [], [])} for entry in burst]
            outs = llm.generate(batch, [_params(params, entry) for entry in burst], use_tqdm=False)
        wall = time.perf_counter() - t0
        for out in outs:
            record(out, wall)
    workers: list[dict[str, Any]] = []
    if spec.get("kv_transfer_config"):
        workers = llm.collective_rpc("s3kv_drain", args=(DRAIN_TIMEOUT_S,))
        if spec.get("flush_prompt"):
            # Figures reach Prometheus with the step after they were counted:
            # one more request publishes what the drained uploads counted.
            llm.generate([{"prompt_token_ids": list(spec["flush_prompt"])}], params, use_tqdm=False)
    result = {
        "outputs": outputs,
        "ttft_s": ttft,
        "num_cached_tokens": cached,
        **({"logprobs": tops} if logprobs is not None else {}),
        "metrics": metrics(llm),
        "workers": workers,
        "startup_s": startup_s,
    }
    del llm
    return result


def main(argv: list[str] | None = None, run_spec: Any = None, prog: str = "s3kv.connector.replica") -> int:
    """``python -m PROG SPEC.json RESULT.json``: ``run_spec`` (default :func:`run`)
    on the spec, its return value written as RESULT. Other runners with
    their own SPEC and RESULT reuse it (benchmarks/_batch_runner.py)."""
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 2:
        print(f"usage: python -m {prog} SPEC.json RESULT.json", file=sys.stderr)
        return 2
    with open(args[0]) as f:
        spec = json.load(f)
    result = (run_spec or run)(spec)
    with open(args[1], "w") as f:
        json.dump(result, f)
    return 0


if __name__ == "__main__":
    sys.exit(main())
