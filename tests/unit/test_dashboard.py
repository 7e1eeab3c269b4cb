"""The Grafana dashboard in ``infra/grafana/s3kv-dashboard.json``: a valid
dashboard, and every PromQL query in it (panel targets and template
variables) names series s3kv exports, with labels and label values those
series carry, used as their type allows (counters and histogram series under
``rate``/``increase``, gauges not). What s3kv exports is read from a private
registry that :class:`s3kv.connector.stats.S3KVPromMetrics` filled from a
payload touching every series, so a new family needs no change here."""

from __future__ import annotations

import functools
import json
import re
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from s3kv.stats import COUNTERS, FAMILIES, GAUGES, HISTOGRAMS

DASHBOARD = Path(__file__).resolve().parents[2] / "infra" / "grafana" / "s3kv-dashboard.json"
PREFIX = "vllm:s3kv_"
VLLM_LABELS = ["model_name", "engine"]
"""The labels vLLM's PrometheusStatLogger passes to a connector's metrics, first."""
SCRAPE_LABELS = {"instance", "job"}
"""Labels Prometheus adds to every series it scrapes."""
GRAFANA_VARIABLES = {"__rate_interval", "__interval", "__interval_ms", "__range", "__range_s", "__range_ms"}
DATASOURCE = {"type": "prometheus", "uid": "${datasource}"}
RANGE_FUNCTIONS = {"rate", "irate", "increase"}
PANEL_TYPES = {"timeseries", "stat", "gauge", "bargauge", "table"}
ROWS = ("Hits", "Loads", "Stores", "Errors", "Manifest & S3")


# -- What s3kv exports ---------------------------------------------------------
@dataclass
class Exported:
    kind: str
    """The family's type: "counter", "histogram" or "gauge"."""
    labels: dict[str, set[str]] = field(default_factory=dict)
    """Label name -> the values seen."""


@functools.lru_cache(maxsize=1)
def exported_series() -> dict[str, Exported]:
    """Sample name -> its family's type and labels, as s3kv's Prometheus
    adapter exports them after a payload that moves every series."""
    pytest.importorskip("vllm")
    from s3kv.connector.stats import S3KVPromMetrics

    reg = CollectorRegistry()
    types = {cls: functools.partial(cls, registry=reg) for cls in (Counter, Gauge, Histogram)}

    class Cfg:
        kv_transfer_config = None

    prom = S3KVPromMetrics(Cfg(), types, VLLM_LABELS, {0: ["m", "0"]})
    prom.observe(
        {
            "counters": dict.fromkeys(COUNTERS, 1),
            "observed": {name: [0.01] for name in HISTOGRAMS},
            "gauges": {"scheduler": dict.fromkeys(GAUGES, 1)},
        },
        0,
    )
    out: dict[str, Exported] = {}
    for metric in reg.collect():
        for sample in metric.samples:
            # Not exported in vLLM's multiprocess mode (vllm serve with several API servers).
            if sample.name.endswith("_created"):
                continue
            series = out.setdefault(sample.name, Exported(metric.type))
            for k, v in sample.labels.items():
                series.labels.setdefault(k, set()).add(v)
    return out


@pytest.fixture(scope="module")
def exported() -> dict[str, Exported]:
    return exported_series()


def test_the_payload_moved_every_series(exported):
    """The reference itself: every family with every label value it declares."""
    suffix = {"counter": ["_total"], "histogram": ["_bucket", "_sum", "_count"], "gauge": [""]}
    for fam in FAMILIES:
        for s in suffix[fam.kind]:
            series = exported[PREFIX + fam.name + s]
            assert series.kind == fam.kind
            assert list(series.labels)[: len(VLLM_LABELS)] == VLLM_LABELS
            if fam.label:
                assert series.labels[fam.label] == set(fam.values), fam.name
    assert exported[PREFIX + "compression_ratio"].kind == "gauge"


