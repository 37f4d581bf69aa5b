"""CTR training throughput, kubeps vs TensorFlow's own parameter-server runtime, side by side in one run.

    .venv/bin/python bench/ctr_vs_tf.py --tf-python /path/tfenv/bin/python [--shape standard|wide|wdl] [--rounds 3]
                                        [--steps 3000] [--train-examples 1048576] [--data DIR] [--json OUT]
                                        [--plaintext] [--metrics-off] [--jax] [--keras] [--floor]
                                        [--dense-staleness N] [--hot-cache]

The workload (``bench/ctr/workload.py``): a synthetic Criteo-like CTR task with a known answer -- 8 categorical fields
of skewed popularity (10 to 500k values) hashed into ONE shared 2^20 x 16 embedding table, 13 dense features, an MLP
head 141-64-32-1 (ReLU), sigmoid cross-entropy, Adagrad (lr 0.05, accumulator from 0.1, eps 1e-7), batch 512, 10
steps per scheduled function; labels drawn from a logistic teacher, whose own held-out log-loss is the floor.
``--shape wide`` makes the table 2^20 x 64 and the batch 2048 (16x the bytes per step: rows pulled, gradients pushed,
the head's input), the shape where per-byte costs of the step path show.
The data set, the held-out set and the initial weights are written once as ``.npy`` files (cached under
``~/.cache/kubeps/bench-ctr/``, keyed by the parameters and the workload's source) so both runtimes start from the
same bytes.

Each round runs, with 1 chief + ``--ps`` (2) ps + ``--workers`` (2) workers as local processes (``kubeps local``):

* kubeps: ``bench/ctr/kubeps_ctr.py`` (``kubeps.runtime``'s ParameterServerStrategy + ClusterCoordinator);
* TensorFlow: ``bench/ctr/tf_ctr.py`` (``tf.distribute.experimental.ParameterServerStrategy`` + ``ClusterCoordinator``,
  the table sharded over the ps by ``FixedShardsPartitioner``, ``tf.data`` per worker), run by ``--tf-python``;

with ``--floor`` the compute floor (``bench/ctr/floor.py``: the same model, data and optimizer with the numpy
layers on local arrays, one process per core, no parameter server, no RPC) and every kubeps side's share of it;
with ``--dense-staleness N`` a kubeps side whose workers reuse the dense weights they pulled for N more steps
(``ParameterServerStrategy(dense_staleness=N)``, also given to the ``--jax`` and ``--keras`` sides); ``--shape wdl``
is DeepRec's Wide & Deep shape (26 fields x 16, 13 dense, MLP 1024-512-256, batch 512);

and with ``--jax`` the same model written with ``jax.numpy`` (``bench/ctr/jax_ctr.py``, gradients from
``kp.value_and_grad``), with ``--keras`` as a Keras 3 model trained with kubeps's ``fit`` entry point
(``bench/ctr/keras_ctr.py``: ``KubepsEmbedding``, ``keras.optimizers.Adagrad`` applied on the ps); each variant's
ratios are to the kubeps numpy side and to TF of the same run, rotating which side goes first. Every program
times from after ``--warmup-executions`` executions to the final ``join()`` and scores its final weights with the
same numpy scorer (``workload.evaluate``). The driver samples every task's peak RSS (``VmHWM``) and reads every
task's CPU time (``/proc/PID/stat``) when the chief prints ``TIMED START`` and ``TIMED END``: CPU milliseconds per
step, all tasks together, is the figure a busy shared machine moves least. It prints one line per round and a
table: examples/s (median of the rounds) of every side and the ratio kubeps/TF (TF is this benchmark's baseline,
measured in the same run), eval log-loss and AUC, the teacher's log-loss, CPU per step and peak RSS per task type.
Exit status 1 when kubeps's median eval log-loss is worse than TF's by more than 1%.

Installing the TensorFlow side (kept out of kubeps's dependencies, in an environment of its own; it only needs
TensorFlow and numpy, which TensorFlow brings)::

    python3 -m venv /path/tfenv && /path/tfenv/bin/pip install tensorflow-cpu==2.21.0

Without ``--tf-python``, or when that interpreter cannot import tensorflow, only the kubeps side runs and the
driver says TF was skipped (exit status 0).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Callable

REPO = Path(__file__).resolve().parents[1]
CTR = REPO / "bench" / "ctr"
sys.path.insert(0, str(CTR))
import workload as wl  # noqa: E402 - only numpy

SIDES = {"kubeps": CTR / "kubeps_ctr.py", "plaintext": CTR / "kubeps_ctr.py", "nometrics": CTR / "kubeps_ctr.py",
         "jax": CTR / "jax_ctr.py", "keras": CTR / "keras_ctr.py", "tf": CTR / "tf_ctr.py",
         "overlap": CTR / "kubeps_ctr.py", "gpu": CTR / "kubeps_ctr.py", "gpu-overlap": CTR / "kubeps_ctr.py",
         "hot": CTR / "kubeps_ctr.py", "stale": CTR / "kubeps_ctr.py", "floor": CTR / "floor.py"}
#: the kubeps numpy layers run another way (``--overlap``, ``--gpu``), each compared with the side named here, of the
#: same run: (what it is, its baseline)
PLACEMENTS = {"overlap": ("overlap (rows pulled during the step)", "kubeps"), "gpu": ("GPU workers", "kubeps"),
              "gpu-overlap": ("GPU workers + overlap", "overlap"), "hot": ("hot-row cache", "kubeps"),
              "stale": ("dense staleness (dense weights pulled every 1 + --dense-staleness steps)", "kubeps"),
              "floor": ("the compute floor (numpy nn, one process per core, no RPC)", "kubeps")}
#: the same model written another way, each compared with the numpy layers (and TF) of the same run
VARIANTS = {"jax": "JAX", "keras": "Keras fit"}
TASK_LINE = re.compile(r"\[kubeps\] (?P<name>(?P<type>[a-z]+)-\d+) pid (?P<pid>\d+)")
RESULT_LINE = re.compile(r"^(?:\[chief-0\] )?RESULT (?P<json>\{.*\})\s*$")
POLL_S = 0.3
#: the examples/s ratio to TF each shape aims at
GOALS = {"standard": 2, "wide": 1.5, "wdl": 1.5}


def data_folder(args: argparse.Namespace) -> Path:
    """The data set's folder, written once: ``--data`` or a cache folder keyed by the parameters and the workload."""
    if args.data:
        folder = Path(args.data)
    else:
        digest = hashlib.sha256((CTR / "workload.py").read_bytes()).hexdigest()[:10]
        shape = "" if wl.shape_name() == "standard" else f"-{wl.shape_name()}"
        folder = (Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "kubeps" / "bench-ctr"
                  / f"n{args.train_examples}-e{args.eval_examples}-s{args.seed}{shape}-{digest}")
    if (folder / "meta.json").exists():
        meta = json.loads((folder / "meta.json").read_text())
        if (meta.get("train_examples") == args.train_examples and meta.get("seed") == args.seed
                and meta.get("shape") == wl.shape_name()):
            return folder
    print(f"writing the data set ({args.train_examples} training examples) to {folder} ...", flush=True)
    partial = folder.with_name(folder.name + f".partial-{os.getpid()}")
    shutil.rmtree(partial, ignore_errors=True)
    wl.write(str(partial), train_examples=args.train_examples, eval_examples=args.eval_examples, seed=args.seed)
    if folder.exists():
        shutil.rmtree(folder)
    partial.rename(folder)
    return folder


