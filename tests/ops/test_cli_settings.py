"""Where the CLI finds the fleet secret (:mod:`s3kv.cli.settings`): a secret
pasted where its key file's path goes is never printed."""

from __future__ import annotations

import json

import pytest

PASTED = "q8Zx/3vKmPz9Lq0Wr7TyUi2Op5AsDf8GhJk4LzXcVbN="
"""A base64 secret pasted where its file's path goes: it has a "/"."""


@pytest.mark.parametrize("given_by", ["flag", "env", "config"])
def test_a_secret_pasted_as_the_key_file_is_never_printed(s3_server, bucket, tmp_path, given_by):
    """``python -m s3kv.cli`` told the secret itself where the key file's path
    goes (by --auth-key-file, S3KV_AUTH_KEY_FILE or the config's
    auth_key_file) says it cannot read it, without the value."""
    import os
    import subprocess
    import sys

    args = [sys.executable, "-m", "s3kv.cli", "ls", "--endpoint-url", s3_server.endpoint_url]
    env = {k: v for k, v in os.environ.items() if not k.startswith("S3KV_")}
    if given_by == "flag":
        args += ["--bucket", bucket, "--auth-key-file", PASTED]
    elif given_by == "env":
        args += ["--bucket", bucket]
        env["S3KV_AUTH_KEY_FILE"] = PASTED
    else:
        config = tmp_path / "kv.json"
        config.write_text(
            json.dumps({"kv_connector_extra_config": {"bucket": bucket, "auth_key_file": PASTED}})
        )
        args += ["--config", str(config)]
    out = subprocess.run(args, capture_output=True, text=True, env=env, timeout=120)
    assert out.returncode == 2, out.stderr
    assert "s3kv: error: auth_key_file (value not shown): cannot read it" in out.stderr
    assert "not the secret itself" in out.stderr
    assert PASTED not in out.stderr + out.stdout and "q8Zx" not in out.stderr + out.stdout
