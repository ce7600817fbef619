"""Which bugs the invariants catch with no reference model to compare against, and what invariant 7
(KV provenance) adds: `python -m kvledger.checker.audit.invariant_catches [--cases N] [--ops N]`.

For each bug of the zoo, seeded fuzz walks are generated on correct code (`fuzz.case_trace`), then
replayed on `fast` alone with the bug patched in, judged after every operation (`CacheScheduler.check`):
once with invariant 7, once without. A bug the judge catches only with provenance is one a shared
edit (the same bug in reference and fast) would hide from everything else. The lockstep harness's
own catch on the same walks is shown for scale. Counts and seeds only: the table is the same on
every machine.

`--shared` measures what no comparison can see: a bug applied to reference and fast alike (a
radix match that trusts a whole edge after comparing its first page). It runs the CI profile's
derandomized property run with the bug on both sides, with and without invariant 7, and prints the
sequence (example) at which the first failure appeared, and what fired.
"""

from __future__ import annotations

import argparse
from contextlib import contextmanager
from typing import Dict, Iterator, List, Optional, Tuple

from kvledger import fast, reference
from kvledger.checker.lockstep_walk import case_trace
from kvledger.engine.ledger.cache_scheduler import CacheScheduler, InvalidOp, InvariantViolation
from kvledger.engine.ledger.trace import Header
from kvledger.subjects.fast_zoo import BUGS, Bug, patched

Catch = Optional[Tuple[str, int]]  # (what fired, at which operation), or None

# A radix match that checks an edge's first page (the child's dictionary key) and trusts the rest
# of the edge, as the same edit on both sides.
TRUSTS_WHOLE_EDGE = (
    Bug(
        "trusts-edge",
        "issue 15 trial",
        "",
        reference.RadixPrefixCache,
        "_walk",
        (("child.key[common] == ids[matched + common]", "True"),),
    ),
    Bug(
        "trusts-edge",
        "issue 15 trial",
        "",
        fast.radix_cache,
        "_common_prefix",
        (("if key[:n] == ids[start : start + n]:", "if True:  # BUG: the edge's first page decides"),),
    ),
)


@contextmanager
def shared(bugs: Tuple[Bug, ...]) -> Iterator[None]:
    """Apply bugs to whatever they target, reference included (zoo.patched touches fast only)."""
    saved = []
    try:
        for bug in bugs:
            for owner, attr, value in bug.patches():
                saved.append((owner, attr, getattr(owner, attr)))
                setattr(owner, attr, value)
        yield
    finally:
        for owner, attr, old in reversed(saved):
            setattr(owner, attr, old)


def property_catch(
    bugs: Tuple[Bug, ...], provenance: bool, examples: int = 1500
) -> Tuple[Optional[int], Optional[str]]:
    """The CI profile's property run with `bugs` applied: the example (sequence) at which the first
    failure appeared, and its kind; (None, None) if none did."""
    from hypothesis import Phase, settings
    from hypothesis.stateful import run_state_machine_as_test

    from kvledger.engine.ledger import cache_scheduler
    from kvledger.properties import lockstep
    from kvledger.properties.lockstep import Finding
    from kvledger.properties.machine import LockstepMachine

    seen = {"examples": 0, "first": None, "kind": None}
    init, apply, tracker = lockstep.Lockstep.__init__, lockstep.Lockstep.apply, cache_scheduler.KVProvenance

    def counting_init(self, *args, **kwargs):
        seen["examples"] += 1
        init(self, *args, **kwargs)

    def noting_apply(self, op):
        try:
            return apply(self, op)
        except Finding as e:
            if seen["first"] is None:
                seen["first"], seen["kind"] = seen["examples"], e.kind
            raise

    lockstep.Lockstep.__init__, lockstep.Lockstep.apply = counting_init, noting_apply
    if not provenance:
        cache_scheduler.KVProvenance = lambda: None
    try:
        with shared(bugs):
            # no shrinking: only the first failure counts (shrinking took minutes, and could end
            # in several distinct failures raised together)
            run_state_machine_as_test(
                LockstepMachine,
                settings=settings(
                    derandomize=True,
                    max_examples=examples,
                    stateful_step_count=60,
                    deadline=None,
                    database=None,
                    phases=[Phase.explicit, Phase.reuse, Phase.generate],
                ),
            )
    except Finding:
        pass
    finally:
        lockstep.Lockstep.__init__, lockstep.Lockstep.apply = init, apply
        cache_scheduler.KVProvenance = tracker
    return seen["first"], seen["kind"]


