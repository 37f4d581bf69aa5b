"""Every fenced code block in README.md and docs/*.md runs, as a user would run it.

One parametrized test over every block, ids ``file:line``. What happens to a block depends on its language:

* ``python``: a whole program (it branches on the task type and starts a ``Server``) runs under ``kubeps local``
  (``--ps 2 --workers 2``, or the arguments of a ``local`` marker); any other block runs with ``python``. Each in a
  fresh directory, with a timeout: a doc example that hangs is a bug.
* ``sh``, ``bash``, ``console``: shell commands. Those that are cheap and local (``RUN_SHELL``) run with bash in
  the repository; those that need a cluster, a registry, TensorFlow or minutes of
  benchmark are listed in ``NOT_RUN`` below with the reason (a stale entry fails too, so the list stays true).
* ``text``: output, listings, synopses; not code.
* an unlabelled block fails: say what it is.

A marker on the line before a block (an HTML comment, invisible on GitHub) changes what happens; docs/testing.md
documents them:

* ``<!-- kubeps-doc-test: skip REASON -->`` does not run it;
* ``<!-- kubeps-doc-test: covered-by PATH -->`` says another test runs it (PATH must exist), e.g. a block of
  docs/models.md that its own test runs with a runner of its own;
* ``<!-- kubeps-doc-test: local ARGS -->`` runs a whole program with ``kubeps local ARGS``.
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
DOCS = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
MARKER = re.compile(r"<!--\s*kubeps-doc-test:\s*(skip|covered-by|local)\b\s*(.*?)\s*-->")
FENCE = re.compile(r"^(\s*)```(\S*)\s*$")
RUN_LANGUAGES = {"python"}
SHELL_LANGUAGES = {"sh", "bash", "console"}
TEXT_LANGUAGES = {"text"}
PYTHON_TIMEOUT_S = 60
LOCAL_TIMEOUT_S = 150

#: shell blocks that are cheap and local: run with bash in the repository, the venv's commands first on PATH
RUN_SHELL = {
    ("docs/train-on-kubernetes.md", "kubeps validate examples/ctr/job.yaml examples/jobs/*.yaml"),
    ("docs/benchmarks.md", ".venv/bin/python bench/plan_cost.py --ps 50 --workers 1000"),
    ("docs/features.md", "kubeps validate examples/criteo/job.yaml"),
}
SHELL_TIMEOUT_S = 60

#: shell blocks that are not run here, by (file, first line of the block): why
NOT_RUN = {
    ("docs/features.md", "kubeps local --ps 2 --workers 2 examples/criteo/train.py -- --model wdl"):
        "three trainings of minutes; tests/models/test_criteo_example.py runs each model at a small size",
    ("README.md", "make example   # creates .venv, installs kubeps, trains examples/ctr with `kubeps local` (2 ps, 2 workers)"):
        "make test would run this suite recursively; make example's command is tests/runtime/test_example_ctr.py's, "
        "and tests/readme/test_readme.py checks both targets exist",
    ("docs/train-on-kubernetes.md", "helm install kubeps charts/kubeps --namespace kubeps-system --create-namespace   # or:"):
        "needs a Kubernetes cluster; tests/e2e installs with the chart and tests/packaging renders it",
    ("docs/train-on-kubernetes.md", "kubectl apply -f examples/ctr/job.yaml"): "needs a cluster with the operator (tests/e2e)",
    ("docs/benchmarks.md", "python3 -m venv /path/tfenv && /path/tfenv/bin/pip install tensorflow-cpu==2.21.0     # the TF side, once"):
        "installs TensorFlow and benchmarks for minutes (make bench)",
    ("docs/benchmarks.md", ".venv/bin/python bench/ctr_vs_tf.py --shape wdl --rounds 2 --steps 800 --dense-staleness 3 --jax --keras \\"):
        "a benchmark of tens of minutes that needs TensorFlow; tests/bench/test_bench_smoke.py runs ctr_vs_tf.py small",
    ("docs/benchmarks.md", ".venv/bin/python bench/ctr_vs_tf.py --shape wide --rounds 3 --steps 1600 [--tf-python /path/tfenv/bin/python]"):
        "benchmarks for minutes; the driver's options are parsed by bench/ctr_vs_tf.py itself",
    ("docs/benchmarks.md", ".venv/bin/python bench/hostile_manifests.py --specs 10000 --seed 0"):
        "starts a control plane and judges 10,000 specs (~40 min); tests/bench/test_bench_smoke.py runs it with 30",
    ("docs/benchmarks.md", ".venv/bin/python bench/ps_capacity.py --cores 1,2 --clients 4 --seconds 8"):
        "benchmarks for minutes, pinning processes to cores",
    ("docs/benchmarks.md", ".venv/bin/python bench/scaling.py --jobs 2+2,4+8 --steps 3000 --rounds 2 --gil-seconds 4"):
        "benchmarks for minutes, sampling two tasks with py-spy (not a dependency of kubeps)",
    ("docs/benchmarks.md", "KUBEPS_CPUS=1 .venv/bin/python bench/ctr_vs_tf.py --ps 1 --workers 1 --rounds 1 --steps 1500   # then KUBEPS_CPUS=2"):
        "benchmarks for minutes (twice)",
    ("docs/benchmarks.md", "kubeps local --ps 2 --workers 2 examples/ctr/train.py      # 2400 steps of 512, ~4 passes over 300k examples"):
        "the CTR example: tests/runtime/test_example_ctr.py runs it",
    ("docs/benchmarks.md", ".venv/bin/python bench/side_by_side.py             # --jobs 50 --reps 2; private loopback control plane, ~10 min"):
        "a 10-minute benchmark (make bench)",
    ("docs/benchmarks.md", ".venv/bin/python bench/ctr_keras.py --rounds 3        # kubeps local --ps 2 --workers 2, both examples, alternating"):
        "a benchmark of minutes (make bench); tests/models runs the Keras example",
    ("docs/benchmarks.md", ".venv/bin/python bench/ctr_vs_tf.py --jax --rounds 3 --steps 1000"):
        "a benchmark of minutes (make bench)",
    ("docs/benchmarks.md", ".venv/bin/python bench/ctr_vs_tf.py --hot-cache --rounds 1 --steps 3000    # --hot-rows 50000 --hot-refresh-steps 30"):
        "a benchmark of minutes (make bench); tests/bench runs it small with --hot-cache",
    ("docs/benchmarks.md", ".venv/bin/python bench/ctr_vs_tf.py --tf-python /tmp/tfenv/bin/python --plaintext --rounds 3 --steps 2000"):
        "a benchmark of minutes (make bench) with TensorFlow beside it",
    ("docs/benchmarks.md", ".venv/bin/python bench/input_formats.py --rounds 5 [--tf-python /path/tfenv/bin/python]"):
        "a benchmark of minutes (make bench); tests/runtime/test_data_formats.py reads every format",
    ("docs/benchmarks.md", "make bench        # every bench/*.py with its defaults"):
        "runs every benchmark, minutes each",
    ("docs/benchmarks.md", ".venv/bin/python bench/ctr_vs_tf.py --overlap --rounds 3 --steps 2000          # overlap on and off, CPU"):
        "a benchmark of minutes; its GPU lines need a GPU machine (hack/device/gpu.sh runs them there)",
    ("docs/benchmarks.md", ".venv/bin/python bench/dispatch.py --workers 8,64,256 --hosts 12 --closures 6000 --idle-s 1 [--closures-per-call 1]"):
        "a benchmark of minutes that starts 256 workers; tests/runtime/test_closure_queue.py tests the wake-ups and "
        "tests/runtime/test_batched_dispatch.py the calls of several functions",
    ("docs/benchmarks.md", ".venv/bin/python bench/dispatch.py --workers 8,64,256 --hosts 12 --closures 6000 --idle-s 1 [--gil-switch-interval 0]"):
        "a benchmark of minutes that starts 256 workers; tests/runtime/test_batched_dispatch.py checks the "
        "coordinator holds the switch interval and tests/runtime/test_gil.py how it is held",
    ("docs/benchmarks.md", ".venv/bin/python bench/dispatch.py --local --workers 2,64 --rounds 3 --closures 4000"):
        "a benchmark of minutes that starts 64 worker processes; tests/bench/test_bench_smoke.py runs the same "
        "--local mode with 1 and 2 workers",
    ("docs/benchmarks.md", ".venv/bin/python -m pytest tests/chaos/test_scale_chaos.py -s     # prints CHAOS {...}"):
        "runs a test file that make test runs itself",
    ("docs/benchmarks.md", ".venv/bin/python bench/request_cost.py --repeat 20"):
        "a benchmark (make bench); tests/runtime/test_hostile_second_pass.py checks the same bounds",
    ("docs/benchmarks.md", ".venv/bin/python bench/ctr_vs_tf.py --metrics-off --rounds 4 --steps 3000"):
        "a benchmark of minutes (make bench)",
    ("docs/benchmarks.md", ".venv/bin/python bench/dynamic_embedding.py                  # all three figures (two kubeps local runs, ~1.5 min)"):
        "a benchmark of minutes (make bench); tests/runtime/test_example_ctr_dynamic.py runs the example",
    ("docs/benchmarks.md", ".venv/bin/python bench/checkpoint_size.py --gb 1 --train-s 3 --rounds 2"):
        "a benchmark of minutes on a 1 GiB table (make bench); tests/bench/test_bench_smoke.py runs it small",
    ("docs/fault-tolerance.md", "$ kubeps local --ps 2 --workers 2 --evaluator --restart examples/ctr/train.py -- --checkpoint-dir /tmp/ctr-ckpt"):
        "a transcript with a ps killed by hand; tests/chaos runs the scenario",
    ("docs/fault-tolerance.md", "KUBEPS_CHAOS_REPORT=/tmp/chaos.jsonl .venv/bin/python -m pytest tests/chaos -s      # 110 s in all on 2 shared cores"):
        "runs the chaos suite, which make test runs itself",
    ("docs/fault-tolerance.md", ".venv/bin/python -m pytest tests/runtime/test_failure_handling.py -s -k parallel              # prints DETECTION"):
        "runs a test file that make test runs itself",
    ("docs/install.md", "docker build --target operator    -t registry.example.com/kubeps-operator:0.1.0 ."):
        "builds images with docker (hack/kind.sh builds them for tests/e2e)",
    ("docs/install.md", "helm install kubeps charts/kubeps --namespace kubeps-system --create-namespace \\"):
        "needs a cluster and a registry",
    ("docs/install.md", "helm install kubeps charts/kubeps -n kubeps-system --create-namespace --set 'watchNamespaces={team-a,team-b}'"):
        "needs a cluster; tests/packaging renders the chart with these values",
    ("docs/install.md", "kubectl apply --server-side -f deploy/"): "needs a cluster; tests/packaging applies deploy/",
    ("docs/install.md", "helm uninstall kubeps -n kubeps-system"): "needs a cluster (tests/e2e uninstalls)",
    ("docs/install.md", "kubectl apply -f examples/jobs/ctr-job.yaml"): "needs a cluster with the operator (tests/e2e)",
    ("docs/install.md", "hack/kind-e2e.sh                       # Helm install; --install manifests for deploy/"):
        "builds a kind cluster with docker (make e2e)",
    ("docs/install.md", "helm lint --strict charts/kubeps"): "tests/packaging/test_chart.py runs these commands",
    ("docs/local.md", "$ kubeps local --ps 2 --workers 2 examples/ctr/train.py -- --steps 1200"):
        "a transcript of the CTR example, which tests/runtime/test_example_ctr.py runs",
    ("docs/local.md", "$ kubeps local --ps 2 --workers 2 --evaluator --restart examples/ctr/train.py -- --checkpoint-dir /tmp/ctr-ckpt"):
        "a transcript of the CTR example with the evaluator and a resume, which tests/runtime/test_example_ctr.py runs",
    ("docs/operator.md", "kubectl apply -f deploy/crd.yaml"): "needs a cluster (tests/operator, tests/e2e)",
    ("docs/operator.md", ".venv/bin/python -m pytest tests/operator          # 116 tests, ~60 s on 2 cores (control plane start included)"):
        "runs a test folder that make test runs itself",
    ("docs/operator.md", ".venv/bin/python bench/operator_latency.py   # private control plane on loopback, ~60 s"):
        "a benchmark (make bench)",
    ("docs/testing.md", "kind create cluster --name kubeps"): "needs docker and kind",
    ("docs/testing.md", "make e2e                                  # hack/kind.sh build, then KUBEPS_E2E=1 pytest tests/e2e"):
        "builds a kind cluster with docker",
}


@dataclass(frozen=True)
class Block:
    file: str  # relative to the repository
    line: int  # of the opening fence
    language: str
    code: str
    marker: tuple[str, str] | None  # (kind, argument)

    @property
    def first_line(self) -> str:
        return next((line.strip() for line in self.code.splitlines() if line.strip()), "")


def blocks_of(path: Path) -> list[Block]:
    lines = path.read_text().splitlines()
    found, i = [], 0
    while i < len(lines):
        fence = FENCE.match(lines[i])
        if not fence:
            i += 1
            continue
        indent, language = fence.groups()
        end = next(j for j in range(i + 1, len(lines)) if lines[j].strip() == "```")
        code = "\n".join(line[len(indent):] for line in lines[i + 1 : end]) + "\n"
        previous = next((lines[j] for j in range(i - 1, -1, -1) if lines[j].strip()), "")
        marker = MARKER.search(previous)
        found.append(Block(str(path.relative_to(REPO)), i + 1, language, code,
                           (marker.group(1), marker.group(2)) if marker else None))
        i = end + 1
    return found


BLOCKS = [block for path in DOCS for block in blocks_of(path)]


def _is_whole_program(code: str) -> bool:
    return "TFConfigClusterResolver(" in code and "Server(" in code


def _run(args: list[str], cwd: Path, timeout: float) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    env.pop("TF_CONFIG", None)
    try:
        return subprocess.run(args, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired as err:
        out = (err.stdout or b"").decode(errors="replace") if isinstance(err.stdout, bytes) else (err.stdout or "")
        pytest.fail(f"the block did not finish within {timeout} s (a doc example that hangs is a bug):\n{out[-3000:]}")


@pytest.mark.timeout(LOCAL_TIMEOUT_S + 30)
@pytest.mark.parametrize("block", BLOCKS, ids=[f"{b.file}:{b.line}" for b in BLOCKS])
def test_doc_block(block: Block, tmp_path: Path) -> None:
    if block.marker is not None:
        kind, argument = block.marker
        if kind == "skip":
            assert argument, f"{block.file}:{block.line}: a skip marker needs a reason"
            pytest.skip(f"marked: {argument}")
        if kind == "covered-by":
            target = argument.split("::")[0]
            assert (REPO / target).is_file(), f"{block.file}:{block.line}: covered-by {target}, which does not exist"
            pytest.skip(f"run by {argument}")
    if block.language in TEXT_LANGUAGES:
        pytest.skip("output or a listing, not code")
    if block.language in SHELL_LANGUAGES and (block.file, block.first_line) in RUN_SHELL:
        env = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"}
        result = subprocess.run(["bash", "-euo", "pipefail", "-c", block.code], cwd=REPO, env=env,
                                capture_output=True, text=True, timeout=SHELL_TIMEOUT_S)
        assert result.returncode == 0, f"{block.file}:{block.line} failed:\n{result.stdout[-3000:]}\n{result.stderr[-3000:]}"
        return
    if block.language in SHELL_LANGUAGES:
        reason = NOT_RUN.get((block.file, block.first_line))
        assert reason, (f"{block.file}:{block.line}: a shell block neither run nor listed in NOT_RUN with a reason "
                        f"(first line {block.first_line!r})")
        pytest.skip(reason)
    assert block.language in RUN_LANGUAGES, (
        f"{block.file}:{block.line}: block language {block.language!r} is not one of "
        f"{sorted(RUN_LANGUAGES | SHELL_LANGUAGES | TEXT_LANGUAGES)}: label it (text for output)")
    script = tmp_path / "example.py"
    script.write_text(block.code)
    local_args = block.marker[1].split() if block.marker and block.marker[0] == "local" else None
    if local_args is not None or _is_whole_program(block.code):
        args = local_args if local_args is not None else ["--ps", "2", "--workers", "2"]
        result = _run([sys.executable, "-m", "kubeps.runtime.cli", "local", *args, "--grace-period", "2",
                       str(script)], tmp_path, LOCAL_TIMEOUT_S)
    else:
        result = _run([sys.executable, str(script)], tmp_path, PYTHON_TIMEOUT_S)
    assert result.returncode == 0, f"{block.file}:{block.line} failed:\n{result.stdout[-3000:]}\n{result.stderr[-3000:]}"


def test_the_allow_list_has_no_stale_entry() -> None:
    shell = {(b.file, b.first_line) for b in BLOCKS if b.language in SHELL_LANGUAGES}
    assert not RUN_SHELL - shell, f"RUN_SHELL lists blocks that no longer exist: {sorted(RUN_SHELL - shell)}"
    assert not set(NOT_RUN) - shell, f"NOT_RUN lists blocks that no longer exist: {sorted(set(NOT_RUN) - shell)}"


def test_the_docs_name_one_tensorflow_version() -> None:
    """runtime.md followed "TensorFlow 2.15" while the benchmarks compared with 2.21."""
    versions = {m for path in DOCS for m in re.findall(r"(?:TensorFlow|TF|tensorflow-cpu(?:==)?) ?(2\.\d+)", path.read_text())}
    assert len(versions) == 1, f"README.md and docs/ name several TensorFlow versions: {sorted(versions)}"
