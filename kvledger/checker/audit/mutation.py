"""`kvledger mutation` (`make mutation`): the mutation score of the cache logic, measured with
cosmic-ray over fast/, reference/ and engine/ledger/cache_scheduler.py (properties/mutation.toml).

Why cosmic-ray, not mutmut: mutmut 3 copies the project into mutants/ and finds the mutated code
through sys.path, but kvledger's folders install as kvledger.fast, kvledger.reference, ... through
setuptools' package-dir mapping (an editable finder pointing at the checkout), so the copies would
never be imported; it also runs only pytest. cosmic-ray lists mutants per file with a stable
description (file, position, operator, occurrence) in a session database, applies one to a file on
disk, and lets any command decide the outcome, which is what the kill stages here need.

How a run goes:

1. `cosmic-ray init`'s work (`cosmic_ray.commands.init`) lists every mutant of the configured files
   into a session database (.kvledger/mutation/session.sqlite), narrowed by `--only`/`--limit`.
2. Mutants recorded in the equivalents file (properties/mutation-equivalents.txt: file:line,
   operator, the mutated line, and why it cannot change behaviour) are marked skipped; entries that
   match no mutant are reported as stale.
3. N workers, each in its own copy of the tree (.kvledger/mutation/tree-N: mutating files in place
   never touches the checkout), apply one mutant at a time with cosmic-ray's `use_mutation`, then
   fork: the child imports kvledger from that copy (a meta-path finder maps the package-dir layout
   onto it) and runs the kill stages; torch, Hypothesis and pytest are imported once, before the
   fork, so a mutant costs its stages, not an interpreter start. The first stage that fails kills
   the mutant; one that passes every stage survives; a child still running after the timeout is
   killed and counted as a timeout (a hang), apart from the others.
4. Results go back into the session database as cosmic-ray WorkResults (`cr-report` reads it);
   the per-file table and the score are printed, and with `--results DIR` written there.

The kill stages (properties/mutation.toml): `fuzz`, seeded random walks of `kvledger fuzz`
(reference and fast in lockstep, cases derived from the seed alone); `pytest`, a few fast targeted
test files; `hypothesis`, the lockstep state machine, derandomized, without shrinking.
`python kvledger/checker/audit/mutation.py kill` runs them in a fresh interpreter from the tree it lies
in: the config's test-command, for plain `cosmic-ray exec` in a scratch clone.

Score = (killed + timeout) / (killed + timeout + survived): reviewed equivalents are left out.
"""

from __future__ import annotations

import argparse
import difflib
import io
import json
import os
import queue
import re
import select
import shutil
import signal
import subprocess
import sys
import threading
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Dict, Iterable, List, Optional, Sequence, Tuple

ROOT = Path(__file__).resolve().parents[3]  # kvledger/checker/audit/ -> the repository
DEFAULT_CONFIG = "properties/mutation.toml"
WORK_DIR = ".kvledger/mutation"
# what a copy of the tree needs: the packages (under their folders) and the tests the stages run
TREE_PARTS = ("pyproject.toml", "kvledger", "fast", "reference", "engine", "properties", "tests")
STAGES = ("fuzz", "pytest", "hypothesis")
TIMEOUT_OUTPUT = "timeout"  # cosmic-ray's own output for a test run past its timeout


def _toml(path: Path) -> Dict[str, Any]:
    import tomllib

    return tomllib.loads(path.read_text())


# -- importing kvledger from a given tree ------------------------------------------------------
def package_dirs(root: Path) -> Dict[str, Path]:
    """kvledger's package -> folder mapping (pyproject's [tool.setuptools.package-dir])."""
    mapping = _toml(root / "pyproject.toml")["tool"]["setuptools"]["package-dir"]
    return {name: (root / folder).resolve() for name, folder in mapping.items()}


class _TreeFinder:
    """A meta-path finder that imports the mapped packages from one tree (ahead of the editable
    install's finder, which points at the checkout)."""

    def __init__(self, mapping: Dict[str, Path]) -> None:
        self.mapping = mapping

    def find_spec(self, fullname: str, path: Any = None, target: Any = None) -> Any:
        folder = self.mapping.get(fullname)
        if folder is None:
            return None
        from importlib.util import spec_from_file_location

        return spec_from_file_location(fullname, folder / "__init__.py", submodule_search_locations=[str(folder)])


def use_tree(root: Path) -> None:
    """Import `kvledger` and its subpackages from `root` from now on (call before importing them)."""
    root = root.resolve()
    loaded = [name for name in sys.modules if name == "kvledger" or name.startswith("kvledger.")]
    if loaded:
        raise RuntimeError(f"use_tree: kvledger already imported ({', '.join(sorted(loaded)[:3])}, ...)")
    script_dir = str(Path(__file__).resolve().parent)
    sys.path[:] = [p for p in sys.path if p != script_dir]  # `python .../mutation.py` puts its folder first
    sys.path.insert(0, str(root))  # the tests import `tests.support`
    sys.meta_path.insert(0, _TreeFinder(package_dirs(root)))


# -- configuration -----------------------------------------------------------------------------
@dataclass
class Config:
    path: Path
    cosmic_ray: Dict[str, Any]
    stages: List[str]
    equivalents: Path
    min_score: float
    fuzz_seed: int
    fuzz_cases: int
    hypothesis_examples: int
    hypothesis_steps: int
    pytest: List[str]

    @property
    def timeout(self) -> float:
        return float(self.cosmic_ray["timeout"])

    @property
    def module_paths(self) -> List[str]:
        paths = self.cosmic_ray["module-path"]
        return [paths] if isinstance(paths, str) else list(paths)

    def to_json(self) -> Dict[str, Any]:
        return {
            "stages": self.stages,
            "fuzz_seed": self.fuzz_seed,
            "fuzz_cases": self.fuzz_cases,
            "hypothesis_examples": self.hypothesis_examples,
            "hypothesis_steps": self.hypothesis_steps,
            "pytest": self.pytest,
        }


