"""DESIGN.md §2's one-way dependencies, checked on the source.

1. At module level a method package imports only the leaves (``peftplug.registry``, ``peftplug.fileio``,
   ``peftplug.errors``, ``peftplug.datadir``, ``peftplug.quantized_layout``, ``peftplug.optional``,
   ``peftplug.parameter_writes``, ``peftplug.validation``, ``peftplug.adapter_params``, ``peftplug_kernels``), and
   the leaves import no package of ours but each other.
2. No import circle between any two of the repository's ``.py`` files. Here an import inside a function counts
   too: it does not run when the module is imported, but it is still a dependency, and a circle of them is a knot a
   reader has to untie (and one lazy import moved to the top turns it into an import error).
3. Benchmarks: a study (``benchmarks/<study>/``) imports ``benchmarks.common`` and the library, never another study,
   lazy imports included; ``benchmarks.common`` imports no study; at most three modules stay loose at the top of
   ``benchmarks/``; ``benchmarks/gpu/`` holds orchestration (shell), no Python.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
METHOD_PACKAGES = ("oftv2", "helene", "prompt_transfer", "steering")
OURS = {"peftplug", "peftplug_kernels", *METHOD_PACKAGES}
LEAVES = {"peftplug.registry", "peftplug.fileio", "peftplug.errors", "peftplug.datadir", "peftplug.quantized_layout",
          "peftplug.optional", "peftplug.parameter_writes", "peftplug.validation", "peftplug.adapter_params",
          "peftplug.seq_cls_pooling",
          "peftplug_kernels"}
#: Folders that are not the repository's code.
SKIP_DIRS = {".venv", ".venv-compat", "runs", "build", "dist", "node_modules", "__pycache__"}
MAX_LOOSE_BENCHMARK_MODULES = 3


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


# ------------------------------------------------------------------------------------------- the file graph
def python_files(root: Path = ROOT) -> dict[str, Path]:
    """Every ``.py`` file of the repository by its module name (``pkg/sub/__init__.py`` -> ``pkg.sub``)."""
    modules = {}
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root)
        if any(part in SKIP_DIRS or part.startswith(".") for part in rel.parts[:-1]):
            continue
        parts = list(rel.with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        if parts and all(p.isidentifier() for p in parts):
            modules[".".join(parts)] = path
    return modules


def all_imports(path: Path, module: str) -> set[str]:
    """Every module name ``path`` imports anywhere (function bodies included), relative imports resolved; for
    ``from a import b`` both ``a`` and ``a.b`` (the caller keeps whichever is a file)."""
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                base_name = ".".join(base + ([node.module] if node.module else []))
            else:
                base_name = node.module or ""
            found.add(base_name)
            found.update(f"{base_name}.{a.name}" for a in node.names)
    return {name for name in found if name}


def import_graph(root: Path = ROOT) -> dict[str, set[str]]:
    """Module -> the repository's modules it imports (the deepest file each import names; no self-arrows)."""
    files = python_files(root)
    graph: dict[str, set[str]] = {}
    for module, path in files.items():
        targets = set()
        for name in all_imports(path, module):
            parts = name.split(".")
            # ``import a.b.c`` depends on the file a/b/c.py; ``from a.b import name`` on a/b.py.
            while parts and ".".join(parts) not in files:
                parts.pop()
            if parts:
                targets.add(".".join(parts))
        graph[module] = targets - {module}
    return graph


