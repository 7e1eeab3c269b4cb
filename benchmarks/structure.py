"""The structure of s3kv, measured: what issue 27 holds the code to, before and after.

    python -m benchmarks.structure [--json PATH] [--static] [--workdir DIR]

No timing figures: counts of modules, calls, lines, attributes and names.
It reports four things about the ``s3kv`` package that Python imports
(``PYTHONPATH`` picks which checkout; ``--static`` skips the engine, (a)):

(a) **Journeys**, measured at run time. A vLLM CPU engine runs in this
process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``: scheduler, worker and s3kv's
background threads in one process) with s3kv's connector and S3 as its only
tier (no CPU or NVMe tier, prefetch off, load policy ``always``), against the
loopback S3 server. One prompt of one chunk and a few tokens is generated
(*store*: its chunk is PUT); a prompt shorter than a chunk then carries the
worker's report to the scheduler; the first prompt again (vLLM's own prefix
cache is off) *loads* its chunk from S3.

``sys.setprofile`` and ``threading.setprofile``, set before the engine
starts, see every call into a function whose file lies under the package
(a *node*: module, function, thread). Each node gets a *logical parent*:
the nearest s3kv frame below it on its thread's stack, or, where work was
handed to another thread or task, the node that handed it over. Hand-offs
are found where asyncio and ``concurrent.futures`` take work, whoever calls
them: a coroutine passed to ``run_coroutine_threadsafe`` or
``create_task``, a callback wrapped in an asyncio ``Handle``
(``call_soon``, ``call_soon_threadsafe``, a future's done callbacks), a
function wrapped in a thread pool's work item (``run_in_executor``,
``to_thread``, ``submit``). A coroutine's resumptions belong to the node of
its first start. A job handed over through a helper (a job loop's
``submit``) has the helper's node as its parent: the helper's module lies on
the path between the job's creator and the job, as it does in execution. Following parents from any node leads to a *root*; a root
that is a method of vLLM's ``KVConnectorBase_V1`` is a connector *hook*.

The S3 requests are the calls into obstore's ``*_async`` functions and
aiobotocore's ``_make_api_call``; a request's node is the s3kv frame that
makes it, and a request whose key holds ``/manifest/`` is the manifest's, not
a chunk's. A *leg* is the chain of nodes from a hook down to a terminal
node, as the module path along it (consecutive nodes of one module are one
visit):

- store, *to S3*: from the hook to the chunk's PUT;
- store, *back*: from the hook to the first call into ``s3kv/manifest/``
  after that PUT started, under the PUT's job (its chain's first node on
  another thread than the hook's): the stored object's publication to the
  fleet's manifest;
- load, *to S3*: from the hook to the chunk's first GET;
- load, *back*: from the hook to the first call into ``s3kv/connector/``
  after that GET started, under the GET's job, that is not an ancestor of
  the GET: the loaded KV returning to the layer that writes vLLM's pages
  (only ``s3kv/connector/`` may touch torch and vLLM).

A module is *re-entered* on a leg when the leg enters it again after
leaving it for another s3kv module: ``runs - 1`` for each module, where runs
are its separate visits along the path. Returns do not count (A calls B,
B returns, A calls C: A is not re-entered); a callback into a module that
called down (A -> B -> A) does. Each leg reports the modules it crosses
(distinct), its module transitions (path length - 1) and its re-entries.
Beside the legs, for each hook called from the store to the load, over all
its calls' chains (hook to any node under it): the modules touched in order
of first entry and each module's largest re-entry count on one chain (the
JSON also has the hook's calls, which vary with the engine steps a load
takes).

(b) **Files**: the largest files of the package in lines, and those over
:data:`LINE_LIMIT`.

(c) **Attributes** of ``SchedulerSide``, ``WorkerSide``, ``Planner`` and
``_Request``, found by class name (with ``ast``) wherever they live:
instance attributes assigned in ``__init__`` (``self.x = ...``) plus
dataclass fields; and attributes assigned on ``self`` in any method.

(d) **Tier names outside their wing**: the wings are the folders (or
modules) of the package's ``tiers`` folder named after a tier (``cpu``,
``nvme``, ``s3``). A tier's names are
its ``Tier`` enum member (``Tier.DISK`` is the NVMe tier's), every class
defined in its wing, any class named after it and ending in ``Handler``,
``TierManager``, ``Spec`` or ``Wing`` (``S3Handler``, ``NvmeHandler``,
``CpuHandler``, ``S3TierManager``), and any name a file imports from the
wing's modules (``open_disk``). Each file of the package outside a tier's
wing that mentions one of them (an identifier, an attribute, an import; not
strings or comments) counts for that tier: a proxy for the files a new tier
touches.
"""

