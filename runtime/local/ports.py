"""The ports of a local job: free ports below the kernel's ephemeral range, or consecutive ones from a base.

Every task of ``kubeps local`` listens on a port of its own (a ps task of several server processes on a run of
consecutive ports), and serves its metrics on another. :class:`PortAllocator` gives a job its addresses on one host;
:func:`free_ports` and :func:`free_port_runs` pick free ports, which the tests and benchmarks use too.

A port is picked between :data:`_LISTEN_FLOOR` and the kernel's ephemeral range, where every outgoing connection
takes its local port: a port picked inside that range and released until the task binds it (seconds later, after
its imports) can be taken meanwhile by any process's connect(); seen when tests ran beside each other ("Failed to
add port to server"), which left the chief waiting for a worker that never started.
"""

from __future__ import annotations

import random
import socket
from typing import Mapping, Sequence

from kubeps.runtime.local.errors import LauncherError

__all__ = ["PORT_ORDER", "PortAllocator", "bracketed", "free_port_runs", "free_ports", "max_port_base"]

#: the order in which a job's tasks take consecutive ports from ``port_base`` (and appear in its cluster)
PORT_ORDER = ("chief", "ps", "worker", "evaluator")
#: the lowest port handed to a task (see the module's docstring)
_LISTEN_FLOOR = 10000
_EPHEMERAL_RANGE = "/proc/sys/net/ipv4/ip_local_port_range"
_rng = random.Random()  # its own seed: a program seeding the random module must not make two runs pick alike


def max_port_base(num_ps: int, num_workers: int, evaluator: bool, ps_processes: int = 1) -> int:
    """The highest first port of a job whose tasks take consecutive ports (``port_base``, ``--port-base``; a ps
    task of several processes takes one port per process)."""
    return 65535 - (1 + num_ps * ps_processes + num_workers + (1 if evaluator else 0)) + 1


def bracketed(host: str) -> str:
    """``host`` as the host part of an address: an IPv6 address in brackets."""
    return f"[{host}]" if ":" in host else host


def _ephemeral_low(path: str = _EPHEMERAL_RANGE) -> int | None:
    """The first port of the kernel's ephemeral range, or None where it cannot be read."""
    try:
        with open(path) as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return None


def _bind(host: str, port: int) -> socket.socket | None:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    s = socket.socket(family, socket.SOCK_STREAM)
    try:
        s.bind((host, port))
    except OSError:
        s.close()
        return None
    return s


def _free_socket(host: str, low: int | None, span: int = 1) -> socket.socket:
    """A socket bound to a free port on ``host`` whose ``span - 1`` next ports are below the ephemeral range (which
    starts at ``low``, :func:`_ephemeral_low`): a random one between :data:`_LISTEN_FLOOR` and that range when there
    is room, else the kernel's choice."""
    if low is not None and low - span - _LISTEN_FLOOR >= 1000:
        for _ in range(200):
            s = _bind(host, _rng.randrange(_LISTEN_FLOOR, low - span + 1))
            if s is not None:
                return s
    s = _bind(host, 0)
    if s is None:
        raise LauncherError(f"no free TCP port on {host}")
    return s


def free_ports(count: int, host: str = "127.0.0.1") -> list[int]:
    """``count`` distinct free TCP ports on ``host``, below the kernel's ephemeral range where there is room; the
    sockets are held together so no port is repeated."""
    sockets = []
    low = _ephemeral_low()
    try:
        for _ in range(count):
            sockets.append(_free_socket(host, low))
        return [s.getsockname()[1] for s in sockets]
    finally:
        for s in sockets:
            s.close()


def free_port_runs(count: int, length: int, host: str = "127.0.0.1", attempts: int = 200) -> list[int]:
    """The first ports of ``count`` runs of ``length`` consecutive free TCP ports on ``host`` (a ps task of
    ``length`` processes serves on its port and the next ones)."""
    if length == 1:
        return free_ports(count, host)
    held: list[socket.socket] = []
    firsts: list[int] = []
    low = _ephemeral_low()
    try:
        for _ in range(attempts):
            if len(firsts) == count:
                break
            first = _free_socket(host, low, span=length)
            run = [first]
            port = first.getsockname()[1]
            for shift in range(1, length):
                s = _bind(host, port + shift) if port + shift <= 65535 else None
                if s is None:
                    break
                run.append(s)
            if len(run) < length:
                for s in run:
                    s.close()
                continue
            held.extend(run)
            firsts.append(port)
        if len(firsts) < count:
            raise LauncherError(f"found only {len(firsts)} of {count} runs of {length} consecutive free ports on "
                                f"{host} in {attempts} attempts: give --port-base")
        return firsts
    finally:
        for s in held:
            s.close()


def _check_ports_free(host: str, ports: Sequence[int]) -> None:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    for port in ports:
        with socket.socket(family, socket.SOCK_STREAM) as s:
            try:
                s.bind((host, port))
            except OSError as err:
                raise LauncherError(
                    f"--port-base: port {port} on {host} is not free ({err.strerror}); the cluster needs ports "
                    f"{ports[0]}..{ports[-1]}: pick another --port-base or leave it out to use free ports"
                ) from None


class PortAllocator:
    """The ports and addresses of one local job's tasks on ``host``."""

    def __init__(self, host: str):
        self.host = host

    def address(self, port: int) -> str:
        """``host:port`` (``[host]:port`` for an IPv6 host)."""
        return f"{bracketed(self.host)}:{port}"

    def free(self, count: int) -> list[int]:
        """``count`` distinct free ports (:func:`free_ports`)."""
        return free_ports(count, self.host)

    def cluster(self, counts: Mapping[str, int], ps_width: int, port_base: int | None) -> dict[str, list[str]]:
        """The addresses of ``counts[type]`` tasks of each type (in :data:`PORT_ORDER`; types without tasks left
        out), each ps task taking ``ps_width`` consecutive ports: consecutive from ``port_base`` (every one checked
        free), or free ports."""
        widths = {t: ps_width if t == "ps" else 1 for t in PORT_ORDER}
        if port_base is not None:
            ports: list[int] = []
            taken: list[int] = []
            for t in PORT_ORDER:
                for _ in range(counts[t]):
                    first = port_base + len(taken)
                    ports.append(first)
                    taken.extend(range(first, first + widths[t]))
            _check_ports_free(self.host, taken)
        else:
            ps_ports = iter(free_port_runs(counts["ps"], ps_width, self.host))
            others = iter(self.free(sum(counts.values()) - counts["ps"]))
            ports = [next(ps_ports) if t == "ps" else next(others) for t in PORT_ORDER for _ in range(counts[t])]
        addresses = iter(self.address(p) for p in ports)
        return {t: [next(addresses) for _ in range(counts[t])] for t in PORT_ORDER if counts[t]}