def load_config(path: str | Path, root: Path = ROOT) -> Config:
    path = Path(path)
    if not path.is_absolute():
        path = root / path
    data = _toml(path)
    own = data.get("kvledger-mutation", {})
    stages = list(own.get("stages", STAGES))
    unknown = [s for s in stages if s not in STAGES]
    if unknown:
        raise ValueError(f"{path}: unknown stages {unknown} (known: {', '.join(STAGES)})")
    equivalents = Path(own.get("equivalents", "properties/mutation-equivalents.txt"))
    return Config(
        path=path,
        cosmic_ray=data["cosmic-ray"],
        stages=stages,
        equivalents=equivalents if equivalents.is_absolute() else root / equivalents,
        min_score=float(own.get("min-score", 0.95)),
        fuzz_seed=int(own.get("fuzz-seed", 0)),
        fuzz_cases=int(own.get("fuzz-cases", 20)),
        hypothesis_examples=int(own.get("hypothesis-examples", 150)),
        hypothesis_steps=int(own.get("hypothesis-steps", 60)),
        pytest=list(own.get("pytest", [])),
    )


# -- the kill stages (run with kvledger imported from the tree under test) -----------------------
def _stage_fuzz(spec: Dict[str, Any]) -> None:
    from kvledger.checker.lockstep_walk import case_seed, make_case, walk
    from kvledger.properties.lockstep import Lockstep

    for case in range(spec["fuzz_cases"]):
        seed = case_seed(spec["fuzz_seed"], 0, case)
        lock = Lockstep(make_case(seed).header)
        try:
            for _ in walk(seed, lock, lambda name: None, lambda: True):
                pass
        except BaseException as e:
            raise AssertionError(
                f"fuzz case {case} (seed {spec['fuzz_seed']}), step {lock.step}: {type(e).__name__}: {e}"
            ) from e


def _stage_pytest(spec: Dict[str, Any]) -> None:
    import pytest

    if not spec["pytest"]:
        return
    code = pytest.main(["-x", "-q", "--no-header", "-p", "no:cacheprovider", "-o", "addopts=", *spec["pytest"]])
    if code != 0:
        raise AssertionError(f"pytest exited {int(code)}")


def _stage_hypothesis(spec: Dict[str, Any]) -> None:
    from hypothesis import HealthCheck, Phase, settings
    from hypothesis.stateful import run_state_machine_as_test

    from kvledger.properties.machine import LockstepMachine

    chosen = settings(
        max_examples=spec["hypothesis_examples"],
        stateful_step_count=spec["hypothesis_steps"],
        derandomize=True,
        deadline=None,
        database=None,
        print_blob=False,
        phases=[Phase.explicit, Phase.generate],
        suppress_health_check=list(HealthCheck),
    )
    run_state_machine_as_test(LockstepMachine, settings=chosen)


_STAGE_FUNCS = {"fuzz": _stage_fuzz, "pytest": _stage_pytest, "hypothesis": _stage_hypothesis}


def run_stages(spec: Dict[str, Any], times: Optional[Dict[str, float]] = None) -> Tuple[Optional[str], str]:
    """Run the stages in order: (None, "") if all pass, else (the failing stage, what failed).
    `times` gets each stage's seconds."""
    for stage in spec["stages"]:
        started = time.perf_counter()
        try:
            _STAGE_FUNCS[stage](spec)
        except BaseException as e:  # anything at all: a mutant may raise what it likes
            detail = "".join(traceback.format_exception_only(type(e), e)).strip()
            return stage, detail[-2000:]
        finally:
            if times is not None:
                times[stage] = time.perf_counter() - started
    return None, ""


# -- a worker: one tree, mutants applied in place there, stages in forked children ---------------
def _preimport() -> None:
    """What every child needs and no mutant changes: imported once, before the forks."""
    import hypothesis  # noqa: F401
    import hypothesis.stateful  # noqa: F401
    import numpy  # noqa: F401
    import pytest  # noqa: F401
    import torch

    torch.set_num_threads(1)
    import cosmic_ray.mutating  # noqa: F401
    import cosmic_ray.plugins  # noqa: F401


def _child(spec: Dict[str, Any], log_path: Path, write_fd: int) -> None:
    payload: Dict[str, Any]
    try:
        fd = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.dup2(fd, 1)
        os.dup2(fd, 2)
        sys.stdout = io.TextIOWrapper(os.fdopen(1, "wb", buffering=0), write_through=True)
        sys.stderr = sys.stdout
        started = time.perf_counter()
        times: Dict[str, float] = {}
        stage, detail = run_stages(spec, times)
        payload = {"killed_by": stage, "detail": detail, "seconds": time.perf_counter() - started, "stages": times}
    except BaseException as e:
        payload = {"killed_by": "child", "detail": repr(e)[-2000:], "seconds": 0.0}
    try:
        os.write(write_fd, json.dumps(payload).encode())
    finally:
        os._exit(0)