from __future__ import annotations

import argparse
import ast
import functools
import itertools
import json
import os
import sys
import tempfile
import threading
from collections import Counter
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

LINE_LIMIT = 450
"""Issue 27's target: no file in the package longer than this."""
TOP_FILES = 15
ATTRIBUTE_CLASSES = ("SchedulerSide", "WorkerSide", "Planner", "_Request")
CHUNK_TOKENS = 64
BLOCK_SIZE = 32
TAIL_TOKENS = 10
"""Tokens past the chunk boundary: one full chunk is stored and loaded."""
MAX_TOKENS = 2
BUCKET = "structure"
MANIFEST_MARK = "/manifest/"
TIER_ALIASES = {"disk": "nvme"}
"""``Tier`` enum values named otherwise than their wing's folder."""
TIER_CLASS_SUFFIXES = ("Handler", "TierManager", "Spec", "Wing")
TIER_CLASS_PREFIXES = {"cpu": ("Cpu", "CPU"), "nvme": ("Nvme", "NVMe", "NVME", "Disk"), "s3": ("S3",)}
_GENERATOR_FLAGS = 0x20 | 0x80 | 0x100 | 0x200
"""CO_GENERATOR | CO_COROUTINE | CO_ITERABLE_COROUTINE | CO_ASYNC_GENERATOR."""


def package_dir() -> Path:
    import s3kv

    return Path(s3kv.__file__).resolve().parent


def _py_files(pkg: Path) -> list[Path]:
    return sorted(p for p in pkg.rglob("*.py") if "__pycache__" not in p.parts)


def _rel(pkg: Path, path: Path) -> str:
    return str(path.relative_to(pkg.parent))


# -- (b) files ---------------------------------------------------------------------------


def largest_files(pkg: Path) -> dict[str, Any]:
    sizes = {_rel(pkg, p): len(p.read_text().splitlines()) for p in _py_files(pkg)}
    ranked = sorted(sizes.items(), key=lambda kv: (-kv[1], kv[0]))
    return {
        "files": len(sizes),
        "lines": sum(sizes.values()),
        "largest": [{"file": f, "lines": n} for f, n in ranked[:TOP_FILES]],
        "over_limit": [{"file": f, "lines": n} for f, n in ranked if n > LINE_LIMIT],
        "limit": LINE_LIMIT,
    }


# -- (c) attributes ----------------------------------------------------------------------


def _classes(pkg: Path) -> list[tuple[str, ast.ClassDef]]:
    out = []
    for path in _py_files(pkg):
        tree = ast.parse(path.read_text(), str(path))
        out += [(_rel(pkg, path), n) for n in ast.walk(tree) if isinstance(n, ast.ClassDef)]
    return out


def _is_dataclass(cls: ast.ClassDef) -> bool:
    for d in cls.decorator_list:
        target = d.func if isinstance(d, ast.Call) else d
        name = target.attr if isinstance(target, ast.Attribute) else getattr(target, "id", "")
        if name == "dataclass":
            return True
    return False


def _self_targets(fn: ast.AST) -> set[str]:
    """Attributes assigned on ``self`` anywhere in ``fn``."""
    names: set[str] = set()

    def add(t: ast.AST) -> None:
        if isinstance(t, ast.Attribute) and isinstance(t.value, ast.Name) and t.value.id == "self":
            names.add(t.attr)
        elif isinstance(t, (ast.Tuple, ast.List)):
            for e in t.elts:
                add(e)
        elif isinstance(t, ast.Starred):
            add(t.value)

    for node in ast.walk(fn):
        if isinstance(node, ast.Assign):
            for t in node.targets:
                add(t)
        elif isinstance(node, (ast.AnnAssign, ast.AugAssign)):
            add(node.target)
    return names


def _dataclass_fields(cls: ast.ClassDef) -> list[str]:
    if not _is_dataclass(cls):
        return []
    out = []
    for s in cls.body:
        if (
            isinstance(s, ast.AnnAssign)
            and isinstance(s.target, ast.Name)
            and "ClassVar" not in ast.unparse(s.annotation)
        ):
            out.append(s.target.id)
    return out


