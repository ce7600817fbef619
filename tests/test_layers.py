"""The layers import downward only: product code (reference, fast, engine) never imports the
harness, the tools or the benchmarks, and nothing imports the old top-level package names."""

from __future__ import annotations

import ast
from pathlib import Path
from typing import Dict, Iterator, Set, Tuple

import pytest

ROOT = Path(__file__).resolve().parents[1]
# layer -> its folder in the repository
# (cli: kvledger/__main__.py, kvledger/__init__.py and the kvledger/cli package)
FOLDERS = {
    "reference": "reference",
    "fast": "fast",
    "engine": "engine",
    "properties": "properties",
    "subjects": "kvledger/subjects",
    "campaign": "kvledger/campaign",
    "checker": "kvledger/checker",
    "tools": "kvledger/tools",
    "bench": "kvledger/bench",
    "cli": "kvledger",
}
# layer -> the layers it may import (itself always); ARCHITECTURE.md gives the reason for each floor
ALLOWED: Dict[str, Set[str]] = {
    "reference": set(),
    "fast": {"reference"},
    "engine": {"reference", "fast"},
    # the checker's core: the subject protocol, its judge, the drivers, lockstep, the machines
    "properties": {"reference", "fast", "engine"},
    # the adapters of cache managers under test: on the protocol (properties/subject.py)
    "subjects": {"reference", "fast", "engine", "properties"},
    # campaigns run tasks by import path: the generic layer under the checker, which defines the tasks
    "campaign": set(),
    # the checker's commands (check, fuzz, minimize, replay, show, explore, zoo) and its audit
    "checker": {"reference", "fast", "engine", "properties", "subjects", "campaign"},
    # the engine's tools (the HTTP fuzzer, the results index) and benchmarks: on the product only
    "tools": {"reference", "fast", "engine"},
    "bench": {"reference", "fast", "engine"},
    "cli": {"reference", "fast", "engine", "properties", "subjects", "campaign", "checker", "tools", "bench"},
}
OLD_NAMES = ("engine", "fast", "reference", "properties")


def layer_of_module(name: str) -> str | None:
    parts = name.split(".")
    if parts[0] != "kvledger":
        return None
    if len(parts) == 1 or parts[1] == "__version__":
        return None  # the package root holds only the version
    if parts[1] in ("cli", "__main__"):
        return "cli"
    return parts[1] if parts[1] in FOLDERS else "cli"


def imports(path: Path) -> Iterator[Tuple[int, str]]:
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield node.lineno, alias.name
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            if node.module == "kvledger":  # `from kvledger import fast`: the subpackage is what counts
                for alias in node.names:
                    yield node.lineno, f"kvledger.{alias.name}"
            else:
                yield node.lineno, node.module


def files_of(layer: str) -> list[Path]:
    folder = ROOT / FOLDERS[layer]
    found = sorted(folder.rglob("*.py"))
    if layer == "cli":  # the kvledger folder itself and its cli package, without tools, bench and subjects
        found = [p for p in found if p.parent == folder or folder / "cli" in p.parents]
    return found


@pytest.mark.parametrize("layer", sorted(FOLDERS))
def test_each_layer_imports_only_the_layers_below_it(layer):
    bad = []
    for path in files_of(layer):
        for line, module in imports(path):
            target = layer_of_module(module)
            if target is not None and target != layer and target not in ALLOWED[layer]:
                bad.append(f"{path.relative_to(ROOT)}:{line} imports {module} ({layer} -> {target})")
    assert not bad, "\n".join(bad)


def test_no_file_imports_the_old_top_level_names():
    bad = []
    for path in sorted(ROOT.rglob("*.py")):
        if any(part.startswith(".") or part in ("build",) for part in path.relative_to(ROOT).parts):
            continue
        for line, module in imports(path):
            if module.split(".")[0] in OLD_NAMES:
                bad.append(f"{path.relative_to(ROOT)}:{line} imports {module}")
    assert not bad, "\n".join(bad)


