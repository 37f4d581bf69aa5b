"""Hostile manifests against the real API server: for every spec generated from the CRD's own schema (valid values,
mutations, hostile YAML text), ``kubeps validate`` gives the API server's verdict (a dry-run create with strict field
validation; the text through ``kubectl`` where only kubectl's YAML reader can say what it means), never a traceback,
each verdict within 2 s. The generator and the judging are ``bench/hostile_manifests.py``'s, which runs >= 10,000
(docs/benchmarks.md); here a few hundred, derandomized."""

from __future__ import annotations

import importlib.util
import os
import sys

import pytest
from hypothesis import HealthCheck, given, settings

from .conftest import REPO, delete_namespace, make_namespace

_spec = importlib.util.spec_from_file_location("hostile_manifests", REPO / "bench" / "hostile_manifests.py")
hostile = importlib.util.module_from_spec(_spec)
sys.modules["hostile_manifests"] = hostile
_spec.loader.exec_module(hostile)

EXAMPLES = int(os.environ.get("KUBEPS_HOSTILE_EXAMPLES") or 250)


@pytest.fixture(scope="module")
def server(crd, kube):
    namespace = make_namespace(kube, "hostile-")
    kubectl = os.path.join(kube.bin_dir, "kubectl") if kube.bin_dir else "kubectl"
    warm_up = (REPO / "examples" / "jobs" / "minimal-job.yaml").read_text()
    assert hostile.kubeps_verdict(warm_up).accepted  # the schema and CEL programs built, untimed
    yield hostile.ApiServer(kube.kubeconfig, kubectl, namespace)
    delete_namespace(kube, namespace)


@pytest.mark.timeout(900)
def test_kubeps_validate_gives_the_api_servers_verdict_on_every_hostile_manifest(server):
    tally = hostile.Tally()

    @settings(max_examples=EXAMPLES, derandomize=True, deadline=None, database=None,
              suppress_health_check=list(HealthCheck))
    @given(hostile.specs())
    def check(spec):
        ours, theirs = hostile.judge(server, spec, tally)
        assert not ours.traceback, f"{spec.text[:2000]}\n{ours.detail}"
        assert ours.accepted == theirs.accepted, (
            f"kubeps {'accepts' if ours.accepted else 'refuses'}, the API server "
            f"{'accepts' if theirs.accepted else 'refuses'} ({spec.how}):\n{spec.text[:2000]}\n--- kubeps: "
            f"{ours.detail}\n--- API server: {theirs.detail}")
        assert ours.seconds < 2.0, (ours.seconds, spec.how, len(spec.text))

    check()
    assert tally.accepted and tally.specs - tally.accepted, "the generator must give valid and invalid specs"
    assert set(tally.by_how) == {"json", "quoted", "kubectl"}, tally.by_how
