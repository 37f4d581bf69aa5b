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

``--local``: real workers under ``kubeps local`` instead (one process per worker, with the job's TLS, token and
metrics, as ``kubeps local`` starts them; the chief is a task of the job too): one job per count, the counts
alternating ``--rounds`` times so that the load of other programs on the machine falls on every count alike. Each
chief measures ``--closures`` trivial functions once its workers all ran some. Prints each job's rate and each
round's ratio of the largest count's rate to the smallest's, then the median ratio; ``--goal-ratio`` (0.8) is
checked on it (exit status 1 on a miss). ``--profile`` profiles the largest count's chief in the first round.

    .venv/bin/python bench/dispatch.py --local --workers 2,64 --rounds 3 --closures 4000

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


def _names(before: dict[int, tuple[float, int]], after: dict[int, tuple[float, int]]) -> dict[str, int]:
    """Thread names (``comm``) of threads that are not Python's, with their CPU ms between two snapshots."""
    python = {t.native_id for t in threading.enumerate()}
    out: dict[str, int] = {}
    for tid, now in after.items():
        if tid in python:
            continue
        try:
            with open(f"/proc/self/task/{tid}/comm") as f:
                name = f.read().strip()
        except OSError:
            continue
        out[name] = out.get(name, 0) + round((now[0] - before.get(tid, (0.0, 0))[0]) * 1000)
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


