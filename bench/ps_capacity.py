"""Capacity of one parameter-server task: pulls + pushes per second against the cores it is given.

    .venv/bin/python bench/ps_capacity.py [--cores 1,2] [--clients 4] [--seconds 8] [--tls] [--json OUT]

One ps task (``python -m kubeps.runtime.server``) and ``--clients`` client processes run pinned together to the
same ``c`` cores (``taskset -c 0..c-1``: the clients share the cores with the ps, as workers do on a small node;
the clients pin every thread of theirs once connected and warm, so that their start-up is not what is measured).
Each client is a coordinator of its own (``ParameterServerStrategy``) with an embedding table of 2^16 x 16 float32
partitioned over the task's servers and Adagrad on the ps, and repeats the step a CTR worker makes: pull the rows
of a batch of 512 x 8 ids (one ``nn.Embedding`` lookup: one RPC per server) and push their gradients (Adagrad's
``apply_gradients``: one RPC per server). The figure is the pulls + pushes per second of all clients together over
``--seconds`` after a warm-up.

For each core count ``c`` it measures the ps task as one server process (``KUBEPS_PS_PROCESSES=1``, the baseline)
and as ``c`` processes (``KUBEPS_PS_PROCESSES=c``, what ``kubeps local`` and the operator choose for a ps given c
cores), and prints the ratio of each to the 1-core, 1-process figure of the same run.
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

TOKEN = "bench-token-" + "0123456789abcdef"
VOCAB, DIM, IDS = 1 << 16, 16, 512 * 8


def _free_port_run(length: int) -> int:
    from kubeps.runtime.local.launcher import free_port_runs  # noqa: PLC0415 - the driver only

    return free_port_runs(1, length)[0]


def client(args: argparse.Namespace) -> int:
    """One client process: warm up, say ``READY``, wait for a line on stdin, run the step loop for ``--seconds``,
    then print ``COUNT n`` (pulls + pushes in the timed window)."""
    import kubeps.runtime as kp  # noqa: PLC0415 - clients only: the driver stays light
    from kubeps.runtime.ops import nn  # noqa: PLC0415

    resolver = kp.TFConfigClusterResolver()
    servers = resolver.cluster_spec().num_tasks("ps")
    strategy = kp.ParameterServerStrategy(resolver, variable_partitioner=kp.FixedShardsPartitioner(servers))
    strategy.wait_for_parameter_servers(timeout=120)
    rng = np.random.default_rng(args.client_id)
    with strategy.scope():
        table = kp.Variable(rng.uniform(-0.05, 0.05, (VOCAB, DIM)).astype(np.float32), name=f"table{args.client_id}")
    embedding = nn.Embedding(VOCAB, DIM, embeddings=table)
    optimizer = kp.Adagrad(learning_rate=0.05)
    batches = [rng.integers(0, VOCAB, (IDS // 8, 8)) for _ in range(16)]
    grad = np.full((IDS // 8, 8, DIM), 1e-3, np.float32)

    def step(i: int) -> None:
        embedding.forward(batches[i % len(batches)])
        embedding.backward(grad)
        optimizer.apply_gradients(nn.all_grads_and_vars([embedding]))

    for i in range(5):  # warm-up: connections, slots, allocations
        step(i)
    cores = set(range(args.pin))
    for tid in os.listdir("/proc/self/task"):  # every thread, gRPC's included, onto the measured cores
        os.sched_setaffinity(int(tid), cores)
    print("READY", flush=True)
    sys.stdin.readline()  # the driver's go, once every client is ready
    count, end = 0, time.monotonic() + args.seconds
    while time.monotonic() < end:
        step(count)
        count += 1
    print(f"COUNT {2 * count}", flush=True)
    strategy.close()
    return 0


def measure(cores: int, processes: int, args: argparse.Namespace, env: dict[str, str]) -> float:
    """Pulls + pushes per second of one ps task of ``processes`` server processes, it and the clients pinned to
    ``cores`` cores."""
    from kubeps.runtime.cluster import TFConfig  # noqa: PLC0415

    port = _free_port_run(processes + 2)  # the ps task's, then the chief's and a worker's (never dialled)
    cluster = {"chief": [f"127.0.0.1:{port + processes}"], "ps": [f"127.0.0.1:{port}"],
               "worker": [f"127.0.0.1:{port + processes + 1}"]}
    pin = ["taskset", "-c", f"0-{cores - 1}"]
    base = dict(env, KUBEPS_JOB_TOKEN=TOKEN, KUBEPS_BIND_HOST="127.0.0.1", KUBEPS_LOG_LEVEL="WARNING",
                KUBEPS_PS_PROCESSES=str(processes), KUBEPS_CPUS=str(cores))
    logs = tempfile.mkdtemp(prefix="kubeps-ps-capacity-")
    with open(os.path.join(logs, "ps.log"), "wb") as log:
        ps = subprocess.Popen(pin + [sys.executable, "-m", "kubeps.runtime.server"],
                              env=dict(base, TF_CONFIG=TFConfig.for_task(cluster, "ps", 0).to_json()),
                              stdout=log, stderr=subprocess.STDOUT)
    clients = []
    try:
        for i in range(args.clients):
            clients.append(subprocess.Popen(
                [sys.executable, __file__, "--client-id", str(i), "--seconds", str(args.seconds), "--pin", str(cores)],
                env=dict(base, TF_CONFIG=TFConfig.for_task(cluster, "chief", 0).to_json()),
                stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
        for proc in clients:  # every client connected and warm before any is timed
            seen = []
            for line in proc.stdout:
                seen.append(line)
                if line.strip() == "READY":
                    break
            else:
                raise SystemExit(f"a client failed before it was ready (exit status {proc.wait()}):\n"
                                 + "".join(seen)[-3000:])
        for proc in clients:
            proc.stdin.write("go\n")
            proc.stdin.flush()
        total = 0
        for proc in clients:
            out, _ = proc.communicate(timeout=args.seconds + 120)
            counts = [int(line.split()[1]) for line in out.splitlines() if line.startswith("COUNT ")]
            if proc.returncode != 0 or not counts:
                raise SystemExit(f"a client failed (exit status {proc.returncode}):\n{out[-3000:]}")
            total += counts[0]
        return total / args.seconds
    finally:
        for proc in clients:
            if proc.poll() is None:
                proc.kill()
        ps.terminate()
        try:
            ps.wait(timeout=10)
        except subprocess.TimeoutExpired:
            ps.kill()
            ps.wait()


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--cores", default="1,2", help="comma-separated core counts (taskset -c 0..c-1); default 1,2")
    p.add_argument("--clients", type=int, default=4, help="client processes sharing the cores (default 4)")
    p.add_argument("--seconds", type=float, default=8.0, help="timed window per measurement (default 8)")
    p.add_argument("--json", help="write the figures to this file")
    p.add_argument("--client-id", type=int, help=argparse.SUPPRESS)
    p.add_argument("--pin", type=int, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.client_id is not None:
        return client(args)
    cores = [int(c) for c in args.cores.split(",")]
    available = len(os.sched_getaffinity(0))
    if max(cores) > available:
        p.error(f"--cores {args.cores}: this process may run on {available} CPU(s)")
    env = {k: v for k, v in os.environ.items() if not k.startswith("KUBEPS_") and k != "TF_CONFIG"}
    print(f"ps capacity: {args.clients} clients, each pulling and pushing {IDS} rows x {DIM} of a {VOCAB} x {DIM} "
          f"table (Adagrad); {args.seconds:g} s per measurement; {os.cpu_count()} CPUs, load "
          f"{os.getloadavg()[0]:.2f}", flush=True)
    rows = []
    for c in cores:
        for processes in sorted({1, c}):
            rate = measure(c, processes, args, env)
            rows.append({"cores": c, "processes": processes, "ops_per_s": rate})
            print(f"  {c} core(s), {processes} server process(es): {rate:9.0f} pulls+pushes/s", flush=True)
    baseline = next(r["ops_per_s"] for r in rows if r["cores"] == min(cores) and r["processes"] == 1)
    print(f"\n{'cores':>6}{'processes':>11}{'pulls+pushes/s':>16}{'ratio':>8}   (baseline: {min(cores)} core, 1 process,"
          " same run)")
    for r in rows:
        r["ratio"] = r["ops_per_s"] / baseline
        print(f"{r['cores']:>6}{r['processes']:>11}{r['ops_per_s']:16.0f}{r['ratio']:7.2f}x")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": {k: v for k, v in vars(args).items() if k not in ("client_id", "pin")},
                       "rows": rows, "load": os.getloadavg()}, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
