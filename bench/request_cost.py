"""What the costliest requests within a parameter server's default limits cost it: ps CPU per request, one real ps
process on loopback, with the ratio to a trivial request (``Ping``) measured in the same run.

    .venv/bin/python bench/request_cost.py [--repeat 20] [--json FILE]

The cases (each sent ``--repeat`` times; CPU read from ``/proc`` around the batch, so its 10 ms tick is divided out):

* ``ping``: a ``Ping`` with an empty header (the baseline; it and ``push-step`` are sent 20 times as often);
* ``create-max-tensors``: a ``CreateVariables`` of as many scalars as one request may carry (``KUBEPS_MAX_TENSORS``,
  within the 1 MiB header: each costs a header entry, a checked view and a variable), re-creating the same names;
* ``header-1mib-most-containers``: a ``Ping`` whose 1 MiB header is the costliest JSON a server parses (as many
  nested empty arrays as it accepts, the rest a string), refused after the parse;
* ``header-64kib-unclosed-string``: the brackets and unclosed escaped string that once took 11.5 s (refused);
* ``read-rows-repeated-id``: 16 KB of one repeated id naming 131 MB of rows of a wide table (refused before
  anything is built);
* ``push-step``: a step's ``Push`` of a CTR worker (4,096 distinct rows of a 16-wide table and 141x64 dense).

The goal the ps is held to: no request within the limits costs more than 100 ms of ps CPU.
"""

from __future__ import annotations

import argparse
import json
import os
import struct
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import grpc
import numpy as np

from kubeps.runtime.cluster import TFConfig
from kubeps.runtime.local.launcher import free_ports
from kubeps.runtime.ops.optimizers import Adagrad
from kubeps.runtime.rpc import wire
from kubeps.runtime.rpc.client import Client
from kubeps.runtime.rpc.protocol import PS, PS_SERVICE, UNARY_PREFIX
from kubeps.runtime.settings import DEFAULT_MAX_HEADER_BYTES, DEFAULT_MAX_TENSORS

TOKEN = "bench-token-" + "0123456789abcdef"
TICK = os.sysconf("SC_CLK_TCK")


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / TICK  # utime, stime


def raw_frame(header: bytes) -> bytes:
    return struct.pack("<4sI", wire.MAGIC, len(header)) + header


def max_scalar_names(limit: int) -> list[str]:
    """The most scalar variables whose CreateVariables header stays within ``limit`` bytes."""
    low, high = 1, 1 << 16
    while low < high:
        mid = (low + high + 1) // 2
        names = [f"s{i}" for i in range(mid)]
        header_len = struct.unpack_from("<I", wire.encode_chunks({"names": names},
                                                                 [np.zeros((), np.float32)] * mid)[0], 4)[0]
        low, high = (mid, high) if header_len <= limit else (low, mid - 1)
    return [f"s{i}" for i in range(low)]