def run_forked(spec: Dict[str, Any], timeout: float, log_path: Path) -> Dict[str, Any]:
    """The stages in a forked child: {"killed_by": stage or None, "detail", "seconds"}, or
    {"timeout": True} if the child was still running after `timeout` seconds."""
    read_fd, write_fd = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child never returns
        os.close(read_fd)
        os.setpgid(0, 0)
        _child(spec, log_path, write_fd)
    os.close(write_fd)
    chunks: List[bytes] = []
    deadline = time.monotonic() + timeout
    timed_out = False
    with os.fdopen(read_fd, "rb", buffering=0) as pipe:
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                timed_out = True
                break
            ready, _, _ = select.select([pipe], [], [], left)
            if ready:
                data = pipe.read(65536)
                if not data:
                    break
                chunks.append(data)
    if timed_out:
        for kill in (lambda: os.killpg(pid, signal.SIGKILL), lambda: os.kill(pid, signal.SIGKILL)):
            try:
                kill()
            except OSError:
                pass
    _, status = os.waitpid(pid, 0)
    if timed_out:
        return {"timeout": True, "seconds": timeout}
    try:
        return json.loads(b"".join(chunks).decode())
    except ValueError:
        return {
            "killed_by": "child",
            "detail": f"the child died without a result (wait status {status})",
            "seconds": 0.0,
        }


def _mutate_and_run(job: Dict[str, Any], spec: Dict[str, Any], timeout: float, log_path: Path) -> Dict[str, Any]:
    import cosmic_ray.plugins
    from cosmic_ray.mutating import use_mutation

    operator = cosmic_ray.plugins.get_operator(job["operator"])(**job.get("operator_args", {}))
    with use_mutation(Path(job["module_path"]), operator, job["occurrence"]) as (original, mutated):
        if mutated is None:
            return {"no_test": True}
        result = run_forked(spec, timeout, log_path)
    result["diff"] = "".join(
        difflib.unified_diff(
            original.splitlines(keepends=True),
            mutated.splitlines(keepends=True),
            f"a/{job['module_path']}",
            f"b/{job['module_path']}",
        )
    )
    return result


def worker_main(spec_path: str) -> int:
    """`mutation.py worker SPEC`: in the current directory (a copy of the tree), read jobs (JSON
    lines) from stdin and answer each with one JSON line on stdout."""
    sys.dont_write_bytecode = True  # a mutant and the original may share a size and an mtime second
    os.environ["PYTHONDONTWRITEBYTECODE"] = "1"
    root = Path.cwd()
    use_tree(root)
    spec = json.loads(Path(spec_path).read_text())
    os.environ["KVLEDGER_FAILURES"] = str(root / ".failures")
    out = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)  # stray prints go to stderr, never into the answers
    _preimport()
    log_path = root / ".mutant.log"
    for line in sys.stdin:
        job = json.loads(line)
        try:
            if job.get("baseline"):
                result = run_forked(spec, job["timeout"], log_path)
            else:
                result = _mutate_and_run(job, spec, job["timeout"], log_path)
        except Exception:  # the machinery, not a mutant: reported as such
            result = {"error": traceback.format_exc()[-4000:]}
        out.write(json.dumps(result) + "\n")
    return 0


def kill_main(config: str) -> int:
    """`mutation.py kill`: the stages once, in this interpreter, on the tree this file lies in
    (the config's test-command for plain `cosmic-ray exec`). Exit 0: every stage passed."""
    sys.dont_write_bytecode = True
    root = ROOT
    cfg = load_config(config, root)
    use_tree(root)
    os.environ.setdefault("KVLEDGER_FAILURES", str(root / ".kvledger" / "mutation-failures"))
    stage, detail = run_stages(cfg.to_json())
    if stage is None:
        print("every stage passed: the mutant survives")
        return 0
    print(f"killed by {stage}: {detail}")
    return 1


# -- mutants, descriptions and the equivalents file --------------------------------------------
@dataclass(frozen=True)
class Mutant:
    job_id: str
    path: str
    line: int
    col: int
    operator: str
    occurrence: int
    function: Optional[str]

    @property
    def sort_key(self) -> Tuple:
        return (self.path, self.line, self.col, self.operator, self.occurrence)


def describe(root: Path, mutants: Iterable[Mutant]) -> Dict[str, Tuple[str, str]]:
    """job_id -> (original line, mutated line), both stripped: what the mutant changes (a removed
    line, for RemoveDecorator, reads "(removed)")."""
    import cosmic_ray.plugins
    from cosmic_ray.mutating import mutate_code

    sources: Dict[str, str] = {}
    out: Dict[str, Tuple[str, str]] = {}
    for m in mutants:
        if m.path not in sources:
            sources[m.path] = (root / m.path).read_text()
        source = sources[m.path]
        mutated = mutate_code(source, cosmic_ray.plugins.get_operator(m.operator)(), m.occurrence)
        if mutated is None:
            out[m.job_id] = ("", "(no mutation)")
            continue
        a, b = source.splitlines(), mutated.splitlines()
        for tag, i1, i2, j1, j2 in difflib.SequenceMatcher(None, a, b, autojunk=False).get_opcodes():
            if tag != "equal":
                out[m.job_id] = (
                    " ".join(x.strip() for x in a[i1:i2]),
                    " ".join(x.strip() for x in b[j1:j2]) or "(removed)",
                )
                break
        else:
            out[m.job_id] = ("", "(no change)")
    return out


@dataclass
class Equivalent:
    path: str
    line: int
    operator: str
    mutated: str
    reason: str
    source_line: int  # where in the equivalents file

    @staticmethod
    def parse(text: str, where: str = "equivalents") -> List["Equivalent"]:
        """One entry a line: `path:line | operator | mutated line | reason` (the mutated line may
        hold " | " itself; the reason may not). Blank lines and lines starting with # are skipped."""
        entries = []
        for n, raw in enumerate(text.splitlines(), 1):
            line = raw.strip()
            if not line or line.startswith("#"):
                continue
            head = line.split(" | ", 2)
            if len(head) != 3 or " | " not in head[2]:
                raise ValueError(f"{where}:{n}: expected `path:line | operator | mutated line | reason`")
            mutated, reason = head[2].rsplit(" | ", 1)
            path, _, lineno = head[0].rpartition(":")
            if not path or not lineno.isdigit() or not reason.strip():
                raise ValueError(f"{where}:{n}: expected `path:line | operator | mutated line | reason`")
            entries.append(Equivalent(path, int(lineno), head[1].strip(), _norm(mutated), reason.strip(), n))
        return entries


