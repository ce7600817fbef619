"""The documentation cannot drift from what it points at: results/README.md is exactly what
`python -m kvledger.tools.results_index` generates, every results/ path the docs name exists, and
every relative link in README.md, ARCHITECTURE.md and docs/*.md resolves (to a file or folder, and
to a heading when it names an anchor in a Markdown file)."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Dict, Iterator, List, Set, Tuple

from kvledger.tools import results_index
from tests.support.paths import ROOT

DOCS = [ROOT / "README.md", ROOT / "ARCHITECTURE.md", *sorted((ROOT / "docs").glob("*.md"))]
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
RESULTS_PATH = re.compile(r"(?<![\w.-])(?:\.\./)?(results/[\w./-]*)")
HEADING = re.compile(r"^(#{1,6})\s+(.*?)\s*#*\s*$")


def prose(path: Path) -> Iterator[Tuple[int, str]]:
    """(line number, line) outside fenced code blocks."""
    fenced = False
    for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        if line.lstrip().startswith("```"):
            fenced = not fenced
            continue
        if not fenced:
            yield number, line


def slug(heading: str, seen: Dict[str, int]) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens, and a
    -1, -2, ... suffix for repeats."""
    base = re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")
    n = seen.get(base, 0)
    seen[base] = n + 1
    return base if n == 0 else f"{base}-{n}"


def anchors(path: Path) -> Set[str]:
    seen: Dict[str, int] = {}
    return {slug(m.group(2), seen) for _, line in prose(path) if (m := HEADING.match(line))}


def test_the_committed_index_is_the_generated_one():
    index = results_index.RESULTS / results_index.INDEX
    assert index.read_text(encoding="utf-8") == results_index.render(), (
        "results/README.md is stale: run python -m kvledger.tools.results_index"
    )
    assert results_index.stale_descriptions() == [], "DESCRIPTIONS names files that are gone"


def test_every_results_path_the_docs_name_exists():
    missing: List[str] = []
    for doc in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
        for number, line in enumerate(doc.read_text(encoding="utf-8").splitlines(), 1):
            for match in RESULTS_PATH.finditer(line):
                rel = match.group(1).rstrip(".,:;")
                if not (ROOT / rel).exists():
                    missing.append(f"{doc.relative_to(ROOT)}:{number}: {rel}")
    assert not missing, "\n".join(missing)


def test_every_relative_link_in_the_docs_resolves():
    broken: List[str] = []
    for doc in DOCS:
        for number, line in prose(doc):
            for target in LINK.findall(line):
                if re.match(r"^[a-z][a-z0-9+.-]*:", target):  # https:, mailto:, ...
                    continue
                path_part, _, anchor = target.partition("#")
                dest = (doc.parent / path_part).resolve() if path_part else doc
                where = f"{doc.relative_to(ROOT)}:{number}: {target}"
                if not dest.exists():
                    broken.append(f"{where} (no such file)")
                elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
                    broken.append(f"{where} (no such heading)")
    assert not broken, "\n".join(broken)


def test_the_checks_see_a_broken_link_and_a_missing_result(tmp_path):
    doc = tmp_path / "page.md"
    doc.write_text(
        "# A title\n\n[ok](#a-title) [gone](nowhere.md) `results/gpu/none.txt`\n```\n[in code](ignored.md)\n```\n"
    )
    links = [t for _, line in prose(doc) for t in LINK.findall(line)]
    assert links == ["#a-title", "nowhere.md"] and "a-title" in anchors(doc)
    assert [m.group(1) for m in RESULTS_PATH.finditer(doc.read_text())] == ["results/gpu/none.txt"]
    assert slug("Split-KV decode: `decode_launch_config` (x.py)", {}) == "split-kv-decode-decode_launch_config-xpy"


def test_the_index_reads_descriptions_from_the_files_and_check_sees_a_stale_one(tmp_path, monkeypatch):
    results = tmp_path / "results"
    (results / "gpu").mkdir(parents=True)
    (results / "gpu" / "run.json").write_text('{"description": "a run | of something", "x": 1}')
    (results / "sweep.txt").write_text("\n# a sweep of things\nrows\n")
    monkeypatch.setattr(results_index, "RESULTS", results)
    monkeypatch.setattr(results_index, "ROOT", tmp_path)
    assert results_index.main(["--check"]) == 1  # no index yet
    assert results_index.main([]) == 0 and results_index.main(["--check"]) == 0
    rows = (results / "README.md").read_text().splitlines()
    assert "| [gpu/run.json](gpu/run.json) | 47 B | a run \\| of something |" in rows
    assert "| [sweep.txt](sweep.txt) | 26 B | a sweep of things |" in rows
    (results / "sweep.txt").write_text("changed\n")
    assert results_index.main(["--check"]) == 1
