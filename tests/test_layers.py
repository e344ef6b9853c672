"""The folders of ``ciera_jax`` and ``ciera_models`` are their layers: each imports only the
layers below it, and no module imports itself back through a circle. ``ciera_models`` sits above
the whole library and reaches it through its public layers. Read from the source (every import
statement, function-level and ``TYPE_CHECKING`` ones included, and the lazy ``_EXPORTS``
tables), no JAX needed."""

from __future__ import annotations

import ast
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "ciera_jax"
MODELS = ROOT / "ciera_models"

BELOW_COLLECTIVE = {"codec", "kernels", "runtime"}
# layer -> the layers it may import (besides itself). ``api`` is the top-level ``ciera_jax``.
MAY_IMPORT = {
    "runtime": set(),
    "codec": {"runtime"},
    "kernels": {"codec", "runtime"},
    "collective": BELOW_COLLECTIVE,
    "planning": {"codec", "runtime"},
    "calibrate": {"planning", "collective"} | BELOW_COLLECTIVE,
    "sim": {"planning", "codec", "runtime"},
    "fsdp.state": {"planning", "collective"} | BELOW_COLLECTIVE,
    "fsdp": {"fsdp.state", "planning", "collective"} | BELOW_COLLECTIVE,
    "loop": {"fsdp", "fsdp.state", "planning", "collective"} | BELOW_COLLECTIVE,
    "cli": {"api", "loop", "fsdp", "fsdp.state", "sim", "calibrate", "planning", "collective"}
    | BELOW_COLLECTIVE,
}
# What ``ciera_models`` may use of the library: its public layers, never the codec or kernels
# (``collective`` re-exports the few codec names a trainer needs). Its own command-line layer
# may also use the library's ``cli`` (``ciera train`` is a subcommand of ``ciera``).
PUBLIC = {"api", "loop", "fsdp", "fsdp.state", "collective", "planning", "runtime"}
MAY_IMPORT |= {
    "models": set(),  # the top-level ``ciera_models``, empty
    "models.model": PUBLIC,
    "models.resilience": PUBLIC,
    "models.checkpoint": {"models.resilience", "models.model"} | PUBLIC,
    "models.train": {"models.checkpoint", "models.resilience", "models.model"} | PUBLIC,
    "models.aot": {"models.train", "models.checkpoint", "models.resilience", "models.model"}
    | PUBLIC,
    "models.cli": {"models.aot", "models.train", "models.checkpoint", "models.resilience",
                   "models.model", "cli"} | PUBLIC,
}
MAX_MODULES = 12


def _module_name(path: pathlib.Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {_module_name(p): p
           for p in sorted([*PACKAGE.rglob("*.py"), *MODELS.rglob("*.py")])}


def _layer(module: str) -> str:
    """``ciera_jax.fsdp.state.caches`` -> ``fsdp.state``; the top-level package -> ``api``;
    ``ciera_models.train.step`` -> ``models.train``."""
    top, *parts = module.split(".")
    if top == "ciera_models":
        return "models" if not parts else f"models.{parts[0]}"
    if not parts:
        return "api"
    if parts[0] == "fsdp" and len(parts) > 1 and parts[1] == "state":
        return "fsdp.state"
    return parts[0]


def _imports(module: str) -> set[str]:
    """Every ciera module ``module`` imports, resolved to module names."""
    path = MODULES[module]
    tree = ast.parse(path.read_text())
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    out: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                src = ".".join(base + ([node.module] if node.module else []))
            else:
                src = node.module or ""
            for alias in node.names:
                sub = f"{src}.{alias.name}"
                out.add(sub if sub in MODULES else src)
        elif isinstance(node, ast.Assign) and any(
                isinstance(t, ast.Name) and t.id == "_EXPORTS" for t in node.targets):
            out |= {c.value for c in ast.walk(node.value)
                    if isinstance(c, ast.Constant) and isinstance(c.value, str)
                    and c.value.startswith("ciera_jax.")}
    return {m for m in out if m.split(".")[0] in ("ciera_jax", "ciera_models")}


GRAPH = {m: _imports(m) - {m} for m in MODULES}


def _upward(graph: dict[str, set[str]]) -> list[str]:
    upward = []
    for module, deps in graph.items():
        if module == "ciera_jax":
            continue  # the public API re-exports on purpose
        layer = _layer(module)
        allowed = MAY_IMPORT[layer] | {layer}
        for dep in deps:
            if _layer(dep) not in allowed:
                upward.append(f"{module} ({layer}) imports {dep} ({_layer(dep)})")
    return sorted(upward)


def _circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Tarjan's strongly connected components of more than one module."""
    index, low, on_stack, stack, circles = {}, {}, set(), [], []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph.get(v, ()):
            if w not in graph:
                continue
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                circles.append(sorted(component))

    for v in graph:
        if v not in index:
            visit(v)
    return circles


def test_every_import_goes_down_the_layers():
    upward = _upward(GRAPH)
    assert not upward, "\n".join(upward)


def test_no_import_circle():
    assert not _circles(GRAPH)


@pytest.mark.parametrize("package", [PACKAGE, MODELS], ids=lambda p: p.name)
def test_every_module_lives_in_a_layer_of_bounded_size(package):
    loose = [p.name for p in package.glob("*.py") if p.name != "__init__.py"]
    assert not loose, f"modules directly in {package.name}/: {loose}"
    for folder in {p.parent for p in package.rglob("*.py")}:
        modules = [p for p in folder.glob("*.py") if p.name != "__init__.py"]
        assert len(modules) <= MAX_MODULES, (folder, len(modules))
    assert {_layer(m) for m in MODULES} == set(MAY_IMPORT) | {"api"}


@pytest.mark.parametrize("module,dep", [
    ("ciera_jax.planning.memory", "ciera_jax.fsdp.state.caches"),
    ("ciera_jax.codec.bitfields", "ciera_jax.collective.gather"),
    ("ciera_jax.fsdp.state.caches", "ciera_jax.fsdp.prepared"),
    ("ciera_jax.calibrate.kit", "ciera_jax"),
    ("ciera_jax.runtime.lazy", "ciera_models.train"),
    ("ciera_models.train.step", "ciera_jax.codec.bitfields"),
    ("ciera_models.model.transformer", "ciera_models.train.state"),
    ("ciera_models.checkpoint.store", "ciera_models.train.loop"),
    ("ciera_models.resilience.peers", "ciera_jax.cli.main"),
])
def test_an_upward_import_is_caught(module, dep):
    graph = {m: set(d) for m, d in GRAPH.items()}
    graph[module].add(dep)
    assert _upward(graph) == [f"{module} ({_layer(module)}) imports {dep} ({_layer(dep)})"]


def test_a_circle_is_caught():
    graph = {m: set(d) for m, d in GRAPH.items()}
    graph["ciera_jax.codec.wire"].add("ciera_jax.codec.escapes")  # escapes imports wire
    assert ["ciera_jax.codec.escapes", "ciera_jax.codec.wire"] in _circles(graph)
