"""Metrics are for people: the operator learns that the chief applied a membership, drained a worker or served a
checkpoint request from the chief's typed membership ack (``status.membershipAck``), never from the names of the
chief's Prometheus metrics. This scan of operator/'s syntax trees fails on any string (code or docstring) that
names one of the metrics that carry the same facts for dashboards."""

from __future__ import annotations

import ast
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
OPERATOR = REPO / "operator"

#: the chief's metrics that mirror its membership ack (runtime/coordinator/cluster_coordinator.py serves them)
ACK_METRICS = ("kubeps_membership_generation", "kubeps_workers_draining", "kubeps_checkpoint_request")


def metric_names_in(source: str) -> list[tuple[int, str]]:
    """``(line, metric)`` of every string constant of ``source`` that names one of :data:`ACK_METRICS`."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Constant) and isinstance(node.value, str):
            found.extend((node.lineno, name) for name in ACK_METRICS if name in node.value)
    return found


def test_the_scan_finds_a_metric_name_in_code_and_in_an_f_string():
    assert metric_names_in('x = "kubeps_workers_draining"\n') == [(1, "kubeps_workers_draining")]
    assert metric_names_in('y = f"{p}kubeps_checkpoint_request"\n') == [(1, "kubeps_checkpoint_request")]
    assert metric_names_in('z = "kubeps_train_step"\n') == []


def test_no_operator_module_reads_the_metrics_that_mirror_the_membership_ack():
    modules = sorted(OPERATOR.rglob("*.py"))
    assert len(modules) > 30  # the scan sees the operator
    offenders = [f"{path.relative_to(REPO)}:{line}: {name}"
                 for path in modules for line, name in metric_names_in(path.read_text())]
    assert offenders == [], "decide from kubeps.runtime.cluster.MembershipAck, not from metrics:\n" + "\n".join(
        offenders)
