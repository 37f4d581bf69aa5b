"""Hypothesis profiles of the fuzz suite. ``ci`` (the default) keeps the whole suite under a minute on two
busy cores; ``KUBEPS_FUZZ=long`` runs the opt-in long profile. docs/testing.md lists the inputs per target."""

from __future__ import annotations

import os

import pytest
from hypothesis import HealthCheck, settings

#: inputs per target, by profile (docs/testing.md repeats this table); ``KUBEPS_FUZZ_EXAMPLES`` overrides the long
#: profile's count (hack/device/fuzz.sh splits a long run over many processes, each with its own seed)
EXAMPLES = {"ci": 150, "long": int(os.environ.get("KUBEPS_FUZZ_EXAMPLES") or 25_000)}

for _name, _count in EXAMPLES.items():
    settings.register_profile(
        _name, max_examples=_count, deadline=None, derandomize=_name == "ci", print_blob=True,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.filter_too_much],
    )
settings.load_profile(os.environ.get("KUBEPS_FUZZ") or "ci")


def pytest_collection_modifyitems(items):
    """The long profile runs as long as it takes: no pytest-timeout on its targets."""
    if os.environ.get("KUBEPS_FUZZ") == "long":
        for item in items:
            if "tests/fuzz/" in str(item.fspath).replace(os.sep, "/"):
                item.add_marker(pytest.mark.timeout(0))
