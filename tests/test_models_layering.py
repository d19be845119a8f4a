"""Imports inside ``models/`` flow one way: no module reaches, even from inside a function, a module
that imports it back (there was a circle policy -> registry -> pyfunc -> policy, and registry <->
ope, hidden behind function-level imports). Read from the source, nothing imported."""

from __future__ import annotations

import ast
from pathlib import Path

MODELS = Path(__file__).resolve().parent.parent / "models"
#: the inference and registry layer: policy <- pyfunc, loader <- ope <- registry; their imports of
#: our packages stand at the top of the module, where a reader sees the direction
TOP_LEVEL_ONLY = ("policy", "pyfunc", "loader", "registry")
OURS = ("models", "envs", "xroute", "router", "cloud_adapters")


def _imports(tree: ast.AST) -> list[tuple[ast.AST, str]]:
    out: list[tuple[ast.AST, str]] = []
    for n in ast.walk(tree):
        if isinstance(n, ast.ImportFrom) and n.module and n.level == 0:
            if n.module == "models":
                out += [(n, f"models.{a.name}") for a in n.names]
            else:
                out.append((n, n.module))
        elif isinstance(n, ast.Import):
            out += [(n, a.name) for a in n.names]
    return out


def _graph() -> dict[str, set[str]]:
    g: dict[str, set[str]] = {}
    for f in MODELS.glob("*.py"):
        name = f"models.{f.stem}"
        g[name] = {m for _, m in _imports(ast.parse(f.read_text())) if m.startswith("models.") and m != name}
    return g


def test_no_import_cycle_inside_models() -> None:
    g = _graph()
    assert "models.loader" in g and "models.policy" in g

    def reach(a: str) -> set[str]:
        seen: set[str] = set()
        todo = [a]
        while todo:
            for b in g.get(todo.pop(), set()):
                if b not in seen:
                    seen.add(b)
                    todo.append(b)
        return seen

    assert [m for m in sorted(g) if m in reach(m)] == []
    # the direction, spelled out: inference knows no registry, the registry knows inference
    assert not reach("models.policy") & {"models.registry", "models.pyfunc", "models.loader"}
    assert reach("models.pyfunc") == {"models.policy"}
    assert {"models.policy", "models.pyfunc", "models.loader", "models.ope"} <= reach("models.registry")


def test_the_inference_and_registry_layer_imports_ours_at_module_level() -> None:
    for stem in TOP_LEVEL_ONLY:
        tree = ast.parse((MODELS / f"{stem}.py").read_text())
        top = {id(n) for n in tree.body}
        late = [m for n, m in _imports(tree) if m.split(".")[0] in OURS and id(n) not in top]
        assert late == [], f"models/{stem}.py imports {late} inside a function"


def test_what_the_router_and_evaluate_import_of_models_pulls_no_training_stack() -> None:
    """The router loads ``models.loader:load_policy``, ``xroute evaluate`` the baselines and the
    loader, ``xroute ope`` the OPE module: none of them may bring torch, SB3 or Ray (the core
    install has none of them)."""
    import subprocess
    import sys

    code = ("import sys, models.loader, models.policy, models.baselines, models.ope, models.pyfunc, models.scenarios; "
            "print(sorted(m for m in ('torch', 'stable_baselines3', 'ray') if m in sys.modules))")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=MODELS.parent, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.strip().splitlines()[-1] == "[]"
