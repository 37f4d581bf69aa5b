"""Training throughput of the CTR example's model: in-process vs on 2 ps and 2 workers, and where step time goes.

    .venv/bin/python bench/train_ctr.py [--batch-size 512] [--steps 600] [--rounds 3] [--profile DIR]

Both measurements use the model, layers, kernels, optimizer and data of ``examples/ctr/train.py``, in one run:

* **in-process**: the model built outside any strategy scope (local variables; Adagrad updates them in place
  through the same ``apply_gradients`` code path), ``train_steps`` called in a loop, alternating between the two
  workers' shards of the data as the distributed run does;
* **distributed**: this file run by ``kubeps local --ps 2 --workers 2``; the chief builds the model inside
  ``strategy.scope()`` and schedules ``train_steps`` (``--steps-per-execution`` steps per call) on the workers.

Examples/s are medians over ``--rounds`` rounds of ``--steps`` steps each (after a warm-up round). On the
workers every step is timed with ``time.perf_counter``, and so is every call into the worker's parameter-server
transport (``PSTransport.call_many``: the ``ReadRows`` of the embedding lookup -- ``ReadMany`` when it also carries
the dense weights' pull --, a ``Read`` of the dense weights if one is still needed, the ``Push`` of the gradients,
which answers with the updated dense weights -- encoding, gRPC, the PS's work and the decoding). Their ratio is the
share of step time spent in RPC and serialisation; the rest is data (``next(iterator)``) and compute. The frame
encoding and decoding is also timed on its own (summed over the parallel calls' threads).

``--profile DIR`` writes a cProfile of each worker's scheduled functions to ``DIR/worker-<i>.prof``
(``python -m pstats DIR/worker-0.prof``).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path


EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "ctr" / "train.py"


def load_example():
    spec = importlib.util.spec_from_file_location("ctr_train_example", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


ctr = load_example()


# -- worker-side instrumentation ----------------------------------------------------------------------------------
class WorkerTimers:
    """Seconds spent by one worker process, kept on its PS transport between scheduled functions."""

    def __init__(self, transport, profile_path: str | None):
        self.rpc = {}  # method -> [calls, seconds]
        self.codec = 0.0  # wire encode + decode, summed over threads
        self.profile_path = profile_path
        self.profiler = None
        if profile_path:
            import cProfile

            self.profiler = cProfile.Profile()
        timed_call_many = transport.call_many  # the bound method; the instance attribute below shadows it

        def call_many(requests, timeout=None):
            method = next(iter(requests.values()))[0]
            t0 = time.perf_counter()
            try:
                return timed_call_many(requests, timeout)
            finally:
                entry = self.rpc.setdefault(method, [0, 0.0])
                entry[0] += len(requests)  # RPCs (one per PS of the fan-out)
                entry[1] += time.perf_counter() - t0

        transport.call_many = call_many
        self._time_codec()

    def _time_codec(self) -> None:
        from kubeps.runtime import wire

        encode, feed, finish = wire.encode_chunks, wire.MessageDecoder.feed, wire.MessageDecoder.finish
        timers = self

        def timed(fn):
            def wrapper(*args, **kwargs):
                t0 = time.perf_counter()
                try:
                    return fn(*args, **kwargs)
                finally:
                    timers.codec += time.perf_counter() - t0
            return wrapper

        wire.encode_chunks = timed(encode)  # the rpc module looks it up on wire at every call
        wire.MessageDecoder.feed = timed(feed)
        wire.MessageDecoder.finish = timed(finish)

    def snapshot(self) -> dict:
        return {"rpc": {m: list(v) for m, v in self.rpc.items()}, "codec": self.codec}

    @staticmethod
    def on_this_worker(profile_path: str | None) -> "WorkerTimers":
        from kubeps.runtime.context import current_closure_context

        ctx = current_closure_context()
        transport = ctx.transport
        timers = getattr(transport, "_bench_timers", None)
        if timers is None:
            path = None if not profile_path else os.path.join(profile_path, f"worker-{ctx.worker_index}.prof")
            timers = transport._bench_timers = WorkerTimers(transport, path)
        return timers


def instrumented_train_steps(model, optimizer, iterator, steps: int, profile_path: str | None) -> dict:
    """``ctr.train_steps`` with every step timed (data, whole step) and the transport's time around it."""
    timers = WorkerTimers.on_this_worker(profile_path)
    before = timers.snapshot()
    if timers.profiler:
        timers.profiler.enable()
    data = step_time = loss = 0.0
    cpu0 = time.process_time()  # this worker process's CPU time, every thread (gRPC's included)
    for _ in range(steps):
        t0 = time.perf_counter()
        ids, dense, labels = next(iterator)
        t1 = time.perf_counter()
        loss += model.train_step(ids, dense, labels, optimizer)
        t2 = time.perf_counter()
        data += t1 - t0
        step_time += t2 - t0
    cpu = time.process_time() - cpu0
    if timers.profiler:
        timers.profiler.disable()
        timers.profiler.dump_stats(timers.profile_path)
    after = timers.snapshot()
    rpc = {m: [after["rpc"][m][0] - before["rpc"].get(m, [0, 0.0])[0],
               after["rpc"][m][1] - before["rpc"].get(m, [0, 0.0])[1]] for m in after["rpc"]}
    return {"loss": loss / steps, "steps": steps, "step_s": step_time, "data_s": data, "cpu_s": cpu, "rpc": rpc,
            "codec_s": after["codec"] - before["codec"]}


