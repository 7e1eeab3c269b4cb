"""The core imports neither vLLM nor torch (checked in a clean interpreter)."""

import subprocess
import sys

CORE = [
    "s3kv.config",
    "s3kv.keys",
    "s3kv.codec",
    "s3kv.chunk_reader",
    "s3kv.stores.base",
    "s3kv.stores.memory",
    "s3kv.stores.local",
    "s3kv.stores.s3",
    "s3kv.stores.factory",
    "s3kv.manifest",
    "s3kv.manifest.keyset",
    "s3kv.manifest.format",
    "s3kv.manifest.protocol",
    "s3kv.manifest.tombstones",
    "s3kv.manifest.sync",
    "s3kv.identity",
    "s3kv.stats",
    "s3kv.tiering.chunks",
    "s3kv.tiering.placement",
    "s3kv.tiering.plan",
    "s3kv.tiering.loop",
    "s3kv.tiering.tiers.manager",
    "s3kv.tiering.tiers.handler",
    "s3kv.tiering.tiers.report",
    "s3kv.tiering.tiers.settings",
    "s3kv.tiering.tiers.cpu.manager",
    "s3kv.tiering.tiers.cpu.handler",
    "s3kv.tiering.tiers.nvme.manager",
    "s3kv.tiering.tiers.nvme.directory",
    "s3kv.tiering.tiers.nvme.handler",
    "s3kv.tiering.tiers.s3.manager",
    "s3kv.tiering.tiers.s3.handler",
    "s3kv.tiering.worker.gate",
    "s3kv.tiering.worker.hostpool",
    "s3kv.tiering.tiers.nvme.files",
    "s3kv.tiering.worker.transfer",
    "s3kv.tiering.worker.stores",
    "s3kv.tiering.worker.sending",
    "s3kv.tiering.worker.sync_loads",
    "s3kv.tiering.worker.publisher",
    "s3kv.tiering.scheduler.planner",
    "s3kv.connector",
    "s3kv.connector.compat",
    "s3kv.connector.plugin",
    "s3kv.cli",
    "s3kv.cli.ops",
    "s3kv.ops.inventory",
    "s3kv.ops.gc",
    "s3kv.ops.lock",
    "s3kv.ops.verify",
    "s3kv.ops.report",
    "s3kv.demo",
    "s3kv.testing",
    "s3kv.testing.loopback_s3",
    "s3kv.testing.latency_proxy",
    "s3kv.testing.replica",
    "s3kv.testing.chunks",
]


def test_core_has_no_vllm_or_torch():
    code = (
        "import sys\n"
        + "".join(f"import {m}\n" for m in CORE)
        + "bad = [m for m in ('vllm', 'torch', 'transformers') if m in sys.modules]\n"
        + "print(','.join(bad))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == ""


def test_no_vllm_import_outside_the_connector_package():
    import pathlib

    root = pathlib.Path(__file__).resolve().parents[2] / "s3kv"
    offenders = [
        str(p.relative_to(root))
        for p in root.rglob("*.py")
        if "connector" not in p.relative_to(root).parts
        and any(line.lstrip().startswith(("import vllm", "from vllm")) for line in p.read_text().splitlines())
    ]
    assert offenders == []
