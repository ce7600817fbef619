"""Where the repository and the tests' data folders are, for test modules at any depth of tests/."""

from pathlib import Path

TESTS = Path(__file__).resolve().parents[1]
ROOT = TESTS.parent  # the repository
SUPPORT = TESTS / "support"
DATA = TESTS / "data"
REGRESSIONS = TESTS / "regressions"  # traces that replay clean (tests/properties/test_regressions.py)
SUBJECT_REGRESSIONS = REGRESSIONS / "subjects"  # the subjects' (tests/subjects/test_regressions.py)
ZOO_TRACES = TESTS / "zoo_traces"  # a minimized failing trace per zoo bug (tests/checker/test_zoo.py)
