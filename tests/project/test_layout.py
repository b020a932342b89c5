"""The package's shape: no import cycles (counting imports inside functions too), and each
package imports only the ones below it.

    core (attention, modules, lm, nnx, ...)  <  training  <  tasks  <  report  <  studies
    core  <  interpretability  <  report, studies

`qkv_jax` is the installed library; `studies` (the sweeps and studies) sits beside the
launchers in the checkout, on top of the library, which never imports it (nor anything else
of the checkout: an installed wheel has none of it). A deferred import (inside a function) is
walked like any other, so one that only dodges a cycle fails here as the cycle itself would.
"""

import ast
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
# The packages walked: the library and the studies on top of it.
PACKAGES = ("qkv_jax", "studies")
# What a checkout holds beside the library; the wheel carries none of it.
CHECKOUT = {"studies", "experiments", "configs", "benchmarks", "docs", "tests"}
# Each package and the packages it may import (besides itself and the core library).
LAYERS = {
    "core": set(),
    "interpretability": set(),
    "training": set(),
    "tasks": {"training"},
    "report": {"training", "tasks", "interpretability"},
    "studies": {"training", "tasks", "report", "interpretability"},
}


def module_name(path: pathlib.Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def modules() -> dict[str, pathlib.Path]:
    return {module_name(path): path for package in PACKAGES for path in (ROOT / package).rglob("*.py")}


def imported_names(path: pathlib.Path) -> list[str]:
    """Every name `path` imports, anywhere in the file (functions included): `from a.b import c`
    gives a.b and a.b.c."""
    names = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names += [node.module] + [f"{node.module}.{alias.name}" for alias in node.names]
    return names


def imports_of(path: pathlib.Path, known: set[str]) -> set[str]:
    """The modules of the walked packages that `path` imports."""
    found = set()
    for name in imported_names(path):
        while name and name not in known:  # `from qkv_jax.x import f`: the module is qkv_jax.x
            name = name.rpartition(".")[0]
        if name.split(".")[0] in PACKAGES:
            found.add(name)
    return found


def graph() -> dict[str, set[str]]:
    found = modules()
    return {name: imports_of(path, set(found)) - {name} for name, path in found.items()}


def layer(name: str) -> str:
    parts = name.split(".")
    if parts[0] == "studies":
        return "studies"
    return parts[1] if len(parts) >= 2 and parts[1] in LAYERS else "core"


def test_no_import_cycles():
    edges = graph()
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    cycles = []

    def visit(node: str, path: list[str]) -> None:
        state[node] = 1
        for target in sorted(edges.get(node, ())):
            if target in PACKAGES or target not in edges:
                continue
            if state.get(target) == 1:
                cycles.append(path[path.index(target) :] + [target] if target in path else [node, target])
            elif state.get(target) is None:
                visit(target, path + [target])
        state[node] = 2

    for node in sorted(edges):
        if state.get(node) is None:
            visit(node, [node])
    assert not cycles, "import cycles: " + "; ".join(" -> ".join(cycle) for cycle in cycles)


@pytest.mark.parametrize("package", sorted(LAYERS))
def test_each_package_imports_only_the_ones_below_it(package):
    wrong = []
    for name, targets in graph().items():
        if layer(name) != package:
            continue
        for target in targets:
            if target not in PACKAGES and layer(target) not in {package, "core"} | LAYERS[package]:
                wrong.append(f"{name} imports {target}")
    if package == "core":  # the library never reaches up into the trainer or the tools around it
        wrong += [
            f"{name} imports {target}"
            for name, targets in graph().items()
            if layer(name) == "core"
            for target in targets
            if layer(target) != "core"
        ]
    assert not wrong, "\n".join(sorted(set(wrong)))


def test_the_walk_sees_imports_inside_functions():
    """report_run imports matplotlib's plots on use, inside the function: the graph has it."""
    assert "qkv_jax.plots" in graph()["qkv_jax.report.run"]


def test_the_library_imports_nothing_of_the_checkout():
    """An installed qkv_jax has no studies, launchers, configs, benchmarks, docs or tests beside
    it: the library imports none of them (the studies import the library, not the other way)."""
    wrong = [
        f"{module_name(path)} imports {name}"
        for path in (ROOT / "qkv_jax").rglob("*.py")
        for name in imported_names(path)
        if name.split(".")[0] in CHECKOUT
    ]
    assert not wrong, "\n".join(sorted(set(wrong)))


def test_the_walk_sees_the_studies_on_top_of_the_library():
    """The studies' own imports and their imports of the trainer are edges of the graph."""
    edges = graph()
    assert {"studies.grid", "studies.results", "qkv_jax.training.run"} <= edges["studies.sweep"]
    assert layer("studies.sweep") == "studies" and layer("qkv_jax.training.run") == "training"