def tensorflow_version(python: str | None) -> tuple[str | None, str]:
    """(TensorFlow's version, "") when ``python`` imports tensorflow, else (None, why not)."""
    if not python:
        return None, "no --tf-python given"
    try:
        out = subprocess.run([python, "-c", "import tensorflow as tf; print(tf.__version__)"], capture_output=True,
                             text=True, timeout=300, env={**os.environ, "TF_CPP_MIN_LOG_LEVEL": "3"})
    except (OSError, subprocess.TimeoutExpired) as exc:
        return None, f"{python}: {exc}"
    if out.returncode != 0:
        return None, f"{python} cannot import tensorflow: {(out.stderr.strip().splitlines() or ['?'])[-1]}"
    return out.stdout.strip().splitlines()[-1], ""


def vm_hwm_bytes(pid: int) -> int | None:
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def usage(pid: int) -> tuple[float, int] | None:
    """``(CPU seconds, context switches)`` of a process so far: user + system time of all its threads, and the
    voluntary + involuntary switches of the threads alive now (a thread that ended took its count with it); with the
    processes it started that still run (a ps task of several server processes)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except OSError:
        return None
    cpu = (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    switches = 0
    try:
        threads = os.listdir(f"/proc/{pid}/task")
    except OSError:
        threads = []
    for tid in threads:
        try:
            with open(f"/proc/{pid}/task/{tid}/status") as f:
                switches += sum(int(line.split()[1]) for line in f if "ctxt_switches:" in line)
        except (OSError, ValueError, IndexError):
            continue
    try:
        with open(f"/proc/{pid}/task/{pid}/children") as f:
            children = [int(c) for c in f.read().split()]
    except OSError:
        children = []
    for child in children:
        if (more := usage(child)) is not None:
            cpu, switches = cpu + more[0], switches + more[1]
    return cpu, switches


class PeakRSS:
    """Polls the peak RSS (VmHWM) of every task the launcher reports, until each exits; ``mark`` reads every task's
    CPU time (the chief prints ``TIMED START`` and ``TIMED END`` around the timed span)."""

    def __init__(self):
        self.tasks: dict[str, int] = {}
        self.peak: dict[str, int] = {}
        self.cpu: dict[str, dict[str, tuple[float, int]]] = {}  # mark -> task -> (CPU seconds, context switches)
        self.lock = threading.Lock()
        self.done = threading.Event()
        self.thread = threading.Thread(target=self._poll, daemon=True)
        self.thread.start()

    def add(self, name: str, pid: int) -> None:
        with self.lock:
            self.tasks[name] = pid

    def _sample(self) -> None:
        with self.lock:
            tasks = list(self.tasks.items())
        for name, pid in tasks:
            hwm = vm_hwm_bytes(pid)
            if hwm is not None:
                self.peak[name] = max(self.peak.get(name, 0), hwm)

    def mark(self, label: str) -> None:
        with self.lock:
            tasks = list(self.tasks.items())
        self.cpu[label] = {name: t for name, pid in tasks if (t := usage(pid)) is not None}

    def per_step(self, steps: int, which: int = 0, scale: float = 1000.0) -> dict[str, float]:
        """Per timed step, of each task type (summed over its tasks) and of all tasks: CPU milliseconds
        (``which=0``), or context switches (``which=1, scale=1``)."""
        start, end = self.cpu.get("start", {}), self.cpu.get("end", {})
        out: dict[str, float] = {}
        for name in start.keys() & end.keys():
            kind = name.rsplit("-", 1)[0]
            out[kind] = out.get(kind, 0.0) + scale * (end[name][which] - start[name][which]) / steps
        out["total"] = sum(out.values())
        return out

    def _poll(self) -> None:
        while not self.done.wait(POLL_S):
            self._sample()

    def stop(self) -> dict[str, int]:
        self.done.set()
        self.thread.join()
        return dict(self.peak)


def run_side(side: str, args: argparse.Namespace, data: Path, tf_python: str | None,
             on_timed_start: Callable[[dict[str, int]], None] | None = None) -> dict:
    """One training run of ``side`` under ``kubeps local``; its RESULT plus the peak RSS of each task.
    ``on_timed_start`` is called with the tasks' pids by name (``ps-0``...) when the timed span starts."""
    cmd = [sys.executable, "-m", "kubeps.runtime.cli", "local", "--ps", str(args.ps), "--workers", str(args.workers)]
    if getattr(args, "ps_processes", None):
        cmd += ["--ps-processes", str(args.ps_processes)]
    if side == "plaintext":  # the kubeps side without mutual TLS between the tasks (kubeps local's default)
        cmd += ["--insecure-plaintext"]
    if side in ("nometrics", "tf"):  # the kubeps side recording no Prometheus metrics (kubeps local records them)
        cmd += ["--no-metrics"]
    if side == "tf":
        cmd += ["--python", tf_python]
    if side == "floor":  # no cluster: one process per core (bench/ctr/floor.py names them as the launcher does)
        cmd = [sys.executable, str(SIDES[side].relative_to(REPO)), "--processes", str(os.cpu_count() or 1)]
    else:
        cmd.append(str(SIDES[side].relative_to(REPO)))
    cmd += ["--", "--data", str(data), "--steps", str(args.steps),
            "--batch-size", str(args.batch_size), "--steps-per-execution", str(args.steps_per_execution),
            "--warmup-executions", str(args.warmup_executions)]
    cmd += ["--overlap"] if side.endswith("overlap") else []
    if side == "hot":
        cmd += ["--hot-rows", str(args.hot_rows), "--hot-refresh-steps", str(args.hot_refresh_steps)]
    if side == "stale" or (side in VARIANTS and getattr(args, "dense_staleness", 0)):
        cmd += ["--dense-staleness", str(args.dense_staleness)]
    head = getattr(args, "head", wl.HIDDEN)  # callers of their own (bench/scaling.py) name only what they vary
    cmd += ["--head", ",".join(map(str, head))] if head != wl.HIDDEN else []
    env = dict(os.environ)
    if getattr(args, "gpu", False):  # every side says where its workers compute: the CPU sides never pick the GPU up by themselves
        env["KUBEPS_DEVICE"] = "gpu" if side.startswith("gpu") else "cpu"
    rss = PeakRSS()
    lines: list[str] = []
    result = None
    started = time.monotonic()
    proc = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True, env=env)
    def stop() -> None:
        try:
            os.killpg(proc.pid, signal.SIGTERM)
        except ProcessLookupError:
            pass

    killer = threading.Timer(args.timeout, stop)
    killer.start()
    try:
        for line in proc.stdout:
            lines.append(line.rstrip("\n"))
            if args.verbose:
                print(f"  {side}| {line}", end="", flush=True)
            if m := TASK_LINE.search(line):
                rss.add(m["name"], int(m["pid"]))
            elif m := RESULT_LINE.match(line.strip()):
                result = json.loads(m["json"])
            elif "TIMED START" in line or "TIMED END" in line:
                rss.mark("start" if "START" in line else "end")
                if "START" in line and on_timed_start is not None:
                    on_timed_start(dict(rss.tasks))
        rc = proc.wait()
    finally:
        killer.cancel()
        if proc.poll() is None:
            stop()
            proc.wait()
        peak = rss.stop()
    if rc != 0 or result is None:
        tail = "\n".join(lines[-40:])
        raise SystemExit(f"{side} run failed (exit status {rc}, {time.monotonic() - started:.0f} s):\n"
                         f"  {' '.join(cmd)}\n{tail}")
    result["peak_rss"] = peak
    executions = args.steps // args.steps_per_execution
    timed_steps = (executions - min(args.warmup_executions, executions)) * args.steps_per_execution
    result["cpu_ms_per_step"] = rss.per_step(max(1, timed_steps))
    result["switches_per_step"] = rss.per_step(max(1, timed_steps), which=1, scale=1.0)
    result["wall_seconds"] = time.monotonic() - started
    return result


