"""No tracker or work-period numbers in the product: README, docs, the changelog, code comments and docstrings.

A reader of the product cannot look up "issue 24" or "session 8" and has no use for when a change was made: say
what is meant (the feature, the commit, the measured effect). References to other projects' trackers stay
("keras-team/keras#18624", "TF PR #48601", "kubeflow/trainer#721"): they name where to read.

docs/benchmarks.md is held to more: it gives the current figure of each benchmark with its command and machine, so
it names no commit (a hash) and tells no time ("2026-11-28", "later that day", "before this change"); a date may
stand only in a table's machine column. Earlier figures and before/after runs belong in CHANGELOG.md.
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


#: what looks like a commit: 7-40 lowercase hex characters with a digit among them ("3dbfeab", "8335150"); not a
#: number written as the page writes numbers ("1,325", "2048", "0.5480") nor a word of hex letters ("added")
COMMIT_HASH = re.compile(r"(?<![\w-])(?<!\d[.,])(?=[0-9a-f]*[0-9])[0-9a-f]{7,40}(?![\w-]|[.,]\d)")
ISO_DATE = re.compile(r"\b20\d\d-[01]\d-[0-3]\d\b")
MONTH = r"(?:Jan|Feb|Mar|Apr|May|Jun|Jul|Aug|Sep|Oct|Nov|Dec)[a-z]*\.?"
#: time told in prose: a date in words, a relative day or time of day, or "before/after this change"
TIME_IN_PROSE = re.compile(
    rf"\b{MONTH} \d{{1,2}}\b|\b\d{{1,2}} {MONTH} 20\d\d\b|"
    r"\b(?:later|earlier) (?:that|the same|this) (?:day|morning|afternoon|evening|week)\b|"
    r"\b(?:this|that) (?:morning|afternoon|evening)\b|\b(?:yester|to)day\b|\btonight\b|"
    r"\bthe (?:same )?days? before\b|\bthe same day\b|\blast (?:week|night)\b|"
    r"\b(?:before|after|since|until) (?:this|that|the last|the latest) (?:change|commit|session|release)\b",
    re.I)
BENCHMARKS = REPO / "docs" / "benchmarks.md"


def work_diary_mentions(text: str) -> list[str]:
    return [m.group(0) for m in WORK_DIARY.finditer(text)]


def history_mentions(line: str) -> list[str]:
    """Commit hashes, and dates or times told in prose, in a line of docs/benchmarks.md. A table row may carry a
    date in its machine column (the last cell): "2-core, 2026-11-28"."""
    found = [m.group(0) for m in COMMIT_HASH.finditer(line)] + [m.group(0) for m in TIME_IN_PROSE.finditer(line)]
    cells = line.strip().strip("|").split("|") if line.lstrip().startswith("|") else None
    prose = "|".join(cells[:-1]) if cells and len(cells) > 1 else line
    return found + [m.group(0) for m in ISO_DATE.finditer(prose)]


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


def test_the_history_pattern_tells_history_from_figures() -> None:
    for history in ("at 3dbfeab", "(8335150 -> 90e2a81)", "changed (8335150):", "2026-11-23, c8e706b, `--reps 2`", "before (ffa1c6d) and after", "2-core, 2026-11-28, quiet",
                    "The same command, later that day:", "Earlier the same day, on the same host", "this morning",
                    "before this change", "in the quiet runs of the days before", "measured on Nov 28",
                    "on 28 November 2026", "yesterday's run", "| 1.59x | 2-core | 2026-11-28 | note |"):
        assert history_mentions(history), history
    for figure in ("1,325 MB/s", "1,966,836; 2,094,725", "0.41454 (+0.166 %)", "a 2^20 x 16 table", "batch 2048", "eps 1e-7", "`--shape wide`", "decade",
                   "added", "141-64-32-1", "tf-python /path/tfenv/bin/python", "| 1.59x | >= 1.5x | 2-core, 2026-11-28 |",
                   "the chief's CPU since the change", "a date may stand in a table"):
        assert not history_mentions(figure), figure


def test_the_benchmarks_page_names_no_commit_and_tells_no_time() -> None:
    found = [f"docs/benchmarks.md:{number}: {mention!r}"
             for number, line in enumerate(BENCHMARKS.read_text().splitlines(), 1)
             for mention in history_mentions(line)]
    assert not found, ("docs/benchmarks.md gives the current figures, not their history (move it to CHANGELOG.md):\n"
                       + "\n".join(found))
