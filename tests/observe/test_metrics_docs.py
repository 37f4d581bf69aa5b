"""docs/observability.md against live scrapes: every runtime metric it lists shows up on the tasks of real
``kubeps local`` CTR runs (a hashed-ids table on range shards, and a dynamic table, with checkpoints), and every
``kubeps_`` metric the tasks serve is listed. Each task is scraped every 0.3 s while the job runs; the last good
scrape of each task counts."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

REPO = Path(__file__).resolve().parents[2]
DOC = REPO / "docs" / "observability.md"
EXAMPLE = REPO / "examples" / "ctr" / "train.py"
START_LINE = re.compile(r"\[kubeps\] (?P<task>\S+) pid \d+ at \S+, metrics (?P<url>http://\S+/metrics)")
ROW = re.compile(r"^\| `(?P<name>kubeps_[a-z_]+)` \| (?P<type>counter|gauge|histogram) \|.*\| (?P<what>[^|]*) \|$")


def section(heading: str) -> list[str]:
    """The lines of docs/observability.md under ``## heading``, up to the next ``##``."""
    text = DOC.read_text().split(f"\n## {heading}\n", 1)[1]
    return text.split("\n## ", 1)[0].splitlines()


def documented() -> dict[str, str]:
    """``{metric: what}`` of the runtime table of docs/observability.md."""
    rows = {m["name"]: m["what"] for line in section("The runtime's metrics") if (m := ROW.match(line))}
    assert len(rows) > 30, "the metrics table of docs/observability.md was not found"
    return rows


def run_and_scrape(tmp_path: Path, *script_args: str) -> dict[str, str]:
    """Run the CTR example under ``kubeps local`` (metrics on), scraping every task; ``{task: last scrape}``."""
    env = {**os.environ, "KUBEPS_HOTSPOT_INTERVAL_S": "1"}
    cmd = [sys.executable, "-m", "kubeps.runtime.cli", "local", "--ps", "2", "--workers", "2", str(EXAMPLE), "--",
           "--train-examples", "50000", "--eval-examples", "10000", "--checkpoint-every", "100",
           "--checkpoint-dir", str(tmp_path / "ckpt"), *script_args]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env, cwd=tmp_path)
    urls: dict[str, str] = {}
    scraped: dict[str, str] = {}

    def scrape() -> None:
        while proc.poll() is None:
            for task, url in list(urls.items()):
                try:
                    scraped[task] = urllib.request.urlopen(url, timeout=2).read().decode()
                except OSError:
                    pass  # not serving yet, or gone
            time.sleep(0.3)

    thread = threading.Thread(target=scrape, daemon=True)
    thread.start()
    lines = []
    assert proc.stdout is not None
    for line in proc.stdout:
        lines.append(line)
        if m := START_LINE.search(line):
            urls[m["task"]] = m["url"]
    proc.wait(timeout=30)
    thread.join(timeout=5)
    output = "".join(lines)
    assert proc.returncode == 0, output[-4000:]
    assert set(urls) == {"chief-0", "ps-0", "ps-1", "worker-0", "worker-1"}, output[:2000]
    assert set(scraped) == set(urls), (sorted(scraped), output[-2000:])
    return scraped


def shown(scrapes: dict[str, str]) -> tuple[dict[str, set[str]], set[str]]:
    """``({metric: tasks with a sample of it}, every metric declared)``: a histogram by its family name, a counter
    by its ``_total`` name."""
    with_samples: dict[str, set[str]] = {}
    declared: set[str] = set()
    for task, text in scrapes.items():
        declared |= set(re.findall(r"^# TYPE (kubeps_\w+) ", text, re.M))
        for family in text_string_to_metric_families(text):
            if not family.name.startswith("kubeps_") or not family.samples:
                continue
            names = {family.name} if family.type == "histogram" else {s.name for s in family.samples}
            for name in names:
                with_samples.setdefault(name, set()).add(task.rsplit("-", 1)[0])
    return with_samples, declared


