"""Ceph's radosgw on loopback: a second, real S3 server for the benchmarks.

Why: the loopback figures measured against moto (:mod:`s3kv.testing.loopback_s3`)
are bounded by moto itself. moto is a Python server: each request costs it
about as much CPU as it costs the client, on the same cores, and it closes
the connection after each answer, so a figure taken against it says as much
about moto as about s3kv. radosgw, the S3 gateway of the Ceph object store,
is written in C++, keeps connections alive, checks signatures and serves
ranged and conditional requests the way a production store does. On this
machine it spends well under half moto's CPU per small request (about 2 ms
against 5); per byte it is no cheaper (it checks the SHA-256 of each body
that a client signs over plain HTTP, which moto skips, and its OSD keeps a
copy), so it is a second point of reference rather than a free server.

How: :class:`RadosGW` runs a one-node Ceph cluster on 127.0.0.1 (one monitor,
one OSD that keeps its objects in memory, "memstore", and radosgw in front)
from Debian bookworm's Ceph 16.2 packages, without installing them. The
packages are fetched with ``apt-get download`` and unpacked with
``dpkg-deb -x`` once, into a cache folder (``$S3KV_CEPH_DIR``, by default
``~/.cache/s3kv/ceph-16``; about 60 MB of .debs, 240 MB unpacked, some 15 s),
and each daemon runs from there; a start with the cache in place takes 2-3 s.
The daemons do not authenticate each other, and all their files
(configuration, monitor store, logs, sockets) lie under one root folder.
Objects live in the OSD's memory and are gone when it stops. It is not a
store for production data. :func:`available` says whether it can run here,
so a benchmark can skip it with the reason.

    python -m benchmarks.radosgw [--root DIR] [--port N]

starts one, prints its endpoint and credentials as JSON, and keeps it running
until Ctrl-C or SIGTERM.
"""

from __future__ import annotations

import argparse
import ctypes
import fcntl
import json
import os
import platform
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from s3kv.testing.loopback_s3 import free_port

_PACKAGE_NAMES = """
    ceph-common ceph-base ceph-mon ceph-osd radosgw librados2 librbd1 librgw2 libradosstriper1 libcephfs2
    python3-rados python3-rbd python3-cephfs python3-ceph-argparse python3-ceph-common python3-rgw
    python3-prettytable python3-wcwidth libtcmalloc-minimal4 libgoogle-perftools4 libboost-context1.74.0
    libboost-thread1.74.0 libboost-program-options1.74.0 libboost-iostreams1.74.0 libboost-python1.74.0
    liblua5.3-0 liboath0 librabbitmq4 libsnappy1v5 libleveldb1d liburcu8 libfuse2 libinih1 libaio1
    libibverbs1 librdmacm1 libfmt9 libnl-3-200 libnl-route-3-200 libpmem1 libndctl6 libdaxctl1
"""
PACKAGES = tuple(_PACKAGE_NAMES.split())
"""Debian bookworm packages that make up the monitor, the OSD, radosgw and the
``ceph`` command line, with the libraries they need beyond a base system."""

CACHE_ENV = "S3KV_CEPH_DIR"
"""Environment variable naming the cache folder for the unpacked packages."""
DEFAULT_CACHE = Path.home() / ".cache" / "s3kv" / "ceph-16"

START_TIMEOUT_S = 300.0
"""How long :meth:`RadosGW.start` may take in all, download included."""
POLL_S = 0.5
"""How often start-up checks whether a daemon is ready."""
LOG_TAIL_LINES = 25
"""How many lines of a log a start-up error quotes."""

_LIB = "usr/lib/x86_64-linux-gnu"
_DONE = ".complete"
"""Marker file in the unpacked tree, written once every package is in it."""
_ROOT_ENTRIES = ("ceph.conf", "monmap", "mon", "osd", "rgw", "run", "log", "crash")
"""What :meth:`RadosGW.start` creates under its root (and removes first)."""
_DAEMON_LOGS = {"mon": "ceph-mon.a", "osd": "ceph-osd.0", "rgw": "ceph-client.rgw"}
"""Each daemon's log file under ``root/log``, less ``.log``."""


# ---------------------------------------------------------------- packages


def cache_dir() -> Path:
    """Where the packages are unpacked: ``$S3KV_CEPH_DIR`` or ``~/.cache/s3kv/ceph-16``."""
    return Path(os.environ.get(CACHE_ENV) or DEFAULT_CACHE).expanduser()


def _tree(cache: Path) -> Path:
    return cache / "tree"


