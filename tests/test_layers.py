"""The house in layers: the package's own import graph has no cycle, each layer imports only the
layers below it, and no source file is over 600 lines.

Every import counts: module level, inside functions (lazy), under ``TYPE_CHECKING``, in module
``__getattr__`` -- a cycle hidden behind a lazy import or a forwarding ``__getattr__`` is still
a cycle. The top-level folders ``schedules/``, ``simulator/`` and ``viz/`` are ``braid.schedules``,
``braid.simulator`` and ``braid.viz``.
"""

from __future__ import annotations

import ast
from pathlib import Path

import networkx as nx
import pytest

ROOT = Path(__file__).resolve().parent.parent
FOLDERS = {"braid": "braid", "schedules": "braid.schedules", "simulator": "braid.simulator", "viz": "braid.viz"}
MAX_LINES = 600
MAX_ROOT_MODULES = 12

# What each layer may import besides itself (lowest first). A package not listed is not
# constrained here beyond having no cycle.
LAYERS = {
    "braid.core": set(),
    "braid.io": set(),
    "braid.schedules": {"braid.core"},
    "braid.cost": {"braid.core", "braid.io"},
    "braid.simulator": {"braid.core", "braid.io", "braid.cost", "braid.schedules"},
    "braid.planner": {"braid.core", "braid.io", "braid.cost", "braid.schedules", "braid.simulator"},
}
TORCH_FREE = ("braid.core", "braid.cost", "braid.schedules", "braid.simulator", "braid.planner")


def modules(root: Path = ROOT) -> dict[str, Path]:
    """Module name -> source file, for every module of the package."""
    out = {}
    for folder, name in FOLDERS.items():
        for path in sorted((root / folder).rglob("*.py")):
            parts = path.relative_to(root / folder).with_suffix("").parts
            mod = ".".join((name, *parts))
            out[mod.removesuffix(".__init__")] = path
    return out


def _imported(tree: ast.AST, mod: str, is_pkg: bool) -> set[str]:
    """Every name an import statement anywhere in ``tree`` imports (absolute, aliases resolved)."""
    pkg = mod if is_pkg else mod.rpartition(".")[0]
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = pkg.split(".")[: len(pkg.split(".")) - node.level + 1]
                base = ".".join(parts + ([base] if base else []))
            names.add(base)
            names.update(f"{base}.{a.name}" for a in node.names)
    for folder, alias in FOLDERS.items():  # ``import schedules`` from inside the tree
        names = {alias + n[len(folder):] if n == folder or n.startswith(folder + ".") else n for n in names}
    return names


def import_graph(root: Path = ROOT) -> nx.DiGraph:
    """Module -> module it imports (the nearest enclosing module of each imported name)."""
    mods = modules(root)
    g = nx.DiGraph()
    g.add_nodes_from(mods)
    for mod, path in mods.items():
        for name in _imported(ast.parse(path.read_text(), str(path)), mod, path.name == "__init__.py"):
            target = name
            while target and target not in mods:
                target = target.rpartition(".")[0]
            # A module importing its own package's __init__ (or a parent package) is not a dependency edge.
            if target and target != mod and not mod.startswith(target + "."):
                g.add_edge(mod, target)
    return g


def cycles(g: nx.DiGraph) -> list[list[str]]:
    return sorted(sorted(c) for c in nx.strongly_connected_components(g) if len(c) > 1)


def _layer(mod: str) -> str | None:
    return next((lay for lay in LAYERS if mod == lay or mod.startswith(lay + ".")), None)


def test_no_import_cycle() -> None:
    found = cycles(import_graph())
    assert not found, "import cycles (every import counts, lazy ones too):\n" + "\n".join(" , ".join(c) for c in found)


def test_a_cycle_is_found_where_a_lazy_import_or_getattr_forward_adds_one(tmp_path: Path) -> None:
    """The check itself: a lazy import in a function, or a module ``__getattr__`` forward, closing a loop is a cycle."""
    for folder in FOLDERS:
        (tmp_path / folder).mkdir()
        (tmp_path / folder / "__init__.py").write_text("")
    (tmp_path / "braid" / "low.py").write_text("X = 1\n")
    (tmp_path / "braid" / "high.py").write_text("from braid.low import X\n")
    assert cycles(import_graph(tmp_path)) == []
    (tmp_path / "braid" / "low.py").write_text("X = 1\ndef f():\n    from braid.high import g\n")
    assert cycles(import_graph(tmp_path)) == [["braid.high", "braid.low"]]
    (tmp_path / "braid" / "low.py").write_text(
        "X = 1\ndef __getattr__(name):\n    from braid import high\n    return getattr(high, name)\n")
    assert cycles(import_graph(tmp_path)) == [["braid.high", "braid.low"]]
    (tmp_path / "schedules" / "gen.py").write_text("from braid.high import X\n")
    (tmp_path / "braid" / "low.py").write_text("from braid.schedules import gen\n")
    assert cycles(import_graph(tmp_path)) == [["braid.high", "braid.low", "braid.schedules.gen"]]


def test_each_layer_imports_only_the_layers_below() -> None:
    g = import_graph()
    wrong = []
    for a, b in g.edges:
        la, lb = _layer(a), _layer(b)
        if la is not None and lb is not None and la != lb and lb not in LAYERS[la]:
            wrong.append(f"{a} -> {b}")
        if la is not None and lb is None and b.startswith("braid."):
            wrong.append(f"{a} -> {b} (above {la})")
    assert not wrong, "imports against the layering:\n" + "\n".join(sorted(wrong))


@pytest.mark.parametrize("layer", TORCH_FREE)
def test_plans_costs_and_simulation_are_torch_free(layer: str) -> None:
    """Planning, costing and simulating run without importing torch (their layers import none)."""
    mods = modules()
    heavy = []
    for mod, path in mods.items():
        if _layer(mod) == layer:
            names = _imported(ast.parse(path.read_text()), mod, path.name == "__init__.py")
            heavy += [f"{mod}: {n}" for n in names if n == "torch" or n.startswith("torch.")]
    assert not heavy, "\n".join(sorted(heavy))


def test_no_source_file_over_600_lines() -> None:
    files = [p for folder in (*FOLDERS, "examples", "benchmarks", "tests") for p in (ROOT / folder).rglob("*.py")]
    long = {str(p.relative_to(ROOT)): n for p in files if (n := len(p.read_text().splitlines())) > MAX_LINES}
    assert not long, f"files over {MAX_LINES} lines: {long}"


def test_few_modules_at_the_package_root() -> None:
    """The root holds the command-line faces; everything else lives in a layer's folder."""
    root = sorted(p.stem for p in (ROOT / "braid").glob("*.py") if p.stem != "__init__")
    assert len(root) <= MAX_ROOT_MODULES, root
