"""DESIGN.md §2's one-way dependencies, checked on the source: at module level a method package imports only the
leaves (``peftplug.registry``, ``peftplug.fileio``, ``peftplug.errors``, ``peftplug_kernels``), and the leaves import no
package of ours but each other. Imports inside functions (the CLIs' lazy use of the trainer) are allowed: they do
not run when the package is imported, so they cannot create an import cycle."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
METHOD_PACKAGES = ("oftv2", "helene", "prompt_transfer", "steering")
OURS = {"peftplug", "peftplug_kernels", *METHOD_PACKAGES}
LEAVES = {"peftplug.registry", "peftplug.fileio", "peftplug.errors", "peftplug.datadir", "peftplug.quantized_layout", "peftplug_kernels"}


def module_level_imports(path: Path) -> set[str]:
    """Absolute imports of our packages that run when ``path`` is imported: every import statement except those
    inside a function (or lambda) body, wherever else it stands (``if``, ``try``, ``with``, a class body, ...)."""
    found: set[str] = set()

    def visit(node):
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
                continue  # runs when called, not on import
            if isinstance(child, ast.Import):
                found.update(a.name for a in child.names)
            elif isinstance(child, ast.ImportFrom) and child.level == 0 and child.module:
                found.add(child.module)
            visit(child)

    visit(ast.parse(path.read_text()))
    return {name for name in found if name.split(".")[0] in OURS}


def is_leaf(name: str) -> bool:
    return any(name == leaf or name.startswith(leaf + ".") for leaf in LEAVES)


@pytest.mark.parametrize("package", METHOD_PACKAGES)
def test_a_method_package_imports_only_the_leaves_at_module_level(package):
    stray = {f"{path.relative_to(ROOT)}: {name}" for path in sorted((ROOT / package).rglob("*.py"))
             for name in module_level_imports(path)
             if name.split(".")[0] != package and not is_leaf(name)}
    assert not stray, f"{package} imports beyond the leaves at module level: {sorted(stray)}"


def test_the_leaves_import_no_method_package_or_trainer():
    paths = [ROOT / "peftplug" / f"{leaf}.py" for leaf in ("registry", "fileio", "errors", "datadir", "quantized_layout")]
    paths += sorted((ROOT / "peftplug_kernels").rglob("*.py"))
    stray = {f"{path.relative_to(ROOT)}: {name}" for path in paths for name in module_level_imports(path)
             if not is_leaf(name)}
    assert not stray, f"a leaf imports beyond the leaves: {sorted(stray)}"


def test_the_check_sees_a_violation(tmp_path):
    bad = tmp_path / "bad.py"
    bad.write_text("import torch\ntry:\n    from peftplug.lightning import PeftModule\nexcept ImportError:\n    pass\n"
                   "class Holder:\n    import peftplug.cli\n"
                   "def lazy():\n    from peftplug.loading import load_model\n")
    assert module_level_imports(bad) == {"peftplug.lightning", "peftplug.cli"}