def _measured_dispatch(coordinator, args, profile: str | None) -> dict:
    """Schedule ``--closures`` functions and join, measured: wall and CPU seconds, the CPU and context switches of
    the chief's threads by role, the calls made, the gRPC threads' CPU; with ``profile``, py-spy records meanwhile."""
    profiler = None
    if profile:
        profiler = subprocess.Popen(
            [os.path.join(os.path.dirname(sys.executable), "py-spy"), "record", "--format", "raw", "--threads",
             "--rate", "200", "--pid", str(os.getpid()), "--output", profile, "--nonblocking"],
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
    calls = args.closures - (coordinator._queue.counters()["batched"] - batched0)
    if profiler is not None:
        profiler.send_signal(signal.SIGINT)
        profiler.wait(timeout=60)
    assert sum(v.fetch() for v in values) == sum(range(1, args.closures + 1))
    return {"wall": wall, "cpu": cpu, "calls": calls, "split": _split(threads0, threads1),
            "switches": _split(threads0, threads1, which=1), "grpc_names": _names(threads0, threads1)}


# -- real workers under kubeps local --------------------------------------------------------------------------------
def local_task(args) -> int:
    """One task of a ``--local`` job: the ps and the workers serve; the chief measures its workers' rate and writes
    it to ``--result``."""
    import kubeps.runtime as kp
    from kubeps.runtime.cluster import TFConfigClusterResolver

    resolver = TFConfigClusterResolver()
    if resolver.task_type != "chief":
        kp.Server(resolver.cluster_spec(), job_name=resolver.task_type, task_index=resolver.task_id).join()
        return 0
    strategy = kp.ParameterServerStrategy(resolver)
    coordinator = kp.ClusterCoordinator(strategy, heartbeat_failures=20, ping_timeout=5.0,
                                        max_closures_per_call=args.closures_per_call,
                                        gil_switch_interval=args.gil_switch_interval or None)
    try:
        count = coordinator.num_workers
        for _ in range(2):  # every worker answered and ran functions
            warm = [coordinator.schedule(_trivial, args=(i,)) for i in range(4 * count)]
            coordinator.join()
        del warm
        run = _measured_dispatch(coordinator, args, args.profile)
    finally:
        coordinator.shutdown()
    with open(args.result, "w") as f:
        json.dump({"workers": count, "rate": args.closures / run["wall"], "us": run["cpu"] * 1e6 / args.closures,
                   "load": os.getloadavg()[0], "per_call": args.closures / max(1, run["calls"]),
                   "split": {k: round(v * 1e6 / args.closures) for k, v in sorted(run["split"].items())},
                   "switches": round(sum(run["switches"].values()) / args.closures, 1),
                   "gone": round((run["cpu"] - sum(run["split"].values())) * 1e6 / args.closures),
                   "grpc_names": run["grpc_names"]}, f)
    return 0


def run_local_bench(args, argv: list[str]) -> int:
    """``--local``: one ``kubeps local`` job per count and round, the counts alternating; each job's chief runs
    :func:`local_task`. Prints each job's rate, each round's ratio and their median, checked against the goal."""
    from kubeps.runtime.local.launcher import run_local

    small, big = min(args.worker_counts), max(args.worker_counts)
    ratios = []
    with tempfile.TemporaryDirectory() as tmp:
        result, log_path = os.path.join(tmp, "result.json"), os.path.join(tmp, "tasks.log")
        for round_ in range(args.rounds):
            rates = {}
            for count in args.worker_counts:
                task_args = ["--local-task", *argv, "--result", result]
                if args.profile and round_ == 0 and count == big:
                    task_args += ["--profile", args.profile]
                with open(log_path, "w") as log:
                    status = run_local(__file__, task_args, num_ps=1, num_workers=count, output=log, log=log)
                if status != 0:
                    with open(log_path) as log:
                        print(log.read()[-4000:])
                    print(f"the job of {count} workers failed with exit status {status}")
                    return 2
                with open(result) as f:
                    got = json.load(f)
                rates[count] = got["rate"]
                print(f"round {round_ + 1}: {count:>4} workers {got['rate']:>7.0f} functions/s, chief "
                      f"{got['us']:.0f} us CPU per function {got['split']}, {got['per_call']:.2f} per call, "
                      f"{got['switches']} context switches per function; load {got['load']:.1f}; {got.get('gone')} us in threads "
                      f"that ended; gRPC threads {got.get('grpc_names')} ms", flush=True)
            ratios.append(rates[big] / rates[small])
            print(f"round {round_ + 1}: {big} / {small} workers {ratios[-1]:.2f}x", flush=True)
    median = sorted(ratios)[len(ratios) // 2]
    met = median >= args.goal_ratio
    print(f"goal: functions/s to {big} workers >= {args.goal_ratio:g}x the rate to {small} under kubeps local "
          f"({os.cpu_count()} CPUs): median of {len(ratios)} round(s) {median:.2f}x "
          f"({', '.join(f'{r:.2f}' for r in ratios)}): {'met' if met else 'MISSED'}", flush=True)
    return 0 if met else 1


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

        run = _measured_dispatch(coordinator, args,
                                 args.profile if args.profile and num_workers == max(args.worker_counts) else None)
        wall, cpu, calls, split, switches = run["wall"], run["cpu"], run["calls"], run["split"], run["switches"]
        del warm
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


def _without(argv: list[str], options: dict[str, int]) -> list[str]:
    """``argv`` without ``options`` (each with the number of values it takes)."""
    out, skip = [], 0
    for arg in argv:
        if skip:
            skip -= 1
        elif arg.split("=", 1)[0] in options:
            skip = options[arg] if "=" not in arg else 0
        else:
            out.append(arg)
    return out


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
    parser.add_argument("--local", action="store_true",
                        help="real workers under kubeps local, the counts alternated --rounds times (see above)")
    parser.add_argument("--local-task", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--result", help=argparse.SUPPRESS)
    parser.add_argument("--rounds", type=int, default=3, help="--local: rounds of every count (3)")
    parser.add_argument("--goal-ratio", type=float, default=0.8,
                        help="--local: the least median ratio of the largest count's rate to the smallest's (0.8)")
    argv = sys.argv[1:]
    args = parser.parse_args(argv)
    if args.serve:
        serve(args.serve[0], args.serve[1], int(args.serve[2]), int(args.serve[3]))
        return 0
    args.worker_counts = [int(w) for w in args.workers.split(",")]
    if not 0 <= args.gil_switch_interval <= 1:
        parser.error(f"--gil-switch-interval: {args.gil_switch_interval:g} is not in [0, 1] seconds (0: the "
                     f"interpreter's own)")
    if args.local_task:
        return local_task(args)
    if args.local:
        return run_local_bench(args, _without(argv, {"--local": 0, "--profile": 1, "--rounds": 1}))

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
