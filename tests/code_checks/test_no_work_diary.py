"""No tracker or work-period numbers in the product: README, docs, the changelog, code comments and docstrings.

A reader of the product cannot look up "issue 24" or "session 8" and has no use for when a change was made: say
what is meant (the feature, the commit, the measured effect). References to other projects' trackers stay
("keras-team/keras#18624", "TF PR #48601", "kubeflow/trainer#721"): they name where to read.
"""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
#: "issue 24", "Issue 23.5", "(issues 6 and 7)", "session 8's", "round 7", "sprint 3", "work period"; not "--rounds 3"
#: (a flag), "rounds 1.06, 0.99" (a benchmark's rounds), "owner/repo#123" or "PR #48601" (another project's tracker)
WORK_DIARY = re.compile(r"(?<![-\w])(?:issues?|sessions?|round|sprints?)\s+#?\d|\bwork[- ]periods?\b", re.I)
TEXT_SUFFIXES = {".md", ".py", ".toml", ".yaml", ".yml", ".sh", ".cfg", ".ini", ".txt", ".tpl", ".json", ""}
SELF = Path(__file__).resolve()


def work_diary_mentions(text: str) -> list[str]:
    return [m.group(0) for m in WORK_DIARY.finditer(text)]


def test_the_pattern_tells_work_diary_from_references() -> None:
    for diary in ("issue 24", "(issue 39)", "Issue 23.5: x", "round 7", "session 12", "Session 8's run",
                  "sessions 6 and 7", "in a work period"):
        assert work_diary_mentions(diary), diary
    for reference in ("TF PR #48601", "kubeflow/trainer#1763", "keras-team/keras#18624", "--rounds 3",
                      "rounds 1.06, 0.99, 0.79", "grace period 0", "a session fixture", "issues with TLS"):
        assert not work_diary_mentions(reference), reference


def test_no_work_diary_numbers_in_tracked_files() -> None:
    tracked = subprocess.run(["git", "ls-files", "-z"], cwd=REPO, capture_output=True, check=True).stdout
    found = []
    for name in tracked.decode().split("\0"):
        path = REPO / name
        if not name or path.resolve() == SELF or path.suffix not in TEXT_SUFFIXES or not path.is_file():
            continue
        try:
            text = path.read_text()
        except UnicodeDecodeError:
            continue
        for number, line in enumerate(text.splitlines(), 1):
            found += [f"{name}:{number}: {mention!r}" for mention in work_diary_mentions(line)]
    assert not found, "tracker or work-period numbers (say what they refer to instead):\n" + "\n".join(found)
