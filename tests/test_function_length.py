"""No function in ``router/`` over 80 lines except the I/O state machines ``docs/architecture.md``
names ("Long functions"; ``tools/function_length.py``), and the check itself on a small tree."""

from __future__ import annotations

import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "tools"))

import function_length as fl  # noqa: E402


def test_no_function_in_router_is_over_the_limit_unless_the_architecture_names_it() -> None:
    problems, _ = fl.check()
    assert problems == [], "\n".join(problems)


def _tree(tmp_path: Path, body_lines: int, table: list[str]) -> tuple[Path, Path]:
    pkg = tmp_path / "router" / "sub"
    pkg.mkdir(parents=True)
    (tmp_path / "router" / "__init__.py").write_text("")
    body = "".join(f"    x{i} = {i}\n" for i in range(body_lines))
    (pkg / "mod.py").write_text(f"class K:\n    @staticmethod\n    def loop():\n{body.replace('    ', '        ')}\n"
                                f"def short():\n    return 1\n")
    doc = tmp_path / "architecture.md"
    doc.write_text("# A\n\n## Long functions\n\n| function | why |\n|---|---|\n" + "".join(
        f"| `{name}` | it is a state machine |\n" for name in table) + "\n## Next\n\n| `router.x:y` | not this table |\n")
    return tmp_path, doc


def test_the_check_counts_from_the_decorator_and_reads_only_its_table(tmp_path: Path) -> None:
    root, doc = _tree(tmp_path, 78, [])  # decorator + def + 78 lines = 80: at the limit
    names = {name: n for name, n, _ in fl.functions(root)}
    assert names == {"router.sub.mod:K.loop": 80, "router.sub.mod:short": 2}
    assert fl.check(80, root, doc)[0] == []
    assert fl.allowed(doc) == {}  # the row under "## Next" is another table's


def test_a_long_function_fails_unless_named_and_a_stale_entry_fails(tmp_path: Path) -> None:
    root, doc = _tree(tmp_path, 79, [])
    problems, long = fl.check(80, root, doc)
    assert [n for n, _, _ in long] == ["router.sub.mod:K.loop"] and len(problems) == 1
    assert "router.sub.mod:K.loop is 81 lines" in problems[0] and "router/sub/mod.py:3" in problems[0]
    root2, doc2 = _tree(tmp_path / "named", 79, ["router.sub.mod:K.loop"])
    assert fl.check(80, root2, doc2)[0] == []
    root3, doc3 = _tree(tmp_path / "stale", 10, ["router.sub.mod:K.loop", "router.sub.mod:gone"])
    stale = fl.check(80, root3, doc3)[0]
    assert len(stale) == 2 and all("drop it from the table" in p for p in stale)