def attribute_counts(pkg: Path, names: Iterable[str] = ATTRIBUTE_CLASSES) -> dict[str, list[dict[str, Any]]]:
    wanted = set(names)
    out: dict[str, list[dict[str, Any]]] = {n: [] for n in names}
    for rel, cls in _classes(pkg):
        if cls.name not in wanted:
            continue
        methods = [s for s in cls.body if isinstance(s, (ast.FunctionDef, ast.AsyncFunctionDef))]
        init = next((m for m in methods if m.name == "__init__"), None)
        in_init = _self_targets(init) if init is not None else set()
        fields = _dataclass_fields(cls)
        anywhere: set[str] = set()
        for m in methods:
            anywhere |= _self_targets(m)
        attrs = sorted(in_init | set(fields))
        out[cls.name].append(
            {
                "file": rel,
                "attributes": len(attrs),
                "init_attributes": len(in_init),
                "dataclass_fields": len(fields),
                "assigned_in_any_method": len(anywhere | set(fields)),
                "names": attrs,
            }
        )
    return out


# -- (d) tier names ----------------------------------------------------------------------


def _tier_enum(trees: dict[Path, ast.Module]) -> dict[str, str]:
    """The ``Tier`` enum's members, each with its wing's name (its value, or the alias)."""
    members: dict[str, str] = {}
    for tree in trees.values():
        for node in ast.walk(tree):
            if isinstance(node, ast.ClassDef) and node.name == "Tier":
                if not any("Enum" in ast.unparse(b) for b in node.bases):
                    continue
                for s in node.body:
                    if (
                        isinstance(s, ast.Assign)
                        and isinstance(s.targets[0], ast.Name)
                        and isinstance(s.value, ast.Constant)
                    ):
                        value = str(s.value.value).lower()
                        members[s.targets[0].id] = TIER_ALIASES.get(value, value)
    return members


def _wings(pkg: Path, names: set[str]) -> tuple[Path | None, dict[str, Path]]:
    """The ``tiers`` folder and its wings by tier name: a folder or a module
    of it named after a tier."""
    for d in sorted(pkg.rglob("tiers")):
        if not d.is_dir():
            continue
        wings = {}
        for w in sorted(d.iterdir()):
            name = w.name.removesuffix(".py")
            if name in names and (w.suffix == ".py" or (w.is_dir() and any(w.glob("*.py")))):
                wings[name] = w
        if wings:
            return d, wings
    return None, {}


def tier_names(pkg: Path) -> dict[str, Any]:
    trees = {path: ast.parse(path.read_text(), str(path)) for path in _py_files(pkg)}
    members = _tier_enum(trees)  # Tier enum member -> wing
    tiers_dir, wings = _wings(pkg, set(members.values()))
    members = {m: w for m, w in members.items() if w in wings}

    def wing_of_path(path: Path) -> str | None:
        for name, w in wings.items():
            if w == path or w in path.parents:
                return name
        return None

    classes: dict[str, str] = {}  # class name -> wing
    for path, tree in trees.items():
        home = wing_of_path(path)
        for node in ast.walk(tree):
            if not isinstance(node, ast.ClassDef):
                continue
            if home is not None:
                classes[node.name] = home
                continue
            for tier, prefixes in TIER_CLASS_PREFIXES.items():
                if (
                    tier in wings
                    and node.name.startswith(prefixes)
                    and node.name.endswith(TIER_CLASS_SUFFIXES)
                ):
                    classes[node.name] = tier
    wing_modules = {
        ".".join((pkg.name, *w.relative_to(pkg).with_suffix("").parts)): name for name, w in wings.items()
    }

    def wing_of_module(module: str) -> str | None:
        for prefix, name in wing_modules.items():
            if module == prefix or module.startswith(prefix + "."):
                return name
        return None

    per_file: dict[str, dict[str, int]] = {}
    for path, tree in trees.items():
        home = wing_of_path(path)
        imported: dict[str, str] = {}  # a name bound from a wing module -> wing
        seen: Counter[str] = Counter()
        for node in ast.walk(tree):
            wing: str | None
            if isinstance(node, ast.ImportFrom) and node.module:
                wing = wing_of_module(node.module)
                for a in node.names:
                    w = wing or wing_of_module(f"{node.module}.{a.name}")
                    if w is not None:
                        imported[a.asname or a.name] = w
            elif isinstance(node, ast.Import):
                for a in node.names:
                    w = wing_of_module(a.name)
                    if w is not None and w != home:
                        seen[w] += 1
        for node in ast.walk(tree):
            wing = None
            if isinstance(node, ast.Attribute):
                if isinstance(node.value, ast.Name) and node.value.id == "Tier":
                    wing = members.get(node.attr)
                else:
                    wing = classes.get(node.attr)
            elif isinstance(node, ast.Name):
                wing = classes.get(node.id) or imported.get(node.id)
            elif isinstance(node, ast.alias):
                wing = classes.get(node.name.rsplit(".", 1)[-1]) or imported.get(node.asname or node.name)
            if wing is not None and wing != home:
                seen[wing] += 1
        if seen:
            per_file[_rel(pkg, path)] = dict(sorted(seen.items()))
    files_per_tier = {w: sorted(f for f, c in per_file.items() if w in c) for w in wings}
    return {
        "wings_dir": _rel(pkg, tiers_dir) if tiers_dir else None,
        "wings": sorted(wings),
        "enum_members": members,
        "tier_classes": dict(sorted(classes.items())),
        "per_file": dict(sorted(per_file.items())),
        "files_per_tier": {w: len(fs) for w, fs in files_per_tier.items()},
        "files_naming_a_tier": len(per_file),
        "mentions": sum(sum(c.values()) for c in per_file.values()),
    }


