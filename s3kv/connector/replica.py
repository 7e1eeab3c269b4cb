"""The engine side of the replica tool (:mod:`s3kv.testing.replica`, whose
docstring describes SPEC and RESULT): :func:`run` builds one ``vllm.LLM``
with SPEC's connector and runs its prompts one at a time, greedily, so that
each request's TTFT is its own and a later prompt may hit what an earlier
one stored; then each rank waits for its pending uploads
(:class:`S3KVWorkerExtension`) and reports its s3kv totals. It lives in the
connector package because it imports vLLM; the command, the process it runs
in and the spec files are the harness's.

With a connector, the engine gets ``worker_extension_cls``
:class:`S3KVWorkerExtension` unless the spec names its own.
"""

from __future__ import annotations

import time
from typing import Any

DRAIN_TIMEOUT_S = 60.0
"""How long each rank waits for its pending uploads before it reports."""
WORKER_EXTENSION = "s3kv.connector.replica.S3KVWorkerExtension"
"""``worker_extension_cls`` of the replica's engine (with s3kv's connector or none)."""


class S3KVWorkerExtension:
    """Mixed into vLLM's worker class (``worker_extension_cls``) so that
    ``collective_rpc("s3kv_drain")`` reaches each worker's s3kv side."""

    def s3kv_kv_cache(self) -> dict[str, Any]:
        """This worker's KV cache: its blocks and its groups' kinds (with or
        without a connector)."""
        config = self.model_runner.kv_cache_config  # type: ignore[attr-defined]
        return {
            "num_blocks": int(config.num_blocks),
            "groups": [type(g.kv_cache_spec).__name__ for g in config.kv_cache_groups],
        }

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
    """Run SPEC in this process and return RESULT (both in :mod:`s3kv.testing.replica`)."""
    from vllm import LLM, SamplingParams

    engine_args = dict(spec.get("engine_args", {}))
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
        "kv_cache": llm.collective_rpc("s3kv_kv_cache"),
        "startup_s": startup_s,
    }
    del llm
    return result
