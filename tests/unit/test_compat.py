import pytest

from s3kv.connector.compat import OVERRIDE_ENV, check_vllm_version
from s3kv.errors import UnsupportedVersion


def test_supported_series_passes():
    assert check_vllm_version("0.32.0") == "0.32.0"
    assert check_vllm_version("0.32.5+cpu") == "0.32.5+cpu"


@pytest.mark.parametrize("version", ["0.31.2", "0.33.0", "1.0.0", "dev"])
def test_other_versions_fail_with_a_clear_message(version, monkeypatch):
    monkeypatch.delenv(OVERRIDE_ENV, raising=False)
    with pytest.raises(UnsupportedVersion, match=f"vLLM {version} is installed"):
        check_vllm_version(version)
    monkeypatch.setenv(OVERRIDE_ENV, "1")
    assert check_vllm_version(version) == version


def test_the_message_names_the_distribution(monkeypatch):
    monkeypatch.delenv(OVERRIDE_ENV, raising=False)
    with pytest.raises(UnsupportedVersion, match="distribution vllm-s3kv.* or a vllm-s3kv that supports"):
        check_vllm_version("0.33.0")


def test_the_distribution_is_named_vllm_s3kv_and_every_install_line_says_so():
    """``s3kv`` on PyPI is an unrelated project (a 2023 S3 key-value library):
    ``pip install s3kv`` installed it. The distribution is vllm-s3kv; the
    import package, the command, the plugin and the connector keep s3kv."""
    import re
    from pathlib import Path

    import s3kv

    tomllib = pytest.importorskip("tomllib")
    root = Path(__file__).resolve().parents[2]
    project = tomllib.loads((root / "pyproject.toml").read_text())["project"]
    assert project["name"] == s3kv.DISTRIBUTION == "vllm-s3kv"
    assert project["scripts"] == {"s3kv": "s3kv.cli:main"}
    assert project["entry-points"]["vllm.general_plugins"] == {"s3kv": "s3kv.connector.plugin:register"}
    wrong = re.compile(r"pip3? install\s+(--?\S+\s+)*['\"]?s3kv\b(?![-_.\w])")
    texts = [root / "README.md", root / "Makefile"] + [
        p for d in ("infra", "s3kv", "benchmarks") for p in (root / d).rglob("*") if p.is_file()
    ]
    found = [
        f"{p.relative_to(root)}: {m.group(0)}"
        for p in texts
        if p.suffix in {".md", ".py", ".tf", ".tftpl", ".txt", ".toml", ""}
        for m in wrong.finditer(p.read_text(errors="replace"))
    ]
    assert found == []
    readme = (root / "README.md").read_text()
    assert (
        "distribution is named `vllm-s3kv`" in readme and "installing that name would bring instead" in readme
    )
    assert "vllm-s3kv" in (root / "infra" / "examples" / "eks-fleet" / "variables.tf").read_text()