# -- (a) the tracer ----------------------------------------------------------------------


@dataclass
class Node:
    """One call into a function of the package."""

    index: int
    seq: int
    module: str
    func: str
    thread: str
    parent: int | None


@dataclass
class Request:
    """One S3 request an s3kv frame made."""

    seq: int
    op: str
    key: str | None
    node: int | None
    thread: str


@dataclass
class Tracer:
    """Calls into the package's functions, with logical parents across
    threads and tasks (see the module docstring)."""

    pkg: Path
    nodes: dict[int, Node] = field(default_factory=dict)
    requests: list[Request] = field(default_factory=list)
    marks: list[tuple[int, str]] = field(default_factory=list)
    active: bool = False

    def __post_init__(self) -> None:
        import asyncio.base_events
        import asyncio.events
        import asyncio.tasks
        import concurrent.futures.thread

        self._prefix = str(self.pkg) + os.sep
        self._seq = itertools.count()
        self._ids = itertools.count()
        self._codes: dict[int, tuple[Any, str, Any]] = {}
        self._live: dict[int, tuple[Any, int]] = {}  # frame id -> (frame, node)
        self._handed: dict[int, tuple[Any, int]] = {}  # coroutine frame / handle / work item -> node
        self._requested: dict[int, Any] = {}  # aiobotocore's request coroutines, by frame
        self._special = {
            id(c): (c, kind)
            for c, kind in (
                (asyncio.tasks.run_coroutine_threadsafe.__code__, "coro"),
                (asyncio.base_events.BaseEventLoop.create_task.__code__, "coro"),
                (asyncio.events.Handle.__init__.__code__, "wrap"),
                (concurrent.futures.thread._WorkItem.__init__.__code__, "wrap"),
                (asyncio.events.Handle._run.__code__, "run"),
                (concurrent.futures.thread._WorkItem.run.__code__, "run"),
            )
        }
        try:
            import inspect

            import aiobotocore.client

            code = inspect.unwrap(aiobotocore.client.AioBaseClient._make_api_call).__code__
            self._special[id(code)] = (code, "botocore")
        except ImportError:
            pass
        self._native_ops: dict[int, str] = {}
        try:
            import obstore

            for name in dir(obstore):
                if name.endswith("_async"):
                    fn = getattr(obstore, name)
                    op = name[: -len("_async")].split("_")[0].upper()
                    self._native_ops[id(fn)] = {"HEAD": "HEAD", "GET": "GET", "PUT": "PUT"}.get(op, op)
        except ImportError:
            pass

    # -- the profile function (every thread) ------------------------------------------
    def start(self) -> None:
        self.active = True
        threading.setprofile(self._profile)
        sys.setprofile(self._profile)

    def stop(self) -> None:
        self.active = False
        sys.setprofile(None)
        threading.setprofile(None)  # type: ignore[arg-type]

    def mark(self, name: str) -> None:
        self.marks.append((next(self._seq), name))

    def _classify(self, code: Any) -> tuple[Any, str, Any]:
        special = self._special.get(id(code))
        entry: tuple[Any, str, Any]
        if special is not None and special[0] is code:
            entry = (code, special[1], None)
        elif code.co_filename.startswith(self._prefix):
            rel = code.co_filename[len(self._prefix) :]
            module = self.pkg.name + "." + rel[:-3].replace(os.sep, ".").removesuffix(".__init__")
            entry = (code, "s3kv", (module, bool(code.co_flags & _GENERATOR_FLAGS)))
        else:
            entry = (code, "", None)
        self._codes[id(code)] = entry
        return entry

    def _profile(self, frame: Any, event: str, arg: Any) -> None:
        if not self.active:
            return
        if event == "call":
            code = frame.f_code
            entry = self._codes.get(id(code))
            if entry is None or entry[0] is not code:
                entry = self._classify(code)
            kind = entry[1]
            if not kind:
                return
            if kind == "s3kv":
                self._enter(frame, code, *entry[2])
            elif kind == "coro":
                coro = frame.f_locals.get("coro")
                cframe = getattr(coro, "cr_frame", None) or getattr(coro, "gi_frame", None)
                if cframe is not None:
                    known = self._handed.get(id(cframe))
                    if known is None or known[0] is not cframe:
                        parent = self._parent(frame)
                        if parent is not None:
                            self._handed[id(cframe)] = (cframe, parent)
            elif kind == "wrap":
                parent = self._parent(frame)
                if parent is not None:
                    obj = frame.f_locals.get("self")
                    self._handed[id(obj)] = (obj, parent)
            elif kind == "botocore":
                started = self._requested.get(id(frame))
                if started is not None and started is frame:
                    return  # a resumption of the coroutine
                self._requested[id(frame)] = frame
                loc = frame.f_locals
                params = loc.get("api_params") or {}
                op = str(loc.get("operation_name", "?"))
                self._request(
                    op, params.get("Key") if isinstance(params, dict) else None, self._parent(frame)
                )
        elif event == "return":
            entry = self._codes.get(id(frame.f_code))
            if entry is not None and entry[1] == "s3kv" and not entry[2][1]:
                live = self._live.get(id(frame))
                if live is not None and live[0] is frame:
                    del self._live[id(frame)]
        elif event == "c_call":
            native = self._native_ops.get(id(arg))
            if native is not None:
                key = frame.f_locals.get("key")
                self._request(native, key if isinstance(key, str) else None, self._parent(frame, own=True))

    def _request(self, op: str, key: str | None, node: int | None) -> None:
        self.requests.append(Request(next(self._seq), op, key, node, threading.current_thread().name))

    def _enter(self, frame: Any, code: Any, module: str, generator: bool) -> None:
        fid = id(frame)
        if generator:
            live = self._live.get(fid)
            if live is not None and live[0] is frame:
                return  # a resumption: the node of its first start
        parent = self._parent(frame)
        index = next(self._ids)
        self.nodes[index] = Node(
            index, next(self._seq), module, code.co_qualname, threading.current_thread().name, parent
        )
        self._live[fid] = (frame, index)

    def _parent(self, frame: Any, own: bool = False) -> int | None:
        """The logical parent of a call whose frame is ``frame`` (with
        ``own``: the node of ``frame`` itself, if it is one)."""
        handed = self._handed.get(id(frame))
        if handed is not None and handed[0] is frame:
            return handed[1]
        f = frame if own else frame.f_back
        while f is not None:
            fid = id(f)
            live = self._live.get(fid)
            if live is not None and live[0] is f:
                return live[1]
            handed = self._handed.get(fid)
            if handed is not None and handed[0] is f:
                return handed[1]
            special = self._special.get(id(f.f_code))
            if special is not None and special[1] == "run" and special[0] is f.f_code:
                obj = f.f_locals.get("self")
                handed = self._handed.get(id(obj))
                return handed[1] if handed is not None and handed[0] is obj else None
            f = f.f_back
        return None


