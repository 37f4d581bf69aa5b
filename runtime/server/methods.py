"""The composition root of the servers' methods: which functions each service answers, by name.

A method is ``fn(state, meta, arrays) -> (meta, arrays)``. The tables are built here, explicitly, from the packages
that define methods (:mod:`kubeps.runtime.ps`, :mod:`kubeps.runtime.worker`, and the ps side of
:mod:`kubeps.runtime.checkpoint`); nothing registers itself by being imported. Users add their own with
:func:`register_ps_method` / :func:`register_worker_method`, in their program or in a module named by
``KUBEPS_SERVER_EXTENSIONS`` that ``python -m kubeps.runtime.server`` imports before it serves.
"""

from __future__ import annotations

import importlib
import threading
from typing import Any, Callable

from kubeps.runtime.checkpoint.shards import PS_METHODS as _CHECKPOINT_PS_METHODS
from kubeps.runtime.contract import SERVER_EXTENSIONS_ENV
from kubeps.runtime.errors import RuntimeConfigError
from kubeps.runtime.ps.dynamic import DYNAMIC_METHODS as _DYNAMIC_PS_METHODS
from kubeps.runtime.ps.methods import BUILTIN_METHODS as _PS_BUILTINS
from kubeps.runtime.rpc.protocol import COLLECT, PING
from kubeps.runtime.settings import TaskSettings
from kubeps.runtime.worker.state import BUILTIN_METHODS as _WORKER_BUILTINS

__all__ = [
    "EXTENSIONS_ENV",
    "Method",
    "PS_METHODS",
    "WORKER_METHODS",
    "load_extensions",
    "ps_methods",
    "register_ps_method",
    "register_worker_method",
    "worker_methods",
]

Method = Callable[[Any, dict[str, Any], list], "tuple[dict[str, Any], list]"]

#: the parameter-server service: variables and pushes (ps), dynamic embedding tables (whose ``Push`` and ``PushRead``
#: take the variables' updates and the tables' alike, in place of the plain ones), checkpoint shards (checkpoint), and
#: the user's
PS_METHODS: dict[str, Method] = {**_PS_BUILTINS, **_DYNAMIC_PS_METHODS, **_CHECKPOINT_PS_METHODS}
#: the worker service: closures and per-worker resources, and the user's
WORKER_METHODS: dict[str, Method] = dict(_WORKER_BUILTINS)

_REGISTRY_LOCK = threading.Lock()
#: answered by the service itself, never by a table entry
_RESERVED = {PING, COLLECT}
#: env var naming modules (comma-separated) that ``python -m kubeps.runtime.server`` imports before serving: the
#: user's own methods, registered with :func:`register_ps_method` / :func:`register_worker_method`
EXTENSIONS_ENV = SERVER_EXTENSIONS_ENV


def load_extensions(settings: TaskSettings | None = None) -> list[str]:
    """Import the user's modules named in ``KUBEPS_SERVER_EXTENSIONS`` (``settings.server_extensions``, default
    :meth:`TaskSettings.from_env() <kubeps.runtime.settings.TaskSettings.from_env>`); returns the ones loaded."""
    loaded = []
    for name in (TaskSettings.from_env() if settings is None else settings).server_extensions:
        try:
            importlib.import_module(name)
        except ModuleNotFoundError as err:
            raise RuntimeConfigError(EXTENSIONS_ENV, name, f"must name an importable module ({err})") from None
        loaded.append(name)
    return loaded


def _register(table: dict[str, Method], kind: str, name: str, fn: Method, replace: bool) -> None:
    if not isinstance(name, str) or not name.isidentifier() or name in _RESERVED:
        raise RuntimeConfigError("name", name, f"a {kind} method name must be an identifier other than {sorted(_RESERVED)}")
    if not callable(fn):
        raise RuntimeConfigError("fn", fn, "must be callable as fn(state, meta, arrays) -> (meta, arrays)")
    with _REGISTRY_LOCK:
        if name in table and table[name] is not fn and not replace:
            raise RuntimeConfigError("name", name, f"a {kind} method of that name is already registered "
                                                   "(pass replace=True to override it)")
        table[name] = fn


def register_ps_method(name: str, fn: Method, replace: bool = False) -> None:
    """Add a parameter-server method: ``fn(state: ParameterServerState, meta, arrays) -> (meta, arrays)``."""
    _register(PS_METHODS, "ps", name, fn, replace)


def register_worker_method(name: str, fn: Method, replace: bool = False) -> None:
    """Add a worker method: ``fn(state: WorkerState, meta, arrays) -> (meta, arrays)``."""
    _register(WORKER_METHODS, "worker", name, fn, replace)


def ps_methods() -> list[str]:
    return sorted(PS_METHODS) + [PING]


def worker_methods() -> list[str]:
    return sorted(WORKER_METHODS) + [PING]
