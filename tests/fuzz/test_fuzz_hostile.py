"""Fuzz targets for the second hostile-input round, one per finding: each property is what the finding broke.

1. the header check: any header (unclosed strings after deep brackets, escapes, brackets inside strings) is
   decoded or refused with a ``WireError``, in bounded CPU time;
2. size fields: any ``CreateDynamic`` config is created within the bounds or refused naming the field;
3. call caps: any sequence of admissions, evictions and departures keeps every client's count and the total
   within their caps, and a stalled call is what gets evicted;
4. confinement: saves and restores into any path below a root holding symlinks to outside touch nothing outside;
5. amplification: any concurrent reads of one client charge at most its budget (alone, one call);
6. storage errors: any directory name is saved or refused with a storage or argument error, and every errno maps
   to a status code other than ``INTERNAL``;
7. csv: any row of integers and numbers reads back exactly or is refused;
8. ``kubeps local``: any task exiting before the chief ends the run exactly when it is a ps (with its status).
"""

from __future__ import annotations

import errno
import os
import struct
import time
from types import SimpleNamespace

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from kubeps.runtime.checkpoint.format import CheckpointError
from kubeps.runtime.checkpoint.shards import rpc_save_shards
from kubeps.runtime.errors import LimitExceededError
from kubeps.runtime.ps.budget import AnswerBudget
from kubeps.runtime.ps.dynamic import rpc_create_dynamic, tables_of
from kubeps.runtime.ps.state import ParameterServerState
from kubeps.runtime.rpc import wire
from kubeps.runtime.rpc.protocol import SaveItem
from kubeps.runtime.settings import TaskSettings

pytestmark = pytest.mark.timeout(600)


def _frame(header: bytes) -> bytes:
    return struct.pack("<4sI", wire.MAGIC, len(header)) + header


# -- 1 -------------------------------------------------------------------------------------------------------------
header_pieces = st.sampled_from([b"[", b"]", b"{", b"}", b'"', b'\\"', b"\\\\", b",", b":", b"1", b"a", b" ",
                                 b'"meta"', b'{"meta":{"x":', b"\\u0041", b"\xff"])


@given(st.integers(0, 200), st.lists(header_pieces, max_size=60), st.integers(0, 20_000),
       st.sampled_from([b'\\"', b"a", b"["]))
def test_any_header_is_decoded_or_refused_in_bounded_time(brackets, pieces, repeat, filler):
    header = b"[" * brackets + b"".join(pieces) + filler * repeat
    start = time.process_time()
    try:
        wire.decode_message(_frame(header))
    except wire.WireError:
        pass
    assert time.process_time() - start < 1.0  # 64 KB here took 11.5 s before; the inputs here cost <= 0.03 s


# -- 2 -------------------------------------------------------------------------------------------------------------
sizes = st.one_of(st.integers(-2, 64), st.sampled_from([2**14, 2**14 + 1, 2**22, 2**24, 2**24 + 1, 2**31, 2**63 - 1]))
LIMITS = TaskSettings(max_table_dim=4096, max_bloom_counters=1 << 16, max_tables=4)


@given(st.fixed_dictionaries({"dim": sizes}, optional={"bloom_counters": sizes, "bloom_hashes": sizes,
                                                         "capacity": sizes, "max_pending": sizes,
                                                         "filter_freq": sizes}),
       st.lists(st.sampled_from(["a", "b", "c", "d", "e", "f"]), min_size=1, max_size=6))
def test_any_table_config_is_created_within_bounds_or_refused(config, names):
    state = ParameterServerState(settings=LIMITS)
    for name in names:
        try:
            rpc_create_dynamic(state, {"name": name, "config": config}, [])
        except LimitExceededError as err:
            assert err.field in ("config.dim", "config.bloom_counters", "name")
        except ValueError as err:
            assert "is not allowed" in str(err)
    tables = tables_of(state).tables
    assert len(tables) <= LIMITS.max_tables
    for table in tables.values():
        assert table.config.dim <= LIMITS.max_table_dim and table.config.bloom_counters <= LIMITS.max_bloom_counters
        assert table.nbytes <= 4 * LIMITS.max_table_dim * 64 + 2 * LIMITS.max_bloom_counters + 4096


