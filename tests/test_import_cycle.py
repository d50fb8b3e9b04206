"""No import cycle in kda_backend, read from the source (no imports run): module-level imports form no cycle, and
the kernel and provider layers import nothing from the layers above them, not even inside a function."""

import ast
from pathlib import Path

import kda_backend

PACKAGE_DIR = Path(kda_backend.__file__).parent
LOWER_LAYERS = ("kda_backend.kernels", "kda_backend.providers")
# What the kernel and provider layers may import besides themselves.
LOWER_LAYER_IMPORTS = ("kda_backend.log", "kda_backend.accuracy", "kda_backend.cache_files")


def _modules() -> dict[str, Path]:
    """Dotted name -> file of every module of the package (packages by their ``__init__``)."""
    found = {}
    for path in PACKAGE_DIR.rglob("*.py"):
        parts = list(path.relative_to(PACKAGE_DIR.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        found[".".join(parts)] = path
    return found


MODULES = _modules()


def _within(name: str, packages: tuple[str, ...]) -> bool:
    """Whether module ``name`` is one of ``packages`` or inside one."""
    return any(name == package or name.startswith(package + ".") for package in packages)


def _module_level(tree: ast.Module) -> list[ast.stmt]:
    """Statements that run when the module is imported (inside ``if`` and ``try`` too, not in functions)."""
    found, todo = [], list(tree.body)
    while todo:
        node = todo.pop()
        found.append(node)
        if isinstance(node, (ast.If, ast.Try)):
            todo += node.body + node.orelse + getattr(node, "finalbody", [])
            todo += [stmt for handler in getattr(node, "handlers", []) for stmt in handler.body]
    return found


def _imports(name: str, module_level_only: bool) -> set[str]:
    """The package's modules that module ``name`` needs executed. An ancestor package is always initialised (or
    initialising) before its submodules, so binding one (``import kda_backend``, ``from kda_backend import env``)
    is no dependency on it; taking a name from one (``from kda_backend import KDAProjection``) is."""
    path = MODULES[name]
    tree = ast.parse(path.read_text())
    package = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
    nodes = _module_level(tree) if module_level_only else list(ast.walk(tree))
    found = set()
    for node in nodes:
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names if alias.name in MODULES and not _within(name, (alias.name,))}
        elif isinstance(node, ast.ImportFrom):
            base = package[: len(package) - node.level + 1] if node.level else []
            source = ".".join(base + ([node.module] if node.module else []))
            for alias in node.names:
                if f"{source}.{alias.name}" in MODULES:
                    found.add(f"{source}.{alias.name}")
                elif source in MODULES:
                    found.add(source)
    found.discard(name)
    return found


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    cycles = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        for nxt in graph[node]:
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = []
            while not component or component[-1] != node:
                component.append(stack.pop())
            if len(component) > 1:
                cycles.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return cycles


def test_scan_reads_the_package_imports():
    assert "kda_backend.kernels.compile_cache" in _imports("kda_backend.providers.cute_provider", True)
    assert "kda_backend.builtin_plugins" in _imports("kda_backend.plugins", True)
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_module_level_imports_form_no_cycle():
    graph = {name: _imports(name, module_level_only=True) for name in MODULES}
    assert _cycles(graph) == []


def test_kernel_and_provider_layers_import_nothing_above_them():
    """Not even lazily: the plugin manager hands the CuTe provider its cache folder instead."""
    allowed = LOWER_LAYERS + LOWER_LAYER_IMPORTS
    for name in MODULES:
        if _within(name, LOWER_LAYERS):
            above = {m for m in _imports(name, module_level_only=False) if not _within(m, allowed)}
            assert not above, f"{name} imports {sorted(above)}"
