"""The package's import graph, read from the source (no import runs): no circle, no upward import.

Every ``import`` and ``from ... import`` of ``lightning_3d`` and ``deepspeed_3d``, relative or
absolute, at module level or inside a function, is an edge from the importing module to the module
it names (``from pkg import name`` names ``pkg.name`` where that is a module, else ``pkg``). Importing
a submodule runs its package's ``__init__`` first, which is not counted: a package may import its
own submodules.

An import inside a function is allowed only where it keeps an integration library (Lightning,
DeepSpeed, ``transformers``, LitGPT, ...) out of the importer: the imported module imports one at
module level, or the import is in a module ``__getattr__`` (a package's lazy public names).

The layers, lowest first (docs/architecture.md, "Layers of the package"): a module imports modules
of its own layer and of lower layers only.
"""

from __future__ import annotations

import ast
import functools
import itertools
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("lightning_3d", "deepspeed_3d")

LAYERS: list[tuple[str, tuple[str, ...]]] = [
    (
        "core",
        (
            "lightning_3d.arguments",
            "lightning_3d.versions",
            "lightning_3d.comm",
            "lightning_3d.agreement",
            "lightning_3d.grid",
            "lightning_3d.sharding",
            "lightning_3d.dense_twin",
            "lightning_3d.layout",
            "lightning_3d.options",
        ),
    ),
    ("sharded state", ("lightning_3d.checkpoint", "lightning_3d.grad_norm")),
    ("runtime", ("lightning_3d.runtime",)),
    ("ops", ("lightning_3d.ops",)),
    ("layers", ("lightning_3d.layers", "lightning_3d.token_rows")),
    ("parallel", ("lightning_3d.parallel",)),
    ("models", ("lightning_3d.models", "lightning_3d.hf", "lightning_3d.litgpt")),
    ("pipeline", ("lightning_3d.pipeline",)),
    ("cost", ("lightning_3d.cost",)),
    ("integration", ("lightning_3d.strategy", "lightning_3d")),
    ("deepspeed", ("deepspeed_3d",)),
]
INTEGRATION_LIBRARIES = {
    "lightning",
    "pytorch_lightning",
    "lightning_fabric",
    "deepspeed",
    "transformers",
    "litgpt",
    "safetensors",
    "huggingface_hub",
    "triton",
}


def modules() -> dict[str, Path]:
    """``{dotted module name: file}`` of both packages."""
    found = {}
    for package in PACKAGES:
        for file in sorted((ROOT / package).rglob("*.py")):
            parts = list(file.relative_to(ROOT).with_suffix("").parts)
            found[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = file
    return found


def _in_function(tree: ast.AST) -> dict[ast.AST, str]:
    """Each import node inside a function, with the innermost function's name."""
    inside = {}
    for fn in ast.walk(tree):
        if isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
            for node in ast.walk(fn):
                if isinstance(node, (ast.Import, ast.ImportFrom)):
                    inside[node] = fn.name
    return inside


@functools.cache
def _parse(file: Path) -> ast.Module:
    return ast.parse(file.read_text(), str(file))


def imports(name: str, file: Path, known: dict[str, Path]) -> list[tuple[str, int, str | None, str]]:
    """``(imported name, line, enclosing function or None, top-level package)`` of every import in ``file``;
    the imported name is a module of ``known`` where the import names one of ours."""
    tree = _parse(file)
    inside = _in_function(tree)
    package = name if file.name == "__init__.py" else name.rpartition(".")[0]
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                module = ".".join(base + ([node.module] if node.module else []))
            else:
                module = node.module
            targets = [
                f"{module}.{alias.name}" if f"{module}.{alias.name}" in known else module
                for alias in node.names
            ]
        else:
            continue
        for target in targets:
            while target not in known and "." in target:
                target = target.rpartition(".")[0]
            found.append((target, node.lineno, inside.get(node), target.split(".")[0]))
    return list(dict.fromkeys(found))


def graph() -> tuple[dict[str, set[str]], dict[tuple[str, str], tuple[int, str | None]], dict[str, Path]]:
    """Edges between our modules, where each edge was found (line, function), and the files."""
    known = modules()
    edges: dict[str, set[str]] = {m: set() for m in known}
    where = {}
    for name, file in known.items():
        for target, line, function, _ in imports(name, file, known):
            if target in known and target != name:
                edges[name].add(target)
                where.setdefault((name, target), (line, function))
    return edges, where, known


def layer_of(name: str) -> int:
    """Index in :data:`LAYERS` of the longest prefix that owns ``name``; -1 where none does."""
    best, length = -1, -1
    for index, (_, owned) in enumerate(LAYERS):
        for prefix in owned:
            if (name == prefix or name.startswith(prefix + ".")) and len(prefix) > length:
                best, length = index, len(prefix)
    return best


def cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan), each sorted."""
    index, low, stack, on_stack, found, counter = {}, {}, [], set(), [], [0]

    def visit(v: str) -> None:
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on_stack.add(v)
        for w in sorted(edges[v]):
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
                found.append(sorted(component))

    for v in sorted(edges):
        if v not in index:
            visit(v)
    return found


def one_circle(component: list[str], edges: dict[str, set[str]]) -> list[str]:
    """A closed path through the component's first module (breadth-first, so a shortest one)."""
    inside, start = set(component), component[0]
    paths = {start: [start]}
    queue = [start]
    while queue:
        v = queue.pop(0)
        for w in sorted(edges[v] & inside):
            if w == start:
                return paths[v] + [start]
            if w not in paths:
                paths[w] = paths[v] + [w]
                queue.append(w)
    return component