def _norm(code: str) -> str:
    return " ".join(code.split())


def match_equivalents(
    entries: List[Equivalent], mutants: List[Mutant], described: Dict[str, Tuple[str, str]]
) -> Tuple[Dict[str, Equivalent], List[Equivalent]]:
    """(job_id -> its entry, the entries that match no mutant). An entry matches a mutant of the
    same file and operator whose mutated line reads the same; of several, the nearest line."""
    taken: Dict[str, Equivalent] = {}
    stale = []
    for entry in entries:
        candidates = [
            m
            for m in mutants
            if m.path == entry.path
            and m.operator == entry.operator
            and m.job_id not in taken
            and _norm(described[m.job_id][1]) == entry.mutated
        ]
        if not candidates:
            stale.append(entry)
            continue
        best = min(candidates, key=lambda m: (abs(m.line - entry.line), m.occurrence))
        taken[best.job_id] = entry
    return taken, stale


def annotation_spans(source: str) -> List[Tuple[Tuple[int, int], Tuple[int, int]]]:
    """The (start, end) positions, (line, column) as cosmic-ray gives them, of every annotation
    in a module that has `from __future__ import annotations`: there annotations stay strings that
    nothing here evaluates, so a mutant inside one cannot change behaviour. Other modules: none."""
    import ast

    tree = ast.parse(source)
    if not any(
        isinstance(n, ast.ImportFrom) and n.module == "__future__" and any(a.name == "annotations" for a in n.names)
        for n in tree.body
    ):
        return []
    found = []
    for node in ast.walk(tree):
        notes: List[Any] = []
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            a = node.args
            notes = [node.returns] + [x.annotation for x in a.posonlyargs + a.args + a.kwonlyargs]
            notes += [x.annotation for x in (a.vararg, a.kwarg) if x is not None]
        elif isinstance(node, ast.AnnAssign):
            notes = [node.annotation]
        found += [((n.lineno, n.col_offset), (n.end_lineno, n.end_col_offset)) for n in notes if n is not None]
    return found


def in_annotation(spans: List[Tuple[Tuple[int, int], Tuple[int, int]]], pos: Tuple[int, int]) -> bool:
    return any(start <= tuple(pos) < end for start, end in spans)


def equivalent_line(m: Mutant, mutated: str, reason: str = "REASON") -> str:
    return f"{m.path}:{m.line} | {m.operator} | {mutated} | {reason}"


# -- a session ---------------------------------------------------------------------------------
def _select(items: List[Any], only: Sequence[str], limit: Optional[int]) -> List[Any]:
    """`only`: PATH, PATH::FUNCTION (cosmic-ray's definition name), PATH:LINE or PATH:FIRST-LAST."""

    def keep(item: Any) -> bool:
        if not only:
            return True
        m = item.mutations[0]
        path, line = str(m.module_path), m.start_pos[0]
        for sel in only:
            if "::" in sel:
                p, func = sel.split("::", 1)
                if path == p and m.definition_name == func:
                    return True
                continue
            match = re.fullmatch(r"(.+?):(\d+)(?:-(\d+))?", sel)
            if match:
                first = int(match.group(2))
                last = int(match.group(3) or first)
                if path == match.group(1) and first <= line <= last:
                    return True
            elif path == sel or path.startswith(sel.rstrip("/") + "/"):
                return True
        return False

    chosen = sorted((i for i in items if keep(i)), key=lambda i: _mutant(i).sort_key)
    return chosen[:limit] if limit is not None else chosen


def _mutant(item: Any) -> Mutant:
    m = item.mutations[0]
    return Mutant(
        item.job_id,
        str(m.module_path),
        m.start_pos[0],
        m.start_pos[1],
        m.operator_name,
        m.occurrence,
        m.definition_name,
    )


def init_session(cfg: Config, session: Path, root: Path, only: Sequence[str], limit: Optional[int]) -> None:
    """`cosmic-ray init` for the configured files (relative to `root`), narrowed by only/limit."""
    import cosmic_ray.commands
    import cosmic_ray.modules
    from cosmic_ray.work_db import use_db

    cwd = os.getcwd()
    os.chdir(root)  # cosmic-ray records module paths as given: keep them relative to the tree
    try:
        modules = cosmic_ray.modules.find_modules([Path(p) for p in cfg.module_paths])
        modules = sorted(cosmic_ray.modules.filter_paths(modules, cfg.cosmic_ray.get("excluded-modules", ())))
        if only:  # list the mutants of the selected files alone (listing all takes seconds)
            wanted = {re.split(r"::|:(?=\d)", sel, maxsplit=1)[0].rstrip("/") for sel in only}
            modules = [m for m in modules if any(str(m) == w or str(m).startswith(w + "/") for w in wanted)]
        if session.exists():
            session.unlink()
        with use_db(str(session)) as db:
            cosmic_ray.commands.init(modules, db, cfg.cosmic_ray.get("operators", {}))
            items = list(db.work_items)
            chosen = _select(items, only, limit)
            if len(chosen) != len(items):
                db.clear()
                db.add_work_items(chosen)
    finally:
        os.chdir(cwd)


