"""Run s3kv's benchmark suite and write benchmarks/RESULTS.md and results.png.

    make bench                      # everything (about 1.5 h on 2 cores)
    .venv/bin/python -m benchmarks [--quick] [--only codec,lookup]

Benchmarks run one after another, each in its own process (they share the
machine's cores; two at once would measure each other). Every figure is a
median of repeats and every comparison a ratio measured side by side in the
same run.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import shlex
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

from benchmarks.common import ROOT, Result, git_rev, machine

SUITE = (
    "codec",
    "s3_clients",
    "load_path",
    "codec_choice",
    "load_concurrent",
    "load_path_radosgw",
    "load_concurrent_radosgw",
    "store_path",
    "lookup",
    "ttft",
    "ttft_32k",
    "hybrid",
    "parallel",
    "load_policy",
    "load_policy_concurrent",
    "prefetch",
    "fleet",
)
HERE = Path(__file__).resolve().parent
RADOSGW = "_radosgw"
"""A suite entry ``<module>_radosgw`` runs ``<module> --server radosgw``: its
S3 rows against Ceph's radosgw (benchmarks/radosgw.py) instead of moto."""
RADOSGW_DOWN = "radosgw start-up:"
"""How benchmarks.radosgw's start-up errors begin (a log holding one: radosgw, not the benchmark, failed)."""


def _not_run(name: str, why: str, seconds: float, notes: list[str] | None = None) -> Result:
    return Result(
        name=name,
        title=name,
        goal="",
        columns=[],
        rows=[],
        verdict=f"not run: {why}",
        notes=notes or [],
        seconds=seconds,
    )


def _run_one(name: str, quick: bool, work: Path) -> Result:
    out = work / f"{name}.json"
    out.unlink(missing_ok=True)
    module, extra = name, []
    t0 = time.perf_counter()
    if name.endswith(RADOSGW):
        from benchmarks.radosgw import available

        module, extra = name[: -len(RADOSGW)], ["--server", "radosgw"]
        reason = available()
        if reason is not None:
            print(f"== {name}: not run, radosgw is not available here: {reason}", flush=True)
            return _not_run(name, f"radosgw is not available here ({reason})", time.perf_counter() - t0)
    cmd = [sys.executable, "-m", f"benchmarks.{module}", *extra]
    cmd += ["--workdir", str(work / name), "--json", str(out)]
    if quick:
        cmd.append("--quick")
    log = work / f"{name}.log"
    print(f"== {name} (log: {log})", flush=True)
    with open(log, "w") as f:
        rc = subprocess.call(cmd, cwd=ROOT, stdout=f, stderr=subprocess.STDOUT)
    if rc != 0 or not out.exists():
        text = log.read_text()
        tail = "".join(text.splitlines(keepends=True)[-15:])
        note = f"end of its log:\n```\n{tail}\n```"
        if extra and RADOSGW_DOWN in text:  # the server, not the benchmark: say so, fail nothing
            why = text[text.index(RADOSGW_DOWN) :].splitlines()[0]
            print(f"   not run: {why}", flush=True)
            return _not_run(name, why, time.perf_counter() - t0, [f"radosgw did not start; {note}"])
        return Result(
            name=name,
            title=name,
            goal="",
            columns=[],
            rows=[],
            verdict=f"failed (exit {rc})",
            notes=[f"The benchmark failed; {note}"],
            seconds=time.perf_counter() - t0,
        )
    r = Result.from_json(json.loads(out.read_text()))
    r.name = name  # unique anchors: a module's radosgw run beside its moto run
    print(f"   {r.verdict} ({r.seconds:.0f} s)", flush=True)
    return r


def _cell(v: object) -> str:
    if isinstance(v, float):
        return f"{v:,.3f}" if abs(v) < 10 else f"{v:,.1f}"
    return str(v)


