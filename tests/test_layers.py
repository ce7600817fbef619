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
    "tools": "kvledger/tools",
    "bench": "kvledger/bench",
    "cli": "kvledger",
}
# layer -> the layers it may import (itself always)
ALLOWED: Dict[str, Set[str]] = {
    "reference": set(),
    "fast": {"reference"},
    "engine": {"reference", "fast"},
    "properties": {"reference", "fast", "engine"},
    # the adapters of cache managers under test: on the protocol (engine/ledger/subject.py), beside the harness
    "subjects": {"reference", "fast", "engine"},
    "tools": {"reference", "fast", "engine", "properties", "subjects"},
    "bench": {"reference", "fast", "engine", "properties", "subjects", "tools"},
    "cli": {"reference", "fast", "engine", "properties", "subjects", "tools", "bench"},
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
    assert not any(n.startswith(("kvledger/tools/", "kvledger/bench/", "kvledger/subjects/")) for n in names)
