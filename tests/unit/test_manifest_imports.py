"""The manifest package's imports: no circle among its modules (a
function-level import counts too), and the core never imports the ops
commands."""

import ast
import pathlib

ROOT = pathlib.Path(__file__).resolve().parents[2] / "s3kv"


def imports_of(path: pathlib.Path) -> set[str]:
    out: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            out.add(node.module)
            out.update(f"{node.module}.{a.name}" for a in node.names)
        elif isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
    return out


def module_name(path: pathlib.Path) -> str:
    parts = path.relative_to(ROOT.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def test_the_manifest_modules_import_no_circle():
    modules = {module_name(p): p for p in (ROOT / "manifest").glob("*.py") if p.name != "__init__.py"}
    graph = {m: {n for n in imports_of(p) if n in modules and n != m} for m, p in modules.items()}
    assert len(graph) >= 10 and any(graph.values())  # it looked at the package
    done: set[str] = set()

    def visit(m: str, path: tuple[str, ...]) -> None:
        assert m not in path, f"import circle: {' -> '.join((*path, m))}"
        if m in done:
            return
        for n in sorted(graph[m]):
            visit(n, (*path, m))
        done.add(m)

    for m in sorted(graph):
        visit(m, ())


def test_the_core_imports_no_ops_command():
    core = [p for p in ROOT.rglob("*.py") if p.relative_to(ROOT).parts[0] not in ("ops", "cli")]
    assert len(core) > 20
    offenders = {
        str(p.relative_to(ROOT)): sorted(n for n in imports_of(p) if n.startswith("s3kv.ops")) for p in core
    }
    assert {p: ops for p, ops in offenders.items() if ops} == {}
