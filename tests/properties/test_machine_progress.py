"""Both Hypothesis machines report what a run reached to the `Progress` they are bound to, and to
nothing else: two runs never share counts, and an unbound machine (as the mutation and invariant
audits run it) leaves every bound run's progress alone."""

from hypothesis import HealthCheck, settings
from hypothesis.stateful import run_state_machine_as_test

from kvledger.properties.machine import LockstepMachine, Progress, run_machine
from kvledger.properties.subject_machine import machine_for
from kvledger.subjects import parse_spec

SMALL = settings(
    max_examples=4,
    stateful_step_count=6,
    derandomize=True,
    database=None,
    deadline=None,
    suppress_health_check=list(HealthCheck),
)


def test_each_lockstep_run_counts_from_one_in_its_own_progress():
    first, second = run_machine(SMALL, Progress()), run_machine(SMALL, Progress())
    assert first.sequences >= 1
    assert (first.sequences, first.reached) == (second.sequences, second.reached)  # derandomized: the same run
    assert first.reached and all(1 <= n <= first.sequences for n in first.reached.values())
    run_state_machine_as_test(LockstepMachine, settings=SMALL)  # unbound: a throwaway progress per sequence
    assert (first.sequences, first.reached) == (second.sequences, second.reached)


def test_a_seeded_lockstep_run_is_the_same_run_bound_to_any_progress():
    runs = [run_machine(settings(SMALL, derandomize=False), Progress(), seed=7) for _ in range(2)]
    assert runs[0].sequences == runs[1].sequences and runs[0].reached == runs[1].reached


def test_the_subject_machine_reports_to_the_progress_it_was_made_with():
    factory = parse_spec("fast").factory(())
    one, other = Progress(), Progress()
    machine = machine_for(factory, one, (1, 2))
    assert machine.__name__ == "SubjectMachine"
    run_state_machine_as_test(machine, settings=SMALL)
    assert one.sequences >= 1 and one.last_failure is None
    assert all(1 <= n <= one.sequences for n in one.reached.values())
    assert other.sequences == 0 and not other.reached