# -- (a) the analysis ----------------------------------------------------------------------


def _collapse(modules: Iterable[str]) -> list[str]:
    out: list[str] = []
    for m in modules:
        if not out or out[-1] != m:
            out.append(m)
    return out


def _reentries(path: list[str]) -> dict[str, int]:
    runs = Counter(path)
    return {m: n - 1 for m, n in runs.items() if n > 1}


def _in_package(prefix: str, node: Node) -> bool:
    return node.module.startswith(prefix)


def _journey(legs: list[dict[str, Any] | None]) -> dict[str, Any]:
    """Both legs of a chunk's journey together: the modules either crosses
    (in order of first entry) and each module's re-entries on the leg where
    it has most."""
    modules: list[str] = []
    worst: dict[str, int] = {}
    for leg in legs:
        if leg is None:
            continue
        modules += [m for m in leg["path"] if m not in modules]
        for m, k in leg["reentries"].items():
            worst[m] = max(worst.get(m, 0), k)
    return {
        "modules": modules,
        "modules_crossed": len(modules),
        "reentries": worst,
        "modules_reentered": len(worst),
        "reentries_total": sum(worst.values()),
    }


class Journeys:
    """The legs and hook summaries of a finished trace."""

    def __init__(self, tracer: Tracer, hooks: set[str]) -> None:
        self.t = tracer
        self.hooks = hooks
        self.nodes = tracer.nodes
        self._chains: dict[int, list[int]] = {}

    def chain(self, index: int) -> list[int]:
        """Node indices from the root down to ``index``."""
        got = self._chains.get(index)
        if got is not None:
            return got
        node = self.nodes[index]
        out = ([] if node.parent is None or node.parent not in self.nodes else self.chain(node.parent)) + [
            index
        ]
        self._chains[index] = out
        return out

    def is_hook(self, index: int) -> bool:
        return self.nodes[index].func.rsplit(".", 1)[-1] in self.hooks

    def phase_of(self, seq: int) -> str | None:
        name = None
        for s, n in self.t.marks:
            if s > seq:
                break
            name = n
        return name

    def leg(self, chain: list[int]) -> dict[str, Any]:
        path = _collapse(self.nodes[i].module for i in chain)
        return {
            "path": path,
            "calls": [f"{self.nodes[i].module}:{self.nodes[i].func} [{self.nodes[i].thread}]" for i in chain],
            "modules_crossed": len(set(path)),
            "transitions": len(path) - 1,
            "reentries": _reentries(path),
            "reentries_total": sum(_reentries(path).values()),
        }

    def chunk_request(self, phase: str, op: str) -> Request | None:
        """The phase's first ``op`` of a chunk (not the manifest's) under a
        hook; else its first one under any root (a hand-off the tracer did
        not follow: the leg then starts at that root)."""
        mine = [
            r
            for r in self.t.requests
            if r.op == op
            and r.node is not None
            and self.phase_of(r.seq) == phase
            and not (r.key and MANIFEST_MARK in r.key)
        ]
        hooked = [r for r in mine if r.node is not None and self.is_hook(self.chain(r.node)[0])]
        found = hooked or mine
        return found[0] if found else None

    def back(self, request: Request, accept: Callable[[Node], bool]) -> list[int] | None:
        """The chain from the request's root to the first node ``accept``
        takes that started after the request, under the request's *job*:
        the first node of its chain on another thread than the root's (what
        the hook's own thread does meanwhile is not the way back)."""
        assert request.node is not None
        down = self.chain(request.node)
        job = next((i for i in down if self.nodes[i].thread != self.nodes[down[0]].thread), down[0])
        for n in sorted(self.nodes.values(), key=lambda n: n.seq):
            if n.seq <= request.seq or n.index in down or not accept(n):
                continue
            ch = self.chain(n.index)
            if job in ch:
                return ch
        return None

    def hook_summary(self, phases: set[str]) -> dict[str, Any]:
        calls: Counter[str] = Counter()
        touched: dict[str, list[str]] = {}
        worst: dict[str, dict[str, int]] = {}
        for n in sorted(self.nodes.values(), key=lambda n: n.seq):
            ch = self.chain(n.index)
            root = self.nodes[ch[0]]
            if not self.is_hook(ch[0]) or self.phase_of(root.seq) not in phases:
                continue
            hook = root.func
            if n.index == ch[0]:
                calls[hook] += 1
            mods = touched.setdefault(hook, [])
            if n.module not in mods:
                mods.append(n.module)
            w = worst.setdefault(hook, {})
            for m, k in _reentries(_collapse(self.nodes[i].module for i in ch)).items():
                w[m] = max(w.get(m, 0), k)
        return {
            h: {
                "calls": calls[h],
                "modules_touched": len(touched[h]),
                "modules": touched[h],
                "max_reentries": dict(sorted(worst[h].items())),
            }
            for h in sorted(touched)
        }


