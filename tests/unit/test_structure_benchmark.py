"""benchmarks/structure.py: its counts on a small package written here, and
its tracer following work across a thread, a task and a thread pool."""

from __future__ import annotations

import asyncio
import concurrent.futures
import importlib
import sys
import textwrap
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from benchmarks.structure import Journeys, Request, Tracer, attribute_counts, largest_files, tier_names


def _write(root: Path, files: dict[str, str]) -> None:
    for rel, text in files.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(textwrap.dedent(text))


@pytest.fixture
def pkg(tmp_path: Path) -> Path:
    root = tmp_path / "pkg"
    _write(
        root,
        {
            "__init__.py": "",
            "placement.py": """
                import enum

                class Tier(str, enum.Enum):
                    CPU = "cpu"
                    DISK = "disk"
                    S3 = "s3"
            """,
            "tiers/__init__.py": "",
            "tiers/base.py": """
                from pkg.placement import Tier

                ORDER = (Tier.CPU, Tier.DISK)
            """,
            "tiers/nvme/__init__.py": "",
            "tiers/nvme/tier.py": """
                from pkg.placement import Tier

                class NvmeHandler:
                    tier = Tier.DISK
                    other = Tier.S3

                def open_disk():
                    return NvmeHandler()
            """,
            "tiers/s3/__init__.py": "",
            "tiers/s3/tier.py": "class S3Handler:\n    pass\n",
            "tiers/cpu.py": "class Pool:\n    pass\n",
            "side.py": """
                from dataclasses import dataclass, field
                from typing import ClassVar

                from pkg.tiers.nvme.tier import open_disk

                class SchedulerSide:
                    def __init__(self):
                        self.a = 1
                        self.b, (self.c, self.d) = 2, (3, 4)
                        self.a += 1
                        local = open_disk()

                    def later(self):
                        self.e = 5

                @dataclass
                class _Request:
                    x: int
                    y: list = field(default_factory=list)
                    z: ClassVar[int] = 0

                    def __post_init__(self):
                        self.w = 1
            """,
            "big.py": "x = 1\n" * 451,
        },
    )
    return root


def test_files_over_the_limit(pkg: Path) -> None:
    files = largest_files(pkg)
    assert files["largest"][0] == {"file": "pkg/big.py", "lines": 451}
    assert files["over_limit"] == [{"file": "pkg/big.py", "lines": 451}]
    assert files["files"] == 11


def test_attributes_of_init_and_dataclass_fields(pkg: Path) -> None:
    counts = attribute_counts(pkg, ("SchedulerSide", "_Request", "Planner"))
    (side,) = counts["SchedulerSide"]
    assert side["file"] == "pkg/side.py"
    assert side["names"] == ["a", "b", "c", "d"]
    assert side["assigned_in_any_method"] == 5  # and e, outside __init__
    (request,) = counts["_Request"]
    assert request["names"] == ["x", "y"]  # not the ClassVar, nor __post_init__'s w
    assert request["assigned_in_any_method"] == 3
    assert counts["Planner"] == []


def test_tier_names_outside_their_wing(pkg: Path) -> None:
    t = tier_names(pkg)
    assert t["wings"] == ["cpu", "nvme", "s3"]  # folders and a module, named after a tier
    assert t["enum_members"] == {"CPU": "cpu", "DISK": "nvme", "S3": "s3"}
    assert t["per_file"] == {
        "pkg/tiers/base.py": {"cpu": 1, "nvme": 1},
        # Tier.S3 in the NVMe wing is outside the S3 tier's own.
        "pkg/tiers/nvme/tier.py": {"s3": 1},
        # the import of open_disk, and its call
        "pkg/side.py": {"nvme": 2},
    }
    assert t["files_per_tier"] == {"cpu": 1, "nvme": 2, "s3": 1}


@pytest.fixture
def traced(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """A package whose hook hands a job to an event loop's thread, whose job
    runs a function in a thread pool, which calls back into the hook's module."""
    root = tmp_path / "tracedpkg"
    _write(
        root,
        {
            "__init__.py": "",
            "hook.py": """
                from tracedpkg import mid

                def start_load_kv(loop, pool):
                    return mid.submit(loop, pool)

                def written():
                    return 1

                def helper():
                    return 2
            """,
            "mid.py": """
                import asyncio

                from tracedpkg import leaf

                def submit(loop, pool):
                    from tracedpkg import hook

                    hook.helper()  # returns: no re-entry of mid
                    return asyncio.run_coroutine_threadsafe(leaf.job(pool), loop)
            """,
            "leaf.py": """
                import asyncio

                from tracedpkg import back

                async def job(pool):
                    await asyncio.sleep(0)  # a resumption is not a new call
                    return await asyncio.get_running_loop().run_in_executor(pool, back.done)
            """,
            "back.py": """
                from tracedpkg import hook

                def done():
                    return hook.written()
            """,
        },
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    yield root
    for name in [m for m in sys.modules if m == "tracedpkg" or m.startswith("tracedpkg.")]:
        del sys.modules[name]


def test_tracer_follows_work_across_threads(traced: Path) -> None:
    hook = importlib.import_module("tracedpkg.hook")
    tracer = Tracer(traced.resolve())
    tracer.start()
    try:
        loop = asyncio.new_event_loop()
        thread = threading.Thread(target=loop.run_forever, name="io")
        thread.start()
        with concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="pool") as pool:
            assert hook.start_load_kv(loop, pool).result(timeout=60) == 1
        loop.call_soon_threadsafe(loop.stop)
        thread.join()
        loop.close()
    finally:
        tracer.stop()
    j = Journeys(tracer, {"start_load_kv"})
    (written,) = [n for n in tracer.nodes.values() if n.func == "written"]
    chain = j.chain(written.index)
    assert [tracer.nodes[i].func for i in chain] == ["start_load_kv", "submit", "job", "done", "written"]
    assert [tracer.nodes[i].thread for i in chain][:3] == ["MainThread", "MainThread", "io"]
    assert tracer.nodes[chain[3]].thread.startswith("pool")
    assert j.is_hook(chain[0])
    leg = j.leg(chain)
    assert leg["path"] == [
        "tracedpkg.hook",
        "tracedpkg.mid",
        "tracedpkg.leaf",
        "tracedpkg.back",
        "tracedpkg.hook",
    ]
    assert leg["reentries"] == {"tracedpkg.hook": 1}  # the call back into hook; helper's return is none
    assert leg["modules_crossed"] == 4 and leg["transitions"] == 4
    assert len([n for n in tracer.nodes.values() if n.func == "job"]) == 1
    # The way back from a request the job made: to the first later call
    # into hook's module under the job (not helper, before it, on the hook's thread).
    job = tracer.nodes[chain[2]]
    request = Request(job.seq, "GET", "k", job.index, job.thread)
    way_back = j.back(request, lambda n: n.module == "tracedpkg.hook")
    assert way_back == chain