def test_the_checker_sees_a_forbidden_import(tmp_path):
    bad = tmp_path / "m.py"
    bad.write_text("from kvledger.properties.lockstep import compare\nimport fast\n")
    found = [m for _, m in imports(bad)]
    assert layer_of_module(found[0]) == "properties" and "properties" not in ALLOWED["engine"]
    assert found[1].split(".")[0] in OLD_NAMES


def test_the_cli_layer_is_the_kvledger_folder_and_its_cli_package():
    names = {p.relative_to(ROOT).as_posix() for p in files_of("cli")}
    assert {"kvledger/__main__.py", "kvledger/cli/__init__.py", "kvledger/cli/bench.py"} <= names
    assert not any(
        n.startswith(("kvledger/tools/", "kvledger/bench/", "kvledger/subjects/", "kvledger/checker/")) for n in names
    )


# -- inside engine/: what each sub-package may import of the others (docs: ARCHITECTURE.md) --------
# The ledger is the verified core: it imports nothing else of the engine. The model imports the
# attention interface and the tensor-parallel collectives it computes with; attention reads only
# the KV pool's layout. The runtime builds on all of those; the server only on the runtime (and the
# ledger's error types). `distributed` holds both the collectives (group, partition: below the
# model) and the rank orchestration (above the runtime: rank 0's engine subclasses `Engine`).
ENGINE_PARTS: Dict[str, Set[str]] = {
    "ledger": set(),
    "attention": {"model.kv_pool"},
    "model": {"attention", "distributed.group", "distributed.partition"},
    "runtime": {"ledger", "model", "attention", "distributed", "engine_config", "options"},
    "server": {"runtime", "ledger", "engine_config"},
    "distributed": {"ledger", "model", "runtime"},
    "engine_config": {"ledger", "options"},
    "options": {"model", "distributed", "engine_config", "runtime.faults"},  # faults: the --inject-fault grammar
}


def engine_part(module: str) -> str | None:
    parts = module.split(".")
    return parts[2] if parts[:2] == ["kvledger", "engine"] and len(parts) > 2 else None


def engine_imports(path: Path) -> Iterator[Tuple[int, str]]:
    """Like imports(), with `from kvledger.engine.x import y` also yielding x.y (y may be a module)."""
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            yield node.lineno, node.module
            yield from ((node.lineno, f"{node.module}.{a.name}") for a in node.names)
        elif isinstance(node, ast.Import):
            yield from ((node.lineno, a.name) for a in node.names)


def _allowed(source: str, module: str) -> bool:
    target = module.split(".")[2:]
    for rule in ENGINE_PARTS[source]:
        head = rule.split(".")
        if target[: len(head)] == head:
            return True
    return False


def test_each_engine_part_imports_only_what_it_builds_on():
    bad = []
    for path in sorted((ROOT / "engine").rglob("*.py")):
        rel = path.relative_to(ROOT / "engine").parts
        source = rel[0] if len(rel) > 1 else rel[0].removesuffix(".py")
        if source == "__init__":
            continue
        for line, module in engine_imports(path):
            target = engine_part(module)
            if target is None or target == source or target not in ENGINE_PARTS:
                continue
            if not _allowed(source, module):
                bad.append(f"{path.relative_to(ROOT)}:{line} imports {module} ({source} -> {target})")
    assert not bad, "\n".join(sorted(set(bad)))


def test_the_engine_rule_catches_a_forbidden_import():
    assert not _allowed("ledger", "kvledger.engine.runtime.engine")
    assert not _allowed("attention", "kvledger.engine.model.model")
    assert _allowed("attention", "kvledger.engine.model.kv_pool")
    assert not _allowed("server", "kvledger.engine.model.weights")


def test_nothing_outside_the_ledger_reads_its_managers():
    """The engine, the server, the benchmarks and the CLI ask the ledger (CacheScheduler's methods
    at the end of the class); only the ledger itself and the harness reach its managers."""
    import re

    managers = re.compile(r"\bcache_scheduler\.(cm|dm|tm|policy|preemptor)\b")
    bad = []
    for folder in ("engine/runtime", "engine/server", "engine/distributed", "kvledger/bench", "kvledger/cli"):
        for path in sorted((ROOT / folder).rglob("*.py")):
            for n, text in enumerate(path.read_text().splitlines(), 1):
                if managers.search(text):
                    bad.append(f"{path.relative_to(ROOT)}:{n}: {text.strip()}")
    assert not bad, "\n".join(bad)