# -- Reading PromQL -------------------------------------------------------------
_TOKEN = re.compile(
    r"""(?P<ws>\s+)
    |(?P<str>"(?:\\.|[^"\\])*"|'(?:\\.|[^'\\])*'|`[^`]*`)
    |(?P<range>\[[^\[\]]*\])
    |(?P<num>(?:0[xX][0-9a-fA-F]+|(?:\d+\.?\d*|\.\d+)(?:[eE][+-]?\d+)?)(?:ms|[smhdwy])*)
    |(?P<var>\$\{\w+(?::\w+)?\}|\$\w+)
    |(?P<ident>[A-Za-z_:][\w:]*)
    |(?P<op>=~|!~|!=|==|<=|>=|[-+*/%^<>=,(){}@])
    """,
    re.X,
)
GROUPING = {"by", "without", "on", "ignoring", "group_left", "group_right"}
KEYWORDS = GROUPING | {"and", "or", "unless", "bool", "offset", "inf", "nan", "atan2"}
AGGREGATIONS = {
    "sum", "avg", "min", "max", "count", "group", "stddev", "stdvar", "topk", "bottomk",
    "quantile", "count_values", "limitk", "limit_ratio",
}  # fmt: skip
_VARIABLE = re.compile(r"\$(?:\{(\w+)[^}]*\}|(\w+))")


class PromQLError(ValueError):
    pass


@dataclass
class Selector:
    name: str
    matchers: list[tuple[str, str, str]]
    """(label, operator, value)."""
    functions: tuple[str, ...]
    """The calls it sits in, outermost first."""


@dataclass
class Query:
    selectors: list[Selector] = field(default_factory=list)
    groupings: list[tuple[str, list[str]]] = field(default_factory=list)
    """(by / without / on / ignoring / group_left / group_right, its labels)."""
    aggregated: bool = False
    label_args: list[str] = field(default_factory=list)
    """The label argument of Grafana's ``label_values(metric, label)``."""
    variables: set[str] = field(default_factory=set)


def _tokens(expr: str) -> list[tuple[str, str]]:
    out, pos = [], 0
    while pos < len(expr):
        m = _TOKEN.match(expr, pos)
        if m is None:
            raise PromQLError(f"cannot read {expr[pos : pos + 20]!r}")
        if m.lastgroup != "ws":
            out.append((m.lastgroup or "", m.group()))
        pos = m.end()
    return out


def _unquote(s: str) -> str:
    return s[1:-1] if s[0] == "`" else re.sub(r"\\(.)", r"\1", s[1:-1])


def parse(expr: str) -> Query:
    """The selectors, groupings and variables of a PromQL expression (or of
    Grafana's ``label_values(...)``); enough of the grammar for dashboards."""
    toks = _tokens(expr)
    q = Query(variables={a or b for a, b in _VARIABLE.findall(expr)})
    stack: list[tuple[str, list[str] | None]] = []  # per open paren: the call, or a grouping's labels
    pending: str | None = None  # ``sum by (x) (`` : the aggregation whose parenthesis is to come

    def matchers(i: int) -> tuple[list[tuple[str, str, str]], int]:
        out = []
        i += 1
        while toks[i][1] != "}":
            (k1, label), (_, op), (k3, value) = toks[i : i + 3]
            if k1 != "ident" or op not in ("=", "!=", "=~", "!~") or k3 != "str":
                raise PromQLError(f"bad label matcher at {label!r}")
            out.append((label, op, _unquote(value)))
            i += 3
            if toks[i][1] == ",":
                i += 1
        return out, i + 1

    i = 0
    try:
        while i < len(toks):
            kind, text = toks[i]
            nxt = toks[i + 1][1] if i + 1 < len(toks) else None
            if kind == "ident":
                low = text.lower()
                if low in GROUPING and nxt == "(":
                    labels: list[str] = []
                    q.groupings.append((low, labels))
                    stack.append(("", labels))
                    i += 2
                elif nxt == "(":
                    stack.append((low, None))
                    q.aggregated |= low in AGGREGATIONS
                    i += 2
                elif low in AGGREGATIONS and nxt in ("by", "without"):
                    pending = low
                    q.aggregated = True
                    i += 1
                elif low in KEYWORDS:
                    i += 1
                elif stack and stack[-1][1] is not None:
                    stack[-1][1].append(text)
                    i += 1
                elif stack and stack[-1][0] == "label_values" and toks[i - 1][1] == ",":
                    q.label_args.append(text)
                    i += 1
                else:
                    found: list[tuple[str, str, str]] = []
                    i += 1
                    if nxt == "{":
                        found, i = matchers(i)
                    calls = tuple(name for name, labels in stack if labels is None and name)
                    q.selectors.append(Selector(text, found, calls))
            elif text == "{":  # a selector by __name__ alone
                found, i = matchers(i)
                names = [v for label, op, v in found if label == "__name__" and op == "="]
                if not names:
                    raise PromQLError("a selector without a metric name")
                calls = tuple(name for name, labels in stack if labels is None and name)
                q.selectors.append(Selector(names[0], found, calls))
            elif text == "(":
                stack.append((pending or "", None))
                pending = None
                i += 1
            elif text == ")":
                if not stack:
                    raise PromQLError("unbalanced ')'")
                stack.pop()
                i += 1
            elif text == "}":
                raise PromQLError("unbalanced '}'")
            else:
                i += 1
    except (IndexError, ValueError) as e:
        raise PromQLError(f"cannot parse {expr!r}: {e}") from e
    if stack:
        raise PromQLError(f"unbalanced '(' in {expr!r}")
    return q


