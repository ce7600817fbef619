"""A small campaign of each kind through a real local Ray cluster, against the same campaign on
local worker processes: fuzz with a planted bug (found, minimized once, replayed alone), the
Hypothesis check, and a block of mutants (the same verdicts)."""

import json
import re

import pytest

from kvledger.checker.audit import mutation
from kvledger.cli import main

pytest.importorskip("ray")

BUG = "double-free-on-finish"
FUZZ = ["fuzz", "--tasks", "2", "--cases", "5", "--bug", BUG, "--minimize-replays", "300", "-q"]


def _summary(directory):
    """The merged result without timings and paths, which differ between the two runs."""
    text = (directory / "summary.txt").read_text().replace(str(directory), "DIR")
    text = re.sub(r", [\d.]+s into its task", "", text)
    return re.sub(r", [\d.]+s on \d+ worker\(s\) \([^)]*\): [\d,]+ ops/s", "", text).splitlines()


def test_a_fuzz_campaign_finds_the_same_on_ray_as_here_and_its_finding_replays_alone(tmp_path, ray_cluster, capsys):
    here, there = tmp_path / "here", tmp_path / "there"
    assert main([*FUZZ, "--workers", "2", "--campaign", str(here)]) == 1
    assert main([*FUZZ, "--cluster", "auto", "--campaign", str(there)]) == 1
    assert _summary(here) == _summary(there)
    text = (there / "summary.txt").read_text()
    assert "FINDING invariant:1-2-partition in task fuzz/seed0/shard0" in text and "minimized (" in text
    outcomes = [json.loads(line) for line in (there / "outcomes.jsonl").read_text().splitlines()]
    assert sorted(o["key"] for o in outcomes) == ["fuzz/seed0/shard0", "fuzz/seed0/shard1"]
    assert all(o["value"]["finding"]["kind"] == "invariant:1-2-partition" for o in outcomes)
    (minimized,) = sorted(there.glob("findings/*-min.jsonl"))
    capsys.readouterr()
    assert main(["replay", str(minimized), "--bug", BUG]) == 1  # it fails alone, with the bug
    assert main(["replay", str(minimized)]) == 0  # and replays clean without it
    # its task alone, as the summary says, finds it again
    assert main([*FUZZ[:2], "1", "--first-task", "0", *FUZZ[3:], "--campaign", str(tmp_path / "alone")]) == 1
    alone = (tmp_path / "alone/summary.txt").read_text()
    assert "FINDING invariant:1-2-partition in task fuzz/seed0/shard0, case 1" in alone


def test_a_ray_task_whose_subject_segfaults_is_a_finding_with_its_stack(tmp_path, ray_cluster, capsys):
    spec = "tests.support.dying_subject:segv"
    args = ["fuzz", "--subject", spec, "--tasks", "2", "--cases", "3", "--cluster", "auto", "-q"]
    assert main([*args, "--minimize-replays", "100", "--campaign", str(tmp_path / "c")]) == 1
    text = (tmp_path / "c" / "summary.txt").read_text()
    assert "FINDING subject-crashed:SIGSEGV in task" in text and "minimized (3 ops" in text
    assert "in die" in text  # the minimized trace's stack, though Ray's driver has a SIGSEGV handler of its own
    outcomes = [json.loads(line) for line in (tmp_path / "c" / "outcomes.jsonl").read_text().splitlines()]
    assert [o["status"] for o in outcomes] == ["done", "done"]  # no task lost its worker
    (minimized,) = sorted((tmp_path / "c").glob("findings/*-min.jsonl"))
    capsys.readouterr()
    assert main(["replay", str(minimized)]) == 1
    assert "subject-crashed:SIGSEGV" in capsys.readouterr().out


def test_a_second_fuzz_campaign_over_the_directory_resumes(tmp_path, capsys):
    directory = tmp_path / "c"
    args = ["fuzz", "--tasks", "2", "--cases", "2", "-q", "--campaign", str(directory)]
    assert main(args) == 0
    corpus = [json.loads(line) for line in (directory / "corpus.jsonl").read_text().splitlines()]
    assert corpus and all(e["task"].startswith("fuzz/seed0/shard") and 0 <= e["case"] < 2 for e in corpus)
    assert main(args) == 0
    assert "(2 task(s) resumed" in (directory / "summary.txt").read_text()
    assert len((directory / "outcomes.jsonl").read_text().splitlines()) == 2
    assert main(["fuzz", "--tasks", "2", "--cases", "3", "-q", "--campaign", str(directory)]) == 2
    assert "holds a different campaign" in capsys.readouterr().err


