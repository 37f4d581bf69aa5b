"""The methods of the parameter-server service over a :class:`~kubeps.runtime.ps.state.ParameterServerState`.

Each is ``fn(state, meta, arrays) -> (meta, arrays)``; the metadata each reads and answers is typed in
:mod:`kubeps.runtime.rpc.protocol`. A method checks its whole request before it changes anything, and says which
field is wrong (``ValueError`` -> ``INVALID_ARGUMENT``).
"""

from __future__ import annotations

from typing import Any, Callable

from kubeps.runtime.ps.state import ParameterServerState
from kubeps.runtime.rpc.protocol import PS

__all__ = ["BUILTIN_METHODS"]

Meta = dict[str, Any]


def _names(meta: Meta, key: str = "names") -> list[str]:
    names = meta.get(key)
    if not isinstance(names, list) or not all(isinstance(n, str) for n in names):
        raise ValueError(f"field '{key}' must be a list of variable names, got {names!r}")
    if len(set(names)) != len(names):
        seen: set[str] = set()
        for name in names:
            if name in seen:
                raise ValueError(f"field '{key}' names variable {name!r} more than once; allowed: each name once")
            seen.add(name)
    return names


def _expect_arrays(method: str, arrays: list, count: int) -> None:
    if len(arrays) != count:
        raise ValueError(f"{method}: field 'tensors' holds {len(arrays)} tensor(s), expected {count}")


def rpc_create_variables(state: ParameterServerState, meta: Meta, arrays: list) -> tuple[Meta, list]:
    names = _names(meta)
    _expect_arrays(PS.CREATE_VARIABLES, arrays, len(names))
    state.create_many(names, arrays)
    return {"created": len(names), "incarnation": state.incarnation}, []


def rpc_read(state: ParameterServerState, meta: Meta, arrays: list) -> tuple[Meta, list]:  # noqa: ARG001
    names = _names(meta)
    state.check_reads(names, [], [])
    return {}, [state.read(n) for n in names]


def rpc_read_rows(state: ParameterServerState, meta: Meta, arrays: list) -> tuple[Meta, list]:
    names = _names(meta)
    _expect_arrays(PS.READ_ROWS, arrays, len(names))
    state.check_reads([], names, arrays)
    return {}, [state.read_rows(n, idx) for n, idx in zip(names, arrays)]


def rpc_read_many(state: ParameterServerState, meta: Meta, arrays: list) -> tuple[Meta, list]:
    """``Read`` and ``ReadRows`` in one call: whole values of ``names``, then the rows of ``rows`` (one int index
    array per name in ``rows``); the answer lists the values, then the row blocks, in that order."""
    names = _names(meta)
    rows = _names(meta, "rows") if "rows" in meta else []
    _expect_arrays(PS.READ_MANY, arrays, len(rows))
    state.check_reads(names, rows, arrays)
    return {}, [state.read(n) for n in names] + [state.read_rows(n, idx) for n, idx in zip(rows, arrays)]


def rpc_assign(state: ParameterServerState, meta: Meta, arrays: list) -> tuple[Meta, list]:
    names = _names(meta)
    ops = meta.get("ops", ["assign"] * len(names))
    if (not isinstance(ops, list) or len(ops) != len(names)
            or not all(isinstance(op, str) and op in ("assign", "add") for op in ops)):
        raise ValueError(f"field 'ops' must list 'assign' or 'add' for each of {len(names)} names, got {ops!r}")
    _expect_arrays(PS.ASSIGN, arrays, len(names))
    state.assign_many(list(zip(names, ops, arrays)))  # all checked before any is written
    return {}, []


def _push_array_count(updates: Any) -> int:
    """Tensors a push's ``updates`` use: one per dense update, two (indices, values) per sparse one."""
    if not isinstance(updates, list):
        return 0  # rpc_push refuses it, naming the field
    return sum(2 if isinstance(u, dict) and u.get("kind") == "sparse" else 1 for u in updates)


