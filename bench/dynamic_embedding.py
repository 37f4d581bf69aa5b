"""Benchmark: a ``DynamicEmbedding`` against a fixed (collision-free) table, three figures in one run.

1. **Quality**: the CTR example (``examples/ctr/train.py``) under ``kubeps local --ps 2 --workers 2``, once with raw
   ids from a 2**40 space in a dynamic table (``--ids raw40``) and once with a collision-free fixed table
   (``--ids exact``, one row per (field, value)); prints both eval log-losses and their ratio (goal: within 1%).
2. **Throughput**: training steps of lookup + sparse Adagrad update at batch ``--batch`` x ``--fields`` ids (Zipf-
   like over ``--rows`` ids), inside a closure context against 2 in-process parameter servers (the push deferred
   onto the next step's lookup, as on a worker), for a fixed table of ``--rows`` rows sharded over both ps and for a
   dynamic table holding the same rows; prints steps/s of both and the ratio (goal: >= 0.7x).
3. **Memory per live row** on the ps: the dynamic table's bytes (rows, Adagrad slots, keys, counts, steps, index)
   over its live rows, against the fixed table's value + slot bytes per row (goal: <= 1.5x).
4. With ``--memory-sweep``: the same ratio for one table in this process at every size from 15k to 800k rows (5k
   rows admitted at a time): min, median and max, since the figure moves as the arrays and the index grow.

Usage: python bench/dynamic_embedding.py [--rows 200000] [--dim 16] [--batch 512] [--fields 6] [--steps 200]
       [--skip-quality] [--memory-sweep]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "ctr" / "train.py"


def run_example(ids: str) -> dict:
    out = subprocess.run([sys.executable, "-m", "kubeps.runtime.cli", "local", "--ps", "2", "--workers", "2",
                          str(EXAMPLE), "--", "--ids", ids], capture_output=True, text=True, timeout=600)
    lines = [line for line in out.stdout.splitlines() if " RESULT " in line]
    if out.returncode or not lines:
        raise SystemExit(f"the example with --ids {ids} failed:\n{out.stdout[-2000:]}\n{out.stderr[-2000:]}")
    return json.loads(lines[0].split(" RESULT ", 1)[1])


def throughput_and_memory(a: argparse.Namespace) -> dict:
    import kubeps.runtime as kp
    from kubeps.runtime.cluster import TFConfig, TFConfigClusterResolver
    from kubeps.runtime.server import Server
    from kubeps.runtime.variables import context as _context

    import socket

    ports = []
    socks = []
    for _ in range(4):
        s = socket.socket()
        s.bind(("127.0.0.1", 0))
        socks.append(s)
        ports.append(s.getsockname()[1])
    for s in socks:
        s.close()
    cluster = {"chief": [f"127.0.0.1:{ports[0]}"], "ps": [f"127.0.0.1:{p}" for p in ports[1:3]],
               "worker": [f"127.0.0.1:{ports[3]}"]}
    token = "bench-token-0123456789abcdef0123"
    servers = [Server(cluster, "ps", i, token=token, bind_host="127.0.0.1") for i in range(2)]
    resolver = TFConfigClusterResolver(tf_config=TFConfig.for_task(cluster, "chief", 0))
    strategy = kp.ParameterServerStrategy(resolver, variable_partitioner=kp.FixedShardsPartitioner(2),
                                          job_token=token)
    rng = np.random.default_rng(0)
    try:
        with strategy.scope():
            fixed = kp.Variable(rng.uniform(-0.05, 0.05, (a.rows, a.dim)).astype(np.float32), name="fixed")
            dynamic = kp.DynamicEmbedding("dynamic", a.dim)
        raw = rng.integers(0, 2**40, a.rows * 2)
        raw = np.unique(raw)[: a.rows]
        rng.shuffle(raw)
        for i in range(0, a.rows, 50_000):  # every row exists before timing, as in the fixed table
            dynamic.lookup(raw[i: i + 50_000], train=True)
        popularity = 1.0 / (np.arange(a.rows) + 10.0) ** 1.1
        popularity /= popularity.sum()
        batches = [rng.choice(a.rows, size=(a.batch, a.fields), p=popularity) for _ in range(16)]
        opt = kp.Adagrad(0.05)

        def steps(table, to_ids, layer_cls) -> float:
            layer = layer_cls(table)
            ctx = _context.ClosureContext(0, strategy.transport, {})
            previous = _context.set_closure_context(ctx)
            try:
                def one(i: int) -> None:
                    out = layer.forward(to_ids(batches[i % len(batches)]))
                    layer.backward(np.ones_like(out))
                    opt.apply_gradients(layer.grads_and_vars())

                for i in range(10):
                    one(i)
                t0 = time.perf_counter()
                for i in range(a.steps):
                    one(i)
                ctx.flush()
                return a.steps / (time.perf_counter() - t0)
            finally:
                _context.set_closure_context(previous)

        def fixed_layer(t):
            return kp.nn.Embedding(a.rows, a.dim, embeddings=t)

        fixed_sps = steps(fixed, lambda b: b, fixed_layer)
        dyn_sps = steps(dynamic, lambda b: raw[b], kp.nn.DynamicEmbeddingLayer)
        fixed_sps2 = steps(fixed, lambda b: b, fixed_layer)  # again: the shared machine's drift shows
        info = dynamic.shard_info()
        live = sum(i["size"] for i in info)
        per_row = sum(i["nbytes"] for i in info) / live
        fixed_per_row = a.dim * 4 * 2  # value + Adagrad accumulator, float32
        return {"fixed_steps_per_s": max(fixed_sps, fixed_sps2), "dynamic_steps_per_s": dyn_sps,
                "throughput_ratio": dyn_sps / max(fixed_sps, fixed_sps2), "live_rows": live,
                "bytes_per_live_row": per_row, "fixed_bytes_per_row": fixed_per_row,
                "memory_ratio": per_row / fixed_per_row}
    finally:
        strategy.close()
        for s in servers:
            s.stop(grace=None)


def memory_sweep(a: argparse.Namespace) -> dict:
    from kubeps.runtime.ops.optimizers import Adagrad
    from kubeps.runtime.rpc.protocol import slot_key
    from kubeps.runtime.variables.dynamic_table import DynamicTable, TableConfig

    opt = Adagrad(0.05)
    table = DynamicTable("sweep", TableConfig(dim=a.dim))
    rng = np.random.default_rng(0)
    keys = np.unique(rng.integers(0, 2**40, 900_000))
    rng.shuffle(keys)
    table.lookup(keys[:10], None, True)  # the Adagrad slots exist from the first update on, as in training
    table.apply_push(opt, slot_key(opt.get_config()), keys[:10], np.zeros((10, a.dim), table.dtype))
    fixed = a.dim * 4 * 2
    ratios = []
    for i in range(10, 800_000, 5_000):
        table.lookup(keys[i: i + 5_000], None, True)
        ratios.append(table.nbytes / table.size / fixed)
    r = np.array(ratios)
    return {"sweep_min": float(r.min()), "sweep_median": float(np.median(r)), "sweep_max": float(r.max())}


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rows", type=int, default=200_000)
    p.add_argument("--dim", type=int, default=16)
    p.add_argument("--batch", type=int, default=512)
    p.add_argument("--fields", type=int, default=6)
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--skip-quality", action="store_true", help="skip the two CTR runs (figure 1)")
    p.add_argument("--memory-sweep", action="store_true", help="also the memory ratio over table sizes (figure 4)")
    a = p.parse_args(argv)
    out: dict = {}
    if not a.skip_quality:
        exact, dyn = run_example("exact"), run_example("raw40")
        out.update(fixed_logloss=exact["logloss"], dynamic_logloss=dyn["logloss"],
                   logloss_ratio=dyn["logloss"] / exact["logloss"], dynamic_rows=dyn.get("table_rows"))
        print(f"eval log-loss: dynamic (raw 2**40 ids) {dyn['logloss']:.4f}, collision-free fixed "
              f"{exact['logloss']:.4f}: ratio {out['logloss_ratio']:.4f} (goal <= 1.01)")
    out.update(throughput_and_memory(a))
    print(f"lookup + Adagrad update, batch {a.batch} x {a.fields} ids, dim {a.dim}, 2 ps: dynamic "
          f"{out['dynamic_steps_per_s']:.0f} steps/s, fixed {out['fixed_steps_per_s']:.0f} steps/s: ratio "
          f"{out['throughput_ratio']:.2f}x (goal >= 0.7x)")
    print(f"ps memory per live row: dynamic {out['bytes_per_live_row']:.1f} B ({out['live_rows']} rows), fixed "
          f"{out['fixed_bytes_per_row']} B: ratio {out['memory_ratio']:.2f}x (goal <= 1.5x)")
    if a.memory_sweep:
        out.update(memory_sweep(a))
        print(f"memory per live row over sizes 15k..800k rows on one ps: min {out['sweep_min']:.2f}x, median "
              f"{out['sweep_median']:.2f}x, max {out['sweep_max']:.2f}x")
    print("RESULT " + json.dumps(out))
    return out


if __name__ == "__main__":
    main()
