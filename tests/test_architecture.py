"""The package's import graph: no cycles, and every module imports only its own layer or the layers below it.

The graph is read from the source (the AST of every module under src/rangefinder), not from what a test run happened
to import, so it includes imports inside functions and `importlib.import_module(...)` calls whose name is a literal or
an f-string with a literal prefix. The strict cycle test also counts imports that only type checkers run and a
package's __init__ importing its own submodules (so a submodule importing the package back closes a loop). It is kept
at module granularity: `from pkg import name` is an edge to `pkg.name` when that is a module, else to `pkg`.

Layers, lowest first (a module may import its own layer and those below):
    base       config, planning, errors, redaction, defaults, container_images, the root package
    formats    on-disk formats: the atomic writer, checkpoints, exports
    library    data, models, training, analysis, tracking, sampling
    launch     how a training step's run starts: one process, torchrun on one node, a TrainJob on several
    steps      one module per KFP step
    pipelines  the KFP DAG, its components, compile/submit
    cli        the `rangefinder` command
"""

from __future__ import annotations

import ast
import os
import re
import subprocess
import sys
import textwrap
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[1] / "src"
PACKAGE = "rangefinder"

LAYERS: dict[str, int] = {
    "": 0,  # the root package, rangefinder/__init__.py
    "config": 0,
    "planning": 0,
    "errors": 0,
    "redaction": 0,
    "defaults": 0,
    "container_images": 0,
    "formats": 1,
    "data": 2,
    "models": 2,
    "training": 2,
    "analysis": 2,
    "tracking": 2,
    "sampling": 2,
    "launch": 3,
    "steps": 4,
    "pipelines": 5,
    "cli": 6,
}
LAYER_NAMES = {0: "base", 1: "formats", 2: "library", 3: "launch", 4: "steps", 5: "pipelines", 6: "cli"}

# Third-party libraries a part of the package must never import, at module level or inside a function.
BANNED_LIBRARIES: dict[str, tuple[str, ...]] = {
    # analysis is numpy + matplotlib, so every decision can be tested on curves built from formulas, fast.
    "analysis": ("torch", "diffusers", "transformers", "accelerate", "peft"),
    # The engine reports through training.MetricSink and is launched by steps; it knows nothing of MLflow or KFP.
    "training": ("kfp", "mlflow"),
    # The on-disk formats are read by every layer; they must not drag the tracking or pipeline stack in.
    "formats": ("kfp", "mlflow"),
}

# A whole string constant naming a module, optionally with an attribute: "rangefinder.training.methods.lora:LoraMethod".
# Registries of this shape feed importlib.import_module(variable), which the AST cannot follow otherwise.
_MODULE_REFERENCE = re.compile(r"^[A-Za-z_][\w]*(\.[A-Za-z_]\w*)+(:[A-Za-z_]\w*)?$")


# --------------------------------------------------------------------------------------------------------------------
# Reading the graph


@dataclass(frozen=True)
class Import:
    """One import statement (or dynamic import) in a module."""

    target: str  # dotted name as written, made absolute: "torch.nn", "rangefinder.formats.checkpoints.read"
    line: int
    local: bool  # inside a function: runs when called, not at import
    type_only: bool  # under `if TYPE_CHECKING:`; never runs
    prefix: bool = False  # an f-string's literal prefix: some module under `target` is imported
    reference: bool = False  # a string naming a module ("pkg.mod:Attr"); counts only if it names one exactly