def _copy_tree(root: Path, dest: Path) -> None:
    if dest.exists():
        shutil.rmtree(dest)
    dest.mkdir(parents=True)
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc", ".hypothesis", ".pytest_cache", "*.egg-info")
    for part in TREE_PARTS:
        src = root / part
        if src.is_dir():
            shutil.copytree(src, dest / part, ignore=ignore)
        elif src.exists():
            shutil.copy2(src, dest / part)


class _Worker:
    def __init__(self, tree: Path, spec_path: Path) -> None:
        self.tree = tree
        env = {
            **os.environ,
            "PYTHONDONTWRITEBYTECODE": "1",
            "OMP_NUM_THREADS": "1",
            "MKL_NUM_THREADS": "1",
            "OMP_WAIT_POLICY": "PASSIVE",
        }
        env.pop("HYPOTHESIS_PROFILE", None)
        self.stderr = open(tree / ".worker.log", "w")
        self.proc = subprocess.Popen(
            [sys.executable, str(tree / "kvledger" / "checker" / "audit" / "mutation.py"), "worker", str(spec_path)],
            cwd=tree,
            env=env,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self.stderr,
            text=True,
            bufsize=1,
        )

    def ask(self, job: Dict[str, Any]) -> Dict[str, Any]:
        assert self.proc.stdin and self.proc.stdout
        self.proc.stdin.write(json.dumps(job) + "\n")
        self.proc.stdin.flush()
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(
                f"worker in {self.tree} died; its log:\n{(self.tree / '.worker.log').read_text()[-3000:]}"
            )
        return json.loads(line)

    def close(self) -> None:
        if self.proc.stdin:
            self.proc.stdin.close()
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self.stderr.close()


def _work_result(answer: Dict[str, Any]) -> Any:
    from cosmic_ray.work_item import TestOutcome, WorkerOutcome, WorkResult

    if "error" in answer:
        return WorkResult(
            worker_outcome=WorkerOutcome.EXCEPTION, output=answer["error"], test_outcome=TestOutcome.INCOMPETENT
        )
    if answer.get("no_test"):
        return WorkResult(worker_outcome=WorkerOutcome.NO_TEST)
    diff = answer.get("diff")
    if answer.get("timeout"):
        return WorkResult(
            worker_outcome=WorkerOutcome.NORMAL, output=TIMEOUT_OUTPUT, test_outcome=TestOutcome.KILLED, diff=diff
        )
    stage = answer.get("killed_by")
    if stage is None:
        return WorkResult(
            worker_outcome=WorkerOutcome.NORMAL,
            output="survived every stage",
            test_outcome=TestOutcome.SURVIVED,
            diff=diff,
        )
    return WorkResult(
        worker_outcome=WorkerOutcome.NORMAL,
        output=f"killed by {stage}: {answer.get('detail', '')}",
        test_outcome=TestOutcome.KILLED,
        diff=diff,
    )