def test_a_check_campaign_on_ray(tmp_path, ray_cluster, capsys):
    directory = tmp_path / "c"
    args = ["check", "--profile", "dev", "--tasks", "2", "--examples", "3", "--cluster", "auto", "-q"]
    assert main([*args, "--campaign", str(directory)]) == 0
    text = (directory / "summary.txt").read_text()
    assert "over 2 of 2 tasks" in text and "passed" in text
    seeds = [t["args"]["hypothesis_seed"] for t in json.loads((directory / "campaign.json").read_text())["tasks"]]
    assert len(set(seeds)) == 2  # each task its own Hypothesis seed


def test_a_block_of_mutants_on_ray_gets_the_local_verdicts(tmp_path, ray_cluster, capsys):
    common = dict(only=["reference/pages.py::align_down"], limit=3, stages=["fuzz"], fuzz_cases=2, timeout=3600)
    assert mutation.run(workers=1, work_dir=str(tmp_path / "local"), **common) == 0
    local = capsys.readouterr().out
    assert mutation.run(cluster="auto", block=2, work_dir=str(tmp_path / "ray"), **common) == 0
    remote = capsys.readouterr().out
    row = "| reference/pages.py | 3 | 0 | 0 | 3 | 0 | 0 | 0 | 100.0% |"
    assert row in local and row in remote, remote
    assert "3 mutants in 2 blocks on 2 worker(s) (ray:auto)" in remote


def test_ctrl_c_stops_the_campaign_and_keeps_what_finished(tmp_path):
    """Decided by counts: the second task cannot end until the test creates its marker, so the
    interrupt always lands with exactly one task finished."""
    import signal
    import subprocess
    import sys
    import time

    directory, marker = tmp_path / "c", tmp_path / "go"
    outcomes = directory / "outcomes.jsonl"
    code = (
        "import sys; from tests.support.campaign_tasks import run_until_interrupted; "
        f"sys.exit(run_until_interrupted({str(directory)!r}, {str(marker)!r}))"
    )
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        while not (outcomes.exists() and outcomes.read_text().strip()):  # the first task has ended
            assert proc.poll() is None, proc.communicate()
            time.sleep(0.05)
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=120)
    finally:  # a campaign that did not stop is not left behind
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert proc.returncode == 130, err
    assert [json.loads(line)["key"] for line in outcomes.read_text().splitlines()] == ["first"]
    assert "interrupted: 1 of 3 tasks finished" in err
    marker.touch()  # the same campaign again runs only the other two
    again = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600)
    assert again.returncode == 0, again.stderr
    assert "3 done" in again.stdout and "(1 task(s) resumed" in again.stdout
    assert sorted(json.loads(line)["key"] for line in outcomes.read_text().splitlines()) == ["first", "last", "waits"]


def test_an_interrupted_fuzz_campaign_says_how_to_resume(tmp_path):
    from kvledger.campaign import CampaignDir, CampaignRun
    from kvledger.checker.campaigns import fuzz_tasks, merge_fuzz

    directory = CampaignDir(tmp_path / "c")
    directory.findings.mkdir(parents=True)
    text, code = merge_fuzz(CampaignRun(interrupted=True), fuzz_tasks(0, 2, 1, None, None), directory, 1.0, None)
    assert f"interrupted: resume with the same options and --campaign {directory.path}" in text and code == 0


def test_a_subject_campaign_finds_mini_sglangs_known_bug_and_not_with_its_fix(tmp_path, capsys):
    from kvledger.subjects import minisgl

    installed, _, detail = minisgl.probe()
    if not installed:
        pytest.skip(detail)
    args = ["fuzz", "--subject", "minisgl", "--tasks", "2", "--cases", "5", "--workers", "2", "-q"]
    assert main([*args, "--minimize-replays", "300", "--campaign", str(tmp_path / "bug")]) == 1
    text = (tmp_path / "bug" / "summary.txt").read_text()
    assert "FINDING 1-2-partition in task fuzz/minisgl/seed0/shard" in text and "minimized (" in text
    (minimized,) = sorted((tmp_path / "bug").glob("findings/*-min.jsonl"))
    assert main(["replay", str(minimized)]) == 1  # the trace names its subject: it fails alone
    assert main([*args, "--fix", "pr142", "--campaign", str(tmp_path / "fixed")]) == 0
    assert "no finding" in (tmp_path / "fixed" / "summary.txt").read_text()
