"""The replica tool's harness (s3kv.testing.replica): the command's file
handling and the process runner, with a spec runner that starts no engine."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from s3kv.testing.replica import main, run_replica, worker_total


def test_main_writes_what_the_runner_returns(tmp_path):
    spec, result = tmp_path / "spec.json", tmp_path / "result.json"
    spec.write_text(json.dumps({"prompts": [[1, 2, 3]]}))
    seen = []

    def run_spec(s):
        seen.append(s)
        return {"outputs": [list(reversed(s["prompts"][0]))]}

    assert main([str(spec), str(result)], run_spec=run_spec) == 0
    assert seen == [{"prompts": [[1, 2, 3]]}]
    assert json.loads(result.read_text()) == {"outputs": [[3, 2, 1]]}


def test_main_without_two_paths_prints_its_usage(capsys):
    assert main(["only-one.json"], run_spec=lambda s: s, prog="benchmarks._x") == 2
    assert "usage: python -m benchmarks._x SPEC.json RESULT.json" in capsys.readouterr().err


def test_the_module_is_the_command():
    out = subprocess.run([sys.executable, "-m", "s3kv.testing.replica"], capture_output=True, text=True)
    assert out.returncode == 2
    assert "usage: python -m s3kv.testing.replica SPEC.json RESULT.json" in out.stderr


def test_run_replica_returns_the_result_and_names_a_failure(tmp_path):
    # A runner module of the tests' own: echoes its spec as its result, or fails.
    (tmp_path / "echo_runner.py").write_text(
        "import sys\n"
        "from s3kv.testing.replica import main\n"
        "def run(spec):\n"
        "    if spec.get('fail'):\n"
        "        print('the runner failed on purpose')\n"
        "        raise SystemExit(3)\n"
        "    return {'workers': spec['workers']}\n"
        "sys.exit(main(run_spec=run, prog='echo_runner'))\n"
    )
    spec = {"workers": [{"store_bytes_s3": 5}, {"store_bytes_s3": 7}, {}]}
    result = run_replica(tmp_path, "ok", spec, module="echo_runner", cwd=tmp_path)
    assert result == spec
    assert worker_total(result, "store_bytes_s3") == 12
    assert json.loads((tmp_path / "ok.spec.json").read_text()) == spec
    with pytest.raises(SystemExit, match=r"replica bad failed \(exit 3\)[\s\S]*the runner failed on purpose"):
        run_replica(tmp_path, "bad", {"fail": True}, module="echo_runner", cwd=tmp_path)
