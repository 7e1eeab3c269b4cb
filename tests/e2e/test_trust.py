"""The trust boundary inside real vLLM engines (CPU build) against real S3
servers on loopback: forged objects under a fleet secret, and a corrupt
object under a role that may not delete it."""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import time
import uuid
from pathlib import Path

import boto3
import numpy as np
import pytest

from s3kv import codec
from s3kv.auth import ENV_VAR, FleetKeys
from s3kv.chunk_reader import decode_chunk
from s3kv.keys import Namespace, parse_object_key
from s3kv.manifest import epochs
from s3kv.manifest import format as mf
from tests.conftest import S3Server, free_port
from tests.e2e.conftest import PROMPTS
from tests.e2e.harness import (
    CHUNK_TOKENS,
    REPLICA_ENV,
    chunk_objects,
    copy_objects,
    engine_keys,
    gc_command,
    greedy_params,
    kv_config,
    metric,
    run_replica,
    s3kv_value,
    start_engine,
    worker_total,
)
from tests.e2e.test_replicas import _rotate_pages

pytestmark = pytest.mark.engine

SECRET = "e2e-fleet-secret-0123456789abcdef0123"
SHARED_CHUNKS = 320 // CHUNK_TOKENS


def _resign(objects: dict[str, bytes], keys: FleetKeys):
    """Chunk objects signed with ``keys``, as a replica with the secret writes them."""

    def transform(name: str, body: bytes) -> bytes:
        ns, key, rank = parse_object_key(name)
        h, layers = decode_chunk(body, namespace=ns, key=key.hex(), rank=rank)
        return codec.encode_chunk(
            namespace=ns,
            key=h.key,
            rank=rank,
            tokens=h.tokens,
            layers=layers,
            dtype=h.dtype,
            itemsize=2,
            page_shape=h.page_shape,
            keys=keys,
        )

    return transform


def test_forged_objects_are_never_served_with_a_fleet_secret(
    replica_a, baseline, workdir, model, s3_server, bucket_a
):
    """A fleet with the secret: its chunks and manifest signed. A forger who
    can write to the bucket replaces the family's chunk objects with others
    that pass every checksum but hold another chunk's KV, the very forgery
    that ``test_negative_control_wrong_kv_changes_output`` shows changes
    the answers of a fleet without a secret."""
    keys = FleetKeys([SECRET])
    client = s3_server.client()
    signed = s3_server.new_bucket()
    objects = chunk_objects(client, bucket_a)
    sign = _resign(objects, keys)
    forge = _rotate_pages(objects)
    ns = parse_object_key(next(iter(objects)))[0]
    family = {k for k in engine_keys(Namespace(ns, {}), PROMPTS[0], CHUNK_TOKENS)}
    forged = 0
    for page in client.get_paginator("list_objects_v2").paginate(Bucket=bucket_a):
        for obj in page.get("Contents", ()):
            name = obj["Key"]
            body = client.get_object(Bucket=bucket_a, Key=name)["Body"].read()
            parsed = parse_object_key(name)
            if parsed is not None:
                body = forge(name, body) if parsed[1] in family else sign(name, body)
                forged += parsed[1] in family
            elif "/manifest/ep/" in name:  # an epoch object: its members' arrays one after another
                base = name[: name.index("ep/")]
                body = epochs.encode(base, epochs.decode(base, name, body), keys)
            elif "/manifest/" in name:
                body = mf.encode(mf.decode(body, name=name), keys)
            client.put_object(Bucket=signed, Key=name, Body=body)
    assert forged == SHARED_CHUNKS
    r = run_replica(
        workdir, "auth", model, PROMPTS, kv_config(s3_server.endpoint_url, signed), env={ENV_VAR: SECRET}
    )
    assert r["outputs"] == baseline["outputs"]  # the forged KV never reached a page
    assert metric(r, "hit_tokens") >= SHARED_CHUNKS * CHUNK_TOKENS  # the signed manifest offered them
    assert worker_total(r, "load_errors_corrupt") >= SHARED_CHUNKS  # ... and their MACs failed
    assert r["num_cached_tokens"][3] >= 3 * CHUNK_TOKENS - 1  # signed objects are served
    assert worker_total(r, "load_chunks_s3") >= 3
    log = Path(r["log"]).read_text()
    assert SECRET not in log and SECRET not in json.dumps(r["metrics"])
    # The forgeries it read were deleted and replaced by signed objects of its own.
    for name, body in chunk_objects(client, signed).items():
        ns_, key, rank = parse_object_key(name)
        if key in family:
            decode_chunk(body, namespace=ns_, key=key.hex(), rank=rank, keys=keys)


# -- a role without DeleteObject ---------------------------------------------------


class IamS3(S3Server):
    """A moto server that checks credentials and IAM policies: an admin who
    may do anything, and a replica role without s3:DeleteObject (the
    Terraform default)."""

    def start(self) -> None:
        os.environ["INITIAL_NO_AUTH_ACTION_COUNT"] = "6"  # the six IAM calls below
        try:
            super().start()
        finally:
            del os.environ["INITIAL_NO_AUTH_ACTION_COUNT"]
        iam = boto3.client("iam", endpoint_url=self.endpoint_url, region_name="us-east-1")
        self.creds = {}
        for user, statements in (
            ("admin", [{"Effect": "Allow", "Action": "*", "Resource": "*"}]),
            (
                "replica",
                [
                    {"Effect": "Allow", "Action": "s3:*", "Resource": "*"},
                    {"Effect": "Deny", "Action": ["s3:DeleteObject"], "Resource": "*"},
                ],
            ),
        ):
            iam.create_user(UserName=user)
            iam.put_user_policy(
                UserName=user,
                PolicyName="p",
                PolicyDocument=json.dumps({"Version": "2012-10-17", "Statement": statements}),
            )
            k = iam.create_access_key(UserName=user)["AccessKey"]
            self.creds[user] = {
                "AWS_ACCESS_KEY_ID": k["AccessKeyId"],
                "AWS_SECRET_ACCESS_KEY": k["SecretAccessKey"],
            }

    def client_as(self, user: str):
        c = self.creds[user]
        return boto3.client(
            "s3",
            endpoint_url=self.endpoint_url,
            region_name="us-east-1",
            aws_access_key_id=c["AWS_ACCESS_KEY_ID"],
            aws_secret_access_key=c["AWS_SECRET_ACCESS_KEY"],
        )