def execute(
    cfg: Config, session: Path, work: Path, root: Path, workers: int, timeout: float, log: Any = print
) -> float:
    """Run every pending mutant of `session`; returns the unmutated stages' time (seconds)."""
    from cosmic_ray.work_db import use_db

    spec_path = work / "spec.json"
    spec_path.write_text(json.dumps(cfg.to_json()))
    with use_db(str(session)) as db:
        pending = [_mutant(i) for i in db.pending_work_items]
        pending_args = {i.job_id: i.mutations[0].operator_args for i in db.pending_work_items}
    if not pending:
        return 0.0
    workers = max(1, min(workers, len(pending)))
    started = time.perf_counter()
    trees = [work / f"tree-{n}" for n in range(workers)]
    for tree in trees:
        _copy_tree(root, tree)
    pool = [_Worker(tree, spec_path) for tree in trees]
    try:
        # every copy must pass every stage unmutated, or no outcome below would mean anything
        baselines: List[Dict[str, Any]] = [{}] * workers

        def baseline(n: int) -> None:
            baselines[n] = pool[n].ask({"baseline": True, "timeout": timeout})

        threads = [threading.Thread(target=baseline, args=(n,)) for n in range(workers)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        for n, b in enumerate(baselines):
            if b.get("timeout") or b.get("killed_by") is not None or "error" in b or not b:
                raise RuntimeError(
                    f"the unmutated tree fails the kill stages (copy {n}): {b}; see {trees[n] / '.mutant.log'}"
                )
        base_s = max(b["seconds"] for b in baselines)
        stage_s = {k: max(b["stages"][k] for b in baselines) for k in cfg.stages}
        log(
            f"unmutated: every stage passes in {base_s:.1f}s ("
            + ", ".join(f"{k} {v:.1f}s" for k, v in stage_s.items())
            + "); "
            f"{len(pending)} mutants on {workers} workers, timeout {timeout:.0f}s each"
        )
        if base_s * 3 > timeout:
            log(f"warning: the timeout ({timeout:.0f}s) is under 3x the unmutated run ({base_s:.1f}s)")

        jobs: "queue.Queue[Optional[Mutant]]" = queue.Queue()
        for m in sorted(pending, key=lambda m: m.sort_key):
            jobs.put(m)
        done: "queue.Queue[Tuple[Mutant, Dict[str, Any]]]" = queue.Queue()

        def serve(worker: _Worker) -> None:
            while True:
                try:
                    m = jobs.get_nowait()
                except queue.Empty:
                    return
                job = {
                    "module_path": m.path,
                    "operator": m.operator,
                    "occurrence": m.occurrence,
                    "operator_args": pending_args.get(m.job_id) or {},
                    "timeout": timeout,
                }
                try:
                    answer = worker.ask(job)
                except Exception as e:
                    done.put((m, {"error": str(e)}))
                    return
                done.put((m, answer))

        threads = [threading.Thread(target=serve, args=(w,), daemon=True) for w in pool]
        for t in threads:
            t.start()
        counts = {"killed": 0, "survived": 0, "timeout": 0, "other": 0}
        last = time.perf_counter()
        with use_db(str(session)) as db:
            for n in range(len(pending)):
                while True:
                    try:
                        m, answer = done.get(timeout=5)
                        break
                    except queue.Empty:
                        if not any(t.is_alive() for t in threads):  # every worker died: the rest stays pending
                            log(f"every worker stopped; {len(pending) - n} mutants left pending")
                            return base_s
                result = _work_result(answer)
                db.set_result(m.job_id, result)
                counts[_outcome(result)] += 1
                if "error" in answer:
                    log(f"error on {m.path}:{m.line} {m.operator}: {answer['error'][-500:]}")
                if time.perf_counter() - last > 15 or n + 1 == len(pending):
                    last = time.perf_counter()
                    log(
                        f"  {n + 1}/{len(pending)} done in {last - started:.0f}s: "
                        + ", ".join(f"{k} {v}" for k, v in counts.items())
                    )
        for t in threads:
            t.join()
        return base_s
    finally:
        for w in pool:
            w.close()


def mutation_block(root: str, spec: Dict[str, Any], jobs: List[Dict[str, Any]], timeout: float) -> Dict[str, Any]:
    """A campaign task: a block of mutants in a private copy of the tree at `root` (on the node
    that runs it), through one worker of the kill stages; the unmutated copy must pass them first.
    Returns {job_id: the worker's answer}, as `execute` records them."""
    import tempfile

    with tempfile.TemporaryDirectory(prefix="kvledger-mutants-") as scratch:
        tree = Path(scratch) / "tree"
        _copy_tree(Path(root), tree)
        spec_path = Path(scratch) / "spec.json"
        spec_path.write_text(json.dumps(spec))
        worker = _Worker(tree, spec_path)
        try:
            base = worker.ask({"baseline": True, "timeout": timeout})
            if base.get("timeout") or base.get("killed_by") is not None or "error" in base:
                raise RuntimeError(f"the unmutated copy fails the kill stages: {base}")
            answers = {job["job_id"]: worker.ask({k: v for k, v in job.items() if k != "job_id"}) for job in jobs}
        finally:
            worker.close()
    return {"baseline_seconds": base["seconds"], "answers": answers}


def execute_campaign(
    cfg: Config,
    session: Path,
    work: Path,
    root: Path,
    cluster: Optional[str],
    workers: int,
    block: int,
    timeout: float,
    log: Any = print,
) -> float:
    """`execute` as a campaign: blocks of `block` pending mutants, one task each, on the cluster (or
    on local worker processes); the verdicts go into the session as `execute` records them. The
    campaign directory (work/campaign) lets an interrupted run resume."""
    from cosmic_ray.work_db import use_db

    from kvledger.campaign import CampaignDir, Task, executor_for, run_campaign

    with use_db(str(session)) as db:
        pending = sorted((_mutant(i) for i in db.pending_work_items), key=lambda m: m.sort_key)
        pending_args = {i.job_id: i.mutations[0].operator_args for i in db.pending_work_items}
    if not pending:
        return 0.0
    jobs = [
        {
            "job_id": m.job_id,
            "module_path": m.path,
            "operator": m.operator,
            "occurrence": m.occurrence,
            "operator_args": pending_args.get(m.job_id) or {},
            "timeout": timeout,
        }
        for m in pending
    ]
    blocks = [jobs[i : i + block] for i in range(0, len(jobs), block)]
    tasks = [
        Task(
            f"mutants/{b[0]['module_path']}/{b[0]['job_id'][:12]}",
            f"{__name__}:mutation_block",
            {"root": str(root), "spec": cfg.to_json(), "jobs": b, "timeout": timeout},
            time_limit=timeout * (len(b) + 1),
        )
        for b in blocks
    ]
    executor = executor_for(cluster, workers)
    log(f"{len(jobs)} mutants in {len(tasks)} blocks on {executor.workers} worker(s) ({executor.where})")
    run = run_campaign(
        "mutation", {"config": str(cfg.path), "block": block}, tasks, executor, CampaignDir(work / "campaign")
    )
    by_id = {m.job_id: m for m in pending}
    counts = {"killed": 0, "survived": 0, "timeout": 0, "other": 0}
    base_s = 0.0
    with use_db(str(session)) as db:
        for task in tasks:
            outcome = run.outcomes.get(task.key)
            if outcome is None:
                continue
            if outcome.status != "done":
                why = (outcome.error or "").strip()[-500:]
                log(f"block {task.key} {outcome.status}: {why}; its mutants stay pending")
                continue
            base_s = max(base_s, outcome.value["baseline_seconds"])
            for job_id, answer in outcome.value["answers"].items():
                result = _work_result(answer)
                db.set_result(by_id[job_id].job_id, result)
                counts[_outcome(result)] += 1
    log(
        f"  {sum(counts.values())}/{len(jobs)} done in {run.seconds:.0f}s: "
        + ", ".join(f"{k} {v}" for k, v in counts.items())
    )
    return base_s


def _outcome(result: Any) -> str:
    """killed / survived / timeout / other (no mutation, or the machinery failed)."""
    from cosmic_ray.work_item import TestOutcome, WorkerOutcome

    if result.worker_outcome != WorkerOutcome.NORMAL or result.test_outcome == TestOutcome.INCOMPETENT:
        return "other"
    if result.test_outcome == TestOutcome.SURVIVED:
        return "survived"
    return "timeout" if result.output == TIMEOUT_OUTPUT else "killed"


def forget_results(session: Path, outcomes: Sequence[str]) -> int:
    """Drop the recorded results whose outcome is in `outcomes` (survived, timeout, killed, other),
    so that a resumed run tries those mutants again; returns how many."""
    from cosmic_ray.work_db import WorkResultStorage, use_db

    with use_db(str(session)) as db:
        drop = [
            job_id
            for job_id, result in db.results
            if result.worker_outcome.value != "skipped" and _outcome(result) in outcomes
        ]
        with db._session_maker.begin() as s:  # cosmic-ray's WorkDB has no call to drop one result
            for job_id in drop:
                s.query(WorkResultStorage).filter(WorkResultStorage.job_id == job_id).delete()
    return len(drop)


EQUIVALENT = "equivalent: "
ANNOTATION = "annotation: inside an annotation that is never evaluated (from __future__ import annotations)"


def mark_equivalents(
    cfg: Config, session: Path, root: Path, log: Any = print
) -> Tuple[Dict[str, Equivalent], List[Equivalent]]:
    """Mark skipped the mutants inside annotations and those the equivalents file names (an
    entry no longer there makes its mutant pending again); returns (matched, stale entries)."""
    from cosmic_ray.work_db import WorkResultStorage, use_db
    from cosmic_ray.work_item import WorkerOutcome, WorkResult

    entries = Equivalent.parse(cfg.equivalents.read_text(), str(cfg.equivalents)) if cfg.equivalents.exists() else []
    with use_db(str(session)) as db:
        items = list(db.work_items)
        mutants = [_mutant(i) for i in items]
        spans = {path: annotation_spans((root / path).read_text()) for path in {m.path for m in mutants}}
        notes = {
            i.job_id for i in items if in_annotation(spans[str(i.mutations[0].module_path)], i.mutations[0].start_pos)
        }
        keys = {(e.path, e.operator) for e in entries}
        described = describe(root, [m for m in mutants if (m.path, m.operator) in keys and m.job_id not in notes])
        taken, stale = match_equivalents(entries, [m for m in mutants if m.job_id in described], described)
        results = dict(db.results)
        for m in mutants:
            old = results.get(m.job_id)
            was = old.output if old is not None and old.worker_outcome == WorkerOutcome.SKIPPED else None
            now = (
                ANNOTATION if m.job_id in notes else EQUIVALENT + taken[m.job_id].reason if m.job_id in taken else None
            )
            if now is not None and was != now:
                db.set_result(m.job_id, WorkResult(worker_outcome=WorkerOutcome.SKIPPED, output=now))
            elif now is None and was is not None and (was.startswith(EQUIVALENT) or was == ANNOTATION):
                with db._session_maker.begin() as s:  # no longer equivalent: run it again
                    s.query(WorkResultStorage).filter(WorkResultStorage.job_id == m.job_id).delete()
    for entry in stale:
        log(
            f"stale equivalent ({cfg.equivalents.name}:{entry.source_line}, matches no mutant): "
            f"{entry.path}:{entry.line} | {entry.operator} | {entry.mutated}"
        )
    return taken, stale


# -- the report --------------------------------------------------------------------------------
@dataclass
class Report:
    rows: Dict[str, Dict[str, int]] = field(default_factory=dict)
    survivors: List[Tuple[Mutant, str, str]] = field(default_factory=list)  # (mutant, original, mutated)
    timeouts: List[Tuple[Mutant, str, str]] = field(default_factory=list)
    others: List[Tuple[Mutant, str]] = field(default_factory=list)
    killed_by: Dict[str, int] = field(default_factory=dict)

    COLUMNS = ("mutants", "equivalent", "annotation", "killed", "survived", "timeout", "other")

    def total(self) -> Dict[str, int]:
        return {c: sum(r[c] for r in self.rows.values()) for c in self.COLUMNS}

    @staticmethod
    def score(row: Dict[str, int]) -> Optional[float]:
        decided = row["killed"] + row["timeout"] + row["survived"]
        return (row["killed"] + row["timeout"]) / decided if decided else None

    def table(self) -> str:
        head = "| file | " + " | ".join(self.COLUMNS) + " | score |"
        lines = [head, "|" + " --- |" * (len(self.COLUMNS) + 2)]
        for name, row in sorted(self.rows.items()) + [("**total**", self.total())]:
            s = self.score(row)
            lines.append(
                f"| {name} | "
                + " | ".join(str(row[c]) for c in self.COLUMNS)
                + f" | {'-' if s is None else f'{100 * s:.1f}%'} |"
            )
        return "\n".join(lines)


def build_report(session: Path, root: Path) -> Report:
    from cosmic_ray.work_db import use_db
    from cosmic_ray.work_item import WorkerOutcome

    report = Report()
    with use_db(str(session)) as db:
        items = {i.job_id: _mutant(i) for i in db.work_items}
        results = dict(db.results)
    pending = [m for job_id, m in items.items() if job_id not in results]
    interesting = []
    for job_id, m in sorted(items.items(), key=lambda kv: kv[1].sort_key):
        row = report.rows.setdefault(m.path, {c: 0 for c in Report.COLUMNS})
        row["mutants"] += 1
        result = results.get(job_id)
        if result is None:
            continue
        if result.worker_outcome == WorkerOutcome.SKIPPED:
            row["annotation" if result.output == ANNOTATION else "equivalent"] += 1
            continue
        outcome = _outcome(result)
        row[outcome] += 1
        if outcome == "killed":
            stage = (result.output or "").removeprefix("killed by ").split(":", 1)[0]
            report.killed_by[stage] = report.killed_by.get(stage, 0) + 1
        elif outcome in ("survived", "timeout"):
            interesting.append((m, outcome))
        else:
            report.others.append((m, (result.output or result.worker_outcome.value)[-300:]))
    described = describe(root, [m for m, _ in interesting])
    for m, outcome in interesting:
        original, mutated = described[m.job_id]
        (report.survivors if outcome == "survived" else report.timeouts).append((m, original, mutated))
    if pending:
        report.others.extend((m, "not run") for m in pending)
    return report


def format_report(report: Report, cfg: Config, equivalents: int, stale: int) -> str:
    total = report.total()
    score = Report.score(total)
    out = [report.table(), ""]
    if report.killed_by:
        out.append("killed by stage: " + ", ".join(f"{k} {v}" for k, v in sorted(report.killed_by.items())))
    out.append(
        f"score (killed + timeout) / (killed + timeout + survived), equivalents and annotations left out: "
        f"{'-' if score is None else f'{100 * score:.2f}%'} (goal {100 * cfg.min_score:.0f}%); "
        f"{equivalents} reviewed equivalents matched, {stale} stale entries"
    )
    if report.timeouts:
        out += ["", f"timeouts ({len(report.timeouts)}; hangs, counted as detected):"]
        out += [f"  {m.path}:{m.line} {m.operator}: {o}  ->  {mu}" for m, o, mu in report.timeouts]
    if report.survivors:
        out += ["", f"survivors ({len(report.survivors)}), in the equivalents file's format:"]
        out += [f"  {equivalent_line(m, mu, 'was: ' + o)}" for m, o, mu in report.survivors]
    if report.others:
        out += ["", f"not decided ({len(report.others)}):"]
        out += [f"  {m.path}:{m.line} {m.operator}: {why}" for m, why in report.others[:50]]
    return "\n".join(out)


# -- the command -------------------------------------------------------------------------------
def run(
    config: str = DEFAULT_CONFIG,
    workers: Optional[int] = None,
    only: Sequence[str] = (),
    limit: Optional[int] = None,
    stages: Optional[Sequence[str]] = None,
    fuzz_cases: Optional[int] = None,
    hypothesis_examples: Optional[int] = None,
    pytest_files: Optional[Sequence[str]] = None,
    equivalents: Optional[str] = None,
    timeout: Optional[float] = None,
    resume: bool = False,
    rerun: Sequence[str] = (),
    work_dir: Optional[str] = None,
    results: Optional[str] = None,
    root: Path = ROOT,
    log: Any = print,
    cluster: Optional[str] = None,
    block: int = 20,
) -> int:
    cfg = load_config(config, root)
    if stages is not None:
        unknown = [s for s in stages if s not in STAGES]
        if unknown:
            raise ValueError(f"unknown stages {unknown} (known: {', '.join(STAGES)})")
        cfg.stages = list(stages)
    if fuzz_cases is not None:
        cfg.fuzz_cases = fuzz_cases
    if hypothesis_examples is not None:
        cfg.hypothesis_examples = hypothesis_examples
    if pytest_files is not None:
        cfg.pytest = list(pytest_files)
    if equivalents is not None:
        cfg.equivalents = Path(equivalents).resolve()
    work = Path(work_dir).resolve() if work_dir else root / WORK_DIR
    work.mkdir(parents=True, exist_ok=True)
    session = work / "session.sqlite"
    started = time.perf_counter()
    if not (resume and session.exists()):
        init_session(cfg, session, root, only, limit)
    elif rerun:
        log(f"resuming {session}: {forget_results(session, rerun)} results of {', '.join(rerun)} dropped")
    taken, stale = mark_equivalents(cfg, session, root, log)
    limit_s = timeout if timeout is not None else cfg.timeout
    if cluster is not None:
        base_s = execute_campaign(
            cfg, session, work, root, cluster, workers or os.cpu_count() or 1, block, limit_s, log
        )
    else:
        base_s = execute(cfg, session, work, root, workers or os.cpu_count() or 1, limit_s, log)
    report = build_report(session, root)
    text = format_report(report, cfg, len(taken), len(stale))
    log(text)
    log(f"({time.perf_counter() - started:.0f}s; session {session}: `cr-report {session}` reads it)")
    if results:
        out = Path(results)
        out.mkdir(parents=True, exist_ok=True)
        shown = cfg.path.relative_to(root) if cfg.path.is_relative_to(root) else cfg.path
        (out / "README.md").write_text(
            "# Mutation score\n\n"
            f"`kvledger mutation` (cosmic-ray, {shown}): "
            f"stages {', '.join(cfg.stages)} (fuzz {cfg.fuzz_cases} cases, Hypothesis {cfg.hypothesis_examples} "
            f"examples of {cfg.hypothesis_steps} steps); unmutated run {base_s:.1f}s.\n\n" + text + "\n"
        )
    total = report.total()
    score = Report.score(total)
    if report.others:
        return 2
    return 0 if score is None or score >= cfg.min_score else 1


def main(argv: Optional[List[str]] = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["worker"]:
        return worker_main(argv[1])
    if argv[:1] == ["kill"]:
        p = argparse.ArgumentParser(prog="mutation.py kill")
        p.add_argument("--config", default=DEFAULT_CONFIG)
        return kill_main(p.parse_args(argv[1:]).config)
    print(
        "mutation.py: the script runs `worker SPEC` and `kill [--config FILE]`; the score: kvledger mutation",
        file=sys.stderr,
    )
    return 2


if __name__ == "__main__":
    sys.exit(main())