def peak_by_type(runs: list[dict]) -> dict[str, int]:
    """The largest peak RSS of each task type (chief, ps, worker) over all tasks of all rounds."""
    out: dict[str, int] = {}
    for run in runs:
        for name, value in run["peak_rss"].items():
            kind = name.rsplit("-", 1)[0]
            out[kind] = max(out.get(kind, 0), value)
    return out


def summarize(runs: list[dict]) -> dict:
    pulls = [r["pull_bytes_per_example"] for r in runs if "pull_bytes_per_example" in r]
    return {"examples_per_s": statistics.median(r["examples_per_s"] for r in runs),
            "pull_bytes_per_example": statistics.median(pulls) if pulls else None,
            "eval_logloss": statistics.median(r["eval_logloss"] for r in runs),
            "eval_auc": statistics.median(r["eval_auc"] for r in runs),
            "teacher_logloss": runs[0]["teacher_logloss"],
            "cpu_ms_per_step": {k: statistics.median(r["cpu_ms_per_step"].get(k, 0.0) for r in runs)
                                for k in ("chief", "ps", "worker", "total")},
            "peak_rss": peak_by_type(runs)}


def describe(run: dict) -> str:
    pulled = (f", rows pulled {run['pull_bytes_per_example']:.0f} B/example" if "pull_bytes_per_example" in run
              else "")
    return (f"{run['examples_per_s']:8.0f} ex/s in {run['train_seconds']:5.1f} s, log-loss {run['eval_logloss']:.4f}"
            f", AUC {run['eval_auc']:.4f}, CPU {run['cpu_ms_per_step']['total']:.1f} ms/step{pulled}")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tf-python", help="an interpreter that imports tensorflow (2.21); without it TF is skipped")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--steps", type=int, default=3000, help="training steps per run (all workers together)")
    p.add_argument("--train-examples", type=int, default=1 << 20)
    p.add_argument("--eval-examples", type=int, default=100_000)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--data", help="data folder (written there if missing; default: a cache folder)")
    p.add_argument("--ps", type=int, default=2)
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--shape", choices=sorted(wl.SHAPES), default="standard",
                   help="standard: 8 fields, table width 16, MLP 64-32, batch 512; wide: width 64, batch 2048; wdl: "
                        "Wide & Deep's 26 fields x 16, MLP 1024-512-256, batch 512 (--batch-size overrides the batch)")
    p.add_argument("--batch-size", type=int, help="examples per step (default: the shape's)")
    p.add_argument("--steps-per-execution", type=int, default=wl.STEPS_PER_EXECUTION)
    p.add_argument("--warmup-executions", type=int, default=4)
    p.add_argument("--timeout", type=float, default=1800, help="seconds one run may take before it is stopped")
    p.add_argument("--verbose", action="store_true", help="stream the tasks' output")
    p.add_argument("--json", help="write the rounds and the summary to this file")
    p.add_argument("--jax", action="store_true",
                   help="also run the model written with jax.numpy (bench/ctr/jax_ctr.py), with its ratio to kubeps's "
                        "numpy layers measured in the same run")
    p.add_argument("--keras", action="store_true",
                   help="also run the model as a Keras 3 model trained with kubeps's fit (bench/ctr/keras_ctr.py), "
                        "with its ratios to kubeps's numpy layers and to TF measured in the same run")
    p.add_argument("--metrics-off", action="store_true",
                   help="also run the kubeps side with no Prometheus metrics (--no-metrics), to measure what recording "
                        "and serving them costs in the same run")
    p.add_argument("--plaintext", action="store_true",
                   help="also run the kubeps side with plaintext between the tasks (--insecure-plaintext), to measure "
                        "what mutual TLS costs in the same run")
    p.add_argument("--overlap", action="store_true",
                   help="also run the kubeps side pulling the next batch's embedding rows while each step computes "
                        "(one step stale), with its ratio and eval log-loss to the kubeps side of the same run")
    p.add_argument("--gpu", action="store_true",
                   help="also run the kubeps side with its workers on the GPU (KUBEPS_DEVICE=gpu; the other sides get "
                        "KUBEPS_DEVICE=cpu), with its ratio to the CPU workers of the same run")
    p.add_argument("--hot-cache", action="store_true",
                   help="also run the kubeps side with each worker caching the table's hottest rows "
                        "(nn.Embedding(hot_rows=...)), with its ratios of embedding bytes pulled per example and eval "
                        "log-loss to the kubeps side of the same run")
    p.add_argument("--hot-rows", type=int, default=50_000, help="rows each worker caches (--hot-cache)")
    p.add_argument("--hot-refresh-steps", type=int, default=30,
                   help="lookups between two pulls of the cached rows, the bound on their staleness (--hot-cache)")
    p.add_argument("--floor", action="store_true",
                   help="also run the compute floor: the same model and data with the numpy layers on local arrays, "
                        "one process per core, no parameter server (bench/ctr/floor.py), with the kubeps side's ratio "
                        "to it")
    p.add_argument("--dense-staleness", type=int, default=0,
                   help="also run the kubeps side with ParameterServerStrategy(dense_staleness=N) (each worker pulls "
                        "the dense weights every N+1 of its steps), with its ratios to the kubeps side of the same run; "
                        "the --jax and --keras sides run with it too")
    p.add_argument("--head", type=wl.hidden_units,
                   help="the MLP head's hidden units (e.g. 1024,1024,512,256: the dense-heavy variant; default: the "
                        "shape's); kubeps's numpy and JAX sides only")
    args = p.parse_args(argv)
    # SIGTERM (a time limit around this driver) stops the run under way and its tasks, as an error does
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
    shape = wl.use_shape(args.shape)
    args.head = args.head or wl.HIDDEN
    if args.head != wl.HIDDEN and (args.keras or args.tf_python):
        p.error(f"--head {','.join(map(str, args.head))}: only the kubeps numpy and JAX sides take another head; "
                "leave out --keras and --tf-python")
    args.batch_size = args.batch_size or shape.batch

    tf_version, why = tensorflow_version(args.tf_python)
    variants = [v for v in VARIANTS if getattr(args, v)]
    sides = (["kubeps"] + (["plaintext"] if args.plaintext else []) + (["nometrics"] if args.metrics_off else [])
             + variants + (["tf"] if tf_version else []))
    sides += [side for side in PLACEMENTS if (not side.endswith("overlap") or args.overlap)
              and (not side.startswith("gpu") or args.gpu) and (side != "hot" or args.hot_cache)
              and (side != "stale" or args.dense_staleness) and (side != "floor" or args.floor)]
    if not tf_version:
        print(f"TensorFlow skipped: {why} (see this file's docstring to install it)", flush=True)
    data = data_folder(args)
    load = os.getloadavg()
    print(f"CTR workload: {wl.FIELDS} fields -> {wl.VOCAB} x {wl.DIM} table, {wl.DENSE} dense, MLP "
          f"{wl.FIELDS * wl.DIM + wl.DENSE}-{'-'.join(map(str, args.head))}-1, Adagrad {wl.LEARNING_RATE}, batch "
          f"{args.batch_size}; {args.steps} steps on {args.ps} ps + {args.workers} workers; data {data}; "
          f"{os.cpu_count()} CPUs, load {load[0]:.2f} {load[1]:.2f} {load[2]:.2f}"
          + (f"; TensorFlow {tf_version}" if tf_version else ""), flush=True)

    runs: dict[str, list[dict]] = {side: [] for side in sides}
    for i in range(args.rounds):
        order = sides if i % 2 == 0 else sides[::-1]
        for side in order:
            runs[side].append(run_side(side, args, data, args.tf_python))
        line = f"round {i + 1}/{args.rounds}: " + " | ".join(
            f"{side} {describe(runs[side][-1])}" for side in sides)
        if tf_version:
            line += f" | ratio {runs['kubeps'][-1]['examples_per_s'] / runs['tf'][-1]['examples_per_s']:.2f}x"
        if args.plaintext:
            line += f" | TLS/plaintext {runs['kubeps'][-1]['examples_per_s'] / runs['plaintext'][-1]['examples_per_s']:.3f}"
        if args.metrics_off:
            on_off = runs["kubeps"][-1]["examples_per_s"] / runs["nometrics"][-1]["examples_per_s"]
            line += f" | metrics on/off {on_off:.3f}"
        for v in variants:
            line += f" | {v}/numpy {runs[v][-1]['examples_per_s'] / runs['kubeps'][-1]['examples_per_s']:.2f}x"
        for side in sides:
            if side in PLACEMENTS:
                base = PLACEMENTS[side][1]
                line += f" | {side}/{base} {runs[side][-1]['examples_per_s'] / runs[base][-1]['examples_per_s']:.2f}x"
        print(line + f"  (first: {order[0]})", flush=True)

    summary = {side: summarize(runs[side]) for side in sides}
    mb = 1 << 20
    names = {"kubeps": "kubeps (mutual TLS)", "plaintext": "kubeps (plaintext)", "nometrics": "kubeps (no metrics)",
             "jax": "kubeps + JAX", "keras": "kubeps Keras fit", "tf": f"TensorFlow {tf_version}",
             "overlap": "kubeps overlap", "gpu": "kubeps GPU workers", "gpu-overlap": "kubeps GPU + overlap",
             "hot": "kubeps hot-row cache", "stale": f"kubeps staleness {args.dense_staleness}",
             "floor": "floor (numpy, no RPC)"}
    print(f"\nmedian of {args.rounds} round(s), {args.steps} steps, batch {args.batch_size}, "
          f"{args.ps} ps + {args.workers} workers:")
    print(f"{'':22}{'examples/s':>12}{'eval log-loss':>15}{'eval AUC':>10}"
          f"{'CPU ms/step: all (ps, workers)':>32}{'peak RSS chief / ps / worker (MB)':>36}")
    for side in sides:
        s = summary[side]
        rss = " / ".join(f"{s['peak_rss'].get(k, 0) / mb:.0f}" for k in ("chief", "ps", "worker"))
        c = s["cpu_ms_per_step"]
        cpu = f"{c['total']:.2f} ({c['ps']:.2f}, {c['worker']:.2f})"
        print(f"{names[side]:22}{s['examples_per_s']:12.0f}{s['eval_logloss']:15.4f}{s['eval_auc']:10.4f}{cpu:>32}"
              f"{rss:>36}")
    print(f"{'teacher (best possible)':22}{'':12}{summary['kubeps']['teacher_logloss']:15.4f}")
    status = 0
    if args.plaintext:
        summary["tls_cost"] = 1 - summary["kubeps"]["examples_per_s"] / summary["plaintext"]["examples_per_s"]
        print(f"mutual TLS costs {summary['tls_cost']:.1%} of plaintext's examples/s (goal <= 15%)")
    if args.metrics_off:
        summary["metrics_cost"] = 1 - summary["kubeps"]["examples_per_s"] / summary["nometrics"]["examples_per_s"]
        print(f"Prometheus metrics cost {summary['metrics_cost']:.1%} of examples/s without them (goal <= 3%; median "
              f"of {args.rounds} round(s))")
    for v in variants:
        j, k = summary[v], summary["kubeps"]
        summary[f"{v}_ratio"] = j["examples_per_s"] / k["examples_per_s"]
        print(f"ratio {VARIANTS[v]}/numpy layers: {summary[f'{v}_ratio']:.2f}x examples/s; eval log-loss "
              f"{VARIANTS[v]}/numpy {j['eval_logloss'] / k['eval_logloss']:.4f}")
        if tf_version:
            summary[f"{v}_tf_ratio"] = j["examples_per_s"] / summary["tf"]["examples_per_s"]
            print(f"ratio {VARIANTS[v]}/TF: {summary[f'{v}_tf_ratio']:.2f}x examples/s (goal >= {GOALS[args.shape]}x); eval log-loss "
                  f"{VARIANTS[v]}/TF {j['eval_logloss'] / summary['tf']['eval_logloss']:.4f}")
    for side in sides:
        if side in PLACEMENTS:
            what, base = PLACEMENTS[side]
            j, k = summary[side], summary[base]
            summary[f"{side}_ratio"] = j["examples_per_s"] / k["examples_per_s"]
            summary[f"{side}_logloss_ratio"] = j["eval_logloss"] / k["eval_logloss"]
            print(f"ratio {what} / {names[base]}: {summary[f'{side}_ratio']:.2f}x examples/s; eval log-loss "
                  f"{summary[f'{side}_logloss_ratio']:.4f} of it")
            if j["pull_bytes_per_example"] and k["pull_bytes_per_example"]:
                summary[f"{side}_pull_ratio"] = j["pull_bytes_per_example"] / k["pull_bytes_per_example"]
                print(f"embedding rows pulled per example, {what} / {names[base]}: {j['pull_bytes_per_example']:.0f}"
                      f" / {k['pull_bytes_per_example']:.0f} bytes = {summary[f'{side}_pull_ratio']:.3f} "
                      f"(goal <= 0.6 for the cache); CPU ms per step, ps: {j['cpu_ms_per_step']['ps']:.2f} / "
                      f"{k['cpu_ms_per_step']['ps']:.2f}")
    if args.floor:
        summary["of_floor"] = {side: summary[side]["examples_per_s"] / summary["floor"]["examples_per_s"]
                               for side in sides if side not in ("floor", "tf")}
        print("share of the compute floor's examples/s (goal on the standard shape >= 45%): " + ", ".join(
            f"{names[side]} {share:.0%}" for side, share in summary["of_floor"].items()))
    if tf_version:
        k, t = summary["kubeps"], summary["tf"]
        ratio = k["examples_per_s"] / t["examples_per_s"]
        print(f"ratio kubeps/TF: {ratio:.2f}x examples/s (goal >= {GOALS[args.shape]}x); eval log-loss kubeps/TF "
              f"{k['eval_logloss'] / t['eval_logloss']:.4f}")
        summary["ratio"] = ratio
        if k["eval_logloss"] > t["eval_logloss"] * 1.01:
            print(f"FAIL: kubeps's eval log-loss {k['eval_logloss']:.4f} is worse than TF's {t['eval_logloss']:.4f} "
                  f"by more than 1%")
            status = 1
    else:
        print("TensorFlow skipped: no baseline, no ratio")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "tensorflow": tf_version, "load": load, "rounds": runs,
                       "summary": summary}, f, indent=2)
    return status


if __name__ == "__main__":
    sys.exit(main())