# -- 3 -------------------------------------------------------------------------------------------------------------
class _Context:
    def __init__(self, address: str):
        self.address, self.cancelled = address, False

    def peer(self):
        return f"ipv4:{self.address}:1"

    def auth_context(self):
        return {}

    def cancel(self):
        self.cancelled = True


@given(st.lists(st.tuples(st.sampled_from(["enter", "enter", "wait", "leave"]), st.integers(0, 40),
                          st.booleans()), max_size=80))
def test_any_sequence_of_calls_keeps_the_caps(ops):
    from kubeps.runtime.server.service import _Guard

    for by_identity in (True, False):
        guard = _Guard(idle_s=60, request_s=60, max_calls_per_client=5, parked=[], max_calls=7,
                       by_identity=by_identity, evict_after_s=0.0)
        admitted = []
        for op, n, flag in ops:
            if op == "enter":
                slot = guard.enter(_Context(f"10.0.0.{n % 3}"))
                if slot is not None:
                    admitted.append(slot)
            elif admitted:
                slot = admitted[n % len(admitted)]
                if op == "wait":  # the call now waits for its next chunk (the janitor's and eviction's view)
                    slot.waiting_since = time.monotonic() - (1.0 if flag else 0.0)
                else:
                    guard.leave(slot)
                    admitted.remove(slot)
            counted = [s for s in admitted if s.counted]
            assert guard._total == len(counted) <= guard.max_calls
            for client in {s.client for s in counted}:
                assert guard._calls[client] == sum(s.client == client for s in counted) <= 5
            for slot in admitted:
                if not slot.counted:  # evicted: it had been waiting, and it was told
                    assert slot.waiting_since is not None and slot.context.cancelled


# -- 4 -------------------------------------------------------------------------------------------------------------
components = st.sampled_from(["a", "b", "link", "dirlink", "filelink", "c"])


@given(st.lists(st.lists(components, min_size=1, max_size=4), min_size=1, max_size=4))
def test_saves_below_a_root_with_links_to_outside_touch_nothing_outside(tmp_path_factory, paths):
    base = tmp_path_factory.mktemp("confined")
    root, outside = base / "root", base / "outside"
    (root / "a").mkdir(parents=True)
    outside.mkdir()
    (outside / "target.npy").write_bytes(b"secret")
    os.symlink(outside, root / "dirlink")
    os.symlink(outside, root / "a" / "link")
    os.symlink(outside / "target.npy", root / "filelink")
    state = ParameterServerState(settings=TaskSettings(checkpoint_root=(str(root),)))
    state.create("emb", np.zeros((2, 2), np.float32))
    item = SaveItem(key="emb", name="emb", start=0, stop=2, shape=[2, 2])
    for parts in paths:
        try:
            rpc_save_shards(state, {"directory": str(root.joinpath(*parts)), "items": [item]}, [])
        except (OSError, ValueError, CheckpointError):
            pass
    assert sorted(p.name for p in outside.iterdir()) == ["target.npy"]
    assert (outside / "target.npy").read_bytes() == b"secret"


# -- 5 -------------------------------------------------------------------------------------------------------------
@given(st.lists(st.tuples(st.sampled_from(["x", "y"]), st.integers(0, 400)), min_size=1, max_size=12),
       st.integers(1, 10_000))
