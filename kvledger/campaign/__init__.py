"""Campaigns: long checking jobs as lists of independent, seeded tasks.

A campaign is a list of `Task`s (a fuzz shard with its seed and case count, a Hypothesis run with
its seed and example count, a block of mutants), an executor that runs them (`LocalExecutor`:
worker processes on this machine; `RayExecutor`: a Ray cluster) and a merge of their outcomes,
kept in a campaign directory a later campaign resumes from. The local path and the cluster path
are the same code with a different executor. The tools define the tasks and the merges
(`kvledger/checker/campaigns.py`); this package knows nothing of what a task checks.
"""

from kvledger.campaign.directory import CampaignDir
from kvledger.campaign.executor import Executor, LocalExecutor
from kvledger.campaign.executor_choice import executor_for
from kvledger.campaign.run import CampaignRun, run_campaign
from kvledger.campaign.task import Outcome, Task, call

__all__ = [
    "CampaignDir",
    "CampaignRun",
    "Executor",
    "LocalExecutor",
    "Outcome",
    "Task",
    "call",
    "executor_for",
    "run_campaign",
]