def _is_unpacked(cache: Path) -> bool:
    return (_tree(cache) / _DONE).exists()


def available() -> str | None:
    """None if :meth:`RadosGW.start` can work here (the packages are unpacked
    already, or apt knows where to download them: this does not try the
    network), else a one-line reason."""
    if sys.platform != "linux" or platform.machine() != "x86_64":
        return f"radosgw from Debian's packages needs x86-64 Linux, not {sys.platform} {platform.machine()}"
    if not Path("/usr/bin/python3").exists():
        return "the ceph command line needs /usr/bin/python3"
    if _is_unpacked(cache_dir()):
        return None
    for tool in ("apt-get", "apt-cache", "dpkg-deb"):
        if shutil.which(tool) is None:
            return f"{tool} is not on PATH (radosgw comes from Debian's packages)"
    try:
        out = subprocess.run(
            ["apt-get", "download", "--print-uris", *PACKAGES],
            capture_output=True,
            text=True,
            timeout=60,
        )
    except (OSError, subprocess.TimeoutExpired) as e:
        return f"apt-get download --print-uris failed: {e}"
    if out.returncode != 0:
        return f"apt-get cannot download Ceph's packages: {_last_line(out.stderr or out.stdout)}"
    return None


def _last_line(text: str) -> str:
    lines = [line for line in text.splitlines() if line.strip()]
    return lines[-1].strip() if lines else "(no output)"


@contextmanager
def _locked(cache: Path) -> Iterator[None]:
    """Hold an exclusive lock on ``cache`` (two starts never unpack at once)."""
    cache.mkdir(parents=True, exist_ok=True)
    with open(cache / ".lock", "w") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        yield


def ensure_packages(cache: Path, timeout_s: float) -> Path:
    """The unpacked tree under ``cache``, downloading and unpacking the
    packages first unless a complete tree is there already."""
    with _locked(cache):
        tree = _tree(cache)
        if _is_unpacked(cache):
            return tree
        with tempfile.TemporaryDirectory(dir=cache, prefix="partial-") as tmp:
            debs, staged = Path(tmp) / "debs", Path(tmp) / "tree"
            debs.mkdir()
            _run_step("apt-get download", ["apt-get", "download", *PACKAGES], timeout_s, cwd=debs)
            for deb in sorted(debs.glob("*.deb")):
                _run_step(f"dpkg-deb -x {deb.name}", ["dpkg-deb", "-x", str(deb), str(staged)], timeout_s)
            (staged / _DONE).write_text(" ".join(PACKAGES) + "\n")
            shutil.rmtree(tree, ignore_errors=True)
            staged.rename(tree)
        return tree


def ceph_env(tree: Path) -> dict[str, str]:
    """This process's environment with the unpacked Ceph binaries, libraries
    and Python modules in front."""
    env = dict(os.environ)

    def prepend(var: str, *paths: Path) -> None:
        env[var] = os.pathsep.join([*map(str, paths), *filter(None, [env.get(var)])])

    prepend("PATH", tree / "usr/bin")
    prepend("LD_LIBRARY_PATH", tree / _LIB, tree / "lib/x86_64-linux-gnu", tree / _LIB / "ceph")
    env["PYTHONPATH"] = str(tree / "usr/lib/python3/dist-packages")
    env.pop("PYTHONHOME", None)
    return env


# ---------------------------------------------------------------- processes


def _run_step(
    step: str,
    argv: list[str],
    timeout_s: float,
    *,
    env: dict[str, str] | None = None,
    cwd: Path | None = None,
) -> str:
    """Run one start-up command; its output, or RuntimeError naming the step
    and quoting the end of its output."""
    try:
        out = subprocess.run(
            argv,
            env=env,
            cwd=cwd,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            timeout=max(timeout_s, 1.0),
        )
    except subprocess.TimeoutExpired as e:
        text = e.output if isinstance(e.output, str) else (e.output or b"").decode(errors="replace")
        raise RuntimeError(
            f"radosgw start-up: {step} timed out after {timeout_s:.0f} s\n{_tail(text)}"
        ) from None
    except OSError as e:
        raise RuntimeError(f"radosgw start-up: {step} could not run: {e}") from None
    if out.returncode != 0:
        raise RuntimeError(f"radosgw start-up: {step} failed (exit {out.returncode})\n{_tail(out.stdout)}")
    return out.stdout


def _tail(text: str, lines: int = LOG_TAIL_LINES) -> str:
    return "\n".join(text.rstrip().splitlines()[-lines:])