def expr_problems(
    expr: str, exported: dict[str, Exported], variables: set[str] | frozenset[str] = frozenset()
) -> list[str]:
    """What is wrong with one query against what s3kv exports (empty: nothing)."""
    try:
        q = parse(expr)
    except PromQLError as e:
        return [str(e)]
    out = []
    if not any(s.name.startswith(PREFIX) for s in q.selectors):
        out.append(f"names no {PREFIX}* series")
    present = set(SCRAPE_LABELS)
    for s in q.selectors:
        series = exported.get(s.name)
        if series is None:
            out.append(f"{s.name} is not a series s3kv exports")
            continue
        present |= series.labels.keys()
        for label, op, value in s.matchers:
            if label not in series.labels:
                if label not in SCRAPE_LABELS:
                    out.append(f"{s.name} has no label {label!r}")
                continue
            if label in VLLM_LABELS or "$" in value:
                continue
            if op in ("=", "!="):
                wanted = [value]
            elif re.fullmatch(r"[\w.+|-]+", value):  # a plain alternation
                wanted = value.split("|")
            else:
                wanted = []
            bad = [v for v in wanted if v not in series.labels[label]]
            out += [f"{s.name}: {label}={v!r} is no value of it" for v in bad]
        inner = s.functions[-1] if s.functions else None
        if inner == "label_values":
            continue
        if series.kind in ("counter", "histogram") and inner not in RANGE_FUNCTIONS:
            out.append(f"{s.name} ({series.kind}) used outside rate()/increase()")
        if series.kind == "gauge" and inner in RANGE_FUNCTIONS:
            out.append(f"{s.name} (gauge) under {inner}()")
        if s.name.endswith("_bucket") and series.kind == "histogram":
            if "histogram_quantile" not in s.functions:
                out.append(f"{s.name} outside histogram_quantile()")
            if not any(kw == "by" and "le" in labels for kw, labels in q.groupings):
                out.append(f"{s.name}: histogram_quantile() over a sum that drops 'le'")
    for kw, labels in q.groupings:
        out += [f"{kw} ({label}): no series here has that label" for label in labels if label not in present]
    out += [f"label_values(..., {a}): no such label" for a in q.label_args if a not in present]
    out += [f"${v} is not a dashboard variable" for v in sorted(q.variables - variables - GRAFANA_VARIABLES)]
    return out


def legend_problems(expr: str, legend: str, exported: dict[str, Exported]) -> list[str]:
    """``{{label}}`` in a legend the query's result does not carry."""
    q = parse(expr)
    by = [set(labels) for kw, labels in q.groupings if kw == "by"]
    if by:
        kept = set().union(*by) - {"le"}
    elif q.aggregated:
        kept = set()
    else:
        kept = set(SCRAPE_LABELS).union(*(exported[s.name].labels for s in q.selectors if s.name in exported))
    used = set(re.findall(r"\{\{\s*(\w+)\s*\}\}", legend))
    return [f"legend {legend!r}: the result has no label {label!r}" for label in sorted(used - kept)]