def test_only_the_ray_executor_imports_ray():
    """The cluster is a dependency of campaigns alone (the `cluster` extra)."""
    bad = []
    for layer in FOLDERS:
        for path in files_of(layer):
            for line, module in imports(path):
                if module.split(".")[0] == "ray" and path != ROOT / "kvledger/campaign/ray_executor.py":
                    bad.append(f"{path.relative_to(ROOT)}:{line} imports {module}")
    assert not bad, "\n".join(bad)


# -- no cycles: between files, and between the packages (folders) of the checker and the engine ------
def module_of(path: Path) -> str:
    """The dotted module a source file installs as (setuptools' package-dir in pyproject.toml)."""
    rel = path.relative_to(ROOT).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts if parts[0] == "kvledger" else ["kvledger", *parts])


def runtime_imports(path: Path) -> Iterator[Tuple[int, str]]:
    """engine_imports() less those under `if TYPE_CHECKING:`, which never run (annotations only)."""
    tree = ast.parse(path.read_text(), str(path))
    typing_only = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            typing_only |= {id(n) for stmt in node.body for n in ast.walk(stmt)}
    for node in ast.walk(tree):
        if id(node) in typing_only:
            continue
        if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            yield node.lineno, node.module
            yield from ((node.lineno, f"{node.module}.{a.name}") for a in node.names)  # a.name may be a module
        elif isinstance(node, ast.Import):
            yield from ((node.lineno, a.name) for a in node.names)


def import_graph() -> Dict[str, Set[str]]:
    """module -> the kvledger modules it imports (at any depth of the file, so lazy imports count)."""
    paths = [p for layer in FOLDERS for p in files_of(layer)]
    known = {module_of(p): p for p in paths}
    graph: Dict[str, Set[str]] = {}
    for name, path in known.items():
        targets = set()
        for _, module in runtime_imports(path):
            while module and module not in known:
                module = module.rpartition(".")[0]
            if module and module != name and module.startswith("kvledger."):
                targets.add(module)
        graph[name] = targets
    return graph


def cycles(graph: Dict[str, Set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one node (Tarjan's algorithm)."""
    index: Dict[str, int] = {}
    low: Dict[str, int] = {}
    stack: list[str] = []
    on_stack: Set[str] = set()
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for nxt in sorted(graph.get(node, ())):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = []
            while True:
                top = stack.pop()
                on_stack.discard(top)
                component.append(top)
                if top == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def package_of(module: str) -> str:
    return module.rpartition(".")[0] if module.count(".") > 1 else module


def test_no_file_imports_itself_through_others():
    found = cycles(import_graph())
    assert not found, "import cycles between files:\n" + "\n".join(map(str, found))


def test_no_two_layers_import_each_other():
    """ALLOWED is a partial order: no layer reaches back to one that may import it, in any number of steps."""
    reach = {layer: set(ALLOWED[layer]) for layer in ALLOWED}
    for _ in ALLOWED:
        for layer in reach:
            reach[layer] |= {far for near in reach[layer] for far in reach[near]}
    assert not [layer for layer in reach if layer in reach[layer]]


# the engine's sub-packages have their own rules (ENGINE_PARTS: `distributed` on both sides of `model`)
def test_no_two_packages_of_the_checker_import_each_other():
    graph = {m: ts for m, ts in import_graph().items() if not m.startswith("kvledger.engine.")}
    ties = set()
    for source, targets in graph.items():
        for target in targets:
            a, b = package_of(source), package_of(target)
            if a != b and not a.startswith(b + ".") and not b.startswith(a + "."):
                if any(package_of(t) == a for s, ts in graph.items() if package_of(s) == b for t in ts):
                    ties.add(tuple(sorted((a, b))))
    assert not ties, "packages that import each other: " + ", ".join(f"{a} <-> {b}" for a, b in sorted(ties))


def test_the_cycle_finder_sees_a_cycle():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": set()}) == []
