"""The unary fast path and the streamed path of every method: which one a call takes, big answers parked and
collected in chunks (a non-idempotent method runs once), the token check and malformed frames on the unary path,
and the number of RPCs a training step makes."""

from __future__ import annotations

import threading
import time

import grpc
import numpy as np
import pytest

from kubeps.runtime.rpc import wire
from kubeps.runtime.variables.context import current_closure_context
from kubeps.runtime.errors import RemoteError, UnauthenticatedError
from kubeps.runtime.ops.optimizers import SGD
from kubeps.runtime.rpc.client import Client
from kubeps.runtime.rpc.protocol import ANSWER_PARKED, PS_SERVICE, UNARY_PREFIX
from kubeps.runtime.rpc.security import TOKEN_METADATA_KEY
from kubeps.runtime.server import Server, register_ps_method
from kubeps.runtime.variables.push import IndexedSlices
from kubeps.runtime.variables.variable import Variable, embedding_lookup

from .conftest import TOKEN, free_ports

pytestmark = pytest.mark.timeout(120)

CHUNK = 64 << 10  # small chunks keep the "big" messages small


@pytest.fixture(params=[False, True], ids=["futures", "sender-threads"])
def ps_server(request):
    """A ps and a client of it whose unary calls are gRPC futures, or blocking calls on the client's sender
    threads (what the ps transport of the step path uses)."""
    port = free_ports(1)[0]
    cluster = {"ps": [f"127.0.0.1:{port}"]}
    server = Server(cluster, "ps", 0, token=TOKEN, bind_host="127.0.0.1", chunk_bytes=CHUNK)
    client = Client(cluster["ps"][0], PS_SERVICE, TOKEN, timeout=10, chunk_bytes=CHUNK, sender_threads=request.param)
    yield server, client
    client.close()
    server.stop(grace=None)


_SEEN: list[str] = []


def _recording(state, meta, arrays):
    _SEEN.append(meta.get("tag", ""))
    return {"tag": meta.get("tag")}, arrays


register_ps_method("RecordForTest", _recording, replace=True)

_RELEASE = threading.Event()


def _waiting(state, meta, arrays):
    _RELEASE.wait(10)
    return {}, []


register_ps_method("WaitForTest", _waiting, replace=True)


def test_a_cancelled_call_releases_its_waiter_at_once_and_the_client_goes_on(ps_server):
    server, client = ps_server
    _RELEASE.clear()
    try:
        call = client.start("WaitForTest", {})
        assert call.unary
        time.sleep(0.2)
        started = time.monotonic()
        assert call.cancel()
        with pytest.raises(RemoteError) as err:
            call.result()
        assert err.value.code == "CANCELLED" and time.monotonic() - started < 2
        assert not call.cancel()  # a cancelled call is not cancelled again
        meta, _ = client.call("Ping")  # another call while the cancelled one may still wait on the server
        assert meta["job"] == "ps"
    finally:
        _RELEASE.set()


def test_sender_threads_end_with_the_client():
    port = free_ports(1)[0]
    cluster = {"ps": [f"127.0.0.1:{port}"]}
    server = Server(cluster, "ps", 0, token=TOKEN, bind_host="127.0.0.1")
    before = {t for t in threading.enumerate() if t.name == "kubeps-rpc-sender"}
    client = Client(cluster["ps"][0], PS_SERVICE, TOKEN, timeout=10, sender_threads=True)
    try:
        calls = [client.start("Ping") for _ in range(3)]  # three in flight at once: up to three threads
        for call in calls:
            assert call.result()[0]["job"] == "ps"
        mine = {t for t in threading.enumerate() if t.name == "kubeps-rpc-sender"} - before
        assert 1 <= len(mine) <= 3
        for _ in range(20):
            client.call("Ping")  # one at a time: the idle threads are reused, none are added
        assert {t for t in threading.enumerate() if t.name == "kubeps-rpc-sender"} - before == mine
    finally:
        client.close()
        server.stop(grace=None)
    for thread in mine:
        thread.join(5)
        assert not thread.is_alive()


def test_small_request_and_answer_take_the_unary_path(ps_server):
    server, client = ps_server
    server.state.create("v", np.arange(6, dtype=np.float32))
    call = client.start("Read", {"names": ["v"]})
    assert call.unary
    meta, (value,) = client.finish(call)
    np.testing.assert_array_equal(value, np.arange(6, dtype=np.float32))
    meta, _ = client.call("Ping")
    assert meta["incarnation"] == server.incarnation and meta["job"] == "ps"