# -- Checking the reader itself -------------------------------------------------
def test_parse_reads_selectors_groupings_and_label_values():
    q = parse(
        'histogram_quantile(0.99, sum by (le, tier) (rate(vllm:s3kv_load_seconds_bucket{tier=~"disk|s3",'
        ' engine=~"$engine"}[$__rate_interval]))) / on() group_left() sum(vllm:s3kv_manifest_keys offset 5m) > 1e3'
    )
    assert [s.name for s in q.selectors] == ["vllm:s3kv_load_seconds_bucket", "vllm:s3kv_manifest_keys"]
    assert q.selectors[0].matchers == [("tier", "=~", "disk|s3"), ("engine", "=~", "$engine")]
    assert q.selectors[0].functions == ("histogram_quantile", "sum", "rate")
    assert q.selectors[1].functions == ("sum",)
    assert q.groupings == [("by", ["le", "tier"]), ("on", []), ("group_left", [])]
    assert q.variables == {"engine", "__rate_interval"} and q.aggregated
    q = parse('label_values(vllm:s3kv_lookup_requests_total{model_name=~"$model_name"}, engine)')
    assert [s.name for s in q.selectors] == ["vllm:s3kv_lookup_requests_total"] and q.label_args == ["engine"]
    q = parse("sum(rate(vllm:s3kv_hit_tokens_total[5m])) by (tier)")
    assert q.groupings == [("by", ["tier"])] and q.selectors[0].functions == ("sum", "rate")


@pytest.mark.parametrize(
    "expr, problem",
    [
        ("sum(rate(vllm:s3kv_made_up_total[5m]))", "vllm:s3kv_made_up_total is not a series"),
        ("sum(rate(vllm:s3kv_hit_tokens[5m]))", "vllm:s3kv_hit_tokens is not a series"),  # no _total
        ("sum(rate(vllm:num_requests_running[5m]))", "names no vllm:s3kv_"),
        ('sum(rate(vllm:s3kv_hit_tokens_total{tier="gpu"}[5m]))', "tier='gpu' is no value"),
        ('sum(rate(vllm:s3kv_hit_tokens_total{tier=~"s3|tape"}[5m]))', "tier='tape' is no value"),
        ('sum(rate(vllm:s3kv_store_bytes_total{tier="cpu"}[5m]))', "tier='cpu' is no value"),
        ('sum(rate(vllm:s3kv_hit_tokens_total{kind="corrupt"}[5m]))', "has no label 'kind'"),
        ("sum by (kind) (rate(vllm:s3kv_hit_tokens_total[5m]))", "by (kind)"),
        ("rate(vllm:s3kv_manifest_keys[5m])", "(gauge) under rate()"),
        ("sum(vllm:s3kv_hit_tokens_total)", "(counter) used outside rate()"),
        ("sum(rate(vllm:s3kv_load_seconds_bucket[5m]))", "outside histogram_quantile()"),
        ("histogram_quantile(0.99, sum by (tier) (rate(vllm:s3kv_load_seconds_bucket[5m])))", "drops 'le'"),
        ("sum(rate(vllm:s3kv_hit_tokens_total[5m])", "unbalanced '('"),
        ('vllm:s3kv_manifest_keys{instance=~"$replica"}', "$replica is not a dashboard variable"),
        ("label_values(vllm:s3kv_lookup_requests_total, tier)", "label_values(..., tier)"),
    ],
)
def test_the_checker_rejects(exported, expr, problem):
    found = expr_problems(expr, exported, {"model_name", "engine"})
    assert any(problem in p for p in found), found


def test_the_checker_accepts_and_legends(exported):
    ok = 'histogram_quantile(0.5, sum by (le, tier) (rate(vllm:s3kv_load_seconds_bucket{tier="s3", le!="+Inf"}[5m])))'
    assert expr_problems(ok, exported) == []
    assert legend_problems(ok, "p50 {{tier}}", exported) == []
    assert legend_problems(ok, "p50 {{kind}}", exported)
    assert legend_problems("sum(rate(vllm:s3kv_hit_tokens_total[5m]))", "{{tier}}", exported)
    assert legend_problems("vllm:s3kv_breaker_open", "{{instance}} {{tier}}", exported) == []


