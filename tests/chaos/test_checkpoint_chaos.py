"""Kill the saving process at random moments, many times: the latest complete checkpoint always restores, its
checksums verify and its values are exactly those of its step; interrupted saves are ignored and cleaned up.

Two savers: the coordinator writing local variables itself, and a coordinator whose variables live on two real
parameter servers that write their own shards (the PS processes are killed too, sometimes)."""

from __future__ import annotations

import os
import random
import subprocess
import sys
import textwrap
import time

import numpy as np
import pytest

from kubeps.runtime.checkpoint import (
    CheckpointReader,
    latest_checkpoint,
    list_checkpoints,
    verify_checkpoint,
)

from kubeps.runtime.cluster import TFConfig

from .conftest import PSProcesses, report

pytestmark = [pytest.mark.slow, pytest.mark.timeout(200)]

SAVER = textwrap.dedent("""
    import sys
    import numpy as np
    from kubeps.runtime.checkpoint import Checkpoint, CheckpointManager, StepCounter

    def values(step):
        return {f"v{i}": np.full((256, 512), step * 10 + i, np.float32) for i in range(6)}

    directory = sys.argv[1]
    saves = int(sys.argv[2]) if len(sys.argv) > 2 else 10**9  # the final run stops on its own, never mid-sweep
    arrays = values(0)
    step = StepCounter()
    mgr = CheckpointManager(Checkpoint(model=arrays, step=step), directory, max_to_keep=2)
    start = mgr.restore_or_initialize()
    for name, arr in values(start).items():
        assert np.array_equal(arrays[name], arr), name
    print("ready", flush=True)
    for s in range(start + 1, start + 1 + saves):
        for name, arr in values(s).items():
            arrays[name][...] = arr
        step.assign(s)
        mgr.save()
""")


def _check_latest(directory: str) -> int:
    """The latest checkpoint verifies and holds exactly the values of its step; returns the step."""
    path = latest_checkpoint(directory)
    if path is None:
        return -1
    manifest = verify_checkpoint(path)
    reader = CheckpointReader(path)
    step = manifest.step
    for i in range(6):
        got = reader.get(f"model/v{i}")
        assert got.shape == (256, 512) and np.all(got == step * 10 + i), f"{path} v{i} is not step {step}'s"
    return step


def test_kill_local_saver_during_saves(tmp_path):
    directory = str(tmp_path / "ckpt")
    script = tmp_path / "saver.py"
    script.write_text(SAVER)
    rng = random.Random(11)
    steps, partial_seen, kills = [], 0, 30
    for _ in range(kills):
        proc = subprocess.Popen([sys.executable, str(script), directory], stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True)
        try:
            line = proc.stdout.readline()
            assert line.strip() == "ready", proc.stderr.read()
            time.sleep(rng.uniform(0.0, 0.25))
        finally:
            proc.kill()  # this test's own child
            proc.wait(timeout=10)
        names = os.listdir(directory)
        committed = {os.path.basename(p) for _, p in list_checkpoints(directory)}
        partial_seen += sum(1 for n in names if n.startswith("ckpt-") and n not in committed)
        steps.append(_check_latest(directory))
    assert steps[-1] > 0 and all(b >= a for a, b in zip(steps, steps[1:])), steps
    assert partial_seen > 0, "no kill landed inside a save; the test would prove nothing"
    # the next run's first save removes every interrupted one
    committed = {os.path.basename(p) for _, p in list_checkpoints(directory)}
    leftovers = [n for n in os.listdir(directory) if n.startswith("ckpt-") and n not in committed]
    # it exits by itself after three saves: a kill here could land inside the max_to_keep sweep, which by design
    # leaves an uncommitted directory for the next save to remove, and the check below would flake
    done = subprocess.run([sys.executable, str(script), directory, "3"], capture_output=True, text=True,
                          timeout=60)
    assert done.returncode == 0, done.stderr
    assert _check_latest(directory) == steps[-1] + 3
    committed = {os.path.basename(p) for _, p in list_checkpoints(directory)}
    remaining = [n for n in os.listdir(directory) if n.startswith("ckpt-") and n not in committed]
    assert remaining == [], f"interrupted saves {remaining} survived a clean run (were: {leftovers})"
    assert len(committed) <= 2, "max_to_keep=2"
    report("kill_during_local_saves", {"kills": kills, "partial_checkpoints_seen": partial_seen,
                                       "final_step": steps[-1]})


PS_SAVER = textwrap.dedent("""
    import sys, time
    import numpy as np
    from kubeps.runtime.checkpoint import Checkpoint, CheckpointManager, StepCounter
    from kubeps.runtime.cluster import TFConfig, TFConfigClusterResolver
    from kubeps.runtime.errors import PSUnavailableError
    from kubeps.runtime.variables.partitioners import FixedShardsPartitioner
    from kubeps.runtime.coordinator.strategy import ParameterServerStrategy
    from kubeps.runtime.variables.variable import Variable

    directory, tf_config = sys.argv[1], sys.argv[2]
    strategy = ParameterServerStrategy(TFConfigClusterResolver(tf_config=tf_config),
                                       variable_partitioner=FixedShardsPartitioner(3))
    for ps in range(strategy.num_ps):
        while True:
            try:
                strategy.transport.call(ps, "Ping", {})
                break
            except PSUnavailableError:
                time.sleep(0.05)
    with strategy.scope():
        variables = {f"v{i}": Variable(np.zeros((256, 512), np.float32), name=f"v{i}") for i in range(6)}
    step = StepCounter()
    mgr = CheckpointManager(Checkpoint(model=variables, step=step), directory, max_to_keep=2)
    start = mgr.restore_or_initialize()
    print("ready", flush=True)
    for s in range(start + 1, 10**9):
        for i, v in enumerate(variables.values()):
            v.assign(np.full((256, 512), s * 10 + i, np.float32))
        step.assign(s)
        mgr.save()
""")


def test_kill_ps_backed_saver_and_parameter_servers_during_saves(tmp_path):
    directory = str(tmp_path / "ckpt")
    script = tmp_path / "ps_saver.py"
    script.write_text(PS_SAVER)
    servers = PSProcesses(2, tmp_path)
    rng = random.Random(5)
    steps, ps_kills, kills = [], 0, 16
    try:
        servers.start_all()
        chief_config = TFConfig.for_task(servers.cluster, "chief", 0).to_json()
        for round_ in range(kills):
            proc = subprocess.Popen([sys.executable, str(script), directory, chief_config], stdout=subprocess.PIPE,
                                    stderr=subprocess.PIPE, text=True, env=servers.env)
            try:
                line = proc.stdout.readline()
                assert line.strip() == "ready", proc.stderr.read()
                time.sleep(rng.uniform(0.05, 0.4))
                if round_ % 4 == 3:  # sometimes a parameter server dies in the middle of a save
                    servers.kill(rng.randrange(2))
                    ps_kills += 1
            finally:
                proc.kill()  # this test's own child
                proc.wait(timeout=10)
            servers.start_all()  # a restarted ps is empty: the next saver restores into it
            steps.append(_check_latest(directory))
    finally:
        servers.stop()
    assert steps[-1] > 0 and all(b >= a for a, b in zip(steps, steps[1:])), steps
    report("kill_during_ps_saves", {"kills": kills, "ps_kills": ps_kills, "final_step": steps[-1]})