# -- (a) the run ---------------------------------------------------------------------------


def _import_first(*names: str) -> Any:
    import importlib

    for name in names:
        try:
            return importlib.import_module(name)
        except ImportError:
            continue
    raise ImportError(f"none of {', '.join(names)}")


def _s3_only(endpoint: str) -> dict[str, Any]:
    return {
        "kv_connector": "S3KVConnector",
        "kv_role": "kv_both",
        "kv_load_failure_policy": "recompute",
        "kv_connector_extra_config": {
            "bucket": BUCKET,
            "endpoint_url": endpoint,
            "region": "us-east-1",
            "chunk_tokens": CHUNK_TOKENS,
            "cpu_bytes": 0,
            "prefetch_bytes": 0,
            "load_policy": "always",
        },
    }


def _drain(timeout_s: float) -> None:
    """Wait for the worker's uploads (in this process: vLLM's accessor of its connector)."""
    from vllm.distributed.kv_transfer import get_kv_transfer_group

    worker = getattr(get_kv_transfer_group(), "worker", None)
    drain = getattr(worker, "drain", None)
    if drain is None or not drain(timeout_s):
        raise SystemExit("the worker's store did not finish (no drain, or it timed out)")


def _environment(work: Path) -> None:
    """One process for the engine and s3kv's threads; the loopback server's
    test credentials; vLLM's weight-digest cache under ``work``."""
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    for k, v in (
        ("AWS_ACCESS_KEY_ID", "testing"),
        ("AWS_SECRET_ACCESS_KEY", "testing"),
        ("AWS_DEFAULT_REGION", "us-east-1"),
    ):
        os.environ.setdefault(k, v)
    os.environ.setdefault("XDG_CACHE_HOME", str(work / "cache"))