# -- The dashboard -------------------------------------------------------------
@pytest.fixture(scope="module")
def dashboard() -> dict[str, Any]:
    return json.loads(DASHBOARD.read_text())


def all_panels(panels: list[dict[str, Any]]) -> Iterator[dict[str, Any]]:
    """Every panel, rows and the panels collapsed rows hold included."""
    for p in panels:
        yield p
        yield from all_panels(p.get("panels", []))


def graphs(dashboard: dict[str, Any]) -> list[dict[str, Any]]:
    return [p for p in all_panels(dashboard["panels"]) if p["type"] != "row"]


def variables(dashboard: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {v["name"]: v for v in dashboard["templating"]["list"]}


def variable_query(v: dict[str, Any]) -> str:
    return v["query"]["query"] if isinstance(v["query"], dict) else v["query"]


def queries(dashboard: dict[str, Any]) -> list[tuple[str, str]]:
    """(where, PromQL) of every panel target and query variable."""
    out = [(f"panel {p['title']!r} {t['refId']}", t["expr"]) for p in graphs(dashboard) for t in p["targets"]]
    out += [
        (f"variable {n}", variable_query(v)) for n, v in variables(dashboard).items() if v["type"] == "query"
    ]
    return out


def test_dashboard_structure(dashboard):
    assert isinstance(dashboard["title"], str) and dashboard["title"]
    assert re.fullmatch(r"[\w-]{1,40}", dashboard["uid"])
    assert isinstance(dashboard["schemaVersion"], int) and dashboard["schemaVersion"] >= 36
    assert dashboard.get("id") is None  # importable anywhere
    assert {"from", "to"} <= dashboard["time"].keys()
    ids = [p["id"] for p in all_panels(dashboard["panels"])]
    assert all(isinstance(i, int) for i in ids) and len(ids) == len(set(ids)), "panel ids must be unique"
    top = dashboard["panels"]
    assert top[0]["type"] == "row", "every panel sits in a row"
    rows = [p for p in top if p["type"] == "row"]
    assert set(ROWS) <= {r["title"] for r in rows}
    for r in rows:
        assert isinstance(r["collapsed"], bool)
        assert all(p["type"] != "row" for p in r["panels"])
        if not r["collapsed"]:
            assert r["panels"] == [], f"row {r['title']!r} is open: its panels follow it at the top level"
    # The grid: 24 columns; no two panels of one layout (the top level, a collapsed row) overlap.
    for group in [top] + [r["panels"] for r in rows if r["collapsed"]]:
        boxes = []
        for p in group:
            g = p["gridPos"]
            assert all(isinstance(g[k], int) for k in ("x", "y", "w", "h")), p["title"]
            assert min(g["x"], g["y"]) >= 0 and min(g["w"], g["h"]) > 0, p["title"]
            assert g["x"] + g["w"] <= 24, p["title"]
            for title, (x, y, w, h) in boxes:
                overlap = g["x"] < x + w and x < g["x"] + g["w"] and g["y"] < y + h and y < g["y"] + g["h"]
                assert not overlap, f"{p['title']!r} overlaps {title!r}"
            boxes.append((p["title"], (g["x"], g["y"], g["w"], g["h"])))
    for p in graphs(dashboard):
        assert p["type"] in PANEL_TYPES, p["title"]
        assert p.get("description", "").strip(), f"{p['title']!r} has no description"
        assert p["datasource"] == DATASOURCE, p["title"]
        assert p["fieldConfig"]["defaults"].get("unit"), f"{p['title']!r} has no unit"
        assert p["targets"], p["title"]
        refs = [t["refId"] for t in p["targets"]]
        assert len(refs) == len(set(refs)), p["title"]
        for t in p["targets"]:
            assert t["datasource"] == DATASOURCE and t["expr"].strip(), p["title"]


def test_template_variables(dashboard, exported):
    v = variables(dashboard)
    assert v["datasource"]["type"] == "datasource" and v["datasource"]["query"] == "prometheus"
    for name in VLLM_LABELS:
        var = v[name]
        assert var["type"] == "query" and var["datasource"] == DATASOURCE
        q = parse(variable_query(var))
        assert q.label_args == [name], variable_query(var)
        assert all(s.name.startswith(PREFIX) and s.name in exported for s in q.selectors)
        if var.get("includeAll"):  # queries match with =~: "All" must be a regex
            assert var.get("allValue") == ".*", name
    # Every variable a query uses is defined (expr_problems checks it), and every filter is used.
    used = set().union(*(parse(expr).variables for _, expr in queries(dashboard)))
    assert {n for n, var in v.items() if var["type"] == "query"} <= used


def test_every_query_names_series_s3kv_exports(dashboard, exported):
    names = set(variables(dashboard))
    found = {}
    for where, expr in queries(dashboard):
        problems = expr_problems(expr, exported, names)
        if problems:
            found[where] = problems
    for p in graphs(dashboard):
        for t in p["targets"]:
            problems = legend_problems(t["expr"], t.get("legendFormat", ""), exported)
            if problems:
                found.setdefault(f"panel {p['title']!r} {t['refId']}", []).extend(problems)
    assert not found, json.dumps(found, indent=1)


# -- What the dashboard must show ---------------------------------------------
def _uses(q: Query, name: str) -> bool:
    return any(s.name == PREFIX + name for s in q.selectors)


def _by(q: Query, label: str) -> bool:
    return any(kw == "by" and label in labels for kw, labels in q.groupings)


def _quantiles(expr: str) -> set[float]:
    return {float(x) for x in re.findall(r"histogram_quantile\(\s*([\d.]+)", expr)}


def _grouped(name: str, label: str, unit: str):
    return lambda unit_, qs, exprs: unit_ == unit and any(_uses(q, name) and _by(q, label) for q in qs)


def _latency(name: str, label: str | None):
    def check(unit, qs, exprs):
        ours = [(q, e) for q, e in zip(qs, exprs) if _uses(q, name + "_bucket")]
        hits = [e for q, e in ours if label is None or _by(q, label)]
        return unit == "s" and {0.5, 0.99} <= set().union(*map(_quantiles, hits))

    return check


SUBJECTS = {
    "hit rate by tier": lambda unit, qs, exprs: (
        unit == "percentunit"
        and any(
            _uses(q, "hit_tokens_total") and _uses(q, "lookup_tokens_total") and _by(q, "tier") for q in qs
        )
    ),
    "chunk load latency p50/p99 by tier": _latency("load_seconds", "tier"),
    "request load latency p50/p99": _latency("request_load_seconds", None),
    "load bytes by tier": _grouped("load_bytes_total", "tier", "Bps"),
    "store bytes by tier": _grouped("store_bytes_total", "tier", "Bps"),
    "tier bytes used": _grouped("tier_used_bytes", "tier", "bytes"),
    "load errors by kind": _grouped("load_errors_total", "kind", "cps"),
    "store errors by tier": _grouped("store_errors_total", "tier", "cps"),
    "dropped stores by reason": _grouped("store_dropped_total", "reason", "cps"),
    "manifest staleness": lambda unit, qs, exprs: (
        unit == "s" and any(_uses(q, "manifest_staleness_seconds") for q in qs)
    ),
    "S3 requests by op": _grouped("s3_requests_total", "op", "reqps"),
    "manifest epochs read, written and missing": lambda unit, qs, exprs: (
        unit == "cps"
        and all(
            any(_uses(q, f"manifest_epochs_{what}_total") for q in qs)
            for what in ("read", "written", "missing")
        )
    ),
    "manifest epochs skipped, covered, refused and found early": lambda unit, qs, exprs: (
        unit == "cps"
        and all(
            any(_uses(q, f"manifest_epochs_{what}_total") for q in qs)
            for what in ("skipped", "covered", "refused", "early")
        )
    ),
}


@pytest.mark.parametrize("subject", list(SUBJECTS))
def test_the_dashboard_shows(dashboard, subject):
    for p in graphs(dashboard):
        exprs = [t["expr"] for t in p["targets"]]
        if SUBJECTS[subject](p["fieldConfig"]["defaults"]["unit"], [parse(e) for e in exprs], exprs):
            return
    pytest.fail(f"no panel shows {subject}")