def costliest_header(limit: int) -> bytes:
    """The costliest header to parse a server accepts: as many nested empty arrays as it parses (one Python object
    each, ~1 us per 2 bytes), the rest of ``limit`` bytes a string."""
    unit = b"[" * 32 + b"]" * 32 + b","
    arrays = (unit * (wire.MAX_JSON_CONTAINERS // 32 - 1)).rstrip(b",")
    return b'{"meta":{"x":[' + arrays + b'],"pad":"' + b"a" * (limit - len(arrays) - 64) + b'"}}'


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeat", type=int, default=20)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()

    (port,) = free_ports(1)
    address = f"127.0.0.1:{port}"
    env = {k: v for k, v in os.environ.items() if not k.startswith("KUBEPS_")}
    env.update(TF_CONFIG=TFConfig.for_task({"ps": [address]}, "ps", 0).to_json(), KUBEPS_JOB_TOKEN=TOKEN,
               KUBEPS_BIND_HOST="127.0.0.1", KUBEPS_LOG_LEVEL="ERROR")
    with tempfile.TemporaryDirectory() as tmp:
        log = open(Path(tmp) / "ps.log", "wb")
        proc = subprocess.Popen([sys.executable, "-m", "kubeps.runtime.server"], env=env, stdout=log,
                                stderr=subprocess.STDOUT, cwd=tmp)
        client = Client(address, PS_SERVICE, TOKEN, 120.0)
        channel = grpc.insecure_channel(address)
        try:
            deadline = time.monotonic() + 60
            while True:
                try:
                    client.call("Ping", timeout=2.0)
                    break
                except Exception:  # noqa: BLE001 - not up yet
                    if time.monotonic() > deadline or proc.poll() is not None:
                        raise
                    time.sleep(0.1)
            ping_raw = channel.unary_unary(f"/{PS_SERVICE}/{UNARY_PREFIX}Ping", request_serializer=lambda b: b,
                                           response_deserializer=lambda b: b)
            metadata = (("x-kubeps-job-token", TOKEN),)

            def raw(frame: bytes) -> None:
                try:
                    ping_raw(frame, timeout=60, metadata=metadata)
                except grpc.RpcError:
                    pass  # refused: the cost is what counts

            def refused(method: str, meta: dict, arrays: list) -> None:
                try:
                    client.call(method, meta, arrays)
                except Exception:  # noqa: BLE001 - refused: the cost is what counts
                    pass

            names = max_scalar_names(DEFAULT_MAX_HEADER_BYTES)[:DEFAULT_MAX_TENSORS]
            scalars = [np.zeros((), np.float32)] * len(names)
            client.call(PS.CREATE_VARIABLES, {"names": ["wide", "emb", "dense"]},
                        [np.zeros((4, 16_000), np.float32), np.zeros((1 << 20, 16), np.float32),
                         np.zeros((141, 64), np.float32)])
            rng = np.random.default_rng(0)
            rows = np.sort(rng.choice(1 << 20, 4096, replace=False)).astype(np.int64)
            push = ({"optimizer": Adagrad(0.05).get_config(),
                     "updates": [{"name": "emb", "kind": "sparse"}, {"name": "dense"}]},
                    [rows, rng.standard_normal((4096, 16)).astype(np.float32),
                     rng.standard_normal((141, 64)).astype(np.float32)])
            costliest = raw_frame(costliest_header(DEFAULT_MAX_HEADER_BYTES))
            unclosed = raw_frame(b"[" * 65 + b'"' + b'\\"' * (((64 << 10) - 66) // 2))
            cases = {
                "ping": lambda: client.call("Ping"),
                f"create-max-tensors ({len(names)} scalars)": lambda: client.call(
                    PS.CREATE_VARIABLES, {"names": names}, scalars),
                "header-1mib-most-containers": lambda: raw(costliest),
                "header-64kib-unclosed-string": lambda: raw(unclosed),
                "read-rows-repeated-id": lambda: refused(PS.READ_ROWS, {"names": ["wide"]},
                                                         [np.zeros(2048, np.int64)]),
                "push-step": lambda: client.call(PS.PUSH, *push),
            }
            results: dict[str, float] = {}
            for name, send in cases.items():
                send()  # warm
                count = args.repeat * (20 if name in ("ping", "push-step") else 1)  # cheap ones: past the tick
                before = cpu_seconds(proc.pid)
                for _ in range(count):
                    send()
                results[name] = (cpu_seconds(proc.pid) - before) / count
        finally:
            client.close()
            channel.close()
            proc.terminate()
            proc.wait(timeout=30)
            log.close()

    baseline = results["ping"]
    print(f"ps CPU per request, one ps process, {args.repeat} of each, {os.cpu_count()} CPUs, load "
          f"{' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    print(f"{'request':<44} {'ps CPU ms':>10} {'x ping':>8}")
    for name, seconds in results.items():
        ratio = f"{seconds / baseline:>8.1f}" if baseline > 0 else f"{'-':>8}"
        print(f"{name:<44} {seconds * 1e3:>10.2f} {ratio}")
    worst = max(results, key=results.get)
    print(f"costliest: {worst}, {results[worst] * 1e3:.1f} ms of ps CPU (goal <= 100 ms)")
    if args.json:
        args.json.write_text(json.dumps({"repeat": args.repeat, "ps_cpu_seconds": results}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