@pytest.fixture(scope="module")
def scrapes(tmp_path_factory) -> list[dict[str, str]]:
    hashed = run_and_scrape(tmp_path_factory.mktemp("hashed"), "--steps", "600")
    dynamic = run_and_scrape(tmp_path_factory.mktemp("dynamic"), "--steps", "200", "--ids", "raw40")
    return [hashed, dynamic]


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_every_documented_metric_is_in_a_live_scrape_on_the_tasks_the_docs_name(scrapes):
    rows = documented()
    seen: dict[str, set[str]] = {}
    declared: set[str] = set()
    for scrape in scrapes:
        with_samples, names = shown(scrape)
        declared |= names
        for name, tasks in with_samples.items():
            seen.setdefault(name, set()).update(tasks)
    table = {m["name"]: m.group(0) for line in section("The runtime's metrics") if (m := ROW.match(line))}
    for name, what in rows.items():
        if "(only " in what:  # a metric with samples only in a state these runs are not in: declared at least
            assert name in declared, name
            continue
        assert name in seen, f"{name} is documented but no task showed a sample of it"
        tasks = set(re.findall(r"chief|worker|ps", table[name].split("|")[4]))
        assert tasks <= seen[name], f"{name}: documented on {sorted(tasks)}, shown by {sorted(seen[name])}"


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_every_metric_a_task_serves_is_documented(scrapes):
    rows = documented()
    for scrape in scrapes:
        with_samples, declared = shown(scrape)
        undocumented = sorted((set(with_samples) | {n for n in declared if not n.endswith("_created")}) - set(rows))
        assert not undocumented, f"served but not in docs/observability.md: {undocumented}"


def test_the_operator_table_lists_exactly_the_operator_metrics():
    """The operator's registry (its module imported, so every metric declared) against the operator's table."""
    from prometheus_client import REGISTRY, generate_latest

    from kubeps.operator.controller import metrics

    collector = metrics.watch_jobs(lambda: [])
    try:
        served = set(re.findall(r"^# TYPE (kubeps_\w+) ", generate_latest(REGISTRY).decode(), re.M))
    finally:
        REGISTRY.unregister(collector)
    rows = {m[1] for line in section("The operator's metrics")
            if (m := re.match(r"^\| `(kubeps_[a-z_]+)` \|", line))}
    runtime = set(documented())
    operator = {name for name in served if name not in runtime and not name.endswith("_created")}
    assert rows and rows == operator, sorted(rows ^ operator)


def _metric_names(query: str) -> set[str]:
    """The metrics a PromQL query names (a histogram by its family name): label matchers, ``by (...)`` lists and
    ``label_values``' label argument are not metrics."""
    query = re.sub(r"\{[^}]*\}", "", query)
    query = re.sub(r"\b(by|without)\s*\([^)]*\)", "", query)
    query = re.sub(r"label_values\((\w+),\s*\w+\)", r"\1", query)
    names = re.findall(r"\b((?:kubeps|process)_\w+?)(?:_bucket|_sum|_count)?\b(?!\s*\()", query)
    return set(names)


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_every_dashboard_query_names_a_metric_of_a_live_scrape_or_the_operator(scrapes):
    """charts/kubeps/files/dashboard.json: a runtime metric must be in the live scrapes, an operator one in the
    operator's table (test_the_operator_table_lists_exactly_the_operator_metrics ties it to the registry)."""
    import json

    dashboard = json.loads((REPO / "charts" / "kubeps" / "files" / "dashboard.json").read_text())
    queries = [t["expr"] for panel in dashboard["panels"] for t in panel["targets"]]
    queries.append(next(v["query"] for v in dashboard["templating"]["list"] if v["name"] == "job"))
    seen: set[str] = set()
    for scrape in scrapes:
        with_samples, declared = shown(scrape)
        seen |= set(with_samples) | declared
        seen |= {n for text in scrape.values() for n in re.findall(r"^(process_\w+) ", text, re.M)}
    operator = {m[1] for line in section("The operator's metrics") if (m := re.match(r"^\| `(kubeps_[a-z_]+)` \|", line))}
    assert len(queries) > 20
    for query in queries:
        names = _metric_names(query)
        assert names, query
        for name in names:
            assert name in seen or f"{name}_total" in seen or name in operator, (name, query)


def test_every_query_names_documented_metrics():
    rows = documented()
    text = DOC.read_text()
    queries = re.findall(r"^\| [^|]+ \| `(.+)` \|$", text, re.M)
    assert len(queries) >= 6
    for query in queries:
        for name in re.findall(r"\b(kubeps_\w+?)(?:_bucket|_sum|_count)?\b", query):
            assert name in rows or f"{name}_total" in rows, (name, query)