def circles(graph: dict[str, set[str]]) -> list[set[str]]:
    """The strongly connected components of more than one module (Tarjan, iteratively: no recursion limit)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[set[str]] = []
    counter = 0
    for start, targets in graph.items():
        if start in index:
            continue
        work = [(start, iter(sorted(targets)))]
        index[start] = low[start] = counter
        counter += 1
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in graph:
                    continue
                if child not in index:
                    index[child] = low[child] = counter
                    counter += 1
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = set()
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.add(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(component)
    return found


def path_in(component: set[str], graph: dict[str, set[str]]) -> list[str]:
    """One circle through ``component``, as the modules in import order (for the failure message)."""
    start = min(component)
    trail, seen, node = [start], {start}, start
    while True:
        nxt = min(t for t in graph[node] if t in component)
        if nxt in seen:
            return trail[trail.index(nxt):] + [nxt]
        trail.append(nxt)
        seen.add(nxt)
        node = nxt


def benchmark_study(module: str) -> str | None:
    """``benchmarks.<study>.x`` -> ``<study>`` (``common`` included); ``None`` for a loose module or another file."""
    parts = module.split(".")
    if parts[0] != "benchmarks" or len(parts) < 2 or (ROOT / "benchmarks" / f"{parts[1]}.py").is_file():
        return None
    return parts[1]


# ----------------------------------------------------------------------------------------------------- tests
@pytest.mark.parametrize("package", METHOD_PACKAGES)
def test_a_method_package_imports_only_the_leaves_at_module_level(package):
    stray = {f"{path.relative_to(ROOT)}: {name}" for path in sorted((ROOT / package).rglob("*.py"))
             for name in module_level_imports(path)
             if name.split(".")[0] != package and not is_leaf(name)}
    assert not stray, f"{package} imports beyond the leaves at module level: {sorted(stray)}"


def test_the_leaves_import_no_method_package_or_trainer():
    paths = [ROOT / "peftplug" / f"{leaf}.py" for leaf in ("registry", "fileio", "errors", "datadir",
                                                           "quantized_layout", "optional", "adapter_params")]
    paths += sorted((ROOT / "peftplug_kernels").rglob("*.py"))
    stray = {f"{path.relative_to(ROOT)}: {name}" for path in paths for name in module_level_imports(path)
             if not is_leaf(name)}
    assert not stray, f"a leaf imports beyond the leaves: {sorted(stray)}"


def test_no_import_circle_between_files_lazy_imports_included():
    graph = import_graph()
    found = circles(graph)
    assert not found, "import circles (an import inside a function counts):\n" + "\n".join(
        " -> ".join(path_in(c, graph)) for c in found)


def test_a_benchmark_study_imports_only_common_and_the_library():
    graph = import_graph()
    stray = set()
    for module, targets in graph.items():
        study = benchmark_study(module)
        if study is None:
            continue
        for target in targets:
            other = benchmark_study(target)
            if target.split(".")[0] == "benchmarks" and other not in (study, "common"):
                stray.add(f"{module} -> {target}")
            if study == "common" and other not in (None, "common"):
                stray.add(f"{module} -> {target} (common imports no study)")
            if study == "common" and target.split(".")[0] == "benchmarks" and other is None and target != "benchmarks":
                stray.add(f"{module} -> {target} (common imports no loose module)")
    assert not stray, f"benchmark studies reach beyond benchmarks.common: {sorted(stray)}"


def test_benchmarks_keep_at_most_three_loose_modules_and_gpu_is_orchestration():
    loose = sorted(p.name for p in (ROOT / "benchmarks").glob("*.py") if p.name != "__init__.py")
    assert len(loose) <= MAX_LOOSE_BENCHMARK_MODULES, f"loose modules at the top of benchmarks/: {loose}"
    assert not sorted((ROOT / "benchmarks" / "gpu").rglob("*.py")), "benchmarks/gpu/ is orchestration (shell) only"


def test_the_checks_see_a_violation(tmp_path):
    bad = tmp_path / "bad.py"
    bad.write_text("import torch\ntry:\n    from peftplug.lightning import PeftModule\nexcept ImportError:\n    pass\n"
                   "class Holder:\n    import peftplug.cli\n"
                   "def lazy():\n    from peftplug.loading import load_model\n")
    assert module_level_imports(bad) == {"peftplug.lightning", "peftplug.cli"}
    # A circle through a lazy and a relative import, and a study reaching into another.
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "__init__.py").write_text("")
    (tmp_path / "pkg" / "a.py").write_text("from . import b\n")
    (tmp_path / "pkg" / "b.py").write_text("def f():\n    from pkg.a import x\n")
    (tmp_path / "pkg" / "c.py").write_text("import pkg.b\n")
    graph = import_graph(tmp_path)
    assert graph["pkg.a"] == {"pkg", "pkg.b"} and graph["pkg.b"] == {"pkg.a"} and graph["pkg.c"] == {"pkg.b"}
    assert circles(graph) == [{"pkg.a", "pkg.b"}]
    assert path_in({"pkg.a", "pkg.b"}, graph) == ["pkg.a", "pkg.b", "pkg.a"]
    assert circles({"x": {"y"}, "y": {"z"}, "z": set()}) == []
    assert benchmark_study("benchmarks.helene.smollm2.runs") == "helene"
    assert benchmark_study("benchmarks.report") is None and benchmark_study("helene.zo") is None
