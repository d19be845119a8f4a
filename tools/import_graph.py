"""Print the import graph of xroute's packages as Markdown: package -> package edges (how many
module imports, how many of them inside a function), and the cycles, between packages and between
modules. Built with grimp, the graph import-linter checks (``make lint``'s ``lint-imports``).

    python tools/import_graph.py                        # the top-level packages
    python tools/import_graph.py --unit router.decision.engine   # and router.decision.engine as a node of its own

A module belongs to the longest ``--unit`` (or top-level package) that contains it. An import
"inside a function" is one whose statement is indented; such imports still count: they are edges,
only hidden from the top of the file. An import under ``if TYPE_CHECKING:`` is an annotation that
never runs, and is left out -- as import-linter leaves it out (``exclude_type_checking_imports`` in
``pyproject.toml``).
"""

from __future__ import annotations

import argparse
import sys
from collections import defaultdict
from pathlib import Path

import grimp

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("xroute_app", "router", "models", "envs", "cloud_adapters", "xroute")


def _source_line(module: str, line: int) -> str:
    base = ROOT / module.replace(".", "/")
    path = base / "__init__.py" if base.is_dir() else base.with_suffix(".py")
    return path.read_text().splitlines()[line - 1]


def _sccs(nodes: set[str], edges: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one node (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in sorted(edges.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
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

    sys.setrecursionlimit(10_000)
    for v in sorted(nodes):
        if v not in index:
            visit(v)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--unit", action="append", default=[], help="a subpackage or module shown as a node of its own")
    args = ap.parse_args()
    sys.path.insert(0, str(ROOT))
    packages = [p for p in PACKAGES if (ROOT / p).is_dir()]  # xroute_app: from issue 18 on
    graph = grimp.build_graph(*packages, include_external_packages=False, exclude_type_checking_imports=True)
    units = sorted([*packages, *args.unit], key=len, reverse=True)

    def unit(m: str) -> str:
        return next(u for u in units if m == u or m.startswith(u + "."))

    pairs: dict[tuple[str, str], list[tuple[str, str, bool]]] = defaultdict(list)
    mod_edges: dict[str, set[str]] = defaultdict(set)
    for importer in sorted(graph.modules):
        for imported in sorted(graph.find_modules_directly_imported_by(importer)):
            mod_edges[importer].add(imported)
            a, b = unit(importer), unit(imported)
            if a == b:
                continue
            details = graph.get_import_details(importer=importer, imported=imported)
            lazy = all(_source_line(importer, d["line_number"])[:1].isspace() for d in details)
            pairs[(a, b)].append((importer, imported, lazy))

    print("| importer | imported | module imports | in functions | e.g. |")
    print("|---|---|---:|---:|---|")
    for (a, b), rows in sorted(pairs.items()):
        lazy = sum(r[2] for r in rows)
        print(f"| `{a}` | `{b}` | {len(rows)} | {lazy} | `{rows[0][0]}` → `{rows[0][1]}` |")

    pkg_edges: dict[str, set[str]] = defaultdict(set)
    for a, b in pairs:
        pkg_edges[a].add(b)
    print()
    cycles = _sccs({u for p in pairs for u in p}, pkg_edges)
    print("package cycles:", "; ".join(" ↔ ".join(c) for c in cycles) if cycles else "none")
    cycles = _sccs(set(graph.modules), mod_edges)
    print("module cycles:", "; ".join(" ↔ ".join(c) for c in cycles) if cycles else "none")


if __name__ == "__main__":
    main()
