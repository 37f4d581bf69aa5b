"""XLA's CPU thread pool is sized to the task's CPU budget (``kubeps.runtime.models.xla``), in fresh processes."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

pytest.importorskip("jax")

CODE = """
import json, os
from kubeps.runtime.models import xla
from kubeps.runtime.settings import TaskSettings
budget = xla.size_cpu_backend(settings=TaskSettings.from_env())
import jax, jax.numpy as jnp
jax.jit(lambda a: (a @ a).sum())(jnp.ones((256, 256))).block_until_ready()
masks = {len(os.sched_getaffinity(int(t))) for t in os.listdir("/proc/self/task")}
print(json.dumps([budget, xla.xla_pool_threads(), sorted(masks)]))
"""


def run(cpus: str | None) -> list:
    env = {k: v for k, v in os.environ.items() if k != "KUBEPS_CPUS"}
    if cpus is not None:
        env["KUBEPS_CPUS"] = cpus
    out = subprocess.run([sys.executable, "-c", CODE], env=env, capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.skipif(not hasattr(os, "sched_setaffinity"), reason="sizing the pool needs sched_setaffinity (Linux)")
def test_the_pool_has_one_thread_per_cpu_of_the_budget_and_every_thread_keeps_all_cpus():
    allowed = len(os.sched_getaffinity(0))
    budget, pool, masks = run("1")
    assert (budget, pool) == (1, 1)
    assert masks == [allowed]  # the window was only for creating the pool: every thread may use every CPU again
    budget, pool, masks = run(None)  # no KUBEPS_CPUS: the whole machine (or the cgroup quota)
    assert budget == pool and masks == [allowed]


def test_without_jax_the_error_names_the_extra(monkeypatch):
    from kubeps.runtime.models import xla

    monkeypatch.setitem(sys.modules, "jax", None)  # `import jax` raises ImportError
    with pytest.raises(ImportError, match=r"pip install 'kubeps\[jax\]'"):
        xla.import_jax()
