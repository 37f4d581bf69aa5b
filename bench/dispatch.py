"""One chief, hundreds of workers: what the coordinator costs per worker and per closure.

Lightweight workers: ``--hosts`` processes each serve a slice of the workers as several in-process worker
``Server`` s (one gRPC server per worker, on its own port, as a pod would have), plus one ps process. The chief is
this process: its CPU is read from its own ``getrusage`` and per thread from ``/proc/self/task/<tid>/stat``, so
what the worker processes burn on the same cores is not counted (the workers run with ``nice 10`` so that the
chief is not starved of a core it asks for).

For each worker count (``--workers 8,64,256``), in one run:

* connect: coordinator construction until every worker answered its first ping (channels + dispatch threads);
* memory: the chief's RSS growth from before the coordinator to after the first closures, per worker;
* dataset: ``create_per_worker_dataset`` on every worker until every worker's copy exists;
* dispatch: ``--closures`` trivial functions (``schedule`` + ``join``): closures/s, the chief's CPU per closure
  and its split between the dispatch threads, the heartbeat monitor, the scheduling thread and gRPC's own threads,
  and the context switches of all its threads per closure (the hand-offs between threads a closure costs);
* idle heartbeats: the chief's CPU per second with every worker connected and nothing to run.

Prints one line per worker count and the ratios of the largest count to the smallest (per-closure CPU and
per-worker memory should stay flat: a ratio well above 1 grows worse than linearly). The goal lines (``>= 2,000
closures/s`` to the largest count on ``<= 1`` core, ``<= 1 MB`` per worker) are checked; exit status 1 on a miss.

    .venv/bin/python bench/dispatch.py [--workers 8,64,256] [--hosts 8] [--closures 4000] [--profile out.txt]

``--profile FILE``: run py-spy (``pip install py-spy``) on the chief during the largest count's dispatch.
``--closure-ms MS``: each function sleeps ``MS`` (a step's stand-in that uses no core): every worker stays busy and a
backlog builds, as in training, so the coordinator sends its fair share of it per call (``--closures-per-call``, the
coordinator's ``max_closures_per_call``; 1 sends each function alone). ``--gil-switch-interval S``: the coordinator's
``gil_switch_interval`` (0: the interpreter's own, 5 ms; the baseline of that setting). With functions that return at once the
workers wait for the chief and nothing queues up: every function goes alone, whatever the setting.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import signal
import subprocess
import sys
import tempfile
import threading
import time

from kubeps.runtime.coordinator.cluster_coordinator import DEFAULT_CLOSURES_PER_CALL, DEFAULT_GIL_SWITCH_INTERVAL
from kubeps.runtime.local.launcher import free_ports

TOKEN = "bench-token-" + "0123456789abcdef"
TICK = os.sysconf("SC_CLK_TCK")


# -- the worker host ---------------------------------------------------------------------------------------------------
def serve(tf_config_path: str, job: str, first: int, count: int) -> None:
    """Serve ``count`` tasks of ``job`` from ``first`` in this process until SIGTERM."""
    from kubeps.runtime.cluster import ClusterSpec, TFConfig
    from kubeps.runtime.server.service import Server

    with open(tf_config_path) as f:
        spec = ClusterSpec(TFConfig.parse(f.read()).cluster)
    servers = [Server(spec, job, i, token=TOKEN, max_workers=4) for i in range(first, first + count)]
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    print("ready", flush=True)
    stop.wait()
    for server in servers:
        server.stop(0)


# -- measurement helpers ---------------------------------------------------------------------------------------------
def _rss_mb() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return float("nan")


def _cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def _threads() -> dict[int, tuple[float, int]]:
    """``(CPU seconds, context switches)`` of every thread of this process, by native thread id."""
    out = {}
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            with open(f"/proc/self/task/{tid}/status") as f:
                switches = sum(int(line.split()[1]) for line in f if "ctxt_switches:" in line)
        except (OSError, ValueError, IndexError):
            continue
        out[int(tid)] = ((int(fields[11]) + int(fields[12])) / TICK, switches)
    return out


def _split(before: dict[int, tuple[float, int]], after: dict[int, tuple[float, int]],
           which: int = 0) -> dict[str, float]:
    """CPU seconds (``which=0``) or context switches (``which=1``) between two snapshots, by the role of each Python
    thread (others: gRPC's threads)."""
    roles = {}
    for thread in threading.enumerate():
        name = thread.name
        role = ("dispatch" if name.startswith("kubeps-worker-") else
                "main" if thread is threading.main_thread() else
                "heartbeat" if "monitor" in name or "heartbeat" in name or "failure" in name else "python-other")
        if thread.native_id is not None:
            roles[thread.native_id] = role
    split: dict[str, float] = {}
    for tid, now in after.items():
        role = roles.get(tid, "grpc")
        split[role] = split.get(role, 0.0) + now[which] - before.get(tid, (0.0, 0))[which]
    return split


# -- the chief -------------------------------------------------------------------------------------------------------
def _trivial(i):
    return i + 1


def _busy(i, seconds):
    """A function that keeps its worker busy for ``seconds`` (a training step's stand-in) without using a core."""
    time.sleep(seconds)
    return i + 1


def _dataset_fn():
    return iter(range(1_000_000))


def measure(num_workers: int, args, tmp: str, ps_port: int) -> dict:
    import kubeps.runtime as kp
    from kubeps.runtime.cluster import TFConfigClusterResolver

    ports = free_ports(num_workers)
    cluster = {"chief": ["127.0.0.1:1"], "ps": [f"127.0.0.1:{ps_port}"], "worker": [f"127.0.0.1:{p}" for p in ports]}
    config_path = os.path.join(tmp, f"tf_config_{num_workers}.json")
    with open(config_path, "w") as f:
        json.dump({"cluster": cluster, "task": {"type": "chief", "index": 0}}, f)
    hosts = min(args.hosts, num_workers)
    per = -(-num_workers // hosts)
    procs = []
    for first in range(0, num_workers, per):
        count = min(per, num_workers - first)
        procs.append(subprocess.Popen(
            ["nice", "-n", "10", sys.executable, __file__, "--serve", config_path, "worker", str(first), str(count)],
            stdout=subprocess.PIPE, text=True))
    try:
        for proc in procs:
            if proc.stdout.readline().strip() != "ready":
                raise RuntimeError("a worker host did not start")
        resolver = TFConfigClusterResolver(tf_config={"cluster": cluster, "task": {"type": "chief", "index": 0}})
        strategy = kp.ParameterServerStrategy(resolver, job_token=TOKEN)
        rss0 = _rss_mb()
        t0 = time.perf_counter()
        # generous failure detection: on a loaded machine a ps or worker host can be starved for seconds
        coordinator = kp.ClusterCoordinator(strategy, heartbeat_failures=20, ping_timeout=5.0,
                                            max_closures_per_call=args.closures_per_call,
                                            gil_switch_interval=args.gil_switch_interval or None)
        # connected: every worker answered (a per-worker value needs every dispatch thread to be up)
        warm = [coordinator.schedule(_trivial, args=(i,)) for i in range(num_workers)]
        coordinator.join()
        connect_s = time.perf_counter() - t0
        switch_interval_ms = sys.getswitchinterval() * 1000
        assert [w.fetch() for w in warm] == [i + 1 for i in range(num_workers)]

        t0 = time.perf_counter()
        dataset = coordinator.create_per_worker_dataset(_dataset_fn)
        coordinator.join()
        dataset_s = time.perf_counter() - t0
        del dataset

        profiler = None
        if args.profile and num_workers == max(args.worker_counts):
            profiler = subprocess.Popen([os.path.join(os.path.dirname(sys.executable), "py-spy"), "record", "--format", "raw", "--threads", "--rate", "200",
                                         "--pid", str(os.getpid()), "--output", args.profile, "--nonblocking"],
                                        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            time.sleep(1.0)
        batched0 = coordinator._queue.counters()["batched"]
        threads0, cpu0, t0 = _threads(), _cpu(), time.perf_counter()
        if args.closure_ms > 0:
            values = [coordinator.schedule(_busy, args=(i, args.closure_ms / 1000)) for i in range(args.closures)]
        else:
            values = [coordinator.schedule(_trivial, args=(i,)) for i in range(args.closures)]
        coordinator.join()
        wall = time.perf_counter() - t0
        cpu = _cpu() - cpu0
        threads1 = _threads()
        split, switches = _split(threads0, threads1), _split(threads0, threads1, which=1)
        calls = args.closures - (coordinator._queue.counters()["batched"] - batched0)
        if profiler is not None:
            profiler.send_signal(signal.SIGINT)
            profiler.wait(timeout=60)
        assert sum(v.fetch() for v in values) == sum(range(1, args.closures + 1))
        del values, warm
        rss1 = _rss_mb()

        cpu0, t0 = _cpu(), time.perf_counter()
        time.sleep(args.idle_s)
        idle_cores = (_cpu() - cpu0) / (time.perf_counter() - t0)
        coordinator.shutdown()
    finally:
        for proc in procs:
            proc.terminate()
        for proc in procs:
            try:
                proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                proc.kill()
    return {"workers": num_workers, "hosts": hosts, "connect_s": connect_s, "dataset_s": dataset_s,
            "dataset_ms_per_worker": dataset_s * 1000 / num_workers,
            "closures_per_s": args.closures / wall, "chief_cores": cpu / wall,
            "chief_us_per_closure": cpu * 1e6 / args.closures,
            "split_us_per_closure": {k: round(v * 1e6 / args.closures, 1) for k, v in sorted(split.items())},
            "switches_per_closure": sum(switches.values()) / args.closures, "switch_interval_ms": switch_interval_ms,
            "switches_split": {k: round(v / args.closures, 1) for k, v in sorted(switches.items())},
            "idle_cores": idle_cores, "mb_per_worker": (rss1 - rss0) / num_workers,
            "functions_per_call": args.closures / max(1, calls)}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--serve", nargs=4, metavar=("TF_CONFIG", "JOB", "FIRST", "COUNT"), help=argparse.SUPPRESS)
    parser.add_argument("--workers", default="8,64,256", help="worker counts, comma-separated (default 8,64,256)")
    parser.add_argument("--hosts", type=int, default=8, help="worker processes the workers are spread over (8)")
    parser.add_argument("--closures", type=int, default=4000, help="trivial functions scheduled per count (4000)")
    parser.add_argument("--idle-s", type=float, default=3.0, help="seconds of idle heartbeats measured (3)")
    parser.add_argument("--profile", help="py-spy raw (collapsed) profile of the chief at the largest count")
    parser.add_argument("--closure-ms", type=float, default=0.0,
                        help="each function sleeps this long (0: returns at once): with functions that keep every "
                             "worker busy, the queue holds a backlog, as in training")
    parser.add_argument("--closures-per-call", type=int, default=DEFAULT_CLOSURES_PER_CALL,
                        help="the coordinator's max_closures_per_call (default %(default)s; 1: one function per call)")
    parser.add_argument("--gil-switch-interval", type=float, default=DEFAULT_GIL_SWITCH_INTERVAL,
                        help="the coordinator's gil_switch_interval in seconds (default %(default)s; 0: the "
                             "interpreter's own)")
    args = parser.parse_args()
    if args.serve:
        serve(args.serve[0], args.serve[1], int(args.serve[2]), int(args.serve[3]))
        return 0
    args.worker_counts = [int(w) for w in args.workers.split(",")]
    if not 0 <= args.gil_switch_interval <= 1:
        parser.error(f"--gil-switch-interval: {args.gil_switch_interval:g} is not in [0, 1] seconds (0: the "
                     f"interpreter's own)")

    with tempfile.TemporaryDirectory() as tmp:
        ps_port = free_ports(1)[0]
        ps_config = os.path.join(tmp, "ps.json")
        with open(ps_config, "w") as f:
            json.dump({"cluster": {"ps": [f"127.0.0.1:{ps_port}"], "worker": ["127.0.0.1:1"]},
                       "task": {"type": "ps", "index": 0}}, f)
        ps = subprocess.Popen([sys.executable, __file__, "--serve", ps_config, "ps", "0", "1"],
                              stdout=subprocess.PIPE, text=True)
        try:
            ps.stdout.readline()
            rows = [measure(n, args, tmp, ps_port) for n in args.worker_counts]
        finally:
            ps.terminate()
            ps.wait(timeout=20)

    print(f"machine: {os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.1f} (workers share the cores; "
          f"only the chief's own CPU is counted); at most {args.closures_per_call} function(s) per call; GIL switch "
          f"interval {rows[0]['switch_interval_ms']:g} ms during the runs; each "
          f"function {'sleeps %g ms' % args.closure_ms if args.closure_ms > 0 else 'returns at once'}")
    print(f"{'workers':>7} {'connect s':>9} {'dataset ms/worker':>17} {'closures/s':>10} {'chief cores':>11} "
          f"{'chief us/closure':>16} {'switches/closure':>16} {'per call':>8} {'idle cores':>10} {'MB/worker':>9}  "
          f"split us/closure, then switches/closure")
    for r in rows:
        print(f"{r['workers']:>7} {r['connect_s']:>9.2f} {r['dataset_ms_per_worker']:>17.2f} {r['closures_per_s']:>10.0f} "
              f"{r['chief_cores']:>11.2f} {r['chief_us_per_closure']:>16.0f} {r['switches_per_closure']:>16.1f} "
              f"{r['functions_per_call']:>8.2f} "
              f"{r['idle_cores']:>10.3f} "
              f"{r['mb_per_worker']:>9.3f}  {r['split_us_per_closure']} {r['switches_split']}")
    small, big = rows[0], rows[-1]
    print(f"ratios {big['workers']} / {small['workers']} workers: chief CPU per closure "
          f"{big['chief_us_per_closure'] / small['chief_us_per_closure']:.2f}x, closures/s "
          f"{big['closures_per_s'] / small['closures_per_s']:.2f}x, dataset time per worker "
          f"{big['dataset_ms_per_worker'] / small['dataset_ms_per_worker']:.2f}x, idle CPU per worker "
          f"{(big['idle_cores'] / big['workers']) / max(small['idle_cores'] / small['workers'], 1e-9):.2f}x")
    # the goal: a chief that needs <= 1 core for 2,000 closures/s (its CPU per closure <= 500 us), whatever the
    # workers on this machine manage to run
    capacity = 1e6 / big["chief_us_per_closure"]
    ok_rate = capacity >= 2000
    ok_mem = big["mb_per_worker"] <= 1.0
    print(f"goal: chief capacity on one core {capacity:.0f} closures/s to {big['workers']} workers (>= 2000): "
          f"{'met' if ok_rate else 'MISSED'}; measured {big['closures_per_s']:.0f}/s on {big['chief_cores']:.2f} cores"
          f" ({'also' if big['closures_per_s'] >= 2000 and big['chief_cores'] <= 1 else 'not'} >= 2000/s on <= 1 "
          f"core as measured)")
    print(f"goal: chief memory per worker {big['mb_per_worker']:.3f} MB (<= 1 MB): {'met' if ok_mem else 'MISSED'}")
    return 0 if ok_rate and ok_mem else 1


if __name__ == "__main__":
    sys.exit(main())
