"""The campaign directory: what a campaign ran and found, kept as it goes.

campaign.json    the campaign: its kind, its options and every task
outcomes.jsonl   one line per finished task, appended as each ends (an interrupted campaign
                 keeps what finished, and a second campaign over the same directory skips it)
findings/        failing traces and their minimized forms, one pair per distinct finding
summary.txt      the merged result, rewritten at the end of each campaign
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Dict, List, Sequence

from kvledger.campaign.task import Outcome, Task


class CampaignDir:
    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self.findings = self.path / "findings"

    @property
    def spec_path(self) -> Path:
        return self.path / "campaign.json"

    @property
    def outcomes_path(self) -> Path:
        return self.path / "outcomes.jsonl"

    def start(self, kind: str, options: Dict[str, Any], tasks: Sequence[Task]) -> None:
        """Write the campaign's spec, or check that it is the one this directory already holds (a
        resumed campaign must run the same tasks, or its outcomes would not merge)."""
        spec = {"kind": kind, "options": options, "tasks": [t.to_json() for t in tasks]}
        self.path.mkdir(parents=True, exist_ok=True)
        self.findings.mkdir(exist_ok=True)
        if self.spec_path.exists():
            old = json.loads(self.spec_path.read_text())
            if old != json.loads(json.dumps(spec)):
                raise ValueError(
                    f"{self.path}: holds a different campaign ({old.get('kind')}, options {old.get('options')}); "
                    "resume with the same options, or choose another --campaign directory"
                )
            return
        self.spec_path.write_text(json.dumps(spec, indent=1) + "\n")

    def outcomes(self) -> List[Outcome]:
        if not self.outcomes_path.exists():
            return []
        found = []
        for n, line in enumerate(self.outcomes_path.read_text().splitlines(), 1):
            if not line.strip():
                continue
            try:
                found.append(Outcome.from_json(json.loads(line)))
            except (ValueError, TypeError) as e:
                raise ValueError(f"{self.outcomes_path}:{n}: not an outcome: {e}") from None
        return found

    def finished(self) -> Dict[str, Outcome]:
        """Outcomes a resumed campaign keeps: every task that ended but was not cancelled."""
        return {o.key: o for o in self.outcomes() if o.status != "cancelled"}

    def record(self, outcome: Outcome) -> None:
        with self.outcomes_path.open("a") as f:
            f.write(json.dumps(outcome.to_json(), separators=(",", ":")) + "\n")

    def write_summary(self, text: str) -> None:
        (self.path / "summary.txt").write_text(text + "\n")
