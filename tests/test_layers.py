"""The house rules of nsa_jax/ and launch/: imports go down the layers only, no import cycles, short modules.

LAYERS is the order README.md's "Start here" gives, lowest first: a module may import
from its own layer and the layers below it, never from one above. It is the order of
dependencies, so the model sits above the kernels it calls (the README's "one training
step's path" lists them the other way round, in the order a batch meets them).
"""

from __future__ import annotations

import ast
import pathlib

import pytest

from nsa_jax.words import count

ROOT = pathlib.Path(__file__).resolve().parent.parent

# (layer, module prefixes), lowest first; a module belongs to the layer of its longest matching prefix.
LAYERS = (
    (
        "config",
        (
            "nsa_jax",
            "nsa_jax.config",
            "nsa_jax.config_checks",
            "nsa_jax.mesh",
            "nsa_jax.config_text",
            "nsa_jax.runbook_env",
            "nsa_jax.seq_layout",
            "nsa_jax.progress_text",
            "nsa_jax.agreement",
            "nsa_jax.words",
        ),
    ),
    ("data", ("nsa_jax.data",)),
    ("kernels", ("nsa_jax.kernels",)),
    ("model", ("nsa_jax.layers", "nsa_jax.nsa", "nsa_jax.model", "nsa_jax.info")),
    ("pretrained", ("nsa_jax.pretrained",)),
    ("train step", ("nsa_jax.step",)),
    ("run directory", ("nsa_jax.rundir",)),
    ("operations", ("nsa_jax.ops",)),
    ("inference", ("nsa_jax.inference",)),
    ("evaluation", ("nsa_jax.evaluation",)),
    ("loop", ("nsa_jax.train",)),
    ("report", ("nsa_jax.report",)),
    ("tools", ("nsa_jax.tools",)),
    ("launch", ("launch",)),
)
# Harness (README "Start here"): of launch/ only launch.info imports nsa_jax.tools (--target).
TOOLS_IMPORTERS = ("launch.info",)
# Upward imports known and being moved, each with its reason; the list shrinks, it never grows.
KNOWN_UPWARD: set[tuple[str, str]] = set()
# No module outside the kernels passes this many lines: a longer one holds more than one concern.
MAX_LINES = 600
LONG_ALLOWED = ("nsa_jax/kernels/",)  # a kernel and its tiling belong together (README "kernels")


