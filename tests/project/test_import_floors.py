"""The package's imports form floors: no cycle (between modules, nor between folders), and no module
imports from a floor above its own.

The floors are declared once, in docs/architecture.md ("Import floors"), and read from there. Every
import counts: top-level, inside a function and under ``if TYPE_CHECKING:`` alike, since a lazy import
that closes a circle is still a circle (it only moves the failure to run time).
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = "ppo_cli"
ARCHITECTURE = ROOT / "docs" / "architecture.md"
FLOOR_LINE = re.compile(r"^\s*(\d+)\s+([^:]+):\s+(.+)$")


# --- reading the package and the floors ------------------------------------------------------------


def package_modules(root: Path = ROOT) -> dict[str, Path]:
    """Dotted name relative to the package ('engine.models'; the package itself is PACKAGE) -> file."""
    modules = {}
    for path in sorted((root / PACKAGE).rglob("*.py")):
        parts = list(path.relative_to(root / PACKAGE).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        modules[".".join(parts) or PACKAGE] = path
    return modules


def imports_of(name: str, source: str, modules: set[str]) -> list[tuple[str, int]]:
    """(imported module, line) for every import of the package in ``source``, wherever it sits."""
    is_package = name == PACKAGE or f"{name}.__init__" in modules
    here = [] if name == PACKAGE else name.split(".")
    found = []

    def add(dotted: str, line: int) -> None:
        inside = dotted.removeprefix(PACKAGE).lstrip(".") if dotted.split(".")[0] == PACKAGE else None
        if inside is None:
            return
        while inside and inside not in modules:  # an attribute or a name from a module: its module
            inside = inside.rpartition(".")[0]
        found.append((inside or PACKAGE, line))

    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            for alias in node.names:
                add(alias.name, node.lineno)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = here if is_package else here[:-1]
                base = base[: len(base) - (node.level - 1)]
                target = ".".join([PACKAGE, *base, *([node.module] if node.module else [])])
            else:
                target = node.module or ""
            for alias in node.names:
                add(f"{target}.{alias.name}", node.lineno)
    return [(target, line) for target, line in found if target != name]


def import_graph(root: Path = ROOT) -> dict[str, list[tuple[str, int]]]:
    modules = package_modules(root)
    names = set(modules)
    return {name: imports_of(name, path.read_text(encoding="utf-8"), names) for name, path in modules.items()}


def read_floors(text: str) -> list[tuple[int, str, list[str]]]:
    """(number, label, module patterns) from the "Import floors" section's block, lowest first."""
    section = text.split("## Import floors", 1)[1].split("\n## ", 1)[0]
    block = section.split("```", 2)[1]
    floors = [m.groups() for m in map(FLOOR_LINE.match, block.splitlines()) if m]
    return [(int(number), label.strip(), patterns.split()) for number, label, patterns in floors]


def floor_of(module: str, floors: list[tuple[int, str, list[str]]]) -> tuple[int, str] | None:
    """The floor whose patterns name ``module`` ('x.*' names x and everything under it); a package's
    own __init__ that is not named imports nothing of ours and sits lowest."""
    for number, label, patterns in floors:
        for pattern in patterns:
            if module == pattern or (pattern.endswith(".*") and (module + ".").startswith(pattern[:-1])):
                return number, label
    return None


# --- the checks --------------------------------------------------------------------------------------


def find_cycle(graph: dict[str, list[tuple[str, int]]]) -> list[str] | None:
    """One import cycle as [a, b, ..., a], or None (depth-first search, modules in sorted order)."""
    state: dict[str, str] = {}
    stack: list[str] = []

    def visit(module: str) -> list[str] | None:
        state[module] = "open"
        stack.append(module)
        for target, _ in sorted(graph.get(module, [])):
            if state.get(target) == "open":
                return stack[stack.index(target):] + [target]
            if target not in state and (cycle := visit(target)):
                return cycle
        state[module] = "done"
        stack.pop()
        return None

    for module in sorted(graph):
        if module not in state and (cycle := visit(module)):
            return cycle
    return None


def floor_problems(graph: dict[str, list[tuple[str, int]]], floors) -> list[str]:
    """One line per module without a floor and per import from a higher floor than the importer's."""
    packages = {PACKAGE} | {m.rpartition(".")[0] for m in graph}
    problems = [f"{module} has no floor in docs/architecture.md" for module in sorted(graph)
                if floor_of(module, floors) is None and module not in packages]
    for module in sorted(graph):
        own = floor_of(module, floors) or (0, "")
        for target, line in sorted(graph[module]):
            theirs = floor_of(target, floors) or (0, "")
            if theirs[0] > own[0]:
                problems.append(f"{module} (floor {own[0]} {own[1]}) imports {target} (floor {theirs[0]} "
                                f"{theirs[1]}) at line {line}: an import up the floors")
    return problems


def folder_graph(graph: dict[str, list[tuple[str, int]]]) -> dict[str, list[tuple[str, int]]]:
    """The graph with each folder of the package (engine/, algo/, ...: everything under it, subfolders
    included) made one node, 'engine/'; a module at the package's top stays a node of its own."""
    folders = {m.split(".")[0] for m in graph if "." in m}

    def node(module: str) -> str:
        top = module.split(".")[0]
        return f"{top}/" if top in folders else module

    merged: dict[str, list[tuple[str, int]]] = {}
    for module, targets in graph.items():
        edges = merged.setdefault(node(module), [])
        edges += [(node(target), line) for target, line in targets if node(target) != node(module)]
    return merged


