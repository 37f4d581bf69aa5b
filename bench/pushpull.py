"""Pull and push of a 100 MiB float32 variable split across 2 parameter servers (real processes on loopback).

Prints MB/s for each direction and the ratio to a numpy copy of the same bytes measured in the same run.

    .venv/bin/python bench/pushpull.py [--mib 100] [--repeat 5] [--chunk-mib 4] [--tls]

``--tls``: the parameter servers and the client talk mutual TLS (a throw-away CA, as ``kubeps local`` makes).

* pull: ``Read`` of both shards, one RPC per PS in parallel (what a worker's step does), no concatenation;
* pull+concat: ``np.asarray(variable)`` (the whole variable as one array);
* push: ``SGD.apply_gradients`` of a dense gradient: one ``Push`` RPC per PS, the update runs on the PS.
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time

import numpy as np

from kubeps.runtime import certs
from kubeps.runtime.contract import TLS_CA_FILE_ENV, TLS_CERT_FILE_ENV, TLS_KEY_FILE_ENV
from kubeps.runtime.rpc import wire
from kubeps.runtime.rpc.tls import load_tls
from kubeps.runtime.settings import TaskSettings
from kubeps.runtime.cluster import TFConfig, TFConfigClusterResolver
from kubeps.runtime.ops.optimizers import SGD
from kubeps.runtime.variables.partitioners import FixedShardsPartitioner
from kubeps.runtime.coordinator.strategy import ParameterServerStrategy
from kubeps.runtime.variables.variable import Variable, _read_many

TOKEN = "bench-token-" + "0123456789abcdef"


def _free_ports(n: int) -> list[int]:
    socks = [socket.socket() for _ in range(n)]
    for s in socks:
        s.bind(("127.0.0.1", 0))
    ports = [s.getsockname()[1] for s in socks]
    for s in socks:
        s.close()
    return ports


def _best(fn, repeat: int) -> tuple[float, float]:
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times), statistics.median(times)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--mib", type=int, default=100, help="variable size in MiB (default 100)")
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--chunk-mib", type=float, default=wire.DEFAULT_CHUNK_BYTES / (1 << 20),
                        help="stream chunk size in MiB (default: wire.DEFAULT_CHUNK_BYTES)")
    parser.add_argument("--tls", action="store_true", help="mutual TLS between the client and the ps tasks")
    args = parser.parse_args()
    chunk = int(args.chunk_mib * (1 << 20))
    wire.DEFAULT_CHUNK_BYTES = chunk  # this process's clients; the servers get it through the environment

    ports = _free_ports(4)
    cluster = {"chief": [f"127.0.0.1:{ports[0]}"], "ps": [f"127.0.0.1:{p}" for p in ports[1:3]],
               "worker": [f"127.0.0.1:{ports[3]}"]}
    procs = []
    logs = tempfile.mkdtemp(prefix="kubeps-bench-")
    tls_env: dict[str, str] = {}
    if args.tls:
        made = certs.issue_job_credentials("bench", ["127.0.0.1", "localhost"])
        for var, (name, data) in {TLS_CA_FILE_ENV: ("ca.crt", made.ca_cert), TLS_CERT_FILE_ENV: ("tls.crt", made.cert),
                                  TLS_KEY_FILE_ENV: ("tls.key", made.key)}.items():
            with open(os.path.join(logs, name), "wb") as fh:
                fh.write(data)
            tls_env[var] = os.path.join(logs, name)
    try:
        for i in range(2):
            env = dict(os.environ, TF_CONFIG=TFConfig.for_task(cluster, "ps", i).to_json(), KUBEPS_JOB_TOKEN=TOKEN,
                       KUBEPS_BIND_HOST="127.0.0.1", KUBEPS_LOG_LEVEL="WARNING",
                       KUBEPS_CHUNK_BYTES=str(chunk), **tls_env)
            with open(os.path.join(logs, f"ps-{i}.log"), "wb") as log:
                procs.append(subprocess.Popen([sys.executable, "-m", "kubeps.runtime.server"], env=env,
                                              stdout=log, stderr=subprocess.STDOUT))
        strategy = ParameterServerStrategy(
            TFConfigClusterResolver(tf_config=TFConfig.for_task(cluster, "chief", 0)),
            variable_partitioner=FixedShardsPartitioner(2), job_token=TOKEN, rpc_timeout=120.0,
            tls=load_tls(TaskSettings.from_env(tls_env)))
        strategy.wait_for_parameter_servers(timeout=60)

        rows = args.mib * (1 << 20) // (1024 * 4)
        value = np.random.default_rng(0).standard_normal((rows, 1024), dtype=np.float32)
        nbytes = value.nbytes
        with strategy.scope():
            var = Variable(value, name="bench")
        grad = np.full_like(value, 1e-3)
        opt = SGD(learning_rate=0.1)

        dst = np.empty_like(value)
        copy_best, copy_med = _best(lambda: np.copyto(dst, value), args.repeat)
        _read_many(var.variables)  # warm-up (connections, allocations)
        opt.apply_gradients([(grad, var)])
        pull_best, pull_med = _best(lambda: _read_many(var.variables), args.repeat)
        full_best, full_med = _best(lambda: np.asarray(var), args.repeat)
        push_best, push_med = _best(lambda: opt.apply_gradients([(grad, var)]), args.repeat)
        expected = value - 0.1 * 1e-3 * (args.repeat + 1)
        np.testing.assert_allclose(np.asarray(var), expected, rtol=1e-4, atol=1e-5)

        mb = nbytes / 1e6
        copy_rate = mb / copy_best
        print(f"variable: {nbytes / (1 << 20):.0f} MiB float32 in 2 shards on 2 ps; chunk {chunk / (1 << 20):g} MiB; "
              f"{'mutual TLS' if args.tls else 'plaintext'}; "
              f"best of {args.repeat} (median in brackets)")
        print(f"numpy copy  : {copy_rate:9.0f} MB/s  ({mb / copy_med:.0f})")
        for label, best, med in (("pull        ", pull_best, pull_med), ("pull+concat ", full_best, full_med),
                                 ("push (SGD)  ", push_best, push_med)):
            rate = mb / best
            print(f"{label}: {rate:9.0f} MB/s  ({mb / med:.0f})   ratio to numpy copy {rate / copy_rate:.3f}")
        strategy.close()
    finally:
        for p in procs:
            p.terminate()
        for p in procs:
            try:
                p.wait(timeout=5)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
    return 0


if __name__ == "__main__":
    sys.exit(main())