def test_every_module_has_a_layer():
    _, _, known = graph()
    assert not [m for m in known if layer_of(m) < 0], "modules in no layer of tests/test_imports.py LAYERS"


def test_no_import_circle():
    edges, where, known = graph()
    problems = []
    for component in cycles(edges):
        path = one_circle(component, edges)
        steps = " -> ".join(
            f"{known[a].relative_to(ROOT)}:{where[a, b][0]}" for a, b in itertools.pairwise(path)
        )
        problems.append(
            f"{len(component)} modules import each other in a circle: {steps} -> {known[path[0]].relative_to(ROOT)}"
        )
    assert not problems, "\n".join(problems)


def test_no_upward_import():
    edges, where, known = graph()
    upward = [
        f"{known[a].relative_to(ROOT)}:{where[a, b][0]} (layer {LAYERS[layer_of(a)][0]!r}) imports {b} "
        f"(layer {LAYERS[layer_of(b)][0]!r}, higher)"
        for a in sorted(edges)
        for b in sorted(edges[a])
        if layer_of(a) >= 0 and layer_of(b) > layer_of(a)
    ]
    assert not upward, "\n".join(upward)


def _imports_integration(file: Path, known: dict[str, Path]) -> bool:
    name = next(m for m, f in known.items() if f == file)
    return any(
        function is None and top in INTEGRATION_LIBRARIES
        for _, _, function, top in imports(name, file, known)
    )


def test_imports_inside_functions_keep_an_integration_library_out():
    known = modules()
    refused = []
    for name, file in known.items():
        for target, line, function, top in imports(name, file, known):
            if function is None or function == "__getattr__" or top not in PACKAGES:
                continue
            if target not in known or not _imports_integration(known[target], known):
                refused.append(
                    f"{file.relative_to(ROOT)}:{line} imports {target} inside {function}(), which imports no "
                    "integration library: import it at module level"
                )
    assert not refused, "\n".join(refused)


def test_the_checks_see_a_circle_and_an_upward_import():
    edges = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert cycles(edges) == [["a", "b", "c"]] and one_circle(["a", "b", "c"], edges) == ["a", "b", "c", "a"]
    assert layer_of("lightning_3d.checkpoint.dense") < layer_of("lightning_3d.models.gpt3d")
    assert (
        layer_of("lightning_3d.strategy.base")
        == layer_of("lightning_3d")
        > layer_of("lightning_3d.cost.search")
    )


@pytest.mark.parametrize(
    "source, expected",
    [
        ("from ..models import GPT3D", "lightning_3d.models"),
        ("from ..models.config import GPTConfig", "lightning_3d.models.config"),
        ("from .. import checkpoint as ckpt", "lightning_3d.checkpoint"),
        ("import lightning_3d.models.dense", "lightning_3d.models.dense"),
        ("def f():\n    from .views import model_state", "lightning_3d.checkpoint.views"),
    ],
)
def test_imports_are_resolved(tmp_path, source, expected):
    file = tmp_path / "probe.py"
    file.write_text(source + "\n")
    known = {**modules(), "lightning_3d.checkpoint.probe": file}
    assert [t for t, *_ in imports("lightning_3d.checkpoint.probe", file, known)] == [expected]