def discover_modules(src: Path, package: str) -> dict[str, Path]:
    """Every module of `package` under `src`, by dotted name (a package is named by its __init__.py)."""
    modules = {}
    for path in sorted((src / package).rglob("*.py")):
        parts = list(path.relative_to(src).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        modules[".".join(parts)] = path
    return modules


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _is_import_module_call(node: ast.Call) -> bool:
    func = node.func
    return (isinstance(func, ast.Attribute) and func.attr == "import_module") or (
        isinstance(func, ast.Name) and func.id == "import_module"
    )


def _absolute(module: str, is_package: bool, level: int, name: str | None) -> str:
    """The absolute name a relative `from ...name import x` in `module` refers to."""
    if level == 0:
        return name or ""
    base = module.split(".") if is_package else module.split(".")[:-1]
    base = base[: len(base) - (level - 1)]
    return ".".join(base + ([name] if name else []))


def read_imports(module: str, path: Path, is_package: bool) -> list[Import]:
    """Every import in one module's source, with where and when it runs."""
    tree = ast.parse(path.read_text(), filename=str(path))
    found: list[Import] = []
    names_read: set[int] = set()  # ids of string constants already taken as an import_module argument

    def visit(node: ast.AST, local: bool, type_only: bool) -> None:
        if isinstance(node, ast.Import):
            found.extend(Import(alias.name, node.lineno, local, type_only) for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = _absolute(module, is_package, node.level, node.module)
            # `from pkg import name`: pkg.name when that is a module; the caller resolves against the known modules.
            found.extend(Import(f"{base}.{alias.name}", node.lineno, local, type_only) for alias in node.names)
        elif isinstance(node, ast.Call) and _is_import_module_call(node) and node.args:
            arg = node.args[0]
            names_read.add(id(arg))
            if isinstance(arg, ast.Constant) and isinstance(arg.value, str):
                found.append(Import(arg.value, node.lineno, local, type_only))
            elif isinstance(arg, ast.JoinedStr) and arg.values and isinstance(arg.values[0], ast.Constant):
                prefix = str(arg.values[0].value)
                found.append(Import(prefix.rstrip("."), node.lineno, local, type_only, prefix=True))
        elif (
            isinstance(node, ast.Constant)
            and isinstance(node.value, str)
            and id(node) not in names_read
            and _MODULE_REFERENCE.match(node.value)
        ):
            # A module named in a registry string; counted as a dynamic import where it is written.
            found.append(Import(node.value.split(":")[0], node.lineno, local, type_only, reference=True))
        if isinstance(node, ast.If) and _is_type_checking(node.test):
            for child in node.body:
                visit(child, local, True)
            for child in node.orelse:
                visit(child, local, type_only)
            return
        inner = local or isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))
        for child in ast.iter_child_nodes(node):
            visit(child, inner, type_only)

    visit(tree, False, False)
    return found


def resolve(target: str, known: Iterable[str]) -> str | None:
    """The known module an imported name lands in: the longest known prefix of `target` (None if outside them)."""
    known = set(known)
    parts = target.split(".")
    for n in range(len(parts), 0, -1):
        candidate = ".".join(parts[:n])
        if candidate in known:
            return candidate
    return None


def _targets(imp: Import, known: set[str]) -> set[str]:
    if imp.prefix:
        # f"rangefinder.cli.commands.{name}": any module under that prefix may be the one imported.
        under = {m for m in known if m.startswith(imp.target + ".")}
        return under or {m for m in [resolve(imp.target, known)] if m}
    found = resolve(imp.target, known)
    if imp.reference and found != imp.target:
        return set()  # "model.safetensors", "rangefinder.yaml": a file name, not a module
    return {found} if found else set()


def is_own_submodule(package: str, module: str) -> bool:
    return module.startswith(package + ".")


def import_graph(
    sources: Mapping[str, Path], *, include_type_only: bool = False, include_own_submodules: bool = False
) -> dict[str, set[str]]:
    """Module -> the package's modules it imports (module level and inside functions).

    A package importing its own submodules (its __init__ re-exporting them) is not an edge unless asked for: that is
    how packages expose their parts, and it is the submodules' imports that can close a cycle.
    """
    known = set(sources)
    packages = {m for m, p in sources.items() if p.name == "__init__.py"}
    graph: dict[str, set[str]] = {m: set() for m in known}
    for module, path in sources.items():
        for imp in read_imports(module, path, module in packages):
            if imp.type_only and not include_type_only:
                continue
            for target in _targets(imp, known):
                own = module in packages and is_own_submodule(module, target)
                if target == module or (own and not include_own_submodules):
                    continue
                graph[module].add(target)
    return graph