def test_big_request_is_streamed_in_chunks(ps_server):
    server, client = ps_server
    big = np.arange(3 * CHUNK // 4, dtype=np.float32)  # 3 chunks
    server.state.create("big", np.zeros_like(big))
    call = client.start("Assign", {"names": ["big"], "ops": ["add"]}, [big])
    assert not call.unary
    client.finish(call)
    np.testing.assert_array_equal(server.state.read("big"), big)


def test_big_answer_to_a_unary_call_is_parked_and_streamed(ps_server):
    server, client = ps_server
    big = np.random.default_rng(0).standard_normal(CHUNK).astype(np.float32)  # 4 chunks
    server.state.create("big", big)
    call = client.start("Read", {"names": ["big"]})
    assert call.unary  # the request is small; the answer is not
    _, (value,) = call.result()
    np.testing.assert_array_equal(value, big)
    assert len(server._handler.parked) == 0  # collected

    # the raw unary call says why and where the answer waits
    channel = grpc.insecure_channel(client.address)
    unary = channel.unary_unary(f"/{PS_SERVICE}/{UNARY_PREFIX}Read")
    with pytest.raises(grpc.RpcError) as info:
        unary(wire.encode_chunks({"names": ["big"]})[0], timeout=5, metadata=((TOKEN_METADATA_KEY, TOKEN),))
    assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert dict(info.value.trailing_metadata())["x-kubeps-error"] == ANSWER_PARKED
    channel.close()


def test_big_answer_of_a_push_applies_the_update_once(ps_server):
    server, client = ps_server
    sgd = SGD(learning_rate=1.0).get_config()
    big = np.ones(CHUNK, np.float32)
    server.state.create("w", big)
    meta, (value,) = client.call("PushRead", {"optimizer": sgd, "updates": [{"name": "w", "kind": "dense"}],
                                              "names": ["w"]}, [np.full(CHUNK, 0.5, np.float32)])
    assert meta["steps"] == [1]  # a streamed request: the push itself is big too
    np.testing.assert_array_equal(value, np.full(CHUNK, 0.5, np.float32))  # read after the update

    server.state.create("small", np.ones(4, np.float32))
    # small request (unary), big answer (parked): the update must run exactly once
    meta, (small, w) = client.call("PushRead", {"optimizer": sgd, "updates": [{"name": "small", "kind": "dense"}],
                                                "names": ["small", "w"]}, [np.ones(4, np.float32)])
    assert meta["steps"] == [1] and server.state.get("small").updates == 1
    np.testing.assert_array_equal(small, np.zeros(4, np.float32))
    assert w.shape == (CHUNK,)
    # rows too, after a sparse update: the answer is the values of 'names', then the row blocks
    meta, (rows,) = client.call("PushRead", {"optimizer": sgd, "updates": [{"name": "small", "kind": "sparse"}],
                                             "names": [], "rows": ["small"]},
                                [np.array([1, 3]), np.ones((2,), np.float32), np.array([3, 0])])
    assert meta["steps"] == [2]
    np.testing.assert_array_equal(rows, np.array([-1.0, 0.0], np.float32))


def test_push_read_refuses_a_malformed_request_naming_the_field(ps_server):
    server, client = ps_server
    server.state.create("v", np.ones(4, np.float32))
    sgd = SGD(learning_rate=1.0).get_config()
    cases = [
        ({"optimizer": sgd, "updates": "v", "names": ["v"]}, [], "field 'updates' has value 'v': input should be a valid list"),
        ({"optimizer": sgd, "updates": [{"name": "v", "kind": "dense"}], "names": ["v"]}, [],
         "field 'tensors' holds 0 tensor(s)"),
        ({"optimizer": sgd, "updates": [], "names": [], "rows": ["v"]}, [], "ReadMany: field 'tensors' holds 0"),
        # a good push with a bad read: refused before the push is applied
        ({"optimizer": sgd, "updates": [{"name": "v", "kind": "dense"}], "names": ["v"], "rows": ["v"]},
         [np.ones(4, np.float32), np.array([9])], "holds row 9; the variable has rows 0..3"),
        ({"optimizer": sgd, "updates": [{"name": "v", "kind": "dense"}], "names": ["nope"]},
         [np.ones(4, np.float32)], "no variable named 'nope'"),
        # a good first update and a bad second one: neither is applied
        ({"optimizer": sgd, "updates": [{"name": "v", "kind": "dense"}, {"name": "v", "kind": "sparse"}],
          "names": []}, [np.ones(4, np.float32), np.array([0]), np.ones((1, 2), np.float32)],
         "'values' has shape [1, 2], expected [1]"),
    ]
    for meta, arrays, message in cases:
        for method in ("PushRead", "Push"):
            if method == "Push" and ("rows" in meta or meta["names"]):
                continue
            if method == "Push":  # a Push declares no reads: its request has no 'names'
                meta = {k: v for k, v in meta.items() if k != "names"}
            with pytest.raises(RemoteError) as info:
                client.call(method, meta, arrays)
            assert info.value.code in ("INVALID_ARGUMENT", "NOT_FOUND") and message in str(info.value), str(info.value)
    assert server.state.get("v").updates == 0  # nothing was applied by the refused calls
    np.testing.assert_array_equal(server.state.read("v"), np.ones(4, np.float32))


def test_collect_of_an_unknown_answer_is_not_found(ps_server):
    _, client = ps_server
    with pytest.raises(RemoteError) as info:
        client._collect("0" * 32, timeout=5)
    assert info.value.code == "NOT_FOUND"


def test_unary_path_refuses_a_wrong_token_before_deserialising(ps_server):
    server, client = ps_server
    _SEEN.clear()
    wrong = Client(client.address, PS_SERVICE, "a-wrong-token-0123456789", timeout=5)
    with pytest.raises(UnauthenticatedError):
        wrong.call("RecordForTest", {"tag": "wrong"})
    wrong.close()
    # a malformed frame with a wrong token: refused for the token, never decoded (that would be INVALID_ARGUMENT)
    channel = grpc.insecure_channel(client.address)
    unary = channel.unary_unary(f"/{PS_SERVICE}/{UNARY_PREFIX}RecordForTest")
    for metadata in ((), ((TOKEN_METADATA_KEY, "a-wrong-token-0123456789"),)):
        with pytest.raises(grpc.RpcError) as info:
            unary(b"not a frame at all", timeout=5, metadata=metadata)
        assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED
    channel.close()
    assert _SEEN == []
    assert client.call("RecordForTest", {"tag": "right"})[0] == {"tag": "right"}
    assert _SEEN == ["right"]


def test_malformed_unary_payload_is_invalid_argument_naming_the_field(ps_server):
    server, client = ps_server
    channel = grpc.insecure_channel(client.address)
    unary = channel.unary_unary(f"/{PS_SERVICE}/{UNARY_PREFIX}RecordForTest")
    good = b"".join(wire.encode_chunks({"tag": "x"}, [np.arange(4, dtype=np.int32)]))
    md = ((TOKEN_METADATA_KEY, TOKEN),)
    cases = {
        b"XXXX" + good[4:]: "field 'magic'",
        good.replace(b'"nbytes":16', b'"nbytes":12'): "field 'tensors[0].nbytes'",
        good.replace(b'"int32"', b'"objec"'): "field 'tensors.0.dtype'",
        good[:-8]: "field 'data_bytes'",
    }
    for payload, field in cases.items():
        with pytest.raises(grpc.RpcError) as info:
            unary(payload, timeout=5, metadata=md)
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT, payload[:40]
        assert field in info.value.details() and info.value.details().startswith("RecordForTest: ")
    channel.close()
    assert client.call("RecordForTest", {"tag": "still serving"})[0] == {"tag": "still serving"}


def test_a_training_step_makes_one_rpc_per_ps(coord):
    """Embedding lookup (table in 2 shards on 2 ps) + dense weights on both ps + one push: 1 call per ps a step.
    The dense pull rides on the lookup's call (ReadMany), and each step's push on the next step's lookup
    (PushRead); the last step's push is sent when the function returns."""
    strategy, coordinator = coord
    with strategy.scope():
        table = Variable(np.zeros((100, 4), np.float32), name="calls_table")  # sharded: part_0, part_1
        ws = [Variable(np.full((1, 4), float(i), np.float32), name=f"calls_w{i}")  # one row: never sharded
              for i in range(2)]
    assert {w.device for w in ws} == {"/job:ps/replica:0/task:0/device:CPU:0", "/job:ps/replica:0/task:1/device:CPU:0"}
    opt = SGD(learning_rate=1.0)

    def steps(n):
        ctx = current_closure_context()
        per_step, seen = [], []
        for step in range(n):
            before = dict(ctx.transport.calls)
            ids = np.array([1, 7, 60, 99, 7])
            rows = embedding_lookup(table, ids)
            x = rows.sum(axis=1, keepdims=True)
            w0, w1 = ws[0].read_value(), ws[1].read_value()
            seen.append((float(w0[0, 0]), float(w1[0, 0])))
            opt.apply_gradients([(IndexedSlices(np.ones((5, 4), np.float32), ids), table),
                                 (np.ones((1, 4), np.float32), ws[0]), (np.ones((1, 4), np.float32), ws[1])])
            del x
            per_step.append({ps: ctx.transport.calls[ps] - before.get(ps, 0) for ps in (0, 1)})
        return per_step, seen, ctx.pulls

    per_step, seen, pulls = coordinator.schedule(steps, args=(3,)).fetch()
    assert per_step == [{0: 1, 1: 1}] * 3
    assert pulls == 6  # every step's dense pull rides on its lookup (ReadMany, then PushRead), one per ps
    assert seen == [(0.0, 1.0), (-1.0, 0.0), (-2.0, -1.0)]  # each step saw the previous push's result
    np.testing.assert_array_equal(ws[0].numpy(), np.full((1, 4), -3.0, np.float32))
    np.testing.assert_array_equal(table.numpy()[7], np.full(4, -6.0, np.float32))  # duplicates summed, 3 steps


def test_small_sharded_weights_ride_on_the_lookup_big_ones_are_read_on_demand(coord):
    """Dense weights are pulled with the step's first call whether or not a partitioner sharded them; a variable
    over PREFETCH_MAX_BYTES (a table) never is: only what a step asks for is read."""
    from kubeps.runtime.variables.context import PREFETCH_MAX_BYTES

    strategy, coordinator = coord
    with strategy.scope():
        table = Variable(np.zeros((100, 4), np.float32), name="od_table")
        kernel = Variable(np.ones((6, 4), np.float32), name="od_kernel")  # small, but sharded over both ps
        big = Variable(np.zeros(PREFETCH_MAX_BYTES // 4 + 2, np.float32), name="od_big")  # sharded, over the limit
    assert len(kernel.variables) == 2 and len(big.variables) == 2
    assert all(s.prefetch for s in kernel.variables) and not any(s.prefetch for s in big.variables)

    def step():
        ctx = current_closure_context()
        before = sum(ctx.transport.calls.values())
        embedding_lookup(table, np.array([1, 99]))
        after_lookup = sum(ctx.transport.calls.values())
        value = kernel.read_value()
        after_kernel = sum(ctx.transport.calls.values())
        return after_lookup - before, after_kernel - after_lookup, float(value.sum())

    lookup_calls, kernel_calls, total = coordinator.schedule(step).fetch()
    assert (lookup_calls, kernel_calls, total) == (2, 0, 24.0)


def test_a_megabytes_kernel_rides_on_the_lookup_and_a_table_is_never_pulled_whole(coord):
    """A Wide & Deep kernel (here 2.8 MB, over the old 1 MiB limit) is pulled with the step's first call, not by a
    call of its own; a table the worker looked rows up in is never pulled whole, however small."""
    strategy, coordinator = coord
    with strategy.scope():
        table = Variable(np.zeros((100, 4), np.float32), name="mb_table")
        kernel = Variable(np.zeros((700, 1024), np.float32), name="mb_kernel")
    opt = SGD(learning_rate=1.0)

    def steps(n):
        ctx = current_closure_context()
        per_step = []
        for _ in range(n):
            before = dict(ctx.transport.calls)
            ids = np.array([1, 7, 60, 99])
            embedding_lookup(table, ids)
            kernel.read_value()
            opt.apply_gradients([(IndexedSlices(np.ones((4, 4), np.float32), ids), table),
                                 (np.ones((700, 1024), np.float32), kernel)])
            per_step.append({ps: ctx.transport.calls[ps] - before.get(ps, 0) for ps in (0, 1)})
        return per_step, sorted(k for k in ctx.cache if k.startswith("mb_table"))

    per_step, cached_table = coordinator.schedule(steps, args=(3,)).fetch()
    assert all(sum(calls.values()) == 2 for calls in per_step), per_step  # one call per ps a step
    assert cached_table == []
    np.testing.assert_array_equal(kernel.numpy()[0, :3], np.full(3, -3.0, np.float32))
