"""The variable methods of the parameter-server service over a :class:`~kubeps.runtime.ps.state.ParameterServerState`.

Each is ``fn(state, request, arrays) -> (answer, arrays)``, with the request and answer declared in
:mod:`kubeps.runtime.rpc.protocol`; the server validated the request's shape against its declaration before it
called the method, so a method checks only what the shape cannot say (names given once, tensor counts, the
variables it holds) -- all of it before it changes anything, naming the field (``ValueError`` ->
``INVALID_ARGUMENT``). The helpers here that :mod:`kubeps.runtime.ps.push` shares are public.
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

from kubeps.runtime.ps.state import ParameterServerState
from kubeps.runtime.rpc.protocol import (PS, AssignRequest, CreateVariablesAnswer, EmptyAnswer, EmptyRequest,
                                          ListVariablesAnswer, NamesRequest, ReadManyRequest, UpdateSpec,
                                          VariableInfo)

__all__ = ["BUILTIN_METHODS", "expect_arrays", "read_values", "unique_names", "variable_updates"]


def unique_names(names: list[str], field: str = "names") -> list[str]:
    """``names``, refused when one is given more than once."""
    if len(set(names)) != len(names):
        seen: set[str] = set()
        for name in names:
            if name in seen:
                raise ValueError(f"field '{field}' names variable {name!r} more than once; allowed: each name once")
            seen.add(name)
    return names


def expect_arrays(method: str, arrays: Sequence[Any], count: int) -> None:
    if len(arrays) != count:
        raise ValueError(f"{method}: field 'tensors' holds {len(arrays)} tensor(s), expected {count}")


def variable_updates(updates: list[UpdateSpec], arrays: Sequence[Any]) -> list[tuple[Any, ...]]:
    """The ``(kind, name, *tensors)`` of a push's dense and sparse ``updates`` (one tensor each, two for a
    sparse one), for :meth:`~kubeps.runtime.ps.state.ParameterServerState.push`."""
    expect_arrays(PS.PUSH, arrays, sum(2 if u.get("kind") == "sparse" else 1 for u in updates))
    out: list[tuple[Any, ...]] = []
    pos = 0
    for update in updates:
        kind = update.get("kind", "dense")
        width = 2 if kind == "sparse" else 1
        out.append((kind, update["name"], *arrays[pos : pos + width]))
        pos += width
    return out


def read_values(state: ParameterServerState, names: list[str], rows: list[str], indices: Sequence[Any]) -> list[Any]:
    """The answer of a ``ReadMany`` whose reads :meth:`~kubeps.runtime.ps.state.ParameterServerState.check_reads`
    accepted: the values of ``names``, then the row blocks of ``rows``."""
    return [state.read(n) for n in names] + [state.read_rows(n, idx) for n, idx in zip(rows, indices)]


def rpc_create_variables(state: ParameterServerState, request: NamesRequest,
                         arrays: list[Any]) -> tuple[CreateVariablesAnswer, list[Any]]:
    names = unique_names(request["names"])
    expect_arrays(PS.CREATE_VARIABLES, arrays, len(names))
    state.create_many(names, arrays)
    return {"created": len(names), "incarnation": state.incarnation}, []


def rpc_read(state: ParameterServerState, request: NamesRequest,
             arrays: list[Any]) -> tuple[EmptyAnswer, list[Any]]:  # noqa: ARG001
    names = unique_names(request["names"])
    state.check_reads(names, [], [])
    return {}, read_values(state, names, [], [])


def rpc_read_rows(state: ParameterServerState, request: NamesRequest,
                  arrays: list[Any]) -> tuple[EmptyAnswer, list[Any]]:
    names = unique_names(request["names"])
    expect_arrays(PS.READ_ROWS, arrays, len(names))
    state.check_reads([], names, arrays)
    return {}, read_values(state, [], names, arrays)


def rpc_read_many(state: ParameterServerState, request: ReadManyRequest,
                  arrays: list[Any]) -> tuple[EmptyAnswer, list[Any]]:
    """``Read`` and ``ReadRows`` in one call: whole values of ``names``, then the rows of ``rows`` (one int index
    array per name in ``rows``); the answer lists the values, then the row blocks, in that order."""
    names = unique_names(request["names"])
    rows = unique_names(request.get("rows", []), "rows")
    expect_arrays(PS.READ_MANY, arrays, len(rows))
    state.check_reads(names, rows, arrays)
    return {}, read_values(state, names, rows, arrays)


def rpc_assign(state: ParameterServerState, request: AssignRequest,
               arrays: list[Any]) -> tuple[EmptyAnswer, list[Any]]:
    names = unique_names(request["names"])
    ops = request.get("ops", ["assign"] * len(names))
    if len(ops) != len(names):
        raise ValueError(f"field 'ops' must list 'assign' or 'add' for each of {len(names)} names, got {ops!r}")
    expect_arrays(PS.ASSIGN, arrays, len(names))
    state.assign_many(list(zip(names, ops, arrays)))  # all checked before any is written
    return {}, []


def rpc_list_variables(state: ParameterServerState, request: EmptyRequest,  # noqa: ARG001
                       arrays: list[Any]) -> tuple[ListVariablesAnswer, list[Any]]:  # noqa: ARG001
    out: list[VariableInfo] = []
    for name in state.names():
        var = state.variables[name]
        out.append({"name": name, "shape": list(var.value.shape), "dtype": var.value.dtype.name,
                    "updates": var.updates, "rows_read": var.rows_read, "bytes_read": var.bytes_read,
                    "rows_pushed": var.rows_pushed, "bytes_pushed": var.bytes_pushed})
    return {"variables": out}, []


#: the variable methods of the parameter-server service (:mod:`kubeps.runtime.server.methods` serves them); the
#: pushes are :mod:`kubeps.runtime.ps.push`'s
BUILTIN_METHODS: dict[str, Callable[..., tuple[Any, list[Any]]]] = {
    PS.CREATE_VARIABLES: rpc_create_variables,
    PS.READ: rpc_read,
    PS.READ_ROWS: rpc_read_rows,
    PS.READ_MANY: rpc_read_many,
    PS.ASSIGN: rpc_assign,
    PS.LIST_VARIABLES: rpc_list_variables,
}