def _file_tail(path: Path) -> str:
    try:
        return f"--- end of {path}:\n{_tail(path.read_text(errors='replace'))}"
    except OSError:
        return f"--- {path}: not written"


_PR_SET_PDEATHSIG = 1


def _die_with_parent() -> None:
    """In a daemon, just after fork: SIGKILL when the process that started it
    ends, so a benchmark that crashes leaves no cluster behind."""
    ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)


# ---------------------------------------------------------------- the cluster


class RadosGW:
    """A one-node Ceph cluster with radosgw on ``127.0.0.1:port`` (a free
    port by default), its files under ``root`` and its objects in an OSD
    memory store of ``memstore_bytes``. :meth:`start` returns once the S3
    endpoint answers; :meth:`stop` kills the daemons, and a later
    :meth:`start` builds a fresh, empty cluster. Also a context manager.
    Keep ``root`` short: the daemons' control sockets live under it, and a
    Unix socket path has at most 107 bytes.

    Same use as :class:`s3kv.testing.loopback_s3.LoopbackS3`, except that
    radosgw checks credentials: pass :meth:`env` (or :attr:`access_key` and
    :attr:`secret_key`) to clients.
    """

    access_key = "s3kv-bench-access-key"
    secret_key = "s3kv-bench-secret-key"
    region = "us-east-1"

    def __init__(self, root: Path, port: int | None = None, memstore_bytes: int = 4 << 30) -> None:
        self.root = Path(root).expanduser().absolute()
        self.port = free_port() if port is None else port
        self.memstore_bytes = memstore_bytes
        self.procs: dict[str, subprocess.Popen] = {}
        """The running daemons by role: ``mon``, ``osd``, ``rgw``."""
        self._tree = Path()
        self._env: dict[str, str] = {}
        self._deadline = 0.0
        self._mon_port = 0
        self._fsid = ""

    @property
    def endpoint_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def env(self) -> dict[str, str]:
        """Environment variables that point AWS clients at this server's credentials."""
        return {
            "AWS_ACCESS_KEY_ID": self.access_key,
            "AWS_SECRET_ACCESS_KEY": self.secret_key,
            "AWS_DEFAULT_REGION": self.region,
        }

    def pids(self) -> list[int]:
        """Process ids of the running daemons (monitor, OSD, radosgw), e.g.
        to read their CPU time from ``/proc/PID/stat``."""
        return [p.pid for p in self.procs.values() if p.poll() is None]

    # ------------------------------------------------------------ start, stop

    def start(self, timeout_s: float = START_TIMEOUT_S) -> RadosGW:
        """Unpack the packages if need be, build a fresh cluster under
        ``root``, start its daemons and wait until the S3 endpoint answers.
        RuntimeError, naming the step and quoting its log, if a step fails or
        ``timeout_s`` passes; whatever had started is stopped then."""
        if self.procs:
            raise RuntimeError("radosgw is running already; stop() it first")
        self._deadline = time.monotonic() + timeout_s
        try:
            self._tree = ensure_packages(cache_dir(), self._left())
            self._env = ceph_env(self._tree)
            self._write_config()
            self._make_monitor()
            self._make_osd()
            self._make_gateway()
        except BaseException:
            self.stop()
            raise
        return self

    def stop(self) -> None:
        """Kill every daemon this object started and wait for each to end.
        SIGKILL, not SIGTERM: an OSD that shuts down cleanly writes its whole
        memory store to disk first, and nothing here is worth keeping."""
        for name in ("rgw", "osd", "mon"):
            proc = self.procs.pop(name, None)
            if proc is not None and proc.poll() is None:
                proc.kill()
            if proc is not None:
                proc.wait()

    def __enter__(self) -> RadosGW:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # ------------------------------------------------------------ S3

    def client(self) -> Any:
        """A boto3 S3 client for this server, with its credentials."""
        import boto3

        return boto3.client(
            "s3",
            endpoint_url=self.endpoint_url,
            region_name=self.region,
            aws_access_key_id=self.access_key,
            aws_secret_access_key=self.secret_key,
        )

    def new_bucket(self, name: str) -> str:
        """Create bucket ``name`` and return it."""
        self.client().create_bucket(Bucket=name)
        return name

    create_bucket = new_bucket
    """The name :class:`~s3kv.testing.loopback_s3.LoopbackS3` gives it."""

    # ------------------------------------------------------------ start-up steps

    def _left(self) -> float:
        return self._deadline - time.monotonic()

    def _path(self, *parts: str) -> Path:
        return self.root.joinpath(*parts)

    def _write_config(self) -> None:
        """Clear what an earlier start left under ``root`` and write ceph.conf."""
        for entry in _ROOT_ENTRIES:
            path = self._path(entry)
            if path.is_dir() and not path.is_symlink():
                shutil.rmtree(path)
            else:
                path.unlink(missing_ok=True)
        for folder in ("mon", "osd/ceph-0", "rgw", "run", "log", "crash"):
            self._path(folder).mkdir(parents=True)
        self._mon_port = free_port()
        self._fsid = str(uuid.uuid4())
        self._path("ceph.conf").write_text(self._config())
        self._env["CEPH_CONF"] = str(self._path("ceph.conf"))

    def _config(self) -> str:
        tree, root = self._tree, self.root
        settings = {
            "fsid": self._fsid,
            "mon host": f"v2:127.0.0.1:{self._mon_port}",
            "public addr": "127.0.0.1",
            "ms bind ipv6": "false",
            "ms bind msgr1": "false",
            "auth cluster required": "none",
            "auth service required": "none",
            "auth client required": "none",
            "keyring": "/dev/null",
            "run dir": f"{root}/run",
            "admin socket": f"{root}/run/$cluster-$name.asok",
            "pid file": f"{root}/run/$cluster-$name.pid",
            "log file": f"{root}/log/$cluster-$name.log",
            "mon cluster log file": f"{root}/log/$cluster.log",
            "crash dir": f"{root}/crash",
            "mon data": f"{root}/mon/$cluster-$id",
            "osd data": f"{root}/osd/$cluster-$id",
            "plugin dir": f"{tree}/{_LIB}/ceph",
            "erasure code dir": f"{tree}/{_LIB}/ceph/erasure-code",
            "osd class dir": f"{tree}/{_LIB}/rados-classes",
            "osd objectstore": "memstore",
            "memstore device bytes": str(self.memstore_bytes),
            "osd pool default size": "1",
            "osd pool default min size": "1",
            "osd pool default pg num": "8",
            "osd pool default pgp num": "8",
            "osd pool default pg autoscale mode": "off",
            "osd crush chooseleaf type": "0",
            "mon allow pool size one": "true",
            "mon allow pool delete": "true",
            "mon max pg per osd": "1000",
            "mon warn on pool no redundancy": "false",
            "mon data avail crit": "1",
            "paxos propose interval": "0.05",  # pool changes (first bucket) in 0.1 s, not 2 s
            "debug rgw": "0/0",  # no log line per request
        }
        gateway = {
            # tcp_nodelay: else small answers wait ~40 ms on Nagle and delayed ACKs
            "rgw frontends": f"beast endpoint=127.0.0.1:{self.port} tcp_nodelay=1",
            "rgw data": f"{root}/rgw",
            # radosgw's own defaults ask for a cephx-encrypted monitor session
            "ms mon client mode": "crc",
            "auth client required": "none",
        }

        def section(name: str, values: dict[str, str]) -> str:
            return f"[{name}]\n" + "".join(f"{k} = {v}\n" for k, v in values.items())

        return section("global", settings) + "\n" + section("client.rgw", gateway)

    def _make_monitor(self) -> None:
        monmap = str(self._path("monmap"))
        addr = f"[v2:127.0.0.1:{self._mon_port}]"
        self._step(
            "monmaptool --create",
            ["monmaptool", "--create", "--fsid", self._fsid, "--addv", "a", addr, monmap],
        )
        self._step("ceph-mon --mkfs", ["ceph-mon", "--mkfs", "-i", "a", "--monmap", monmap], "mon")
        self._daemon("mon", ["ceph-mon", "-f", "-i", "a"])

    def _make_osd(self) -> None:
        osd_uuid = str(uuid.uuid4())
        osd_id = self._ceph("osd", "new", osd_uuid).strip()
        self._step("ceph-osd --mkfs", ["ceph-osd", "--mkfs", "-i", osd_id, "--osd-uuid", osd_uuid], "osd")
        self._daemon("osd", ["ceph-osd", "-f", "-i", osd_id])
        self._wait("the OSD to come up", self._osd_is_up, "osd")

    def _make_gateway(self) -> None:
        user = ["--uid", "s3kv", "--display-name", "s3kv", "--access-key", self.access_key]
        user += ["--secret-key", self.secret_key]
        self._step(
            "radosgw-admin user create", ["radosgw-admin", "-n", "client.rgw", "user", "create", *user], "osd"
        )
        self._daemon("rgw", ["radosgw", "-f", "-n", "client.rgw"])
        self._wait("radosgw to answer on " + self.endpoint_url, self._answers, "rgw")

    def _ceph(self, *args: str) -> str:
        return self._step("ceph " + " ".join(args), ["ceph", "--connect-timeout", "30", *args], "mon")

    def _step(self, step: str, argv: list[str], daemon: str | None = None) -> str:
        """Run one start-up command in the Ceph environment; on failure the
        error also quotes ``daemon``'s log."""
        try:
            return _run_step(step, argv, self._left(), env=self._env, cwd=self.root)
        except RuntimeError as e:
            raise RuntimeError(f"{e}\n{self._logs(daemon)}") from None

    def _daemon(self, name: str, argv: list[str]) -> None:
        """Start one daemon in the foreground, in its own session (a Ctrl-C
        meant for this process does not reach it; :meth:`stop` ends it)."""
        with open(self._path("log", f"{name}.out"), "wb") as out:
            self.procs[name] = subprocess.Popen(
                argv,
                env=self._env,
                cwd=self.root,
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,
                preexec_fn=_die_with_parent,
            )

    def _wait(self, what: str, ready: Callable[[], bool], daemon: str) -> None:
        """Poll ``ready`` until it holds; RuntimeError if a daemon exits or
        the start-up deadline passes first."""
        while True:
            for name, proc in self.procs.items():
                if proc.poll() is not None:
                    raise RuntimeError(
                        f"radosgw start-up: the {name} daemon exited (code {proc.returncode}) "
                        f"while waiting for {what}\n{self._logs(name)}"
                    )
            if ready():
                return
            if self._left() <= 0:
                raise RuntimeError(f"radosgw start-up: timed out waiting for {what}\n{self._logs(daemon)}")
            time.sleep(POLL_S)

    def _logs(self, daemon: str | None) -> str:
        if daemon is None:
            return ""
        return "\n".join(
            _file_tail(self._path("log", name)) for name in (f"{daemon}.out", f"{_DAEMON_LOGS[daemon]}.log")
        )

    def _osd_is_up(self) -> bool:
        try:
            out = subprocess.run(
                ["ceph", "--connect-timeout", "5", "osd", "stat", "--format", "json"],
                env=self._env,
                capture_output=True,
                text=True,
                timeout=15,
            )
            return out.returncode == 0 and json.loads(out.stdout).get("num_up_osds", 0) >= 1
        except (OSError, ValueError, subprocess.TimeoutExpired):
            return False

    def _answers(self) -> bool:
        try:
            with urllib.request.urlopen(self.endpoint_url, timeout=2) as answer:
                answer.read()
        except urllib.error.HTTPError:
            return True  # any HTTP answer will do (anonymous requests may be refused)
        except OSError:
            return False
        return True