def trace_engine(work: Path) -> tuple[Tracer, int]:
    """Store one chunk and load it back in a traced engine; the trace and
    the tokens the load phase's request found cached."""
    import random

    _environment(work)
    # The harness may live in s3kv.testing or in s3kv.demo.
    loopback = _import_first("s3kv.testing.loopback_s3", "s3kv.testing", "s3kv.demo.loopback_s3")
    model_mod = _import_first("s3kv.testing.model", "s3kv.demo.model")
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    import s3kv.connector  # noqa: F401 (registers the connector before tracing starts)

    model = model_mod.build_model(work / "model", seed=0)
    rng = random.Random(27)
    prompt = [rng.randrange(3, 2000) for _ in range(CHUNK_TOKENS + TAIL_TOKENS)]
    flush = [rng.randrange(3, 2000) for _ in range(CHUNK_TOKENS // 4)]
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    tracer = Tracer(package_dir())
    with loopback.LoopbackS3() as server:
        server.create_bucket(BUCKET)
        tracer.mark("startup")
        tracer.start()
        try:
            llm = LLM(
                model=str(model),
                skip_tokenizer_init=True,
                kv_transfer_config=_s3_only(server.endpoint_url),
                enable_prefix_caching=False,
                enforce_eager=True,
                block_size=BLOCK_SIZE,
                max_model_len=4 * CHUNK_TOKENS,
                gpu_memory_utilization=0.15,
            )
            outs = []
            for phase, tokens in (("store", prompt), ("report", flush), ("load", prompt)):
                tracer.mark(phase)
                (out,) = llm.generate([TokensPrompt(prompt_token_ids=tokens)], params, use_tqdm=False)
                outs.append(out)
                if phase == "store":
                    _drain(60.0)
            tracer.mark("end")
        finally:
            tracer.stop()
        llm.llm_engine.engine_core.shutdown()
    return tracer, int(outs[-1].num_cached_tokens or 0)


def analyse(tracer: Tracer, cached: int) -> dict[str, Any]:
    """The journeys of :func:`trace_engine`'s trace (see the module docstring)."""
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1

    j = Journeys(tracer, {n for n in dir(KVConnectorBase_V1) if not n.startswith("_")})
    requests = Counter(
        f"{r.op}{' (manifest)' if r.key and MANIFEST_MARK in r.key else ''}" for r in tracer.requests
    )
    out: dict[str, Any] = {
        "config": "S3 the only tier (cpu_bytes 0, no disk_path, prefetch off, load_policy always)",
        "chunk_tokens": CHUNK_TOKENS,
        "prompt_tokens": CHUNK_TOKENS + TAIL_TOKENS,
        "load_cached_tokens": cached,
        "nodes": len(tracer.nodes),
        "s3_requests": dict(requests),
        "requests": [
            {
                "op": r.op,
                "key": r.key,
                "phase": j.phase_of(r.seq),
                "root": None if r.node is None else j.nodes[j.chain(r.node)[0]].func,
            }
            for r in tracer.requests
        ],
    }
    for phase, op, back_in in (("store", "PUT", ".manifest."), ("load", "GET", ".connector.")):
        r = j.chunk_request(phase, op)
        entry: dict[str, Any] = {"request": op, "found": r is not None}
        if r is not None and r.node is not None:
            prefix = package_dir().name + back_in
            down = j.chain(r.node)
            back = j.back(r, functools.partial(_in_package, prefix))
            root = j.nodes[down[0]].func
            entry.update(
                hook=root if j.is_hook(down[0]) else f"{root} (not a hook: a hand-off not followed)",
                key=r.key,
                to_s3=j.leg(down),
                back=j.leg(back) if back is not None else None,
            )
            entry["journey"] = _journey([entry["to_s3"], entry["back"]])
        out[phase] = entry
    out["hooks"] = j.hook_summary({"store", "report", "load"})
    if cached < CHUNK_TOKENS or not out["load"]["found"]:
        out["error"] = f"the load phase did not load the chunk from S3 (cached {cached} tokens)"
    return out


# -- output --------------------------------------------------------------------------------


def _print_leg(name: str, leg: dict[str, Any] | None) -> None:
    if leg is None:
        print(f"    {name}: (no terminal found)")
        return
    re_ = ", ".join(f"{m} x{k}" for m, k in leg["reentries"].items()) or "none"
    print(
        f"    {name}: {leg['modules_crossed']} modules, {leg['transitions']} transitions, "
        f"re-entries {leg['reentries_total']} ({re_})"
    )
    for c in leg["calls"]:
        print(f"        {c}")


def report(result: dict[str, Any]) -> None:
    import s3kv

    print(f"s3kv structure: {package_dir()} ({getattr(s3kv, '__version__', '?')})")
    j = result.get("journeys")
    if j:
        print(f"\n(a) journeys, {j['config']}; S3 requests: {j['s3_requests']}")
        if "error" in j:
            print(f"    ERROR: {j['error']}")
        for phase in ("store", "load"):
            e = j[phase]
            print(f"  {phase}: hook {e.get('hook', '?')}, {e['request']} {e.get('key', '(none found)')}")
            if "journey" in e:
                jr = e["journey"]
                re_ = ", ".join(f"{m} x{k}" for m, k in jr["reentries"].items()) or "none"
                print(f"    both legs: {jr['modules_crossed']} modules, re-entered: {re_}")
            _print_leg("to S3", e.get("to_s3"))
            _print_leg("back", e.get("back"))
        print("  hooks called from the store to the load: modules touched; the most re-entries on one chain")
        for h, s in j["hooks"].items():
            re_ = ", ".join(f"{m} x{k}" for m, k in s["max_reentries"].items()) or "none"
            print(f"    {h}: {s['modules_touched']}; {re_}")
    f = result["files"]
    print(f"\n(b) files: {f['files']} files, {f['lines']} lines; over {f['limit']}: {len(f['over_limit'])}")
    for row in f["largest"]:
        mark = " *" if row["lines"] > f["limit"] else ""
        print(f"    {row['lines']:5d}  {row['file']}{mark}")
    print("\n(c) attributes (__init__ + dataclass fields; assigned in any method):")
    for name, found in result["attributes"].items():
        if not found:
            print(f"    {name}: not found")
        for c in found:
            print(f"    {name} ({c['file']}): {c['attributes']}; {c['assigned_in_any_method']}")
    t = result["tiers"]
    print(
        f"\n(d) tier names outside their wing ({t['wings_dir']}: {', '.join(t['wings'])}): "
        f"{t['files_naming_a_tier']} files, {t['mentions']} mentions; files per tier {t['files_per_tier']}"
    )
    for path, counts in t["per_file"].items():
        print(f"    {path}: {', '.join(f'{w} {n}' for w, n in counts.items())}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.structure", description=__doc__.split("\n")[0])
    ap.add_argument("--json", help="also write the result here")
    ap.add_argument("--static", action="store_true", help="only (b)-(d): no engine")
    ap.add_argument("--workdir", default=os.path.join(tempfile.gettempdir(), "s3kv-structure"))
    args = ap.parse_args(argv)
    pkg = package_dir()
    result: dict[str, Any] = {
        "package": str(pkg),
        "files": largest_files(pkg),
        "attributes": attribute_counts(pkg),
        "tiers": tier_names(pkg),
    }
    if not args.static:
        work = Path(args.workdir)
        work.mkdir(parents=True, exist_ok=True)
        result["journeys"] = analyse(*trace_engine(work))
    report(result)
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))
    return 1 if result.get("journeys", {}).get("error") else 0


if __name__ == "__main__":
    sys.exit(main())