def check(graph, floors) -> list[str]:
    """Cycles between modules, else cycles between folders (a module outside engine/ that engine/
    imports and that imports engine/ back: each import can sit on a floor of its own, yet the folder
    is no longer a layer), then the imports up the floors."""
    cycle = find_cycle(graph)
    if cycle:
        problems = [f"import cycle: {' -> '.join(cycle)}"]
    else:
        folder_cycle = find_cycle(folder_graph(graph))
        problems = [f"import cycle between folders: {' -> '.join(folder_cycle)}"] if folder_cycle else []
    return problems + floor_problems(graph, floors)


# --- the package itself ------------------------------------------------------------------------------


FLOORS = read_floors(ARCHITECTURE.read_text(encoding="utf-8"))


def test_floors_are_declared_lowest_first():
    assert [number for number, _, _ in FLOORS] == list(range(len(FLOORS))) and len(FLOORS) > 5


def test_every_floor_pattern_names_a_module():
    modules = set(package_modules())
    stale = [p for _, _, patterns in FLOORS for p in patterns
             if p not in modules and not (p.endswith(".*") and p[:-2] in modules)]
    assert stale == [], f"docs/architecture.md names modules that do not exist: {stale}"


def test_package_has_no_import_cycle_and_no_import_up_the_floors():
    problems = check(import_graph(), FLOORS)
    assert problems == [], "\n".join(problems)


def test_the_schema_imports_nothing_of_the_engine():
    assert [t for t, _ in import_graph()["recipe"]] == []


# --- the checker, on graphs made up for it ----------------------------------------------------------

SYNTHETIC_FLOORS = [(0, "leaves", ["errors", "algo.*"]), (1, "schema", ["recipe"]), (2, "engine", ["engine.*"])]


def test_check_names_a_cycle_and_an_import_up_the_floors():
    graph = {
        "errors": [],
        "recipe": [("engine.critics", 7)],  # the schema reaching up into the engine
        "engine.critics": [("engine.models", 3)],
        "engine.models": [("engine.critics", 12), ("recipe", 4)],
    }
    assert check(graph, SYNTHETIC_FLOORS) == [
        "import cycle: engine.critics -> engine.models -> engine.critics",
        "recipe (floor 1 schema) imports engine.critics (floor 2 engine) at line 7: an import up the floors",
    ]


def test_check_finds_a_longer_cycle_through_floors_and_an_unplaced_module():
    graph = {"algo.kl": [("errors", 1)], "errors": [("recipe", 2)], "recipe": [("algo.kl", 3)], "stray": [],
             "tools": [], "tools.x": []}  # tools: a package's own __init__, which needs no floor of its own
    assert check(graph, SYNTHETIC_FLOORS) == [
        "import cycle: algo.kl -> errors -> recipe -> algo.kl",
        "stray has no floor in docs/architecture.md",
        "tools.x has no floor in docs/architecture.md",
        "errors (floor 0 leaves) imports recipe (floor 1 schema) at line 2: an import up the floors",
    ]


def test_check_names_a_folder_that_a_module_outside_it_imports_and_is_imported_by():
    # The loop reward_checks.py closed before it moved into engine/rewards/: every import goes down a
    # floor (or stays on one), no module imports itself round, and yet engine/ -> reward_checks -> engine/.
    floors = [(0, "leaves", ["errors"]), (1, "schema", ["recipe"]),
              (2, "rewards", ["engine.reward_types", "reward_checks"]), (3, "engine", ["engine.inference"])]
    graph = {"errors": [], "recipe": [("errors", 1)], "engine.reward_types": [("recipe", 16)],
             "reward_checks": [("engine.reward_types", 11)], "engine.inference": [("reward_checks", 66)]}
    assert check(graph, floors) == ["import cycle between folders: engine/ -> reward_checks -> engine/"]
    graph["engine.reward_checks"] = graph.pop("reward_checks")  # moved inside the folder it serves
    graph["engine.inference"] = [("engine.reward_checks", 66)]
    floors[2] = (2, "rewards", ["engine.reward_types", "engine.reward_checks"])
    assert check(graph, floors) == []


def test_folder_graph_makes_each_folder_one_node_subfolders_included():
    graph = {"recipe": [], "engine.rewards.stack": [("engine.data", 20), ("recipe", 24)], "engine.data": [],
             "commands.train": [("engine.rewards.stack", 3), ("trainer", 4)], "trainer": [("engine.data", 9)]}
    assert folder_graph(graph) == {"recipe": [], "engine/": [("recipe", 24)],
                                   "commands/": [("engine/", 3), ("trainer", 4)], "trainer": [("engine/", 9)]}


def test_check_passes_a_graph_that_only_imports_down():
    graph = {"errors": [], "algo.kl": [], "recipe": [("errors", 1)], "engine.models": [("recipe", 1), ("algo.kl", 2)]}
    assert check(graph, SYNTHETIC_FLOORS) == []


@pytest.mark.parametrize("source, expected", [
    ("from ppo_cli.engine.models import load_tokenizer", [("engine.models", 1)]),
    ("def f():\n    from ppo_cli import plan_memory", [("plan_memory", 2)]),
    ("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from ppo_cli.recipe import Recipe", [("recipe", 3)]),
    ("from .models import freeze", [("engine.models", 1)]),
    ("from ..errors import PpoError", [("errors", 1)]),
    ("import ppo_cli.engine.data as data", [("engine.data", 1)]),
    ("import torch\nfrom pathlib import Path", []),
])
def test_imports_of_sees_every_kind_of_import(source, expected):
    modules = {"engine.critics", "engine.models", "engine.data", "plan_memory", "recipe", "errors", PACKAGE}
    assert imports_of("engine.critics", source, modules) == expected
