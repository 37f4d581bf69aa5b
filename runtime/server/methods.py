"""The composition root of the servers' methods: which functions each service answers, by name.

A method is ``fn(state, request, arrays) -> (answer, arrays)``. The tables are built here, explicitly, from the
packages that define methods (:mod:`kubeps.runtime.ps`, :mod:`kubeps.runtime.worker`, and the ps side of
:mod:`kubeps.runtime.checkpoint`); nothing registers itself by being imported, and one method is defined by one
package: two that define the same name are an error at import, not an override. A built-in method's request and
answer are declared in :mod:`kubeps.runtime.rpc.protocol`, and the server validates the request against the
declaration before it calls the method.

Users add their own with :func:`register_ps_method` / :func:`register_worker_method`, in their program or in a
module named by ``KUBEPS_SERVER_EXTENSIONS`` that ``python -m kubeps.runtime.server`` imports before it serves. A
user's method has no declaration: it receives the request's metadata as the decoded JSON object (a ``dict``) and
checks it itself.
"""

from __future__ import annotations

import importlib
import threading
from typing import Any, Callable, Mapping

from kubeps.runtime.checkpoint.shards import PS_METHODS as _CHECKPOINT_PS_METHODS
from kubeps.runtime.contract import SERVER_EXTENSIONS_ENV
from kubeps.runtime.checks import check_callable
from kubeps.runtime.errors import RuntimeConfigError
from kubeps.runtime.ps.dynamic import DYNAMIC_METHODS as _DYNAMIC_PS_METHODS
from kubeps.runtime.ps.methods import BUILTIN_METHODS as _PS_BUILTINS
from kubeps.runtime.ps.push import PUSH_METHODS as _PUSH_PS_METHODS
from kubeps.runtime.rpc.protocol import COLLECT, PING
from kubeps.runtime.settings import TaskSettings
from kubeps.runtime.worker.state import BUILTIN_METHODS as _WORKER_BUILTINS

__all__ = [
    "BUILTIN_PS_METHODS",
    "BUILTIN_WORKER_METHODS",
    "Method",
    "compose",
    "PS_METHODS",
    "WORKER_METHODS",
    "load_extensions",
    "ps_methods",
    "register_ps_method",
    "register_worker_method",
    "worker_methods",
]

#: ``fn(state, request, arrays) -> (answer, arrays)``; a built-in method's request and answer are its
#: declarations in :mod:`kubeps.runtime.rpc.protocol`, a user's method gets and answers plain dicts
Method = Callable[..., "tuple[Mapping[str, Any], list[Any]]"]


def compose(**parts: Mapping[str, Method]) -> dict[str, Method]:
    """One method table from the parts that define methods (by package name); a method that two parts define
    is refused, naming both, so no part's method silently replaces another's."""
    table: dict[str, Method] = {}
    owner: dict[str, str] = {}
    for part, methods in parts.items():
        for name, fn in methods.items():
            if name in table:
                raise RuntimeConfigError("method", name, f"is defined by both {owner[name]} and {part}; a method "
                                                         "has one definition")
            table[name], owner[name] = fn, part
    return table


#: the parameter-server service: variables (ps.methods), the step's pushes and lookups (ps.push), dynamic embedding
#: tables (ps.dynamic), checkpoint shards (checkpoint), and the user's
PS_METHODS: dict[str, Method] = compose(variables=_PS_BUILTINS, push=_PUSH_PS_METHODS, dynamic=_DYNAMIC_PS_METHODS,
                                        checkpoint=_CHECKPOINT_PS_METHODS)
#: the worker service: closures and per-worker resources, and the user's
WORKER_METHODS: dict[str, Method] = compose(worker=_WORKER_BUILTINS)
#: the built-in methods alone, each with its declaration in :mod:`kubeps.runtime.rpc.protocol` (a user's method
#: registered under a built-in's name with ``replace=True`` is not one: its request is not validated)
BUILTIN_PS_METHODS: Mapping[str, Method] = dict(PS_METHODS)
BUILTIN_WORKER_METHODS: Mapping[str, Method] = dict(WORKER_METHODS)

_REGISTRY_LOCK = threading.Lock()
#: answered by the service itself, never by a table entry
_RESERVED = {PING, COLLECT}


def load_extensions(settings: TaskSettings) -> list[str]:
    """Import the user's modules named in ``KUBEPS_SERVER_EXTENSIONS`` (``settings.server_extensions``, the task's
    settings, passed down by its :class:`~kubeps.runtime.server.service.Server`); returns the ones loaded."""
    loaded = []
    for name in settings.server_extensions:
        try:
            importlib.import_module(name)
        except ModuleNotFoundError as err:
            raise RuntimeConfigError(SERVER_EXTENSIONS_ENV, name, f"must name an importable module ({err})") from None
        loaded.append(name)
    return loaded


def _register(table: dict[str, Method], kind: str, name: str, fn: Method, replace: bool) -> None:
    if not isinstance(name, str) or not name.isidentifier() or name in _RESERVED:
        raise RuntimeConfigError("name", name, f"a {kind} method name must be an identifier other than {sorted(_RESERVED)}")
    check_callable("fn", fn, allowed="must be callable as fn(state, meta, arrays) -> (meta, arrays)")
    with _REGISTRY_LOCK:
        if name in table and table[name] is not fn and not replace:
            raise RuntimeConfigError("name", name, f"a {kind} method of that name is already registered "
                                                   "(pass replace=True to override it)")
        table[name] = fn


def register_ps_method(name: str, fn: Method, replace: bool = False) -> None:
    """Add a parameter-server method: ``fn(state: ParameterServerState, meta, arrays) -> (meta, arrays)``; ``meta``
    is the request's metadata as the decoded JSON object (no declaration checked it: ``fn`` checks what it reads)."""
    _register(PS_METHODS, "ps", name, fn, replace)


def register_worker_method(name: str, fn: Method, replace: bool = False) -> None:
    """Add a worker method: ``fn(state: WorkerState, meta, arrays) -> (meta, arrays)``; ``meta`` as for
    :func:`register_ps_method`."""
    _register(WORKER_METHODS, "worker", name, fn, replace)


def ps_methods() -> list[str]:
    return sorted(PS_METHODS) + [PING]


def worker_methods() -> list[str]:
    return sorted(WORKER_METHODS) + [PING]
