"""The package's layout, read from its source: imports between its modules go
one way (no cycle, counting imports inside functions and under
``TYPE_CHECKING``), the core imports no wing, and no module exists only to
re-export another's names (package ``__init__`` files aside, which are the
public faces)."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[2] / "composable_shard"


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path: Path, modules: set[str]) -> set[str]:
    """The package's modules ``path`` imports, anywhere in its body: ``from x
    import y`` counts as importing module ``x.y`` where that is a module, else ``x``."""
    name = _module_name(path)
    package = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = package[: len(package) - node.level + 1] if node.level else []
            source = ".".join(base + (node.module.split(".") if node.module else []))
            for alias in node.names:
                found.add(f"{source}.{alias.name}" if f"{source}.{alias.name}" in modules else source)
    return {module for module in found if module in modules and module != name}


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    cycles: list[list[str]] = []

    def visit(module: str) -> None:
        index[module] = low[module] = len(index)
        stack.append(module)
        for target in sorted(graph[module]):
            if target not in index:
                visit(target)
                low[module] = min(low[module], low[target])
            elif target in stack:
                low[module] = min(low[module], index[target])
        if low[module] == index[module]:
            component = []
            while True:
                member = stack.pop()
                component.append(member)
                if member == module:
                    break
            if len(component) > 1:
                cycles.append(sorted(component))

    for module in sorted(graph):
        if module not in index:
            visit(module)
    return cycles


def _sources() -> dict[str, Path]:
    return {_module_name(path): path for path in sorted(PACKAGE.rglob("*.py"))}


def test_imports_between_the_package_modules_have_no_cycle() -> None:
    sources = _sources()
    graph = {name: _imports(path, set(sources)) for name, path in sources.items()}
    assert "composable_shard.planning.table" in graph["composable_shard.planning.sharding_plan"]  # the reader sees edges
    assert _cycles(graph) == [], "modules that import each other (directly or around a loop)"


def test_no_module_only_re_exports_another() -> None:
    only_imports = []
    for name, path in _sources().items():
        if path.name == "__init__.py":
            continue
        body = ast.parse(path.read_text(), str(path)).body
        if all(
            isinstance(node, (ast.Import, ast.ImportFrom))
            or (isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant))  # docstring
            or (isinstance(node, ast.Assign) and [getattr(t, "id", None) for t in node.targets] == ["__all__"])
            for node in body
        ):
            only_imports.append(name)
    assert only_imports == [], "modules with nothing but imports: import from the module that defines the names"


# The core: what fully_shard builds and a training step runs. Wings build on
# it (state dicts, checkpoints, plans, the utilities over a sharded tree)
# and may import it; the core never imports a wing. By package prefix, so a
# module split into a folder of the same name stays in its layer.
CORE = ("api", "policy", "handle", "comm", "runtime", "units", "entry")
WINGS = ("state_dict", "checkpoint", "planning", "controls", "interop", "comm_hooks", "optim", "integrations")


def _layer(module: str) -> str | None:
    parts = module.split(".")
    if len(parts) < 2:
        return None  # the package's own __init__: the public face, above both
    if parts[1] in CORE:
        return "core"
    if parts[1] in WINGS:
        return "wing"
    return "unknown"


def test_every_module_belongs_to_a_layer() -> None:
    unknown = [name for name in _sources() if _layer(name) == "unknown"]
    assert unknown == [], "modules in no layer: add their top-level name to CORE or WINGS"


def test_the_core_imports_no_wing() -> None:
    sources = _sources()
    upward = sorted(
        f"{name} -> {target}"
        for name, path in sources.items()
        if _layer(name) == "core"
        for target in _imports(path, set(sources))
        if _layer(target) == "wing"
    )
    assert "composable_shard.controls.unshard_params" in sources and "composable_shard.state_dict.hooks" in sources  # layers seen
    assert upward == [], "core modules importing a wing (register through an extension point instead)"


def _subpackage(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else ""


def test_subpackages_import_each_other_one_way() -> None:
    """The folders, not only the modules, are layered: collapse every module to
    its top-level subpackage and the graph has no cycle (``state_dict`` never
    imports ``checkpoint``, which builds on it)."""
    sources = _sources()
    graph: dict[str, set[str]] = {}
    for name, path in sources.items():
        if not _subpackage(name):
            continue  # the package's face imports everything
        edges = graph.setdefault(_subpackage(name), set())
        edges.update(_subpackage(t) for t in _imports(path, set(sources)) if _subpackage(t) != _subpackage(name))
    assert "state_dict" in graph["checkpoint"]  # the reader sees the edge that must exist
    assert _cycles(graph) == [], "subpackages that import each other (directly or around a loop)"


def test_root_holds_a_handful_of_modules() -> None:
    modules = sorted(path.name for path in PACKAGE.glob("*.py"))
    assert len(modules) <= 6, f"modules at the package root (move them into the folder of their concern): {modules}"


def test_every_subpackage_is_importable_as_itself() -> None:
    import importlib

    import composable_shard

    for folder in sorted(p.parent for p in PACKAGE.glob("*/__init__.py")):
        name = f"composable_shard.{folder.name}"
        module = importlib.import_module(name)
        assert module.__name__ == name and getattr(composable_shard, folder.name, module) is module, name


def test_no_module_passes_six_hundred_lines() -> None:
    """A module that grows past ~600 lines has a second responsibility: split it by noun."""
    long = sorted(
        f"{path.relative_to(PACKAGE.parent)} ({count})"
        for path in PACKAGE.rglob("*.py")
        if (count := len(path.read_text().splitlines())) > 600
    )
    assert long == [], f"modules over 600 lines: {long}"


def test_test_files_have_unique_names() -> None:
    """Two test files of one name are two subjects a reader cannot tell apart
    in a failure line: name each by what it tests."""
    tests = PACKAGE.parent / "tests"
    names: dict[str, list[str]] = {}
    for path in sorted(tests.rglob("test_*.py")):
        names.setdefault(path.name, []).append(str(path.relative_to(tests)))
    assert {name: paths for name, paths in names.items() if len(paths) > 1} == {}