def _module_name(path: pathlib.Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _modules() -> dict[str, pathlib.Path]:
    return {_module_name(p): p for d in ("nsa_jax", "launch") for p in sorted((ROOT / d).rglob("*.py"))}


def import_graph() -> dict[str, set[str]]:
    """module -> the project modules it imports anywhere in its file (function-level imports included)."""
    mods = _modules()
    graph = {}
    for name, path in mods.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        targets = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                targets.update(a.name for a in node.names)
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:  # relative: from the package, up level - 1
                    up = package.split(".")[: len(package.split(".")) - node.level + 1]
                    base = ".".join(up + ([base] if base else []))
                # `from pkg import module` names a module; `from module import name` its module
                targets.update(f"{base}.{a.name}" if f"{base}.{a.name}" in mods else base for a in node.names)
        resolved = set()
        for target in targets:
            while target and target not in mods:
                target = target.rpartition(".")[0]
            if target and target != name:
                resolved.add(target)
        graph[name] = resolved
    return graph


def layer_of(module: str) -> int:
    """The index in LAYERS of `module`'s layer; KeyError for a module no layer names."""
    best = None
    for i, (_, prefixes) in enumerate(LAYERS):
        for prefix in prefixes:
            if module == prefix or module.startswith(prefix + "."):
                if best is None or len(prefix) > best[1]:
                    best = (i, len(prefix))
    if best is None:
        raise KeyError(module)
    return best[0]


def upward_imports(graph: dict[str, set[str]]) -> list[str]:
    """Every import of a module from a layer above its own, as `a (layer) -> b (layer)`."""
    out = []
    for module, targets in sorted(graph.items()):
        for target in sorted(targets):
            if layer_of(target) > layer_of(module) and (module, target) not in KNOWN_UPWARD:
                out.append(f"{module} ({LAYERS[layer_of(module)][0]}) -> {target} ({LAYERS[layer_of(target)][0]})")
    return out


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan)."""
    index, low, stack, on_stack, out = {}, {}, [], set(), []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph.get(v, ())):
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
                out.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def test_every_module_has_a_layer():
    unplaced = []
    for module in _modules():
        try:
            layer_of(module)
        except KeyError:
            unplaced.append(module)
    assert not unplaced, f"modules in no layer: {unplaced}; add them to LAYERS in tests/test_layers.py"


def test_imports_go_down_the_layers_only():
    found = upward_imports(import_graph())
    assert not found, "imports from a layer above (README 'Start here'; move the shared code down):\n" + "\n".join(
        found
    )


def test_the_known_upward_imports_still_exist():
    # A known one that is gone leaves the list: the list never hides a new one under an old name.
    graph = import_graph()
    gone = [pair for pair in sorted(KNOWN_UPWARD) if pair[1] not in graph.get(pair[0], set())]
    assert not gone, f"remove from KNOWN_UPWARD, they no longer import upward: {gone}"


def test_only_launch_info_imports_the_tools():
    graph = import_graph()
    importers = sorted(
        m for m, targets in graph.items() if any(layer_of(t) == layer_of("nsa_jax.tools") for t in targets)
    )
    assert set(importers) <= {*TOOLS_IMPORTERS, *(m for m in importers if m.startswith("nsa_jax.tools"))}, importers


def test_no_import_cycles():
    found = cycles(import_graph())
    assert not found, f"modules that import each other, directly or around a loop: {found}"


def test_the_rules_catch_what_they_are_for():
    # An upward import and a cycle, made up: the checks above would say them.
    graph = {"nsa_jax.rundir.checkpoint": {"nsa_jax.ops.health"}, "nsa_jax.ops.health": {"nsa_jax.rundir.checkpoint"}}
    assert upward_imports(graph) == ["nsa_jax.rundir.checkpoint (run directory) -> nsa_jax.ops.health (operations)"]
    assert cycles(graph) == [["nsa_jax.ops.health", "nsa_jax.rundir.checkpoint"]]
    assert too_long({"nsa_jax/report/criteria.py": MAX_LINES + 1, "nsa_jax/kernels/x.py": 900}) == [
        f"nsa_jax/report/criteria.py: {MAX_LINES + 1} lines"
    ]


def too_long(lines: dict[str, int]) -> list[str]:
    """The modules (path: line count) over MAX_LINES outside LONG_ALLOWED."""
    return [
        f"{path}: {n} lines" for path, n in sorted(lines.items()) if n > MAX_LINES and not path.startswith(LONG_ALLOWED)
    ]


@pytest.mark.parametrize("tree", ["nsa_jax", "launch"])
def test_no_module_outside_the_kernels_passes_600_lines(tree):
    lines = {str(p.relative_to(ROOT)): len(p.read_text().splitlines()) for p in sorted((ROOT / tree).rglob("*.py"))}
    found = too_long(lines)
    assert not found, f"split these along their concerns (at most {MAX_LINES} lines a module): {found}"


MAX_FUNCTION_LINES = 100


def long_functions(path: pathlib.Path, root: pathlib.Path = ROOT, limit: int = MAX_FUNCTION_LINES) -> list[str]:
    """The functions and methods of `path` longer than `limit` lines (decorators excluded, docstring in)."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        n = node.end_lineno - node.lineno + 1 if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) else 0
        if n > limit:
            found.append(f"{path.relative_to(root)}:{node.lineno} {node.name} ({n})")
    return found


@pytest.mark.parametrize("tree", ["nsa_jax", "launch"])
def test_no_function_passes_100_lines(tree):
    found = [f for p in sorted((ROOT / tree).rglob("*.py")) for f in long_functions(p)]
    assert not found, f"split these (at most {MAX_FUNCTION_LINES} lines a function): {found}"


def test_the_function_rule_catches_a_long_one(tmp_path):
    body = "\n".join(f"    x{i} = {i}" for i in range(MAX_FUNCTION_LINES))
    (tmp_path / "m.py").write_text(f"def short():\n    return 1\n\n\ndef long():\n{body}\n")
    assert long_functions(tmp_path / "m.py", tmp_path) == [f"m.py:5 long ({MAX_FUNCTION_LINES + 1})"]


def test_counts_are_said_in_the_singular_for_one():
    assert count(1, "step") == "1 step" and count(0, "step") == "0 steps" and count(1234, "row") == "1,234 rows"
    assert count(1, "process", "processes") == "1 process" and count(2, "process", "processes") == "2 processes"