def render(results: list[Result], meta: dict, png: str | None) -> str:
    lines = [
        "# s3kv benchmark results",
        "",
        f"- Date: {meta['date']}",
        f"- Command: `{meta['command']}`",
        f"- Commit: {meta['commit']}; total {meta['seconds'] / 60:.1f} min"
        + (" (quick mode)" if meta["quick"] else ""),
        f"- Machine: {meta['machine']['cpu']}, {meta['machine']['cores']} cores, "
        f"{meta['machine']['memory_gib']} GiB, {meta['machine']['os']}, Python {meta['machine']['python']}",
        "- Versions: " + ", ".join(f"{k} {v}" for k, v in meta["machine"]["versions"].items()),
        "",
        'The machine has no GPU: vLLM runs its CPU build and the "GPU" KV cache is host memory. '
        "Models have random weights, whose KV compresses worse than a trained model's. "
        "S3 is a server on loopback, not AWS: moto (one Python process), except in the benchmarks whose "
        "title ends in (radosgw): Ceph 16.2's radosgw with one in-memory OSD (benchmarks/radosgw.py). "
        "What bounds each figure, and what was fixed on the way: [ANALYSIS.md](ANALYSIS.md).",
        "",
        "## Summary",
        "",
        "| benchmark | goal | result |",
        "|---|---|---|",
    ]
    for r in results:
        lines.append(f"| [{r.title}](#{r.name}) | {r.goal} | {r.verdict} |")
    if png:
        lines += ["", f"![results]({png})"]
    for r in results:
        lines += [
            "",
            f'<a id="{r.name}"></a>',
            f"## {r.title}",
            "",
            f"Goal: {r.goal}. **{r.verdict}** ({r.seconds:.0f} s).",
        ]
        if r.columns:
            lines += ["", "| " + " | ".join(r.columns) + " |", "|" + "---|" * len(r.columns)]
            lines += ["| " + " | ".join(_cell(c) for c in row) + " |" for row in r.rows]
        if r.notes:
            lines.append("")
            lines += [f"- {n}" for n in r.notes]
    return "\n".join(lines) + "\n"


def plot(results: list[Result], path: Path) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed (make bench installs it): no plot", file=sys.stderr)
        return False
    panels = [r for r in results if r.bars]
    if not panels:
        return False
    fig, axes = plt.subplots(len(panels), 1, figsize=(10, 3.6 * len(panels)), squeeze=False)
    for ax, r in zip(axes[:, 0], panels):
        labels = [b.label for b in r.bars]
        values = [b.value for b in r.bars]
        ax.bar(range(len(values)), values, color="#4c72b0")
        ax.set_xticks(range(len(values)))
        ax.set_xticklabels(labels, rotation=20, ha="right", fontsize=8)
        ax.set_ylabel(r.ylabel)
        ax.set_title(textwrap.fill(r.title, 100) + "\n" + textwrap.fill(r.verdict, 110), fontsize=9)
        positive = [v for v in values if v > 0]
        if positive and max(positive) / min(positive) > 50:  # small bars stay readable
            ax.set_yscale("log")
        if r.goal_line is not None:
            ax.axhline(r.goal_line, color="#c44e52", linestyle="--", linewidth=1, label="goal")
            ax.legend(fontsize=8)
        for i, v in enumerate(values):
            ax.annotate(_cell(round(v, 3)), (i, v), ha="center", va="bottom", fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="fewer repeats, smaller sizes (minutes, not tens)")
    ap.add_argument("--only", help=f"comma-separated subset of {','.join(SUITE)}")
    ap.add_argument("--workdir", default=os.path.join(tempfile.gettempdir(), "s3kv-bench"))
    ap.add_argument("--out", default=str(HERE / "RESULTS.md"))
    ap.add_argument("--replot", action="store_true", help="redraw results.png from results.json, run nothing")
    args = ap.parse_args()
    if args.replot:
        saved = json.loads(Path(args.out).with_name("results.json").read_text())
        return (
            0
            if plot([Result.from_json(r) for r in saved["results"]], Path(args.out).with_name("results.png"))
            else 1
        )
    names = [n.strip() for n in args.only.split(",")] if args.only else list(SUITE)
    unknown = set(names) - set(SUITE)
    if unknown:
        ap.error(f"unknown benchmark(s): {', '.join(sorted(unknown))}; choose from {', '.join(SUITE)}")
    work = Path(args.workdir)
    work.mkdir(parents=True, exist_ok=True)
    # radosgw's packages, unpacked once and kept with the suite's work (not in $HOME).
    os.environ.setdefault("S3KV_CEPH_DIR", str(work / "ceph-16"))
    t0 = time.perf_counter()
    results = [_run_one(n, args.quick, work) for n in names]
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    png = out.with_name("results.png")
    have_png = plot(results, png)
    meta = {
        "date": dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "command": "make bench"
        if os.environ.get("S3KV_BENCH_VIA_MAKE")
        else shlex.join(["python", "-m", "benchmarks", *sys.argv[1:]]),
        "commit": git_rev(),
        "seconds": time.perf_counter() - t0,
        "quick": args.quick,
        "machine": machine(),
    }
    out.write_text(render(results, meta, png.name if have_png else None))
    (out.with_name("results.json")).write_text(
        json.dumps({"meta": meta, "results": [r.to_json() for r in results]}, indent=1)
    )
    print(f"wrote {out}" + (f" and {png}" if have_png else ""))
    return 0 if all(not r.verdict.startswith("failed") for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