def find_cycles(graph: Mapping[str, Iterable[str]]) -> list[list[str]]:
    """One cycle, as [a, b, ..., a], through each strongly connected part of `graph` that has one.

    Tarjan's algorithm for the strongly connected components, then a shortest cycle inside each, so the message names
    a path one can follow in the code.
    """
    edges = {node: sorted(set(targets)) for node, targets in graph.items()}
    for targets in list(edges.values()):
        for t in targets:
            edges.setdefault(t, [])
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components: list[list[str]] = []

    def strongconnect(root: str) -> None:
        # Iterative, so a long chain of modules cannot hit the recursion limit.
        work = [(root, iter(edges[root]))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, successors = work[-1]
            for succ in successors:
                if succ not in index:
                    index[succ] = low[succ] = len(index)
                    stack.append(succ)
                    on_stack.add(succ)
                    work.append((succ, iter(edges[succ])))
                    break
                if succ in on_stack:
                    low[node] = min(low[node], index[succ])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    component = []
                    while True:
                        member = stack.pop()
                        on_stack.discard(member)
                        component.append(member)
                        if member == node:
                            break
                    components.append(sorted(component))

    for node in sorted(edges):
        if node not in index:
            strongconnect(node)

    cycles = []
    for component in sorted(components):
        members = set(component)
        start = component[0]
        if len(component) == 1 and start not in edges[start]:
            continue
        # Breadth-first from `start` back to `start` inside the component: a shortest cycle through it.
        parent: dict[str, str] = {}
        frontier = [start]
        found = None
        while frontier and found is None:
            following = []
            for node in frontier:
                for succ in edges[node]:
                    if succ == start:
                        found = node
                        break
                    if succ in members and succ not in parent:
                        parent[succ] = node
                        following.append(succ)
                if found is not None:
                    break
            frontier = following
        assert found is not None, component
        path = [found]
        while path[-1] != start:
            path.append(parent[path[-1]])
        cycles.append([start, *reversed(path[:-1]), start] if len(path) > 1 else [start, start])
    return cycles


def layer_of(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else ""


# --------------------------------------------------------------------------------------------------------------------
# The cycle finder and graph reader on small graphs, so a planted cycle is known to fail the real test


def test_find_cycles_on_a_dag_finds_none():
    assert find_cycles({"a": {"b", "c"}, "b": {"c"}, "c": set()}) == []


def test_find_cycles_names_the_path_of_each_cycle():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a", "d"}, "d": set(), "x": {"y"}, "y": {"x"}, "s": {"s"}}
    assert find_cycles(graph) == [["a", "b", "c", "a"], ["s", "s"], ["x", "y", "x"]]


def test_find_cycles_gives_a_shortest_cycle_inside_a_tangle():
    # a -> b -> c -> d -> a, and the shortcut a -> d: the shortest way back to a is a -> d -> a.
    assert find_cycles({"a": {"b", "d"}, "b": {"c"}, "c": {"d"}, "d": {"a"}}) == [["a", "d", "a"]]


def _write_package(root: Path, files: dict[str, str]) -> dict[str, Path]:
    for name, text in files.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(textwrap.dedent(text))
    return discover_modules(root, "pkg")


def test_graph_sees_function_local_and_dynamic_imports(tmp_path):
    sources = _write_package(
        tmp_path,
        {
            "pkg/__init__.py": "from pkg.a import thing\nfrom pkg import b\n",  # re-exports: not a cycle
            "pkg/a.py": "def thing():\n    from pkg.b import helper\n    return helper\n",
            "pkg/b.py": "import importlib\n\ndef helper():\n    return importlib.import_module('pkg.sub.c')\n",
            "pkg/sub/__init__.py": "",
            "pkg/sub/c.py": "from pkg import a\n",  # pkg.a is a module: the edge goes to it, closing a -> b -> c -> a
            "pkg/sub/d.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from pkg.a import thing\n",
            "pkg/cmd.py": "import importlib\n\ndef run(n):\n    return importlib.import_module(f'pkg.sub.{n}')\n",
        },
    )
    graph = import_graph(sources)
    assert graph["pkg"] == set()
    assert graph["pkg.a"] == {"pkg.b"}
    assert graph["pkg.b"] == {"pkg.sub.c"}
    assert graph["pkg.sub.c"] == {"pkg.a"}
    assert graph["pkg.sub.d"] == set()  # TYPE_CHECKING imports never run
    assert graph["pkg.cmd"] == {"pkg.sub.c", "pkg.sub.d"}  # any module the f-string's prefix may complete to
    assert find_cycles(graph) == [["pkg.a", "pkg.b", "pkg.sub.c", "pkg.a"]]


def test_the_strict_graph_sees_a_type_only_loop_and_a_loop_through_the_package_face(tmp_path):
    """What the strict cycle test reads and the default one leaves out: a loop closed by a TYPE_CHECKING import (as
    setup -> checkpointing -> setup once was), and a submodule importing its package's __init__ that imports it back
    (as training.loop -> training -> training.loop once was)."""
    sources = _write_package(
        tmp_path,
        {
            "pkg/__init__.py": "",
            "pkg/setup.py": "from pkg.ckpt import save\n",
            "pkg/ckpt.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from pkg.setup import Run\n",
            "pkg/eng/__init__.py": "SINK = 1\n\ndef __getattr__(name):\n    from pkg.eng import loop\n"
                                   "    return loop\n",
            "pkg/eng/loop.py": "from pkg.eng import SINK\n",
        },
    )
    assert find_cycles(import_graph(sources)) == []
    strict = import_graph(sources, include_type_only=True, include_own_submodules=True)
    assert find_cycles(strict) == [["pkg.ckpt", "pkg.setup", "pkg.ckpt"], ["pkg.eng", "pkg.eng.loop", "pkg.eng"]]


def test_graph_resolves_from_imports_of_names_and_of_modules(tmp_path):
    sources = _write_package(
        tmp_path,
        {
            "pkg/__init__.py": "",
            "pkg/x.py": "from pkg.y import value\nfrom pkg import z\nfrom . import w\nimport pkg.y\n",
            "pkg/y.py": "value = 1\n",
            "pkg/z.py": "REGISTRY = {'w': 'pkg.w:Thing'}\n",
            "pkg/w.py": "class Thing: ...\n",
        },
    )
    graph = import_graph(sources)
    assert graph["pkg.x"] == {"pkg.y", "pkg.z", "pkg.w"}
    assert graph["pkg.z"] == {"pkg.w"}  # named in a registry string fed to import_module
    assert find_cycles(graph) == []


# --------------------------------------------------------------------------------------------------------------------
# The package itself


@pytest.fixture(scope="module")
def sources() -> dict[str, Path]:
    found = discover_modules(SRC, PACKAGE)
    assert len(found) > 50, f"expected the package's modules under {SRC}"
    return found


@pytest.fixture(scope="module")
def imports(sources) -> dict[str, list[Import]]:
    return {m: read_imports(m, p, p.name == "__init__.py") for m, p in sources.items()}


def test_every_module_has_a_layer(sources):
    unplaced = sorted(m for m in sources if layer_of(m) not in LAYERS)
    assert not unplaced, f"add these to LAYERS in {Path(__file__).name}: {unplaced}"


def test_no_import_cycles(sources):
    cycles = find_cycles(import_graph(sources))
    assert not cycles, "import cycles:\n" + "\n".join("  " + " -> ".join(c) for c in cycles)


def test_no_import_cycles_counting_type_only_imports_and_package_faces(sources):
    """No loop either through an import under `if TYPE_CHECKING:` (it never runs, but it says one module's meaning
    depends on the other's: a hidden loop of acts) or through a package's `__init__` that a module inside the package
    imports back (five training modules once went round training/__init__.py's lazy `train`)."""
    graph = import_graph(sources, include_type_only=True, include_own_submodules=True)
    cycles = find_cycles(graph)
    assert not cycles, "import cycles (type-only imports and package faces counted):\n" + "\n".join(
        "  " + " -> ".join(c) for c in cycles)


def test_layers_import_only_downwards(sources, imports):
    known = set(sources)
    breaks = []
    for module, found in imports.items():
        rank = LAYERS[layer_of(module)]
        for imp in found:  # type-only imports count too: the direction is about what a layer knows of
            for target in _targets(imp, known):
                if LAYERS[layer_of(target)] > rank:
                    breaks.append(
                        f"{module}:{imp.line} ({LAYER_NAMES[rank]}) imports {target} "
                        f"({LAYER_NAMES[LAYERS[layer_of(target)]]})"
                    )
    assert not breaks, "imports against the layering:\n" + "\n".join("  " + b for b in breaks)


@pytest.mark.parametrize("layer", sorted(BANNED_LIBRARIES))
def test_layer_never_imports_banned_libraries(layer, sources, imports):
    """Direct imports anywhere in the layer, and module-level imports of every module the layer reaches."""
    banned = BANNED_LIBRARIES[layer]
    # What importing the layer runs: its modules, what they import, and the packages around each of those.
    graph = import_graph(sources, include_own_submodules=True)
    reached = {m for m in sources if layer_of(m) == layer}
    frontier = list(reached)
    while frontier:
        module = frontier.pop()
        parents = {module.rsplit(".", n)[0] for n in range(1, module.count(".") + 1)}
        for target in graph[module] | parents:
            if target not in reached:
                reached.add(target)
                frontier.append(target)
    breaks = []
    for module in sorted(reached):
        own = layer_of(module) == layer
        for imp in imports[module]:
            if imp.reference:
                continue
            if imp.target.split(".")[0] in banned and (own or not (imp.local or imp.type_only)):
                via = "" if own else f" (reached from {layer})"
                breaks.append(f"{module}:{imp.line} imports {imp.target}{via}")
    assert not breaks, f"{layer} must not import {', '.join(banned)}:\n" + "\n".join("  " + b for b in breaks)


def test_importing_analysis_loads_no_torch(sources):
    """What actually happens at import, as a check on the static reading above."""
    analysis = sorted(m for m in sources if layer_of(m) == "analysis")
    code = f"import sys\nfor m in {analysis!r}:\n    __import__(m)\nprint('torch' in sys.modules)\n"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(SRC), os.environ.get("PYTHONPATH", "")])}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_every_torch_load_says_whether_it_may_unpickle(imports, sources):
    """torch.load unpickles (runs code) unless weights_only=True; each call must choose, visibly, on purpose."""
    silent = []
    for module, path in sources.items():
        for node in ast.walk(ast.parse(path.read_text())):
            if (
                isinstance(node, ast.Call)
                and isinstance(node.func, ast.Attribute)
                and node.func.attr == "load"
                and isinstance(node.func.value, ast.Name)
                and node.func.value.id == "torch"
                and not any(k.arg == "weights_only" for k in node.keywords)
            ):
                silent.append(f"{module}:{node.lineno}")
    assert not silent, f"torch.load without weights_only=: {silent}"


def test_every_step_s_run_function_says_what_it_does():
    """help(run_<step>) in a notebook: the steps are the library's plain functions (one each, steps/<step>.py), and
    run_prepare_dataset, run_finetune and run_sample_images said nothing of their arguments or what they return. One
    that takes a config (ConfigLike) says it takes a dict too (config.as_config): its help said nothing of it."""
    silent, mute_on_dicts = [], []
    for path in sorted((SRC / PACKAGE / "steps").glob("*.py")):
        for node in ast.parse(path.read_text()).body:
            if isinstance(node, ast.FunctionDef) and node.name == f"run_{path.stem}":
                doc = ast.get_docstring(node)
                if not doc:
                    silent.append(f"{path.name}: {node.name}")
                takes_config = any(a.arg == "cfg" and a.annotation is not None and ast.unparse(a.annotation)
                                   == "ConfigLike" for a in node.args.args)
                if takes_config and "as_config" not in (doc or ""):
                    mute_on_dicts.append(node.name)
    assert not silent, f"run_<step>() without a docstring: {silent}"
    assert not mute_on_dicts, f"run_<step>() whose docstring does not say it takes a dict (as_config): {mute_on_dicts}"