def judged_alone(header: Header, ops: List[Dict], provenance: bool) -> Catch:
    """Replay on fast alone; the first invariant that fires, or "changed-results" when the walk
    stops being valid (the bug changed what the scheduler did, which only a comparison sees)."""
    d = CacheScheduler(fast, track_provenance=provenance, **header.cache_scheduler_args())
    for step, op in enumerate(ops, 1):
        try:
            d.apply(op)
            d.check()
        except InvariantViolation as e:
            return e.invariant, step
        except InvalidOp:
            return None
        except Exception as e:  # the bug crashed fast: no invariant needed
            return f"raised:{type(e).__name__}", step
    return None


def lockstep_catch(header: Header, ops: List[Dict]) -> Catch:
    from kvledger.properties.lockstep import Finding, Lockstep

    lock = Lockstep(header)
    for op in ops:
        try:
            lock.apply(op)
        except Finding as e:
            return e.kind, e.step
        except InvalidOp:
            return None
    return None


def measure(bug: str, cases: int, max_ops: int, seed: int = 0) -> Dict[str, Catch]:
    """The earliest catch (fewest operations, over the first `cases` walks) of each judge."""
    best: Dict[str, Catch] = {"lockstep": None, "alone": None, "alone+provenance": None}
    for case in range(cases):
        header, ops = case_trace(seed, 0, case, max_ops=max_ops)
        with patched(bug):
            found = {
                "lockstep": lockstep_catch(header, ops),
                "alone": judged_alone(header, ops, False),
                "alone+provenance": judged_alone(header, ops, True),
            }
        for judge, catch in found.items():
            if catch is not None and (best[judge] is None or catch[1] < best[judge][1]):
                best[judge] = catch
    return best


def _cell(catch: Catch) -> str:
    return "-" if catch is None else f"{catch[0]} @{catch[1]}"


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m kvledger.checker.audit.invariant_catches", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument("--cases", type=int, default=6, help="fuzz walks per bug (default 6)")
    parser.add_argument("--ops", type=int, default=300, help="operations per walk (default 300)")
    parser.add_argument("--bugs", default=None, help="comma-separated zoo bugs (default: all)")
    parser.add_argument("--shared", action="store_true", help="the shared-bug property measurement instead")
    args = parser.parse_args(argv)
    if args.shared:
        for provenance in (True, False):
            first, kind = property_catch(TRUSTS_WHOLE_EDGE, provenance)
            label = "with invariant 7" if provenance else "without invariant 7"
            print(
                f"shared trusts-whole-edge, CI profile {label}: "
                + (f"first failure in sequence {first}: {kind}" if first else "never caught")
            )
        return 0
    names = args.bugs.split(",") if args.bugs else sorted(BUGS)
    print("| bug | lockstep | fast alone, invariants 1-6, 8 | fast alone, + invariant 7 |\n|---|---|---|---|")
    only, earlier = [], []
    for name in names:
        row = measure(name, args.cases, args.ops)
        print(
            f"| {name} | {_cell(row['lockstep'])} | {_cell(row['alone'])} | {_cell(row['alone+provenance'])} |",
            flush=True,
        )
        plain, prov = row["alone"], row["alone+provenance"]
        if prov is not None and plain is None:
            only.append(name)
        elif prov is not None and plain is not None and prov[1] < plain[1]:
            earlier.append(name)
    print(f"\ncaught alone only with invariant 7: {', '.join(only) or 'none'}")
    print(f"caught alone earlier with invariant 7: {', '.join(earlier) or 'none'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