def merge(parts: list[dict]) -> dict:
    out = {"steps": 0, "step_s": 0.0, "data_s": 0.0, "cpu_s": 0.0, "codec_s": 0.0, "rpc": {}}
    for p in parts:
        for key in ("steps", "step_s", "data_s", "cpu_s", "codec_s"):
            out[key] += p[key]
        for method, (calls, seconds) in p["rpc"].items():
            entry = out["rpc"].setdefault(method, [0, 0.0])
            entry[0] += calls
            entry[1] += seconds
    out["rpc_s"] = sum(s for _, s in out["rpc"].values())
    out["rpcs"] = sum(c for c, _ in out["rpc"].values())
    return out


# -- the distributed half (this file under kubeps local) ------------------------------------------------------------
def run_chief(args: argparse.Namespace) -> int:
    from kubeps.runtime.cluster import TFConfigClusterResolver
    from kubeps.runtime.coordinator import ClusterCoordinator
    from kubeps.runtime.partitioners import MinSizePartitioner
    from kubeps.runtime.strategy import ParameterServerStrategy

    resolver = TFConfigClusterResolver()
    num_ps = resolver.cluster_spec().num_tasks("ps")
    strategy = ParameterServerStrategy(resolver, variable_partitioner=MinSizePartitioner(256 << 10, num_ps))
    coordinator = ClusterCoordinator(strategy)
    try:
        with strategy.scope():
            model = ctr.build_model(args)
        optimizer = ctr.make_optimizer(args)
        iterator = iter(coordinator.create_per_worker_dataset(lambda ctx: ctr.make_dataset(args, ctx)))
        n, profile = args.steps_per_execution, args.profile

        def train_fn(it):
            return instrumented_train_steps(model, optimizer, it, n, profile)

        rounds = []
        for r in range(args.rounds + 1):  # round 0 warms up (connections, slots, first allocations)
            t0 = time.perf_counter()
            parts = [coordinator.schedule(train_fn, args=(iterator,)) for _ in range(args.steps // n)]
            coordinator.join()
            elapsed = time.perf_counter() - t0
            if r:
                stats = merge([p.fetch() for p in parts])
                stats["examples_per_s"] = args.steps * args.batch_size / elapsed
                rounds.append(stats)
        print("RESULT " + json.dumps(rounds))
        return 0
    finally:
        coordinator.shutdown()
        strategy.close()


def distributed(args: argparse.Namespace) -> list[dict]:
    cmd = [sys.executable, "-m", "kubeps.runtime.cli", "local", "--ps", "2", "--workers", "2", __file__, "--",
           *forwarded(args)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("[chief-0] RESULT ")]
    if proc.returncode != 0 or len(lines) != 1:
        sys.exit(f"the distributed run failed (status {proc.returncode}):\n{proc.stdout[-4000:]}\n{proc.stderr[-4000:]}")
    return json.loads(lines[0].split(" RESULT ", 1)[1])


def forwarded(args: argparse.Namespace) -> list[str]:
    out = ["--batch-size", str(args.batch_size), "--steps", str(args.steps), "--steps-per-execution",
           str(args.steps_per_execution), "--rounds", str(args.rounds)]
    return out + (["--profile", os.path.abspath(args.profile)] if args.profile else [])


# -- the in-process half ------------------------------------------------------------------------------------------
def in_process(args: argparse.Namespace) -> tuple[list[float], list[float]]:
    from kubeps.runtime.data import InputContext

    model, optimizer = ctr.build_model(args), ctr.make_optimizer(args)  # no scope: local variables
    iterators = [iter(ctr.make_dataset(args, InputContext(2, i, 1))) for i in range(2)]
    n = args.steps_per_execution
    rates, cpu_ms = [], []
    for r in range(args.rounds + 1):
        t0, c0 = time.perf_counter(), time.process_time()
        for k in range(args.steps // n):
            ctr.train_steps(model, optimizer, iterators[k % 2], n)
        elapsed, cpu = time.perf_counter() - t0, time.process_time() - c0
        if r:
            rates.append(args.steps * args.batch_size / elapsed)
            cpu_ms.append(1e3 * cpu / args.steps)
    return rates, cpu_ms


def ctr_args(args: argparse.Namespace) -> argparse.Namespace:
    """The example's defaults with this run's batch size and step counts."""
    model_args = ctr.parse_args(["--batch-size", str(args.batch_size), "--steps", str(args.steps),
                                 "--steps-per-execution", str(args.steps_per_execution)])
    for key, value in vars(model_args).items():
        if not hasattr(args, key):
            setattr(args, key, value)
    return args


def report(args: argparse.Namespace, local_rates: list[float], local_cpu_ms: list[float], rounds: list[dict]) -> dict:
    local = statistics.median(local_rates)
    local_step_ms = 1e3 * args.batch_size / local
    worker_cpu_ms = statistics.median(1e3 * r["cpu_s"] / r["steps"] for r in rounds)
    dist = statistics.median(r["examples_per_s"] for r in rounds)
    share = statistics.median(r["rpc_s"] / r["step_s"] for r in rounds)
    codec = statistics.median(r["codec_s"] / r["step_s"] for r in rounds)
    data = statistics.median(r["data_s"] / r["step_s"] for r in rounds)
    step_ms = statistics.median(1e3 * r["step_s"] / r["steps"] for r in rounds)
    print(f"CTR model ({ctr.FIELDS} fields -> embedding {args.vocab_size}x{args.embedding_dim} -> MLP "
          f"{args.hidden} -> 1), batch {args.batch_size}, Adagrad, {args.rounds} rounds of {args.steps} steps, "
          f"medians")
    print(f"  in-process (local variables)        {local:9.0f} examples/s   rounds: "
          + " ".join(f"{x:.0f}" for x in local_rates))
    print(f"  kubeps local, 2 ps + 2 workers      {dist:9.0f} examples/s   rounds: "
          + " ".join(f"{r['examples_per_s']:.0f}" for r in rounds))
    print(f"  ratio distributed / in-process      {dist / local:9.2f}")
    print(f"  step time: in-process               {local_step_ms:9.2f} ms  (CPU {statistics.median(local_cpu_ms):.2f} ms)")
    print(f"  step time: on a worker              {step_ms:9.2f} ms  (CPU of the worker process "
          f"{worker_cpu_ms:.2f} ms; 2 workers + 2 ps + chief share the machine's cores)")
    print(f"  share in RPC + serialisation        {100 * share:8.1f} %   (goal < 30%)")
    last = rounds[len(rounds) // 2]  # the middle round
    for method, (calls, seconds) in sorted(last["rpc"].items()):
        print(f"    {method:<10} {calls / last['steps']:.2f} RPCs/step  {1e3 * seconds / last['steps']:6.2f} ms/step"
              f"  {100 * seconds / last['step_s']:5.1f} %")
    print(f"    all        {last['rpcs'] / last['steps']:.2f} RPCs/step (2 ps)")
    print(f"    of which frame encode/decode (thread time) {100 * codec:5.1f} %")
    print(f"  share in next(iterator)             {100 * data:8.1f} %")
    print(f"  share in compute (the rest)         {100 * (1 - share - data):8.1f} %")
    summary = {"in_process_examples_per_s": local, "distributed_examples_per_s": dist, "ratio": dist / local,
               "rpc_share": share, "codec_share": codec, "data_share": data, "worker_step_ms": step_ms,
               "worker_cpu_ms_per_step": worker_cpu_ms,
               "rpcs_per_step": statistics.median(r["rpcs"] / r["steps"] for r in rounds),
               "in_process_step_ms": local_step_ms,
               "in_process_cpu_ms_per_step": statistics.median(local_cpu_ms)}
    print("SUMMARY " + json.dumps(summary))
    return summary


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--batch-size", type=int, default=512)
    p.add_argument("--steps", type=int, default=600, help="steps per measured round")
    p.add_argument("--steps-per-execution", type=int, default=20)
    p.add_argument("--rounds", type=int, default=3, help="measured rounds (after one warm-up round)")
    p.add_argument("--profile", default=None, help="directory for a cProfile of each worker's scheduled functions")
    args = p.parse_args(argv)
    if args.steps % args.steps_per_execution:
        p.error(f"--steps={args.steps} must be a multiple of --steps-per-execution={args.steps_per_execution}")
    if args.rounds < 1:
        p.error(f"--rounds must be >= 1, got {args.rounds}")
    return ctr_args(args)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    task = json.loads(os.environ["TF_CONFIG"])["task"]["type"] if os.environ.get("TF_CONFIG") else None
    if task in ("ps", "worker"):
        return ctr.main([])  # serve
    if task == "chief":
        return run_chief(args)
    if args.profile:
        os.makedirs(args.profile, exist_ok=True)
    local_rates, local_cpu_ms = in_process(args)
    rounds = distributed(args)
    report(args, local_rates, local_cpu_ms, rounds)
    return 0


if __name__ == "__main__":
    sys.exit(main())
