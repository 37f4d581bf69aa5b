"""Benchmark: checkpoints of a big table on real parameter servers -- save and restore speed, what an incremental
save writes, training during a save, and each ps's peak memory.

One embedding table of ``--gb`` GB (float32 rows of ``--dim`` plus their Adagrad accumulators: the table's bytes are
values + slots) in ``--ps`` shards on ``--ps`` parameter-server processes (``python -m kubeps.runtime.server``), the
chief in this process. In one run:

1. **full save** (the baseline: ``CheckpointManager`` without ``incremental``) and **restore** of it: GB/s per ps
   (each ps writes and reads its own shard, all at once, into the page cache of ``--dir``);
2. **incremental saves** (``incremental=True``): the first (a full one), then after 0%, 1% and 10% of the rows changed:
   the bytes each wrote, as a fraction of the full save's; the restore of the last one (base + 3 deltas);
3. **training during a save**: sparse Adagrad pushes of ``--batch`` random rows from a thread of this process, for
   ``--train-s`` seconds without a save, then with full saves running meanwhile, alternating ``--rounds`` times:
   examples/s with a save as a ratio to without;
4. **peak RSS per ps** (``VmHWM``, reset before each phase through ``/proc/<pid>/clear_refs``) over the table's bytes
   on that ps.

Usage: python bench/checkpoint_size.py [--gb 1] [--ps 2] [--dim 16] [--dir DIR] [--train-s 3] [--rounds 2]
       [--batch 4096]
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np

TOKEN = "bench-checkpoint-token-0123456789abcdef"


class Servers:
    """``n`` parameter-server processes on loopback, stopped by PID."""

    def __init__(self, n: int, log_dir: Path):
        from kubeps.runtime.cluster import TFConfig
        from kubeps.runtime.local.ports import free_ports
        from kubeps.runtime.rpc.client import Client
        from kubeps.runtime.rpc.protocol import PS_SERVICE

        ports = free_ports(n + 2)
        self.cluster = {"chief": [f"127.0.0.1:{ports[0]}"], "worker": [f"127.0.0.1:{ports[1]}"],
                        "ps": [f"127.0.0.1:{p}" for p in ports[2:]]}
        env = {k: v for k, v in os.environ.items() if not k.startswith("KUBEPS_") and k != "TF_CONFIG"}
        env.update(KUBEPS_BIND_HOST="127.0.0.1", KUBEPS_LOG_LEVEL="WARNING", KUBEPS_JOB_TOKEN=TOKEN)
        self.procs = []
        for i in range(n):
            env["TF_CONFIG"] = TFConfig.for_task(self.cluster, "ps", i).to_json()
            with open(log_dir / f"ps-{i}.log", "wb") as log:
                self.procs.append(subprocess.Popen([sys.executable, "-m", "kubeps.runtime.server"], env=dict(env),
                                                   stdout=log, stderr=subprocess.STDOUT))
        for i, address in enumerate(self.cluster["ps"]):
            client = Client(address, PS_SERVICE, TOKEN, 2.0)
            deadline = time.monotonic() + 60
            while True:
                if self.procs[i].poll() is not None:
                    raise SystemExit(f"ps {i} exited with {self.procs[i].returncode}: see {log_dir}")
                try:
                    client.call("Ping", timeout=2.0)
                    break
                except Exception:  # noqa: BLE001 - not up yet
                    if time.monotonic() > deadline:
                        raise
                    time.sleep(0.1)
            client.close()

    def reset_peaks(self) -> None:
        for p in self.procs:
            with open(f"/proc/{p.pid}/clear_refs", "w") as f:
                f.write("5")  # resets VmHWM to the current RSS

    def peaks(self) -> list[int]:
        out = []
        for p in self.procs:
            with open(f"/proc/{p.pid}/status") as f:
                out.append(next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmHWM:")))
        return out

    def stop(self) -> None:
        for p in self.procs:
            p.terminate()
        for p in self.procs:
            try:
                p.wait(timeout=10)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()


def _dir_bytes(path: str) -> int:
    return sum(f.stat().st_size for f in Path(path).iterdir())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--gb", type=float, default=1.0, help="table bytes (values + Adagrad accumulators), GiB")
    ap.add_argument("--ps", type=int, default=2)
    ap.add_argument("--dim", type=int, default=16)
    ap.add_argument("--dir", default=None, help="where checkpoints go (default: a temporary directory)")
    ap.add_argument("--train-s", type=float, default=3.0)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--batch", type=int, default=4096)
    a = ap.parse_args()

    import kubeps.runtime as kp
    from kubeps.runtime.cluster import TFConfig, TFConfigClusterResolver
    from kubeps.runtime.variables.push import IndexedSlices

    work = Path(a.dir or tempfile.mkdtemp(prefix="kubeps-ckpt-bench-"))
    work.mkdir(parents=True, exist_ok=True)
    rows = int(a.gb * 2**30 / (a.dim * 4 * 2))
    table = rows * a.dim * 4 * 2
    per_ps = table / a.ps
    print(f"table: {rows} rows x {a.dim} float32 + Adagrad accumulator = {table / 2**30:.2f} GiB on {a.ps} ps "
          f"({per_ps / 2**30:.2f} GiB each); checkpoints in {work}")
    servers = Servers(a.ps, work)
    strategy = None
    try:
        resolver = TFConfigClusterResolver(tf_config=TFConfig.for_task(servers.cluster, "chief", 0))
        strategy = kp.ParameterServerStrategy(resolver, job_token=TOKEN,
                                              variable_partitioner=kp.FixedShardsPartitioner(a.ps))
        servers.reset_peaks()
        with strategy.scope():
            emb = kp.Variable(np.zeros((rows, a.dim), np.float32), name="emb")
        opt = kp.Adagrad(0.05)
        rng = np.random.default_rng(0)
        chunk = 1 << 18
        for start in range(0, rows, chunk):  # every row gets its accumulator (and a value)
            ids = np.arange(start, min(rows, start + chunk))
            opt.apply_gradients([(IndexedSlices(rng.normal(size=(len(ids), a.dim)).astype(np.float32), ids), emb)])
        peaks = {"create + first push": servers.peaks()}

        def touch(fraction: float) -> None:
            ids = np.unique(rng.integers(0, rows, int(rows * fraction)))
            for i in range(0, len(ids), chunk):
                part = ids[i:i + chunk]
                opt.apply_gradients([(IndexedSlices(np.ones((len(part), a.dim), np.float32), part), emb)])

        ckpt = kp.Checkpoint(emb=emb)
        full = kp.CheckpointManager(ckpt, str(work / "full"), max_to_keep=1)
        servers.reset_peaks()
        t = time.perf_counter()
        full_path = full.save()
        save_s = time.perf_counter() - t
        peaks["full save"] = servers.peaks()
        full_bytes = _dir_bytes(full_path)
        servers.reset_peaks()
        t = time.perf_counter()
        full.restore()
        restore_s = time.perf_counter() - t
        peaks["restore (full)"] = servers.peaks()

        inc = kp.CheckpointManager(ckpt, str(work / "incremental"), max_to_keep=None, incremental=True)
        servers.reset_peaks()
        t = time.perf_counter()
        inc.save()
        inc_first_s = time.perf_counter() - t
        peaks["incremental save (first, full)"] = servers.peaks()
        written = {}
        for fraction in (0.0, 0.01, 0.10):
            touch(fraction)
            t = time.perf_counter()
            path = inc.save()
            written[fraction] = (_dir_bytes(path), time.perf_counter() - t)
        servers.reset_peaks()
        t = time.perf_counter()
        inc.restore()
        inc_restore_s = time.perf_counter() - t
        peaks["restore (base + 3 deltas)"] = servers.peaks()

        # training during a save: pushes from a thread, with and without saves running meanwhile, alternating
        def train(seconds: float) -> float:
            examples, end = 0, time.perf_counter() + seconds
            g = np.ones((a.batch, a.dim), np.float32)
            while time.perf_counter() < end:
                ids = np.unique(rng.integers(0, rows, a.batch))
                opt.apply_gradients([(IndexedSlices(g[: len(ids)], ids), emb)])
                examples += a.batch
            return examples / seconds

        def with_saves(seconds: float) -> tuple[float, int]:
            stop, saves = threading.Event(), [0]

            def saver() -> None:
                while not stop.is_set():
                    full.save()
                    saves[0] += 1
            thread = threading.Thread(target=saver)
            thread.start()
            rate = train(seconds)
            stop.set()
            thread.join()
            return rate, saves[0]

        quiet, busy = [], []
        servers.reset_peaks()
        for _ in range(a.rounds):
            quiet.append(train(a.train_s))
            rate, saves = with_saves(a.train_s)
            busy.append(rate)
        peaks["training during saves"] = servers.peaks()
    finally:
        if strategy is not None:
            strategy.close()
        servers.stop()
        if a.dir is None:
            shutil.rmtree(work, ignore_errors=True)

    gb = 1e9
    print(f"\nfull save (baseline)        {save_s:7.2f} s   {per_ps / save_s / gb:6.2f} GB/s per ps   "
          f"{full_bytes / gb:.3f} GB written")
    print(f"restore of the full save    {restore_s:7.2f} s   {per_ps / restore_s / gb:6.2f} GB/s per ps")
    print(f"incremental, first (full)   {inc_first_s:7.2f} s   {per_ps / inc_first_s / gb:6.2f} GB/s per ps")
    for fraction, (nbytes, seconds) in written.items():
        print(f"incremental after {fraction:4.0%} rows changed {seconds:6.2f} s   {nbytes / gb:.4f} GB written: "
              f"{nbytes / full_bytes:.4f}x the full save")
    print(f"restore of base + 3 deltas  {inc_restore_s:7.2f} s   {per_ps / inc_restore_s / gb:6.2f} GB/s per ps")
    q, b = float(np.median(quiet)), float(np.median(busy))
    print(f"training: {q:,.0f} examples/s without a save, {b:,.0f} during saves: ratio {b / q:.2f}x "
          f"(median of {a.rounds} alternating rounds of {a.train_s:g} s, batch {a.batch})")
    print("peak RSS per ps (VmHWM) over the table's bytes on it:")
    for phase, values in peaks.items():
        print(f"  {phase:32s} " + "  ".join(f"{v / per_ps:.2f}x" for v in values))


if __name__ == "__main__":
    main()
