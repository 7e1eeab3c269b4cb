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
