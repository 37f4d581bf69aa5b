"""The operator's metrics, named as training-operator's: job transitions counted per namespace, the time to Running,
restarts by role and reason, the jobs in each phase read at scrape time; and its JSON log lines."""

from __future__ import annotations

import json
import logging
from datetime import datetime, timedelta, timezone

import pytest
from prometheus_client import REGISTRY, generate_latest

from kubeps.operator.controller import metrics
from kubeps.operator.controller.recorder import Recorder
from kubeps.operator.controller.settings import Settings
from kubeps.operator.main import configure_logging, settings_from_args


def _job(namespace: str, created_s_ago: float = 30.0, conditions: tuple[str, ...] = ()) -> dict:
    created = (datetime.now(timezone.utc) - timedelta(seconds=created_s_ago)).strftime("%Y-%m-%dT%H:%M:%SZ")
    return {"metadata": {"name": "ctr", "namespace": namespace, "uid": "u", "creationTimestamp": created},
            "status": _status(*conditions)}


def _status(*true: str, restarts: dict | None = None, reason: str = "") -> dict:
    conditions = [{"type": t, "status": "True", **({"reason": reason} if t == "Restarting" else {})} for t in true]
    return {"conditions": conditions,
            "replicaStatuses": {role: {"restarts": n} for role, n in (restarts or {}).items()}}


def _value(name: str, labels: dict | None = None) -> float:
    return REGISTRY.get_sample_value(name, labels or {}) or 0.0


def test_transitions_count_jobs_per_namespace_as_training_operator_names_them():
    ns = "metrics-a"
    job = _job(ns, created_s_ago=42)
    before = {k: _value(f"kubeps_jobs_{k}_total", {"namespace": ns}) for k in ("created", "successful", "restarted")}
    running_before = _value("kubeps_job_time_to_running_seconds_count")
    Recorder.transitions(_status(), _status("Created"), job)
    Recorder.transitions(_status("Created"), _status("Created", "Running"), job)
    Recorder.transitions(_status("Created", "Running"), _status("Created", "Running", "Restarting",
                                                                   restarts={"PS": 1}, reason="PSRestarting"), job)
    Recorder.transitions(_status("Created", "Running"), _status("Created", "Running", "Succeeded"), job)
    assert _value("kubeps_jobs_created_total", {"namespace": ns}) == before["created"] + 1
    assert _value("kubeps_jobs_successful_total", {"namespace": ns}) == before["successful"] + 1
    assert _value("kubeps_jobs_restarted_total", {"namespace": ns}) == before["restarted"] + 1
    assert _value("kubeps_restarts_total", {"role": "PS", "reason": "PSRestarting"}) >= 1
    assert _value("kubeps_job_time_to_running_seconds_count") == running_before + 1
    # the observation is the job's age when it first ran: about 42 s, in the (30, 60] bucket
    assert _value("kubeps_job_time_to_running_seconds_bucket", {"le": "60.0"}) > \
        _value("kubeps_job_time_to_running_seconds_bucket", {"le": "30.0"})


def test_a_failed_job_is_counted_with_its_namespace_and_reason():
    ns = "metrics-b"
    failed = {"conditions": [{"type": "Failed", "status": "True", "reason": "BackoffLimitExceeded"}]}
    Recorder.transitions(_status("Created"), failed, _job(ns))
    assert _value("kubeps_jobs_failed_total", {"namespace": ns, "reason": "BackoffLimitExceeded"}) == 1


@pytest.mark.parametrize("conditions, phase", [
    ((), "Pending"), (("Created",), "Created"), (("Created", "Running"), "Running"),
    (("Created", "Running", "Restarting"), "Restarting"), (("Created", "Suspended"), "Suspended"),
    (("Created", "Running", "Succeeded"), "Succeeded"), (("Created", "Failed"), "Failed"),
])
def test_phase_of_is_the_last_true_condition(conditions, phase):
    assert metrics.phase_of(_job("x", conditions=conditions)) == phase


def test_the_phase_gauge_counts_the_watched_jobs_at_each_scrape():
    jobs = [_job("a", conditions=("Created", "Running")), _job("b", conditions=("Created", "Running")),
            _job("c", conditions=("Created", "Failed"))]
    collector = metrics.watch_jobs(lambda: jobs)
    try:
        assert _value("kubeps_jobs", {"phase": "Running"}) == 2
        assert _value("kubeps_jobs", {"phase": "Failed"}) == 1
        assert _value("kubeps_jobs", {"phase": "Succeeded"}) == 0  # every phase is shown
        jobs.pop()
        assert _value("kubeps_jobs", {"phase": "Failed"}) == 0
        assert b"kubeps_jobs{phase=\"Running\"} 2.0" in generate_latest(REGISTRY)
    finally:
        REGISTRY.unregister(collector)


def test_json_logs_are_an_option(capsys):
    assert settings_from_args(["--log-format", "json"]).log_format == "json"
    assert Settings.from_env({"KUBEPS_LOG_FORMAT": "json"}).log_format == "json"
    with pytest.raises(ValueError, match="'KUBEPS_LOG_FORMAT' has invalid value 'xml': one of text, json"):
        Settings.from_env({"KUBEPS_LOG_FORMAT": "xml"})
    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level
    try:
        configure_logging(Settings(log_format="json"))
        logging.getLogger("kubeps.operator.test").warning("hello %s", "json")
    finally:
        for handler in list(root.handlers):
            root.removeHandler(handler)
        for handler in handlers:
            root.addHandler(handler)
        root.setLevel(level)
    lines = [json.loads(line) for line in capsys.readouterr().err.splitlines() if line.startswith("{")]
    assert any(line.get("message") == "hello json" and line.get("severity") == "warn" for line in lines), lines
