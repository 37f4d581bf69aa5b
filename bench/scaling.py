"""Scaling of the CTR workload with parameter servers and workers: P ps x W workers, one invocation.

    .venv/bin/python bench/scaling.py [--jobs 2+2,2+4,4+8,4+8x3] [--steps 3000] [--rounds 1] [--json OUT]
                                      [--gil-seconds 5]

The workload is ``bench/ctr_vs_tf.py``'s kubeps side (numpy layers, batch 512, mutual TLS between the tasks, the
table sharded over the ps by ``FixedShardsPartitioner(num_ps)``), run under ``kubeps local`` once per job of
``--jobs``: ``P+W`` is P ps tasks of one server process each and W workers; ``P+WxN`` the same with N server
processes per ps task (``--ps-processes N``, ``docs/scaling.md``). For each job it prints examples/s, CPU
milliseconds per step of the ps tasks and of the workers (all of them together, a ps task's processes included),
the cores each ps task and each worker used over the timed span, and the scaling efficiency against the first
job of the same invocation (the baseline): ``(examples/s / baseline's) / (W / baseline's W)``. Context switches
per step (voluntary and involuntary, every thread of the tasks) count the hand-offs between threads a step costs.

``--gil-seconds S`` samples ``ps-0`` and ``worker-0`` with py-spy (``--gil``, 100 per second, without stopping
them) for the first S seconds of each timed span: the share of samples in which one of the process's threads held
the GIL. A ps held back by the GIL shows a share near 1; one well below 1 that still uses about one core waits on
something else (hand-offs between threads, the network, its clients).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import ctr_vs_tf  # noqa: E402 - next to this file: the runs and their CPU accounting
import workload as wl  # noqa: E402 - bench/ctr, put on the path by ctr_vs_tf

JOB = re.compile(r"^(?P<ps>\d+)\+(?P<workers>\d+)(?:x(?P<processes>\d+))?$")


def parse_jobs(text: str) -> list[tuple[int, int, int]]:
    jobs = []
    for item in text.split(","):
        m = JOB.match(item.strip())
        if not m or int(m["ps"]) < 1 or int(m["workers"]) < 1 or int(m["processes"] or 1) < 1:
            raise SystemExit(f"--jobs: {item!r} is not P+W or P+WxN (ps tasks, workers, server processes per ps "
                             f"task, each >= 1), e.g. 2+2,4+8x3")
        jobs.append((int(m["ps"]), int(m["workers"]), int(m["processes"] or 1)))
    return jobs


class GilSampler:
    """py-spy with ``--gil`` on some tasks of a run for ``seconds`` from the start of its timed span: per task, the
    share of the expected samples (``RATE`` a second) in which a thread of the task held the GIL."""

    TASKS = ("ps-0", "worker-0")
    RATE = 100

    def __init__(self, seconds: float, py_spy: str):
        self.seconds, self.py_spy = seconds, py_spy
        self.runs: dict[str, tuple[subprocess.Popen, Path]] = {}
        self.folder = Path(tempfile.mkdtemp(prefix="kubeps-gil-"))

    def start(self, tasks: dict[str, int]) -> None:
        for name in self.TASKS:
            if name in tasks:
                out = self.folder / f"{name}.txt"
                cmd = [self.py_spy, "record", "--gil", "--nonblocking", "--rate", str(self.RATE), "--duration",
                       f"{self.seconds:g}", "--format", "raw", "--output", str(out), "--pid", str(tasks[name])]
                self.runs[name] = (subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL), out)

    def shares(self, timed_seconds: float) -> dict[str, float | None]:
        """The GIL share of each sampled task; None where the timed span was shorter than the sampling (the task
        went on to other work, or ended) or py-spy wrote nothing."""
        found: dict[str, float | None] = {}
        for name, (proc, out) in self.runs.items():
            try:
                proc.wait(timeout=self.seconds + 30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
            samples = 0
            if out.exists():
                samples = sum(int(line.rsplit(" ", 1)[1]) for line in out.read_text().splitlines() if " " in line)
            short = timed_seconds < self.seconds or not out.exists()
            found[name] = None if short else samples / (self.RATE * self.seconds)
        shutil.rmtree(self.folder, ignore_errors=True)
        return found


def run_job(ps: int, workers: int, processes: int, args: argparse.Namespace, data: Path) -> dict:
    side_args = argparse.Namespace(**{**vars(args), "ps": ps, "workers": workers, "ps_processes": processes})
    sampler = GilSampler(args.gil_seconds, args.py_spy) if args.gil_seconds else None
    result = ctr_vs_tf.run_side("kubeps", side_args, data, None,
                                on_timed_start=sampler.start if sampler is not None else None)
    if sampler is not None:
        result["gil_share"] = sampler.shares(result["train_seconds"])
    executions = args.steps // args.steps_per_execution
    timed_steps = (executions - min(args.warmup_executions, executions)) * args.steps_per_execution
    seconds = result["train_seconds"]
    cpu = result["cpu_ms_per_step"]
    result.update(ps=ps, workers=workers, ps_processes=processes,
                  cores_per_ps=cpu.get("ps", 0.0) * timed_steps / 1000 / seconds / ps,
                  cores_per_worker=cpu.get("worker", 0.0) * timed_steps / 1000 / seconds / workers)
    return result


def _pair(left: float | None, right: float | None, width: int, form: str) -> str:
    text = " / ".join("n/a" if v is None else form.format(v) for v in (left, right))
    return f"{text:>{width}}"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--jobs", default="2+2,2+4,4+8,4+8x3",
                   help="P+W or P+WxN (N server processes per ps task), comma-separated; the first is the baseline")
    p.add_argument("--steps", type=int, default=3000, help="training steps per run (all workers together)")
    p.add_argument("--rounds", type=int, default=1, help="runs of each job (the median is reported)")
    p.add_argument("--train-examples", type=int, default=1 << 20)
    p.add_argument("--eval-examples", type=int, default=100_000)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--data", help="data folder (written there if missing; default: a cache folder)")
    p.add_argument("--batch-size", type=int, default=wl.BATCH)
    p.add_argument("--steps-per-execution", type=int, default=wl.STEPS_PER_EXECUTION)
    p.add_argument("--warmup-executions", type=int, default=4)
    p.add_argument("--timeout", type=float, default=900, help="seconds one run may take before it is stopped")
    p.add_argument("--verbose", action="store_true", help="stream the tasks' output")
    p.add_argument("--json", help="write the runs and the table to this file")
    p.add_argument("--gil-seconds", type=float, default=0.0,
                   help="sample ps-0 and worker-0 with py-spy --gil for this many seconds of each timed span "
                        "(0: not sampled); the table gains the share of samples holding the GIL")
    args = p.parse_args(argv)
    if args.gil_seconds < 0:
        p.error(f"--gil-seconds: {args.gil_seconds:g} is negative; give 0 (no sampling) or the seconds to sample")
    args.py_spy = None
    if args.gil_seconds:
        args.py_spy = shutil.which("py-spy") or shutil.which("py-spy", path=str(Path(sys.executable).parent))
        if args.py_spy is None:
            p.error("--gil-seconds needs py-spy on PATH or beside this Python (pip install py-spy)")
    jobs = parse_jobs(args.jobs)
    data = ctr_vs_tf.data_folder(args)
    load = os.getloadavg()
    print(f"CTR scaling: batch {args.batch_size}, {args.steps} steps per run, mutual TLS; {os.cpu_count()} CPUs, "
          f"load {load[0]:.2f}; jobs {args.jobs} (baseline {args.jobs.split(',')[0]})", flush=True)
    rows = []
    for ps, workers, processes in jobs:
        runs = []
        for _ in range(args.rounds):
            runs.append(run_job(ps, workers, processes, args, data))
        runs.sort(key=lambda r: r["examples_per_s"])
        row = runs[len(runs) // 2]
        rows.append(row)
        print(f"  {ps}+{workers}" + (f"x{processes}" if processes > 1 else "") + f": {row['examples_per_s']:.0f} "
              f"examples/s, log-loss {row['eval_logloss']:.4f}", flush=True)
    base = rows[0]
    header = (f"{'ps + workers':>14}{'examples/s':>12}{'CPU ms/step ps / workers':>26}{'cores per ps':>14}"
              f"{'cores per worker':>18}{'efficiency':>12}{'log-loss':>10}{'switches/step ps / workers':>28}")
    if args.gil_seconds:
        header += f"{'GIL held ps-0 / worker-0':>26}"
    lines = [header]
    for r in rows:
        r["efficiency"] = (r["examples_per_s"] / base["examples_per_s"]) / (r["workers"] / base["workers"])
        name = f"{r['ps']} + {r['workers']}" + (f" (x{r['ps_processes']})" if r["ps_processes"] > 1 else "")
        cpu = r["cpu_ms_per_step"]
        lines.append(f"{name:>14}{r['examples_per_s']:12.0f}{cpu.get('ps', 0):13.2f} / {cpu.get('worker', 0):<10.2f}"
                     f"{r['cores_per_ps']:14.2f}{r['cores_per_worker']:18.2f}{r['efficiency']:11.0%}"
                     f"{r['eval_logloss']:10.4f}" + _pair(r["switches_per_step"].get("ps"),
                                                            r["switches_per_step"].get("worker"), 28, "{:.1f}")
                     + (_pair(r["gil_share"].get("ps-0"), r["gil_share"].get("worker-0"), 26, "{:.0%}")
                        if args.gil_seconds else ""))
    lines.append(f"efficiency: examples/s per worker against the first job ({base['ps']} + {base['workers']}) of this "
                 f"invocation; (xN): N server processes per ps task")
    print("\n" + "\n".join(lines), flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "load": load, "rows": rows, "table": lines}, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
