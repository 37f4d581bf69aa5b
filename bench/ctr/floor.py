"""The compute floor of ``bench/ctr_vs_tf.py --floor``: the same model, data and optimizer trained with the numpy
``nn`` layers on local arrays, no parameter server and no RPC, in one process per core, each on its shard of the
data (independent models: this measures how fast the machine does the step's math, not a training recipe).

    python bench/ctr/floor.py --processes 2 -- --data DIR --steps 3000

The parent starts ``--processes`` children (``--child I``), which build the model from the initial weights in
``DIR`` (``kubeps_ctr.Model`` outside any strategy scope: every variable local, Adagrad applied in the process),
train ``--warmup-executions`` x ``--steps-per-execution`` of their share of the steps untimed, then wait. The parent
prints ``TIMED START``, lets them all go, waits for the last, prints ``TIMED END`` and one ``RESULT {json}`` with
the timed examples of all children over that span; the first child's final weights are scored with
``workload.evaluate`` (trained on ``1/processes`` of the steps, so its log-loss is not the job's). Like the
launcher, it names each child ``[kubeps] worker-I pid P``, so the driver reads their CPU time.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import workload as wl  # noqa: E402 - next to this file, only numpy


def child(index: int, processes: int, args: argparse.Namespace, weights_out: str) -> int:
    import kubeps.runtime as kp  # noqa: PLC0415 - only the children train
    import kubeps_ctr  # noqa: PLC0415
    from threadpoolctl import threadpool_limits  # noqa: PLC0415

    threadpool_limits(1)  # one process per core
    model = kubeps_ctr.Model(wl.init_weights(args.data, args.head))
    optimizer = kp.Adagrad(learning_rate=wl.LEARNING_RATE, initial_accumulator_value=wl.INITIAL_ACCUMULATOR,
                           epsilon=wl.EPSILON)
    ctx = kp.InputContext(num_input_pipelines=processes, input_pipeline_id=index)
    batches = iter(kubeps_ctr.make_dataset(args.data, args.batch_size, ctx))
    spe = args.steps_per_execution
    executions = args.steps // spe
    warmup = min(args.warmup_executions, executions)
    share = lambda n: n // processes + (1 if index < n % processes else 0)  # noqa: E731 - this child's part of n
    for _ in range(share(warmup) * spe):
        model.train_step(*next(batches), optimizer)
    print("READY", flush=True)
    sys.stdin.readline()  # the parent's go
    timed = share(executions - warmup) * spe
    started = time.perf_counter()
    for _ in range(timed):
        model.train_step(*next(batches), optimizer)
    print(f"DONE {timed} {time.perf_counter() - started:.6f}", flush=True)
    if index == 0:
        np.savez(weights_out, **model.weights())
    return 0


def parent(processes: int, argv: list[str]) -> int:
    args = wl.parse_args(__doc__.splitlines()[0], argv)
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "weights.npz")
        kids = [subprocess.Popen([sys.executable, __file__, "--processes", str(processes), "--child", str(i),
                                  "--weights-out", out, "--", *argv], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                 text=True) for i in range(processes)]
        for i, kid in enumerate(kids):
            print(f"[kubeps] worker-{i} pid {kid.pid}", flush=True)
        for kid in kids:
            if kid.stdout.readline().strip() != "READY":  # type: ignore[union-attr]
                raise SystemExit(f"a floor process failed before its timed steps (exit status {kid.wait()})")
        print(f"TIMED START {time.time():.6f}", flush=True)
        started = time.perf_counter()
        for kid in kids:
            kid.stdin.write("go\n")  # type: ignore[union-attr]
            kid.stdin.flush()  # type: ignore[union-attr]
        steps = 0
        for kid in kids:
            line = kid.stdout.readline().split()  # type: ignore[union-attr]
            if not line or line[0] != "DONE":
                raise SystemExit(f"a floor process failed in its timed steps (exit status {kid.wait()})")
            steps += int(line[1])
        elapsed = time.perf_counter() - started
        print(f"TIMED END {time.time():.6f}", flush=True)
        if any(kid.wait() != 0 for kid in kids):
            raise SystemExit("a floor process failed after its timed steps")
        weights = dict(np.load(out))
    result = {"examples_per_s": steps * args.batch_size / elapsed, "train_seconds": elapsed, "steps": args.steps,
              "train_logloss": float("nan")}
    result.update(wl.evaluate(weights, args.data))
    print(f"floor: {steps} timed steps of {args.batch_size} in {processes} processes in {elapsed:.1f} s: "
          f"{result['examples_per_s']:.0f} examples/s", flush=True)
    print("RESULT " + json.dumps(result), flush=True)
    return 0


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--processes", type=int, default=os.cpu_count() or 1, help="one per core (default: all)")
    p.add_argument("--child", type=int, help=argparse.SUPPRESS)
    p.add_argument("--weights-out", help=argparse.SUPPRESS)
    own, rest = p.parse_known_args()
    rest = rest[1:] if rest[:1] == ["--"] else rest
    if own.processes < 1:
        p.error(f"--processes={own.processes}; allowed: an integer >= 1")
    if own.child is None:
        return parent(own.processes, rest)
    return child(own.child, own.processes, wl.parse_args(__doc__.splitlines()[0], rest), own.weights_out)


if __name__ == "__main__":
    sys.exit(main())
