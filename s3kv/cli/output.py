"""Tables, JSON and progress bars for the CLI (rich, on stdout and stderr)."""

from __future__ import annotations

import contextlib
import json
import sys
import time
from collections.abc import Iterator, Sequence
from typing import Any

from rich.console import Console
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    SpinnerColumn,
    TextColumn,
    TimeElapsedColumn,
)
from rich.table import Table
from rich.text import Text

from s3kv.units import format_size


def stdout() -> Console:
    # Piped output keeps whole rows (ids are 32 characters), not an 80-column fold.
    width = None if sys.stdout.isatty() else 200
    # markup=False: object and model names are printed as they are, never as rich markup.
    return Console(file=sys.stdout, highlight=False, soft_wrap=False, width=width, markup=False)


def stderr() -> Console:
    return Console(file=sys.stderr, highlight=False, markup=False)


def print_json(doc: Any) -> None:
    sys.stdout.write(json.dumps(doc, indent=1, sort_keys=True, default=str) + "\n")


def when(ts: float | None) -> str:
    if ts is None:
        return "-"
    return time.strftime("%Y-%m-%d %H:%M", time.gmtime(ts))


def ago(seconds: float | None) -> str:
    if seconds is None:
        return "-"
    for unit, n in (("d", 86400), ("h", 3600), ("m", 60)):
        if seconds >= n:
            return f"{seconds / n:.1f}{unit}"
    return f"{max(0.0, seconds):.0f}s"


def dollars(x: float) -> str:
    return f"${x:.2f}" if x >= 1 else f"${x:.4f}"


def size(n: int | float | None) -> str:
    return "-" if n is None else format_size(n)


def table(
    title: str | None, columns: Sequence[str], rows: Sequence[Sequence[Any]], right: Sequence[str] = ()
) -> Table:
    t = Table(title=title, title_justify="left", header_style="bold")
    for c in columns:
        t.add_column(c, justify="right" if c in right else "left", overflow="fold")
    for r in rows:
        t.add_row(*(Text(str(x)) for x in r))
    return t


class Bar:
    """A progress bar on stderr, or nothing when progress is off."""

    def __init__(self, progress: Progress | None, task: Any) -> None:
        self._p, self._t = progress, task

    def advance(self, n: int = 1) -> None:
        if self._p is not None:
            self._p.advance(self._t, n)

    def total(self, n: int | None) -> None:
        if self._p is not None:
            self._p.update(self._t, total=n)


@contextlib.contextmanager
def bar(enabled: bool, description: str, total: int | None = None) -> Iterator[Bar]:
    if not enabled:
        yield Bar(None, None)
        return
    p = Progress(
        SpinnerColumn(),
        TextColumn("[progress.description]{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        console=stderr(),
        transient=True,
    )
    with p:
        yield Bar(p, p.add_task(description, total=total))
