"""One vLLM engine that runs batches of token prompts concurrently and times
their decode steps (the store-path benchmark's engine).

    python -m benchmarks._batch_runner SPEC.json RESULT.json

SPEC is s3kv.testing.replica's (``model``, ``engine_args``,
``kv_transfer_config``, ``max_tokens``) with ``batches`` (a list of lists of
token prompts) instead of ``prompts``: each batch is one ``llm.generate``
call, so its requests prefill and decode together. The engine starts with
the same arguments as s3kv.connector.replica's.

Step times come from the engine core's own clock: every step's outputs
(``EngineCoreOutputs``) carry the monotonic time they were made, so the
difference between two consecutive steps' timestamps is one step's time
(scheduling, forward, sampling, the connector's hooks). They are read by
wrapping ``llm.llm_engine.engine_core.get_output``, a vLLM internal: no
public API gives per-step times. A step is a *decode step of the whole
batch* when it and the step before it both gave every request of the batch
a token: no prefill is in it. RESULT has, per batch, those steps' times,
the wall time of ``llm.generate`` and the outputs, and at the end s3kv's
counters (metrics and the workers' drained totals, as s3kv.connector.replica reports
them).
"""

from __future__ import annotations

import sys
import time
from typing import Any


def run(spec: dict[str, Any]) -> dict[str, Any]:
    from vllm import LLM, SamplingParams

    from s3kv.connector.replica import DRAIN_TIMEOUT_S, WORKER_EXTENSION, metrics

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
    steps: list[tuple[float, int]] = []
    """(engine-core timestamp, requests with a new token) of every step."""
    core = llm.llm_engine.engine_core
    get_output = core.get_output

    def recording_get_output() -> Any:
        out = get_output()
        if out.outputs:
            steps.append((out.timestamp, sum(1 for o in out.outputs if o.new_token_ids)))
        return out

    core.get_output = recording_get_output
    params = SamplingParams(max_tokens=int(spec["max_tokens"]), temperature=0.0, ignore_eos=True)
    batches = []
    for batch in spec["batches"]:
        del steps[:]
        t0 = time.perf_counter()
        outs = llm.generate([{"prompt_token_ids": p} for p in batch], params, use_tqdm=False)
        wall = time.perf_counter() - t0
        full = len(batch)
        decode_steps = [
            b - a
            for (a, n0), (b, n1) in zip(steps, steps[1:])
            if n0 == full and n1 == full  # both steps decoded every request
        ]
        batches.append(
            {
                "wall_s": wall,
                "decode_step_s": decode_steps,
                "steps": len(steps),
                "generated": [len(o.outputs[0].token_ids) for o in outs],
                "outputs": [list(o.outputs[0].token_ids) for o in outs],
            }
        )
    workers: list[dict[str, Any]] = []
    if spec.get("kv_transfer_config"):
        workers = llm.collective_rpc("s3kv_drain", args=(DRAIN_TIMEOUT_S,))
    result = {"batches": batches, "metrics": metrics(llm), "workers": workers, "startup_s": startup_s}
    del llm
    return result


if __name__ == "__main__":
    from s3kv.testing.replica import main

    sys.exit(main(run_spec=run, prog="benchmarks._batch_runner"))