# ---------------------------------------------------------------- command line


def main(argv: list[str] | None = None) -> int:
    """Start radosgw, print its endpoint and credentials as JSON, and run
    until Ctrl-C or SIGTERM (or until a daemon dies: exit 1)."""
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.radosgw", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument("--root", type=Path, default=Path(tempfile.gettempdir()) / "s3kv-radosgw")
    parser.add_argument("--port", type=int, default=None)
    parser.add_argument("--memstore-bytes", type=int, default=4 << 30)
    args = parser.parse_args(argv)
    reason = available()
    if reason is not None:
        print(f"radosgw is not available here: {reason}", file=sys.stderr)
        return 2

    rgw = RadosGW(args.root, args.port, args.memstore_bytes)
    done = threading.Event()
    running = False

    def on_signal(signum: int, frame: object) -> None:
        if not running:
            raise KeyboardInterrupt  # still starting: start() stops what it started
        done.set()  # running: the loop below stops it

    signal.signal(signal.SIGINT, on_signal)
    signal.signal(signal.SIGTERM, on_signal)
    t0 = time.monotonic()
    try:
        rgw.start()
    except KeyboardInterrupt:
        print("radosgw: interrupted while starting; stopped", file=sys.stderr)
        return 130
    except RuntimeError as e:
        print(e, file=sys.stderr)
        return 1
    running = True
    try:
        info = {"endpoint_url": rgw.endpoint_url, **rgw.env(), "root": str(rgw.root), "pids": rgw.pids()}
        print(json.dumps({**info, "start_s": round(time.monotonic() - t0, 1)}), flush=True)
        while not done.wait(1.0):
            if len(rgw.pids()) < len(_DAEMON_LOGS):
                print("radosgw: a daemon exited; stopping", file=sys.stderr)
                return 1
        return 0
    finally:
        rgw.stop()


if __name__ == "__main__":
    sys.exit(main())
