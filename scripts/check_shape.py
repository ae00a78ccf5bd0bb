"""Check the package's shape: sizes of modules, classes and functions, and import cycles.

Usage: python scripts/check_shape.py [PACKAGE_DIR]   (default: omnistage)

Limits: a module at most 450 lines, a class at most 250, a function at most 60. Imports
are read from the source (every import statement, TYPE_CHECKING blocks and imports
inside functions included): no cycle between modules, and none between the package's
sub-packages and top-level modules. Exits 1 and lists what breaks a rule.
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

MAX_MODULE, MAX_CLASS, MAX_FUNCTION = 450, 250, 60


def module_name(path: Path, root: Path) -> str:
    parts = list(path.relative_to(root.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def resolve(mod: str, is_pkg: bool, node: ast.ImportFrom) -> str:
    if not node.level:
        return node.module or ""
    base = mod.split(".")
    if not is_pkg:
        base = base[:-1]
    base = base[: len(base) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def imports_of(mod: str, is_pkg: bool, tree: ast.AST, known: set[str], top: str) -> set[str]:
    out: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names if a.name.split(".")[0] == top)
        elif isinstance(node, ast.ImportFrom):
            target = resolve(mod, is_pkg, node)
            if target.split(".")[0] != top:
                continue
            for alias in node.names:
                sub = f"{target}.{alias.name}"
                out.add(sub if sub in known else target)
    # Importing a.b.c runs a/__init__ and a/b/__init__ first: those are edges too, except
    # the importer's own ancestors (already running when the importer runs).
    own = {".".join(mod.split(".")[:i]) for i in range(1, mod.count(".") + 1)}
    for m in list(out):
        parts = m.split(".")
        out.update(".".join(parts[:i]) for i in range(2, len(parts)))
    return {m for m in out if m in known and m != mod and m not in own}


def sizes(path: Path, tree: ast.AST, lines: int) -> list[str]:
    bad = []
    if lines > MAX_MODULE:
        bad.append(f"{path}: module {lines} lines (> {MAX_MODULE})")
    for node in ast.walk(tree):
        length = (getattr(node, "end_lineno", 0) or 0) - getattr(node, "lineno", 0) + 1
        if isinstance(node, ast.ClassDef) and length > MAX_CLASS:
            bad.append(f"{path}:{node.lineno}: class {node.name} {length} lines (> {MAX_CLASS})")
        elif isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef) and length > MAX_FUNCTION:
            bad.append(
                f"{path}:{node.lineno}: function {node.name} {length} lines (> {MAX_FUNCTION})"
            )
    return bad


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one member (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[list[str]] = []
    counter = 0
    for start in sorted(graph):
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = counter
        counter += 1
        stack.append(start)
        on.add(start)
        while work:
            v, it = work[-1]
            for w in it:
                if w not in index:
                    index[w] = low[w] = counter
                    counter += 1
                    stack.append(w)
                    on.add(w)
                    work.append((w, iter(sorted(graph[w]))))
                    break
                if w in on:
                    low[v] = min(low[v], index[w])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[v])
                if low[v] == index[v]:
                    comp = []
                    while True:
                        w = stack.pop()
                        on.discard(w)
                        comp.append(w)
                        if w == v:
                            break
                    if len(comp) > 1:
                        out.append(sorted(comp))
    return out


def unit(mod: str) -> str:
    """The sub-package or top-level module a module belongs to."""
    return ".".join(mod.split(".")[:2])


def problems(root: Path) -> list[str]:
    """Every rule the package at ``root`` breaks, one line each (empty: none)."""
    files = sorted(root.rglob("*.py"))
    names = {module_name(p, root): p for p in files}
    known = set(names)
    graph: dict[str, set[str]] = {}
    bad: list[str] = []
    for mod, path in names.items():
        text = path.read_text()
        tree = ast.parse(text)
        graph[mod] = imports_of(mod, path.name == "__init__.py", tree, known, root.name)
        bad += sizes(path.relative_to(root.parent), tree, len(text.splitlines()))
    for comp in cycles(graph):
        bad.append("module cycle: " + " ".join(comp))
    units: dict[str, set[str]] = {}
    for mod, deps in graph.items():
        u = unit(mod)
        units.setdefault(u, set()).update(unit(d) for d in deps if unit(d) != u)
    for u in list(units):
        units[u] = {d for d in units[u] if d != root.name}
    for comp in cycles(units):
        bad.append("package cycle: " + " ".join(comp))
    return bad


def main() -> int:
    root = Path(sys.argv[1] if len(sys.argv) > 1 else "omnistage").resolve()
    bad = problems(root)
    print("\n".join(bad) or "shape ok")
    print(f"{len(bad)} problems", file=sys.stderr)
    return 1 if bad else 0


if __name__ == "__main__":
    raise SystemExit(main())
