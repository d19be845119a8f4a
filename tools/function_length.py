"""No function in ``router/`` over :data:`LIMIT` lines, except the I/O state machines
``docs/architecture.md`` names (its table "Long functions": the function, then why it is one piece).

A function's length is its lines from its ``def`` (or its first decorator) to its last line,
docstring and comments included; a nested function counts in its parent and on its own. The
allowed functions are read from the document, so the list and the check cannot disagree; an
entry that no longer names a function over the limit is an error too (the list stays true).

Usage: ``python tools/function_length.py [--limit 80] [--all]`` (``--all``: list every function
over the limit, allowed or not). Exits 1 on a function over the limit that the document does not
name, or a stale entry. ``make lint`` runs it; ``tests/test_function_length.py`` too.
"""

from __future__ import annotations

import argparse
import ast
import re
import sys
from collections.abc import Iterator
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
LIMIT = 80
#: the document naming the allowed functions, and the heading of its table
DOC = REPO / "docs" / "architecture.md"
HEADING = "## Long functions"
_ROW = re.compile(r"^\|\s*`([\w.]+:[\w.]+)`\s*\|\s*(.+?)\s*\|\s*$")


def functions(root: Path = REPO, package: str = "router") -> Iterator[tuple[str, int, str]]:
    """``(module:qualified name, lines, path:line)`` of every function in ``package``."""
    for path in sorted((root / package).rglob("*.py")):
        module = ".".join(path.relative_to(root).with_suffix("").parts).removesuffix(".__init__")
        tree = ast.parse(path.read_text(), str(path))
        yield from _walk(tree, module, "", path.relative_to(root))


def _walk(node: ast.AST, module: str, prefix: str, path: Path) -> Iterator[tuple[str, int, str]]:
    for child in ast.iter_child_nodes(node):
        if isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef):
            name = f"{prefix}{child.name}"
            first = min([child.lineno, *(d.lineno for d in child.decorator_list)])
            yield f"{module}:{name}", (child.end_lineno or child.lineno) - first + 1, f"{path}:{child.lineno}"
            yield from _walk(child, module, f"{name}.", path)
        elif isinstance(child, ast.ClassDef):
            yield from _walk(child, module, f"{prefix}{child.name}.", path)
        else:
            yield from _walk(child, module, prefix, path)


def allowed(doc: Path = DOC) -> dict[str, str]:
    """The document's table of allowed functions: ``module:qualified name`` -> why."""
    out: dict[str, str] = {}
    inside = False
    for line in doc.read_text().splitlines():
        if line.startswith("## "):
            inside = line.strip() == HEADING
        elif inside and (m := _ROW.match(line)):
            out[m.group(1)] = m.group(2)
    return out


def check(limit: int = LIMIT, root: Path = REPO, doc: Path = DOC) -> tuple[list[str], list[tuple[str, int, str]]]:
    """The problems (one line each) and every function over ``limit`` (name, lines, where)."""
    ok = allowed(doc)
    long = [f for f in functions(root) if f[1] > limit]
    problems = [f"{where}: {name} is {n} lines (over {limit}); split it, or name it in {doc.name}, "
                f"'{HEADING[3:]}', if it is an I/O state machine" for name, n, where in long if name not in ok]
    over = {name for name, _, _ in long}
    problems += [f"{doc.name}, '{HEADING[3:]}': {name} is not a function over {limit} lines (any more): "
                 "drop it from the table" for name in ok if name not in over]
    return problems, long


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--limit", type=int, default=LIMIT)
    ap.add_argument("--all", action="store_true", help="list every function over the limit")
    a = ap.parse_args()
    problems, long = check(a.limit)
    if a.all:
        ok = allowed()
        for name, n, where in sorted(long, key=lambda f: -f[1]):
            print(f"{n:5d}  {name}  ({where}){'  [allowed]' if name in ok else ''}")
    for p in problems:
        print(p, file=sys.stderr)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
