"""Both executors run the same tasks to the same outcomes, faults included: a worker killed
mid-task (retried once, then reported), a task past its time limit (reported as hung), a task
that raises (reported with its traceback). The Ray one runs on a real local cluster of 2 CPUs."""

import pytest

from kvledger.campaign import CampaignDir, LocalExecutor, Task, run_campaign

ray = pytest.importorskip("ray")

F = "tests.support.campaign_tasks"


def _tasks(tmp_path):
    return [
        Task("square/3", f"{F}:square", {"x": 3}),
        Task("square/4", f"{F}:square", {"x": 4}),
        Task("die-once", f"{F}:die_once", {"marker": str(tmp_path / "marker")}),
        Task("always-die", f"{F}:always_die"),
        Task("hang", f"{F}:hang", {"seconds": 60}, time_limit=2.0),
        Task("broken", f"{F}:broken"),
    ]


def _check(run):
    out = run.outcomes
    assert out["square/3"].status == "done" and out["square/3"].value["square"] == 9
    assert out["square/4"].value["square"] == 16
    assert out["die-once"].status == "done" and out["die-once"].attempts == 2  # retried once elsewhere
    assert out["always-die"].status == "died" and out["always-die"].attempts == 2
    assert "each of 2 tries" in out["always-die"].error
    assert out["hang"].status == "hung" and "time limit of 2 s" in out["hang"].error
    assert out["broken"].status == "failed" and "ValueError: a bug in the task itself" in out["broken"].error


def test_local_executor_outcomes(tmp_path):
    run = run_campaign("test", {}, _tasks(tmp_path), LocalExecutor(2), CampaignDir(tmp_path / "c"), progress=False)
    _check(run)
    assert not run.interrupted and run.workers == 2


def test_ray_executor_outcomes(tmp_path, ray_cluster):
    from kvledger.campaign.ray_executor import RayExecutor

    run = run_campaign("test", {}, _tasks(tmp_path), RayExecutor("auto"), CampaignDir(tmp_path / "c"), progress=False)
    _check(run)
    assert run.where == "ray:auto" and run.workers == 2
    assert ray_cluster.is_initialized()  # a cluster the campaign found running is left running


def test_a_second_campaign_over_the_directory_runs_only_what_did_not_finish(tmp_path):
    directory = CampaignDir(tmp_path / "c")
    tasks = [Task(f"square/{x}", f"{F}:square", {"x": x}) for x in range(4)]
    first = run_campaign("test", {"n": 4}, tasks[:2] + tasks[2:], LocalExecutor(1), directory, progress=False)
    assert first.resumed == 0 and len(first.outcomes) == 4
    again = run_campaign("test", {"n": 4}, tasks, LocalExecutor(1), directory, progress=False)
    assert again.resumed == 4 and len(directory.outcomes()) == 4  # nothing ran twice
    with pytest.raises(ValueError, match="holds a different campaign"):
        run_campaign("test", {"n": 5}, tasks, LocalExecutor(1), directory, progress=False)
