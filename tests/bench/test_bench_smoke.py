"""Every benchmark under ``bench/`` runs: at a small size each script exits 0 and prints its figure and its ratio.

docs/benchmarks.md quotes these scripts' figures and commands; a script that no longer starts (a renamed setting,
a moved module) makes those figures unrepeatable without anyone noticing, as ``make bench`` runs nowhere by itself.
Here each script runs with its own flags at the smallest size that still goes through its whole path -- start,
measure, baseline, summary -- and its output must hold the line with its figure and the line with its ratio to the
baseline of the same run. The figures themselves are meaningless at these sizes and nothing checks them.

What CI lacks is left out, and each case says so:

* TensorFlow: ``bench/ctr_vs_tf.py`` runs without ``--tf-python``, as on a machine without TensorFlow: its kubeps
  side only, and it says there is no baseline and no ratio (the other sides' ratios are to the kubeps side of the
  same run, and ``--plaintext`` here checks one of them). Its ``--gpu`` sides need a GPU (``hack/device/gpu.sh``).
* A Kubernetes API server: ``bench/operator_latency.py --smoke`` and ``bench/hostile_manifests.py --specs 30`` run on
  the test cluster (the ``kube`` fixture:
  skipped without ``hack/controlplane.sh build``, failed instead under ``KUBEPS_REQUIRE_CONTROL_PLANE=1``).
* Kubeflow's training-operator, the baseline of ``bench/side_by_side.py``, is built from the Go module proxy in
  minutes: that script is checked with ``--help`` only.
* ``bench/ps_capacity.py`` pins its processes to 2 cores with ``taskset``: skipped on a machine of one core.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
BENCH = REPO / "bench"
TIMEOUT_S = 240


@dataclass(frozen=True)
class Case:
    script: str
    args: tuple[str, ...]
    #: patterns the output must hold: the figure's line, then the ratio's (multiline regexes)
    lines: tuple[str, ...]
    #: takes ``--data``: the small CTR data set the cases share, written by the first that runs
    ctr_data: bool = False
    #: cores the script needs
    cores: int = 1


CTR_SMALL = ("--steps", "40", "--train-examples", "16384", "--eval-examples", "2048", "--warmup-executions", "1")

CASES = [
    Case("ctr_keras.py", ("--rounds", "1", "--smoke"),
         (r"^\| numpy \(examples/ctr\) \| \d+ \| 1 \|", r"^\| Keras fit \(examples/keras\) \| \d+ \| \d+\.\d\d \|")),
    Case("checkpoint_size.py", ("--gb", "0.02", "--train-s", "0.3", "--rounds", "1"),
         (r"^full save \(baseline\) +\d+\.\d\d s +\d+\.\d\d GB/s per ps",
          r"^incremental after +1% rows changed .* \d+\.\d{4}x the full save$",
          r"^training: .* ratio \d+\.\d\dx")),
    Case("ctr_vs_tf.py", ("--rounds", "1", "--plaintext", "--hot-cache", "--hot-rows", "500", "--hot-refresh-steps", "5",
                          "--dense-staleness", "2", "--floor", *CTR_SMALL),
         (r"^kubeps \(mutual TLS\) +\d+ +0\.\d{4}", r"^mutual TLS costs -?\d+\.\d% of plaintext's examples/s",
          r"^embedding rows pulled per example, hot-row cache / kubeps \(mutual TLS\): \d+ / \d+ bytes = \d\.\d{3}",
          r"^ratio dense staleness .* / kubeps \(mutual TLS\): \d+\.\d\dx examples/s; eval log-loss \d\.\d{4}",
          r"^share of the compute floor's examples/s .*: kubeps \(mutual TLS\) \d+%",
          r"^TensorFlow skipped: no baseline, no ratio$"), ctr_data=True),
    Case("criteo_reader.py", ("--lines", "3000", "--rounds", "1"),
         (r"^kubeps criteo reader +\d+ +\d+$", r"^ratio to the python loop: \d+\.\d\dx \(CPU\)")),
    Case("dispatch.py", ("--workers", "2,4", "--hosts", "1", "--closures", "100", "--idle-s", "0.2"),
         (r"^ +4 +\d+\.\d\d +\d+\.\d\d +\d+ ", r"^ratios 4 / 2 workers: chief CPU per closure \d+\.\d\dx")),
    Case("dispatch.py", ("--local", "--workers", "1,2", "--rounds", "1", "--closures", "200", "--goal-ratio", "0"),
         (r"^round \d+: +2 workers +\d+ functions/s", r"^round \d+: 2 / 1 workers \d+\.\d\dx")),
    Case("dynamic_embedding.py", ("--skip-quality", "--rows", "5000", "--steps", "10"),
         (r"dynamic \d+ steps/s, fixed \d+ steps/s: ratio \d+\.\d\dx",
          r"^ps memory per live row: dynamic \d+\.\d B .*ratio \d+\.\d\dx")),
    Case("input_formats.py", ("--rows", "4096", "--files", "2", "--rounds", "1"),
         (r"arrays \(baseline\) +[\d,]+ examples/s", r"csv +[\d,]+ examples/s +\d+\.\d{3}x arrays")),
    Case("input_pipeline.py", ("--rows", "8192", "--batches", "20", "--rounds", "1"),
         (r"block-wise \d+\.\d{3} ms/batch, element-wise \(baseline\) \d+\.\d{3} ms/batch: \d+\.\dx faster",)),
    Case("plan_cost.py", ("--ps", "2", "--workers", "8", "--plans", "2", "--sets", "1"),
         (r"every pod read again \(baseline\) \d+\.\d, observations kept \d+\.\d: \d+\.\d\dx",)),
    Case("ps_capacity.py", ("--cores", "2", "--clients", "1", "--seconds", "0.5"),  # 1 server process, then 2
         (r"^ +2 +1 +\d+ +1\.00x", r"^ +2 +2 +\d+ +\d+\.\d\dx"), cores=2),
    Case("pushpull.py", ("--mib", "4", "--repeat", "1", "--tls"),
         (r"^numpy copy +: +\d+ MB/s", r"^pull +: +\d+ MB/s .* ratio to numpy copy \d+\.\d{3}",
          r"^push \(SGD\) +: +\d+ MB/s .* ratio to numpy copy \d+\.\d{3}")),
    Case("request_cost.py", ("--repeat", "3"),  # 60 pings: past the 10 ms tick of the CPU clock
         (r"^ping +\d+\.\d\d +1\.0", r"^costliest: \S+, \d+\.\d ms of ps CPU")),
    Case("scaling.py", ("--jobs", "1+1", "--rounds", "1", *CTR_SMALL),
         (r"^ +1 \+ 1 +\d+ ", r"^ +1 \+ 1 .* 100% "), ctr_data=True),
    Case("side_by_side.py", ("--help",), (r"^usage: side_by_side\.py",)),
    Case("sparse_update.py", ("--rows", "20000", "--ids", "512", "--repeat", "3"),
         (r"kubeps apply_sparse +\d+\.\d{3} ms", r"naive: dense np\.add\.at +\d+\.\d{3} ms +-> kubeps is \d+\.\dx faster")),
]
#: run by ``test_the_hostile_manifests_benchmark_runs`` on the test cluster
HOSTILE_CASE = Case("hostile_manifests.py", ("--external", "--specs", "30", "--create-every", "5"),
                    (r"^specs: 30 ", r"^disagreements: 0$", r"^tracebacks: 0$", r"^slowest verdict: \d+\.\d{3} s"))
#: run by ``test_the_operator_benchmark_runs`` on the test cluster
OPERATOR_CASE = Case("operator_latency.py", ("--external", "--smoke"),
                     (r"^single job \(1 runs\): create -> all children p50 \d+\.\d{3} s",
                      r"^ratio single-job p50 / direct-create baseline: \d+\.\d\dx",
                      r"^ratio burst p50 / single-job p50: \d+\.\d\dx"))


def run(case: Case, tmp_path: Path, env: dict[str, str] | None = None, extra: tuple[str, ...] = ()) -> None:
    done = subprocess.run([sys.executable, str(BENCH / case.script), *case.args, *extra], cwd=tmp_path,
                          env={**os.environ, **(env or {}), "PYTHONUNBUFFERED": "1"}, capture_output=True, text=True,
                          timeout=TIMEOUT_S)
    out = done.stdout + done.stderr
    assert done.returncode == 0, f"{case.script} {' '.join(case.args)}: exit status {done.returncode}\n{out[-4000:]}"
    for pattern in case.lines:
        assert re.search(pattern, done.stdout, re.M), f"{case.script}: no line matching {pattern!r} in\n{done.stdout[-4000:]}"


@pytest.fixture(scope="module")
def ctr_data(tmp_path_factory: pytest.TempPathFactory) -> str:
    """One small CTR data set for ``ctr_vs_tf.py`` and ``scaling.py`` (written by the first that runs)."""
    return str(tmp_path_factory.mktemp("bench-ctr") / "data")


@pytest.mark.timeout(TIMEOUT_S + 30)
@pytest.mark.parametrize("case", CASES, ids=[c.script + ("-local" if "--local" in c.args else "") for c in CASES])
def test_the_benchmark_runs(case: Case, tmp_path: Path, ctr_data: str) -> None:
    if (os.cpu_count() or 1) < case.cores:
        pytest.skip(f"{case.script} pins its processes to {case.cores} cores; this machine has {os.cpu_count()}")
    run(case, tmp_path, extra=("--data", ctr_data) if case.ctr_data else ())


@pytest.mark.timeout(TIMEOUT_S + 30)
def test_the_operator_benchmark_runs(kube, tmp_path: Path) -> None:
    run(OPERATOR_CASE, tmp_path, kube.env)


@pytest.mark.timeout(TIMEOUT_S + 30)
def test_the_hostile_manifests_benchmark_runs(kube, tmp_path: Path) -> None:
    run(HOSTILE_CASE, tmp_path, kube.env)


def test_every_benchmark_has_a_case() -> None:
    """A new script under bench/ gets a case here, or it can break unseen."""
    scripts = {path.name for path in BENCH.glob("*.py")}
    covered = {case.script for case in [*CASES, OPERATOR_CASE, HOSTILE_CASE]}
    assert scripts == covered, (f"bench/ scripts without a case: {sorted(scripts - covered)}; "
                                f"cases of no script: {sorted(covered - scripts)}")
