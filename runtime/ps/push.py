"""The calls of a training step on a parameter server: ``Push`` (variables' and dynamic tables' updates with one
optimizer), ``PushRead`` (a push, then a ``ReadMany``), ``LookupDynamic`` (a ``ReadMany`` with table lookups) and
``PushLookupDynamic`` (a push, then a ``LookupDynamic``): one function per method, all four one body.

The whole request is checked before anything changes -- the variables' part by
:meth:`~kubeps.runtime.ps.state.ParameterServerState.push` (which refuses before it applies anything), the tables'
part by :mod:`kubeps.runtime.ps.dynamic`'s checks with the locks of the tables it touches held (taken in name order,
before any variable's lock) -- and every update is applied before anything is read, so the answer includes the push.
"""

from __future__ import annotations

from typing import Any, Callable

from kubeps.runtime.ps.dynamic import (DynamicTables, check_answer_size, prepare_table_pushes, split_push,
                                       table_lookups, tables_of)
from kubeps.runtime.ps.methods import expect_arrays, read_values, unique_names, variable_updates
from kubeps.runtime.ps.state import ParameterServerState
from kubeps.runtime.rpc.protocol import (PS, DynamicLookup, EmptyAnswer, LookupDynamicRequest, PushAnswer,
                                          PushLookupDynamicRequest, PushReadRequest, PushRequest, UpdateSpec)

__all__ = ["PUSH_METHODS"]


def _step(state: ParameterServerState, arrays: list[Any], optimizer: dict[str, Any] | None,
          updates: list[UpdateSpec] | None, names: list[str], rows: list[str], dynamic: list[DynamicLookup] | None,
          ) -> tuple[list[int], list[int] | None, list[Any]]:
    """Push ``updates`` (None: no push) with ``optimizer``, then read ``names`` and ``rows`` and look up ``dynamic``
    (None: no read); returns the variables' steps, the tables' steps (None without a table update) and the answer's
    tensors: the values of ``names``, the row blocks of ``rows``, one row block per lookup."""
    registry = tables_of(state)
    read = dynamic is not None
    var_updates: list[UpdateSpec] = []
    var_arrays: list[Any] = []
    table_updates: list[tuple[str, Any, Any]] = []
    used = 0
    if updates is not None:
        var_updates, var_arrays, table_updates, used = split_push(updates, arrays)
    rest = arrays[used:]
    rows = unique_names(rows, "rows")
    names = unique_names(names)
    indices = rest[: len(rows)]
    lookups = table_lookups(registry, dynamic, rest[len(rows):]) if dynamic is not None else []
    opt, okey, pushes = prepare_table_pushes(state, registry, optimizer, table_updates)
    with DynamicTables.locked([t for t, _, _ in pushes] + [t for t, _, _, _ in lookups]):
        checked = [(t, k, t.check_push(opt, k, g, state.allow_nonfinite)) for t, k, g in pushes]
        if read:
            expect_arrays(PS.READ_MANY, indices, len(rows))  # the row indices of the read
            check_answer_size(state, lookups, 0)
        steps: list[int] = []
        out: list[Any] = []
        if var_updates or names or rows:  # else the call is the tables' alone: no variable to push or read
            pushed = variable_updates(var_updates, var_arrays)
            state.check_reads(names, rows, indices)
            if optimizer is not None:
                steps = state.push(optimizer, pushed)
            out = read_values(state, names, rows, indices)
        # everything was checked and the variables' part is applied: nothing below is refused
        dynamic_steps = [t.apply_push(opt, okey, k, g) for t, k, g in checked] if checked else None
        out += [table.lookup(keys, counts, train) for table, keys, counts, train in lookups]
    return steps, dynamic_steps, out


def _answer(steps: list[int], dynamic_steps: list[int] | None) -> PushAnswer:
    answer: PushAnswer = {"steps": steps}
    if dynamic_steps is not None:
        answer["dynamic_steps"] = dynamic_steps
    return answer


def rpc_push(state: ParameterServerState, request: PushRequest,
             arrays: list[Any]) -> tuple[PushAnswer, list[Any]]:
    """Apply gradients with one optimizer: to variables, dense ``[grad]`` or sparse ``[indices, values]``; to
    dynamic tables (``kind: dynamic``), ``[keys, gradient rows]`` (all checked before any is applied)."""
    steps, dynamic_steps, out = _step(state, arrays, request["optimizer"], request["updates"], [], [], None)
    return _answer(steps, dynamic_steps), out


def rpc_push_read(state: ParameterServerState, request: PushReadRequest,
                  arrays: list[Any]) -> tuple[PushAnswer, list[Any]]:
    """``Push`` then ``ReadMany`` in one call: a worker's step pushes its gradients with the next step's reads.

    ``arrays`` holds the push's tensors, then one index array per name in ``rows``. The whole request is checked
    first (nothing is applied if any of it is malformed); the answer holds the values of ``names``, then the row
    blocks."""
    steps, dynamic_steps, out = _step(state, arrays, request["optimizer"], request["updates"],
                                      request["names"], request.get("rows", []), [])
    return _answer(steps, dynamic_steps), out


def rpc_lookup_dynamic(state: ParameterServerState, request: LookupDynamicRequest,
                       arrays: list[Any]) -> tuple[EmptyAnswer, list[Any]]:
    """``LookupDynamic``: a ``ReadMany`` (``names``, ``rows``) and table lookups (``dynamic``): ``arrays`` holds one
    index array per name in ``rows``, then ``(keys, counts)`` per table."""
    _, _, out = _step(state, arrays, None, None, request.get("names", []), request.get("rows", []),
                      request.get("dynamic", []))
    return {}, out


def rpc_push_lookup_dynamic(state: ParameterServerState, request: PushLookupDynamicRequest,
                            arrays: list[Any]) -> tuple[PushAnswer, list[Any]]:
    """``PushLookupDynamic``: a ``Push`` (tables included), then a ``LookupDynamic``, in one call."""
    steps, dynamic_steps, out = _step(state, arrays, request["optimizer"], request["updates"],
                                      request.get("names", []), request.get("rows", []), request.get("dynamic", []))
    return _answer(steps, dynamic_steps), out


#: the step's methods of the parameter-server service (:mod:`kubeps.runtime.server.methods` serves them)
PUSH_METHODS: dict[str, Callable[..., tuple[Any, list[Any]]]] = {
    PS.PUSH: rpc_push,
    PS.PUSH_READ: rpc_push_read,
    PS.LOOKUP_DYNAMIC: rpc_lookup_dynamic,
    PS.PUSH_LOOKUP_DYNAMIC: rpc_push_lookup_dynamic,
}