def _reported_bad(client, bucket: str, ns: str) -> set[str]:
    """The object names the namespace's manifest segments report bad."""
    prefix = f"s3kv/{ns}/manifest/seg/"
    named: set[str] = set()
    for page in client.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix):
        for o in page.get("Contents", ()):
            obj = mf.decode(client.get_object(Bucket=bucket, Key=o["Key"])["Body"].read(), name=o["Key"])
            named.update(entry[0] for entry in obj.meta.get("bad") or ())
    return named


def test_a_corrupt_object_no_replica_may_delete_costs_one_load_each(
    replica_a, baseline, workdir, model, s3_server, bucket_a, monkeypatch
):
    server = IamS3(free_port())
    server.start()
    engines = []
    try:
        admin = server.client_as("admin")
        bucket = f"s3kv-iam-{uuid.uuid4().hex[:10]}"
        admin.create_bucket(Bucket=bucket)
        names = copy_objects(s3_server.client(), bucket_a, admin, bucket)
        ns = next(parse_object_key(n)[0] for n in names if parse_object_key(n) is not None)
        # The family's third chunk is damaged: every family prompt would hit it.
        key = engine_keys(Namespace(ns, {}), PROMPTS[0], CHUNK_TOKENS)[2]
        name = f"s3kv/{ns}/{key.hex()[:2]}/{key.hex()}.r0"
        good = admin.get_object(Bucket=bucket, Key=name)["Body"].read()
        bad = bytearray(good)
        bad[-100] ^= 0xFF
        admin.put_object(Bucket=bucket, Key=name, Body=bytes(bad))
        replica = server.creds["replica"]
        with pytest.raises(Exception, match="AccessDenied"):
            server.client_as("replica").delete_object(Bucket=bucket, Key=name)

        # Replica 1: one failed load, then the key is reported bad, not read again.
        family = [PROMPTS[0], PROMPTS[1], PROMPTS[2], PROMPTS[0]]
        config = kv_config(server.endpoint_url, bucket, manifest_publish_s=0.5)
        r1 = run_replica(workdir, "no-delete-1", model, family, config, env=replica)
        assert r1["outputs"] == [baseline["outputs"][i] for i in (0, 1, 2, 0)]
        assert worker_total(r1, "load_errors_corrupt") == 1 and worker_total(r1, "quarantined_chunks") == 1
        assert admin.get_object(Bucket=bucket, Key=name)["Body"].read() == bytes(bad)  # still there
        # Its bad record is a segment in the bucket (gc reads those; a snapshot without the key
        # would also keep replica 2 off it, so replica 2's miss alone does not show the record).
        assert name in _reported_bad(admin, bucket, ns), "replica 1 published no bad record naming it"

        # Replica 2 learned it from replica 1's bad record: no failed load at all.
        for k, v in {**REPLICA_ENV, **replica}.items():
            monkeypatch.setenv(k, v)
        llm = start_engine(model, config)
        engines.append(llm)
        params = greedy_params()

        def generate(i):
            (out,) = llm.generate([{"prompt_token_ids": PROMPTS[i]}], params, use_tqdm=False)
            assert list(out.outputs[0].token_ids) == baseline["outputs"][i]
            return out

        assert generate(1).num_cached_tokens == 2 * CHUNK_TOKENS  # chunks 0 and 1, then recomputed
        generate(0)
        assert s3kv_value(llm, "load_errors_corrupt") == 0

        # gc (with delete permission) removes it; then a replica stores the key again. A report
        # gc could not read this run (it says so) is judged the next run, as an operator's cron does.
        for _ in range(3):
            gc = subprocess.run(
                gc_command(bucket, server.endpoint_url, "--region", "us-east-1", "--json"),
                capture_output=True,
                text=True,
                timeout=300,
                env={**os.environ, **server.creds["admin"]},
            )
            assert gc.returncode == 0, gc.stderr
            answer = json.loads(gc.stdout)
            skipped = answer["bad_objects_skipped"] or answer["bad_report_segments_skipped"]
            if answer["result"]["bad_objects_deleted"] or not skipped:
                break
        # gc's whole answer with a failure: what it skipped, and why, says whether the bucket or gc erred.
        assert answer["result"]["bad_objects_deleted"] == 1, gc.stdout
        deadline = time.monotonic() + 180
        while True:
            generate(2)  # computes the chunk again, and stores it now that its name is free
            body = None
            with contextlib.suppress(admin.exceptions.NoSuchKey):
                body = admin.get_object(Bucket=bucket, Key=name)["Body"].read()
            if body is not None:
                break
            assert time.monotonic() < deadline, "the chunk was never stored again"
        decode_chunk(body, namespace=ns, key=key.hex(), rank=0)
        assert np.frombuffer(body, np.uint8).size > 0
    finally:
        for engine in engines:
            engine.llm_engine.engine_core.shutdown()
        server.stop()
