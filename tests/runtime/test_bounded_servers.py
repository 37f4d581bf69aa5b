"""Servers are bounded. Stalled streams cannot starve correct clients, requests and answers have size
caps, parked answers expire on a timer, slot sets per variable are bounded -- and the memory of a ps stays flat
under the amplification cases (measured as the RSS of the ps process)."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import numpy as np
import pytest

from kubeps.runtime.errors import RemoteError
from kubeps.runtime.ops.optimizers import SGD, Adagrad, Adam, Ftrl, Momentum
from kubeps.runtime.rpc import wire
from kubeps.runtime.rpc.protocol import PS, PS_SERVICE

from .conftest import TOKEN
from .stalling import StallingPeer, answered_before_end_of_stream

pytestmark = pytest.mark.timeout(180)

SGD_CONFIG = SGD(0.1).get_config()


def rss_mb(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    raise AssertionError("no VmRSS")


def served(client, rounds: int = 10, limit_s: float = 2.0) -> float:
    """Correct calls (Ping, Read, Push) made ``rounds`` times; returns the slowest, each must finish in time."""
    slowest = 0.0
    for _ in range(rounds):
        for method, meta, arrays in ((PS.READ, {"names": ["v"]}, []), ("Ping", {}, []),
                                     (PS.PUSH, {"optimizer": SGD_CONFIG, "updates": [{"name": "v"}]},
                                      [np.ones(8, np.float32)])):
            start = time.monotonic()
            client.call(method, meta, arrays, timeout=limit_s)
            slowest = max(slowest, time.monotonic() - start)
    return slowest


def test_200_stalled_streams_from_another_client_do_not_starve_correct_ones(make_cluster):
    cluster = make_cluster(1, 0, extra_env={"KUBEPS_STREAM_IDLE_TIMEOUT_S": "60"})
    client = cluster.client("ps", 0, timeout=5)
    client.call(PS.CREATE_VARIABLES, {"names": ["v"]}, [np.zeros(8, np.float32)])
    peer = StallingPeer(cluster.cluster["ps"][0], f"/{PS_SERVICE}/{PS.PUSH}", TOKEN, streams=200, connections=20)
    try:
        time.sleep(1.0)  # let the server take them all in
        slowest = served(client)
    finally:
        peer.close()
    assert slowest < 2.0
    meta, _ = client.call(PS.LIST_VARIABLES)
    assert meta["variables"][0]["updates"] == 10  # the correct pushes, and only those
    client.close()


def test_stalled_streams_of_the_same_client_are_cancelled_after_the_idle_timeout(make_cluster):
    """32 stalled streams (the ps's handler threads, before) from the address the correct
    client uses too. The stalled ones are cancelled after the idle timeout, the correct calls go through."""
    cluster = make_cluster(1, 0, extra_env={"KUBEPS_STREAM_IDLE_TIMEOUT_S": "1", "KUBEPS_LOG_LEVEL": "WARNING"})
    client = cluster.client("ps", 0, timeout=10)
    client.call(PS.CREATE_VARIABLES, {"names": ["v"]}, [np.zeros(8, np.float32)])
    peer = StallingPeer(cluster.cluster["ps"][0], f"/{PS_SERVICE}/Unary.{PS.ASSIGN}", TOKEN, streams=64,
                        connections=4, source="127.0.0.1")
    try:
        time.sleep(0.5)
        slowest = served(client, rounds=3, limit_s=8.0)
    finally:
        peer.close()
    assert slowest < 8.0
    deadline = time.monotonic() + 10
    while "its request stalled" not in cluster.log_text("ps", 0) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert "its request stalled" in cluster.log_text("ps", 0)
    client.close()


def test_a_unary_call_is_answered_without_waiting_for_the_end_of_its_stream(make_cluster):
    """The unary twin reads its one request message and answers: it does not wait for the client to end its side
    of the stream (which would cost the server one more trip through gRPC's polling thread per call). A streamed
    method still reads to the end (its request may have more chunks)."""
    cluster = make_cluster(1, 0, extra_env={"KUBEPS_STREAM_IDLE_TIMEOUT_S": "60"})
    address = cluster.cluster["ps"][0]
    ping = wire.encode_chunks({}, [])[0]
    assert answered_before_end_of_stream(address, f"/{PS_SERVICE}/Unary.Ping", TOKEN, ping, wait_s=5.0)
    assert not answered_before_end_of_stream(address, f"/{PS_SERVICE}/Ping", TOKEN, ping, wait_s=1.0)
    cluster.client("ps", 0).call("Ping")


def test_request_caps(make_cluster):
    cluster = make_cluster(1, 0, extra_env={"KUBEPS_MAX_REQUEST_BYTES": str(1 << 20)})
    client = cluster.client("ps", 0, timeout=20)
    client.call(PS.CREATE_VARIABLES, {"names": ["v"]}, [np.zeros(8, np.float32)])
    start = time.monotonic()
    with pytest.raises(RemoteError) as info:  # today: 256 MiB to Ping accepted
        client.call("Ping", {}, [np.zeros(256 << 20, np.uint8)])
    assert info.value.code == "INVALID_ARGUMENT" and "data_bytes" in str(info.value) and "Ping" in str(info.value)
    with pytest.raises(RemoteError) as info:
        client.call(PS.CREATE_VARIABLES, {"names": ["big"]}, [np.zeros(2 << 20, np.uint8)])
    assert info.value.code == "INVALID_ARGUMENT" and f"at most {1 << 20} bytes" in str(info.value)
    assert time.monotonic() - start < 15
    client.call("Ping")
    client.close()


def test_answers_are_capped_and_repeated_names_refused(make_cluster):
    cluster = make_cluster(1, 0, extra_env={"KUBEPS_MAX_ANSWER_BYTES": str(8 << 20)})
    client = cluster.client("ps", 0, timeout=20)
    client.call(PS.CREATE_VARIABLES, {"names": ["emb"]}, [np.zeros((1000, 16), np.float32)])
    with pytest.raises(RemoteError) as info:
        client.call(PS.READ_MANY, {"names": ["emb"] * 30})
    assert info.value.code == "INVALID_ARGUMENT" and "more than once" in str(info.value)
    with pytest.raises(RemoteError) as info:  # one row asked 200k times: a 12.8 MB answer from a 1.6 MB request
        client.call(PS.READ_ROWS, {"names": ["emb"]}, [np.zeros(200_000, np.int64)])
    assert info.value.code == "INVALID_ARGUMENT" and "200000 ids name 1 distinct rows" in str(info.value)
    client.call(PS.CREATE_VARIABLES, {"names": ["big"]}, [np.zeros((200_000, 16), np.float32)])
    with pytest.raises(RemoteError) as info:  # 200k distinct rows: 12.8 MB, past the 8 MiB answer bound
        client.call(PS.READ_ROWS, {"names": ["big"]}, [np.arange(200_000, dtype=np.int64)])
    assert info.value.code == "RESOURCE_EXHAUSTED" and "KUBEPS_MAX_ANSWER_BYTES" in str(info.value)
    assert info.value.reason == "limit"
    client.close()


def test_slot_sets_per_variable_are_bounded(make_cluster):
    cluster = make_cluster(1, 0, extra_env={"KUBEPS_MAX_SLOT_SETS": "3"})
    client = cluster.client("ps", 0, timeout=20)
    client.call(PS.CREATE_VARIABLES, {"names": ["v"]}, [np.zeros(8, np.float32)])
    # slot sets are keyed by optimizer class: a learning-rate change reuses its class's set
    for optimizer in (Adam(0.1), Adam(0.2), Adagrad(0.1), Ftrl(0.1)):
        client.call(PS.PUSH, {"optimizer": optimizer.get_config(), "updates": [{"name": "v"}]},
                    [np.ones(8, np.float32)])
    with pytest.raises(RemoteError) as info:
        client.call(PS.PUSH, {"optimizer": Momentum(0.1, 0.9).get_config(), "updates": [{"name": "v"}]},
                    [np.ones(8, np.float32)])
    assert info.value.code == "RESOURCE_EXHAUSTED" and "KUBEPS_MAX_SLOT_SETS=3" in str(info.value)
    meta, _ = client.call(PS.LIST_VARIABLES)
    assert meta["variables"][0]["updates"] == 4
    client.close()


#: what a ps may keep above its baseline once an amplification case is over (MB)
RETAINED_MB = 64


def test_ps_memory_stays_flat_under_the_amplification_cases(make_cluster, tmp_path: Path):
    """Amplification cases against one ps process; its RSS is measured after each (the figures are
    printed: ``pytest -s`` shows them). Under heavy load the allocator once kept 51 MB of the first case's 143 MB
    for the rest of the process's life (one full ``make test`` in four; alone, 0 MB in every run): a ps that is over
    the bound gets the cases again in a fresh process, once. The bugs the bound guards against (answers kept,
    +124-150 MB) show in every process, so they fail both times."""
    # the bound: the goal's +64 MB. Under load the allocator has kept 17-51 MB of what the cases freed (glibc's
    # arenas); the bugs the bound guards against keep 124-150 MB in every process
    attempts = []
    for _ in range(2):
        cluster = make_cluster(1, 0, extra_env={"KUBEPS_PARKED_ANSWER_TTL_S": "1", "KUBEPS_MAX_SLOT_SETS": "8"})
        figures = _amplification_figures(cluster)
        cluster.stop()
        attempts.append(figures)
        print("\nps RSS above the baseline (MB):", {k: round(v, 1) for k, v in figures.items()})
        if all(growth <= RETAINED_MB for case, growth in figures.items() if "peak" not in case):
            break
    (tmp_path / "rss.txt").write_text(repr(attempts))
    for case, growth in attempts[-1].items():
        if "peak" not in case:
            assert growth <= RETAINED_MB, (case, attempts)


def _amplification_figures(cluster) -> dict[str, float]:
    """The cases, each followed by the ps's RSS above its baseline once settled."""
    pid = cluster.procs[("ps", 0)].pid
    client = cluster.client("ps", 0, timeout=30)
    big = np.ones(1_200_000, np.float32)  # 4.8 MB: its Read answer is parked (> one 4 MiB chunk)
    client.call(PS.CREATE_VARIABLES, {"names": ["big"]}, [big])
    # the slot sets the test's optimizers legitimately hold, and a few pushes of each so that the allocator's
    # steady state (a push's transient 4.8 MB buffers) is in the baseline
    for optimizer in (SGD(0.1), SGD(0.2), Adam(0.001), Adam(0.002), Adam(0.003)):
        client.call(PS.PUSH, {"optimizer": optimizer.get_config(), "updates": [{"name": "big"}]}, [big])
    client.call(PS.READ, {"names": ["big"]})
    settle = 2.5  # the server's janitor hands freed memory back every 2 s

    def settled() -> float:
        """RSS above the baseline once the janitor has had its turn: polled for up to three of its periods more (a
        loaded machine runs it late), returning as soon as the growth is within the bound."""
        deadline = time.monotonic() + 6.0
        while (growth := rss_mb(pid) - base) > RETAINED_MB and time.monotonic() < deadline:
            time.sleep(0.25)
        return growth
    time.sleep(settle)
    base = rss_mb(pid)
    figures = {}

    # 30 parked answers nobody collects (today +150 MB, kept until the next answer parks)
    unary = client._method(PS.READ, unary=True)
    frame = wire.encode_chunks({"names": ["big"]})[0]
    for _ in range(30):
        with pytest.raises(Exception):
            unary(frame, timeout=10, metadata=client._metadata)
    figures["30 parked answers, peak"] = rss_mb(pid) - base
    time.sleep(settle)  # TTL 1 s, the janitor looks every 0.25 s or more
    figures["30 parked answers, after the TTL"] = settled()

    # 60 distinct optimizer configs on one variable (before: +124 MB, kept for good): slots are keyed by the
    # optimizer's class, so they share Adam's one slot set, and the ps caches a bounded number of optimizer objects
    for i in range(60):
        client.call(PS.PUSH, {"optimizer": Adam(0.001 * (i + 1)).get_config(), "updates": [{"name": "big"}]}, [big])
    time.sleep(settle)
    figures["60 optimizer configs"] = settled()

    # ReadMany naming the 4.8 MB variable 30 times (today a 144 MB answer)
    for _ in range(5):
        with pytest.raises(RemoteError):
            client.call(PS.READ_MANY, {"names": ["big"] * 30})
    time.sleep(settle)
    figures["ReadMany x30"] = settled()

    # 256 MiB streamed to Ping (today accepted)
    with pytest.raises(RemoteError):
        client.call("Ping", {}, [np.zeros(256 << 20, np.uint8)])
    time.sleep(settle)
    figures["256 MiB to Ping"] = settled()

    client.close()
    return figures


def test_parked_answers_expire_on_a_timer_in_process():
    from kubeps.runtime.server.service import _ParkedAnswers

    parked = _ParkedAnswers(ttl_s=0.05, max_bytes=10)
    parked.park([b"123456"])
    parked.park([b"abcdef"])  # over max_bytes: the oldest goes
    assert len(parked) == 1 and parked.nbytes == 6
    time.sleep(0.1)
    assert parked.expire() == 1 and len(parked) == 0


def test_a_busy_refusal_is_retried_by_the_client(make_cluster):
    cluster = make_cluster(1, 0, extra_env={"KUBEPS_MAX_CALLS_PER_CLIENT": "2"})
    client = cluster.client("ps", 0, timeout=20)
    client.call(PS.CREATE_VARIABLES, {"names": ["v"]}, [np.zeros(8, np.float32)])
    errors: list[BaseException] = []

    def push():
        try:
            for _ in range(20):
                client.call(PS.PUSH, {"optimizer": SGD_CONFIG, "updates": [{"name": "v"}]}, [np.ones(8, np.float32)])
        except BaseException as err:  # noqa: BLE001 - checked below
            errors.append(err)

    threads = [threading.Thread(target=push) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    meta, _ = client.call(PS.LIST_VARIABLES)
    assert meta["variables"][0]["updates"] == 160
    client.close()


def test_a_served_process_reuses_step_sized_blocks_without_faulting_their_pages_again():
    """A server's allocator keeps blocks of a few MiB (a wide step's rows and gradients) in its heap: allocating
    and filling one 3 MiB array 40 times faults its pages in about once, not 40 times (a fresh mapping each time
    is what a 1 MiB mmap threshold did, at 2.5x the CPU of the arithmetic on the arrays)."""
    import resource

    from kubeps.runtime.server import service

    service._tune_allocator()
    np.ones(1 << 20, np.float32).sum()  # the first block's pages
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    for _ in range(40):
        block = np.empty(3 << 18, np.float32)  # 3 MiB (numpy asks for huge pages from 4 MiB up)
        block.fill(1.0)
        del block
    faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before
    pages = (3 << 20) // resource.getpagesize()
    assert faults < 5 * pages, f"{faults} minor page faults for 40 x 3 MiB ({pages} pages each)"
