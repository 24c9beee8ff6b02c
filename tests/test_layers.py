"""The house: treadle's modules import one way, top to bottom, and no two import each other.

Layers (a module may import its own layer and those below it):
cli -> train -> checkpoint / speculative / data / drafts -> engine / models -> config / metrics / corpus and the small
shared modules (errors, fsutil, tokenizer, distributed). Imports under ``if TYPE_CHECKING:`` do not run and
are not counted; imports inside functions are (a lazy import is still a dependency).
"""

import ast
import sys
from pathlib import Path

import treadle

ROOT = Path(treadle.__file__).parent
LAYERS = {
    "cli": 4, "__main__": 4, "__init__": 4, "api": 4,
    "train": 3,
    "checkpoint": 2, "speculative": 2, "data": 2, "drafts": 2,
    "engine": 1, "models": 1,
    "config": 0, "metrics": 0, "corpus": 0, "errors": 0, "fsutil": 0, "tokenizer": 0, "distributed": 0, "quiet": 0, "model_dirs": 0, "presets": 0,
    "versions": 0, "compat": 0, "machine_load": 0,
}


def _modules() -> dict[str, Path]:
    return {".".join(p.relative_to(ROOT.parent).with_suffix("").parts).removesuffix(".__init__"): p
            for p in ROOT.rglob("*.py")}


def _imports(path: Path, modules: dict[str, Path]) -> set[str]:
    tree = ast.parse(path.read_text())
    skip = {id(n) for node in ast.walk(tree) if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test)
            for b in node.body for n in ast.walk(b)}
    out = set()
    for node in ast.walk(tree):
        if id(node) in skip:
            continue
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("treadle"):
            for alias in node.names:
                full = f"{node.module}.{alias.name}"
                out.add(full if full in modules else node.module)
        elif isinstance(node, ast.Import):
            out |= {a.name for a in node.names if a.name.startswith("treadle")}
    return {m for m in out if m in modules}


def _layer(module: str) -> int:
    parts = module.split(".")
    if parts[1:2] == ["drafts"] and parts[-1] == "settings":  # a draft kind's [draft] rules, plain Python: the config reads them
        return LAYERS["config"]
    return LAYERS[parts[1] if len(parts) > 1 else "__init__"]


def _graph() -> dict[str, set[str]]:
    modules = _modules()
    graph = {m: _imports(p, modules) - {m} for m, p in modules.items()}
    # a package's own __init__ re-exporting from inside it is not a dependency between files
    return {m: {t for t in ts if not (m.startswith(t + ".") and modules[t].name == "__init__.py")} for m, ts in graph.items()}


def upward_imports(graph: dict[str, set[str]]) -> list[str]:
    return sorted(f"{m} -> {t}" for m, ts in graph.items() for t in ts if _layer(t) > _layer(m))


def circles(graph: dict[str, set[str]]) -> list[str]:
    found, state = [], {}  # state: 1 = on the current path, 2 = done

    def visit(m: str, path: list[str]) -> None:
        state[m] = 1
        for t in sorted(graph[m]):
            if state.get(t) == 1:
                found.append(" -> ".join(path[path.index(t):] + [t]))
            elif t not in state:
                visit(t, path + [t])
        state[m] = 2

    for m in sorted(graph):
        if m not in state:
            visit(m, [m])
    return found


def test_every_module_has_a_layer():
    unknown = sorted(m for m in _modules() if (m.split(".") + ["__init__"])[1] not in LAYERS)
    assert not unknown, f"modules outside the layer map (add them to LAYERS): {unknown}"


def test_imports_go_down_the_layers_only():
    assert not upward_imports(_graph())


def test_no_import_circles():
    assert not circles(_graph())


def test_the_checks_fail_on_a_circle_and_an_upward_import(tmp_path, monkeypatch):
    """The checks above are only worth something if they can fail: feed them a package that breaks both rules."""
    pkg = tmp_path / "treadle"
    (pkg / "data").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "data" / "__init__.py").write_text("")
    (pkg / "corpus.py").write_text("def f():\n    from treadle.data.prepare import prepare\n")  # lazy, still counted
    (pkg / "data" / "prepare.py").write_text("from treadle.corpus import f\n")
    monkeypatch.setattr(sys.modules[__name__], "ROOT", pkg)
    graph = _graph()
    assert upward_imports(graph) == ["treadle.corpus -> treadle.data.prepare"]
    assert circles(graph) == ["treadle.corpus -> treadle.data.prepare -> treadle.corpus"]