_UPDATE_KEYS = frozenset({"name", "kind"})


def _push_updates(meta: Meta, arrays: list) -> tuple[dict[str, Any], list[tuple]]:
    """The optimizer config and the ``(kind, name, *tensors)`` updates of a ``Push`` request."""
    config = meta.get("optimizer")
    if not isinstance(config, dict):
        raise ValueError(f"field 'optimizer' must be an optimizer config object, got {config!r}")
    updates = meta.get("updates")
    if not isinstance(updates, list):
        raise ValueError(f"field 'updates' must be a list, got {updates!r}")
    _expect_arrays(PS.PUSH, arrays, _push_array_count(updates))
    out = []
    pos = 0
    for i, update in enumerate(updates):
        if not isinstance(update, dict) or not isinstance(update.get("name"), str) or not update.keys() <= _UPDATE_KEYS:
            raise ValueError(f"field 'updates[{i}]' must be an object with a 'name' and optionally a 'kind', "
                             f"got {update!r}")
        kind = update.get("kind", "dense")
        if kind not in ("dense", "sparse"):
            raise ValueError(f"field 'updates[{i}].kind' has value {kind!r}: allowed are 'dense' and 'sparse'")
        width = 2 if kind == "sparse" else 1
        out.append((kind, update["name"], *arrays[pos : pos + width]))
        pos += width
    return config, out


def rpc_push(state: ParameterServerState, meta: Meta, arrays: list) -> tuple[Meta, list]:
    """Apply gradients to many variables with one optimizer: dense ``[grad]`` or sparse ``[indices, values]``
    (all checked before any is applied)."""
    config, updates = _push_updates(meta, arrays)
    return {"steps": state.push(config, updates)}, []


def rpc_push_read(state: ParameterServerState, meta: Meta, arrays: list) -> tuple[Meta, list]:
    """``Push`` then ``ReadMany`` in one call: a worker's step pushes its gradients with the next step's reads.

    ``meta`` holds the push's ``optimizer`` and ``updates`` and the read's ``names`` and ``rows``; ``arrays`` the
    push's tensors, then one index array per name in ``rows``. The whole request is checked first (nothing is
    applied if any of it is malformed); every update is applied before anything is read, so the answer (the values
    of ``names``, then the row blocks) includes this push."""
    needed = _push_array_count(meta.get("updates"))
    config, updates = _push_updates(meta, arrays[:needed])
    names = _names(meta)
    rows = _names(meta, "rows") if "rows" in meta else []
    indices = arrays[needed:]
    _expect_arrays(PS.READ_MANY, indices, len(rows))
    state.check_reads(names, rows, indices)
    steps = state.push(config, updates)
    return {"steps": steps}, [state.read(n) for n in names] + [state.read_rows(n, i) for n, i in zip(rows, indices)]


def rpc_list_variables(state: ParameterServerState, meta: Meta, arrays: list) -> tuple[Meta, list]:  # noqa: ARG001
    out = []
    for name in state.names():
        var = state.variables[name]
        out.append({"name": name, "shape": list(var.value.shape), "dtype": var.value.dtype.name,
                    "updates": var.updates})
    return {"variables": out}, []


#: the variable methods of the parameter-server service (:mod:`kubeps.runtime.server.methods` serves them)
BUILTIN_METHODS: dict[str, Callable[[ParameterServerState, Meta, list], tuple[Meta, list]]] = {
    PS.CREATE_VARIABLES: rpc_create_variables,
    PS.READ: rpc_read,
    PS.READ_ROWS: rpc_read_rows,
    PS.READ_MANY: rpc_read_many,
    PS.ASSIGN: rpc_assign,
    PS.PUSH: rpc_push,
    PS.PUSH_READ: rpc_push_read,
    PS.LIST_VARIABLES: rpc_list_variables,
}
