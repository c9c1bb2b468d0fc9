"""Packaging: one namespace, every import declared.

A machine that already has a package hides a missing dependency (numpy did exactly
that), so this test reads the source rather than trusting the environment: every import
outside the standard library made at module level in the installed folders must be a
declared dependency; optional ones must sit inside a function or a ``try`` block.
"""

from __future__ import annotations

import ast
import re
import sys
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())
FOLDERS = {"braid": "braid", "schedules": "braid.schedules", "simulator": "braid.simulator", "viz": "braid.viz"}
# distribution name -> import name, where they differ
IMPORT_NAME = {"pyyaml": "yaml", "megatron-core": "megatron", "nvidia-ml-py": "pynvml"}


def _declared(extra: str | None = None) -> set[str]:
    reqs = PYPROJECT["project"]["dependencies"] if extra is None else PYPROJECT["project"]["optional-dependencies"][extra]
    names = {re.split(r"[<>=!~\[; ]", r, maxsplit=1)[0].strip().lower() for r in reqs}
    return {IMPORT_NAME.get(n, n.replace("-", "_")) for n in names}


def _module_level_imports(path: Path) -> set[str]:
    """Top-level names imported outside functions and outside ``try`` blocks."""
    tree = ast.parse(path.read_text(), filename=str(path))
    found: set[str] = set()

    def visit(nodes):
        for node in nodes:
            if isinstance(node, ast.Import):
                found.update(a.name.split(".")[0] for a in node.names)
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                found.add(node.module.split(".")[0])
            elif isinstance(node, (ast.If,)):
                if not (isinstance(node.test, ast.Name) and node.test.id == "TYPE_CHECKING"):
                    visit(node.body)
                    visit(node.orelse)
            elif isinstance(node, ast.ClassDef):
                visit(node.body)
            # functions and try blocks: guarded / lazy imports, not module-level requirements

    visit(tree.body)
    return found


def _package_dirs() -> list[tuple[str, Path]]:
    out = []
    for folder, pkg in FOLDERS.items():
        for init in sorted((ROOT / folder).rglob("__init__.py")):
            rel = init.parent.relative_to(ROOT / folder)
            name = ".".join([pkg, *rel.parts]) if rel.parts else pkg
            out.append((name, init.parent))
    return out


def test_every_package_folder_is_installed_under_braid():
    listed = set(PYPROJECT["tool"]["setuptools"]["packages"])
    found = {name for name, _ in _package_dirs()}
    assert found - listed == set(), "package folders missing from [tool.setuptools] packages"
    assert listed - found == set(), "listed packages without a folder"
    mapping = PYPROJECT["tool"]["setuptools"]["package-dir"]
    assert {k: v for k, v in mapping.items() if k != "braid"} == {
        "braid.schedules": "schedules", "braid.simulator": "simulator", "braid.viz": "viz"}


@pytest.mark.parametrize("pkg,folder", _package_dirs(), ids=[n for n, _ in _package_dirs()])
def test_module_level_imports_are_declared(pkg, folder):
    declared = _declared() | {"braid"}
    for path in sorted(folder.glob("*.py")):
        for name in _module_level_imports(path):
            if name in sys.stdlib_module_names or name == "__future__":
                continue
            assert name in declared, (
                f"{path.relative_to(ROOT)} imports {name!r} at module level but it is not a declared "
                f"dependency: add it to [project] dependencies, or import it inside the function that needs it")


def _all_extras() -> set[str]:
    out: set[str] = set()
    for extra in PYPROJECT["project"]["optional-dependencies"]:
        out |= _declared(extra)
    return out


@pytest.mark.parametrize("pkg,folder", _package_dirs(), ids=[n for n, _ in _package_dirs()])
def test_every_import_is_declared_somewhere(pkg, folder):
    """Lazy and guarded imports too: an optional package belongs to an extra (``pip install 'braid-pipeline[x]'``)."""
    declared = _declared() | _all_extras() | {"braid"}
    for path in sorted(folder.glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import)
                     else [node.module] if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module else [])
            for name in (n.split(".")[0] for n in names):
                if name in sys.stdlib_module_names or name == "__future__":
                    continue
                assert name in declared, (f"{path.relative_to(ROOT)} imports {name!r}, which no dependency or extra "
                                          "declares: add it to pyproject.toml")


def test_no_code_imports_the_bare_folder_names():
    """``schedules``/``simulator``/``viz`` are generic names other distributions install too."""
    pattern = re.compile(r"^\s*(from|import)\s+(schedules|simulator|viz)\b", re.M)
    offenders = [str(p.relative_to(ROOT)) for d in ("braid", "schedules", "simulator", "viz", "tests", "examples", "benchmarks")
                 for p in (ROOT / d).rglob("*.py") if pattern.search(p.read_text())]
    assert offenders == []


def test_test_imports_are_declared_test_dependencies():
    local = {p.stem for p in (ROOT / "tests").glob("*.py")}
    declared = _declared() | _declared("test") | {"braid", "tests"} | local
    for path in sorted((ROOT / "tests").glob("*.py")):
        for name in _module_level_imports(path):
            if name in sys.stdlib_module_names or name == "__future__":
                continue
            assert name in declared, f"{path.name} imports {name!r} at module level; declare it in the 'test' extra"


def test_install_hints_name_our_distribution_and_a_declared_extra() -> None:
    """Every ``pip install 'NAME[extra]'`` in the code and the docs names this project's distribution
    (the import name ``braid`` is another project's distribution name on the package index) and an extra
    that pyproject.toml declares."""
    name = PYPROJECT["project"]["name"]
    extras = set(PYPROJECT["project"]["optional-dependencies"])
    files = [p for folder in (*FOLDERS, "examples", "docs") for p in (ROOT / folder).rglob("*") if p.suffix in (".py", ".md")]
    hints = [(p, m) for p in [*files, ROOT / "README.md"] for m in re.finditer(r"pip install '([\w.-]+)\[(\w+)\]'", p.read_text())]
    assert hints
    for path, m in hints:
        assert (m.group(1), m.group(2) in extras) == (name, True), f"{path.relative_to(ROOT)}: {m.group(0)}"
    assert name != "braid"