def test_concurrent_reads_of_a_client_charge_at_most_its_budget(reads, budget_bytes):
    budget = AnswerBudget(budget_bytes)
    open_ledgers = []
    for client, nbytes in reads:
        ledger = budget.ledger(client)
        with budget.charging(ledger):
            try:
                budget.charge(nbytes, "names", ["v"])
            except LimitExceededError:
                continue
        open_ledgers.append(ledger)
        for who in ("x", "y"):
            held = [entry.nbytes for entry in open_ledgers if entry.client == who and entry.nbytes]
            assert budget.held(who) == sum(held)
            assert len(held) <= 1 or sum(held) <= budget_bytes
    for ledger in open_ledgers:
        ledger.release()
    assert budget.held("x") == budget.held("y") == 0


# -- 6 -------------------------------------------------------------------------------------------------------------
@given(st.one_of(st.text(min_size=1, max_size=40), st.integers(200, 6000).map(lambda n: "n" * n),
                 st.sampled_from(["file/ck", "a/../b", "./x", "x\0y", "🙂" * 300, " ", "-"])))
def test_any_directory_name_is_saved_or_refused_with_a_storage_error(tmp_path_factory, name):
    root = tmp_path_factory.mktemp("names")
    (root / "file").write_text("x")
    state = ParameterServerState(settings=TaskSettings(checkpoint_root=(str(root),)))
    state.create("emb", np.zeros((2, 2), np.float32))
    item = SaveItem(key="emb", name="emb", start=0, stop=2, shape=[2, 2])
    try:
        rpc_save_shards(state, {"directory": f"{root}/{name}", "items": [item]}, [])
    except (OSError, ValueError, CheckpointError):
        pass


@given(st.sampled_from(sorted(errno.errorcode)), st.booleans())
def test_every_errno_maps_to_a_status_code_other_than_internal(code, named):
    import grpc

    from kubeps.runtime.server.service import _storage_message, _storage_status

    err = OSError(code, os.strerror(code), "/root/" + "x" * 500 if named else None)
    assert _storage_status(err) in (grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.FAILED_PRECONDITION,
                                    grpc.StatusCode.RESOURCE_EXHAUSTED)
    assert "Traceback" not in _storage_message(err) and len(_storage_message(err)) < 400


# -- 7 -------------------------------------------------------------------------------------------------------------
fields = st.one_of(st.integers(-2**64, 2**64).map(str), st.sampled_from([str(2**24 + 1), str(2**53 + 1), "1e39",
                                                                         "-0", "+7", "1.5"]),
                   st.floats(allow_nan=False, allow_infinity=False, width=32).map(repr))


@given(st.lists(fields, min_size=1, max_size=6), st.sampled_from(["float32", "float64", "int64"]))
def test_csv_rows_read_exactly_or_are_refused(tmp_path_factory, row, dtype):
    from kubeps.runtime.data.readers import read_csv

    path = tmp_path_factory.mktemp("csv") / "f.csv"
    path.write_text(",".join(row) + "\n")
    try:
        (values,) = list(read_csv(str(path), dtype=np.dtype(dtype)))
    except ValueError:
        return
    for text, value in zip(row, values.tolist()):
        if text.lstrip("+-").isdigit():
            assert int(value) == int(text)
        else:
            assert np.isfinite(value)


# -- 8 -------------------------------------------------------------------------------------------------------------
@given(st.sampled_from(["ps", "worker", "evaluator"]), st.integers(-15, 255))
def test_a_task_exit_before_the_chief_ends_the_run_exactly_for_a_ps(task_type, returncode):
    import io

    from kubeps.runtime.local.launcher import LocalCluster, TaskProcess, exit_status

    cluster = LocalCluster(__file__, [], num_ps=1, num_workers=1, output=io.StringIO(), log=io.StringIO())
    task = TaskProcess(task_type, 0, "127.0.0.1:1", SimpleNamespace(pid=1))  # type: ignore[arg-type]
    task.returncode = returncode
    ended = cluster.on_task_exit(task)
    if task_type == "ps":
        assert ended == (exit_status(returncode) or 1)
    else:
        assert ended is None

