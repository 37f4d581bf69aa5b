"""The protocol between tasks: every service and method name, and the metadata each request and answer carries.

A call is ``(method, meta, arrays)``: ``meta`` is a JSON object (the typed dicts below say which keys each method
reads and answers), ``arrays`` the tensors of the wire frame (:mod:`kubeps.runtime.rpc.wire`), in the order each
method's docstring gives. Clients name methods with the constants here, servers serve them under the same names
(:mod:`kubeps.runtime.server.methods`), so a rename is one edit and a typo is an ``AttributeError`` at import.

This module is pure data: no grpc, no numpy.
"""

from __future__ import annotations

import json
from typing import Any, Literal, TypedDict

__all__ = [
    "ANSWER_ID_KEY",
    "ANSWER_PARKED",
    "COLLECT",
    "ERROR_REASON_KEY",
    "LIMIT",
    "PING",
    "PS",
    "PS_SERVICE",
    "TOO_MANY_CALLS",
    "UNARY_PREFIX",
    "UNKNOWN_VARIABLE",
    "WORKER",
    "WORKER_SERVICE",
    "AssignRequest",
    "ClosureAnswer",
    "ClosureStatus",
    "CreateResourceRequest",
    "CreateVariablesAnswer",
    "DynamicLookup",
    "DynamicTableInfo",
    "LookupDynamicRequest",
    "NamesRequest",
    "PingAnswer",
    "PushAnswer",
    "PushLookupDynamicRequest",
    "PushReadRequest",
    "PushRequest",
    "ReadManyRequest",
    "RestoreShardsRequest",
    "SaveShardsRequest",
    "UpdateSpec",
    "optimizer_key",
    "legacy_slot_key",
    "slot_key",
]

#: the gRPC service of a parameter server; of a worker
PS_SERVICE = "kubeps.ParameterServer"
WORKER_SERVICE = "kubeps.Worker"

#: answered by both services: ``{}`` -> :class:`PingAnswer` (the failure detector's heartbeat)
PING = "Ping"
#: reserved stream-stream method of both services: the request is a parked answer's id, the answer its chunks
COLLECT = "Collect"
#: method-name prefix of the unary twin of every method: ``/kubeps.ParameterServer/Unary.Read``
UNARY_PREFIX = "Unary."


class PS:
    """Methods of the parameter-server service."""

    CREATE_VARIABLES = "CreateVariables"  #: :class:`NamesRequest` + one value per name -> :class:`CreateVariablesAnswer`
    READ = "Read"  #: :class:`NamesRequest` -> one value per name
    READ_ROWS = "ReadRows"  #: :class:`NamesRequest` + one index array per name -> one row block per name
    READ_MANY = "ReadMany"  #: :class:`ReadManyRequest` + one index array per ``rows`` name -> values, then row blocks
    ASSIGN = "Assign"  #: :class:`AssignRequest` + one value per name -> ``{}``
    PUSH = "Push"  #: :class:`PushRequest` + the updates' tensors -> :class:`PushAnswer`
    PUSH_READ = "PushRead"  #: :class:`PushReadRequest`: a ``Push`` and then a ``ReadMany`` in one call
    LIST_VARIABLES = "ListVariables"  #: ``{}`` -> ``{"variables": [{name, shape, dtype, updates}]}``
    SAVE_SHARDS = "SaveShards"  #: :class:`SaveShardsRequest` -> ``{"saved": [SavedShard]}``
    #: dynamic embedding tables (:mod:`kubeps.runtime.ps.dynamic`): ``{"name", "config"}`` -> :class:`CreateVariablesAnswer`
    CREATE_DYNAMIC = "CreateDynamic"
    #: :class:`LookupDynamicRequest` + one index array per ``rows`` name + ``(keys, counts)`` per ``dynamic`` table ->
    #: values, then row blocks, then one row block per table (a ``ReadMany`` with table lookups)
    LOOKUP_DYNAMIC = "LookupDynamic"
    #: :class:`PushLookupDynamicRequest`: a ``Push`` and then a ``LookupDynamic`` in one call
    PUSH_LOOKUP_DYNAMIC = "PushLookupDynamic"
    #: ``{"names"}`` -> ``{"tables": [DynamicTableInfo]}``
    DYNAMIC_INFO = "DynamicInfo"
    #: ``{"name"}`` -> ``{"slots": [[optimizer key, slot]]}`` + keys, values, freqs, steps, then one array per slot
    EXPORT_DYNAMIC = "ExportDynamic"
    RESTORE_SHARDS = "RestoreShards"  #: :class:`RestoreShardsRequest` -> ``{"restored": n}``
    #: checkpoints of dynamic tables: ``{"directory", "items": [SaveTableItem]}`` -> ``{"saved": [DynamicShardEntry]}``
    SAVE_DYNAMIC = "SaveDynamic"
    #: ``{"directory", "items": [RestoreTableItem]}`` -> ``{"restored": [rows loaded per item]}``
    RESTORE_DYNAMIC = "RestoreDynamic"

    #: the methods that only read: a worker's closure context may batch them
    READS = frozenset({READ, READ_ROWS, READ_MANY})


class WORKER:
    """Methods of the worker service."""

    RUN_CLOSURE = "RunClosure"  #: one uint8 tensor (the pickled function) -> :class:`ClosureAnswer` + result tensors
    CREATE_RESOURCE = "CreateResource"  #: :class:`CreateResourceRequest` + the pickled creator -> :class:`ClosureAnswer`


# -- errors ----------------------------------------------------------------------------------------------------------
#: trailing-metadata key a server sets to say why a call failed, beyond the status code; a client's
#: :class:`~kubeps.runtime.errors.RemoteError` carries it as ``.reason``
ERROR_REASON_KEY = "x-kubeps-error"
#: ``reason`` of a NOT_FOUND for a variable the parameter server does not hold (it restarted and lost it)
UNKNOWN_VARIABLE = "unknown-variable"
#: ``reason`` of the RESOURCE_EXHAUSTED a unary call gets when its answer is bigger than one chunk: the server ran
#: the method once and parked the answer under the id in :data:`ANSWER_ID_KEY`; the client streams it with
#: :data:`COLLECT` (so a non-idempotent method such as ``Push`` never runs twice)
ANSWER_PARKED = "answer-parked"
ANSWER_ID_KEY = "x-kubeps-answer-id"
#: ``reason`` of the RESOURCE_EXHAUSTED a call gets when its client already has as many calls in the server as one
#: client may: the method never ran, so kubeps clients retry it (until the call's deadline)
TOO_MANY_CALLS = "too-many-calls"
#: ``reason`` of the RESOURCE_EXHAUSTED for a request over one of the server's limits (answer size, slot sets):
#: not retried; the message names the field, the value and the setting
LIMIT = "limit"


# -- request and answer metadata -------------------------------------------------------------------------------------
class NamesRequest(TypedDict):
    names: list[str]


class ReadManyRequest(TypedDict, total=False):
    names: list[str]  #: whole values, answered first
    rows: list[str]  #: variables read by rows, one index array each, answered after the values


class AssignRequest(TypedDict, total=False):
    names: list[str]
    ops: list[Literal["assign", "add"]]  #: one per name; default all ``assign``


class UpdateSpec(TypedDict, total=False):
    name: str
    #: dense: one tensor (the gradient); sparse: two (indices, values); dynamic: two (int64 keys, gradient rows), to
    #: a dynamic embedding table
    kind: Literal["dense", "sparse", "dynamic"]


class PushRequest(TypedDict):
    optimizer: dict[str, Any]  #: the optimizer's ``get_config()``
    updates: list[UpdateSpec]


class PushReadRequest(PushRequest, ReadManyRequest):
    pass


class DynamicLookup(TypedDict):
    name: str
    train: bool  #: count the keys, admit and create rows (a training step); else read only


class LookupDynamicRequest(ReadManyRequest, total=False):
    dynamic: list[DynamicLookup]


class PushLookupDynamicRequest(PushRequest, LookupDynamicRequest):
    pass


class DynamicTableInfo(TypedDict):
    name: str
    size: int  #: live rows on this ps
    updates: int
    evicted: int  #: rows evicted so far
    nbytes: int  #: bytes the table holds on this ps (rows, slots, metadata, index, filter)
    capacity: int


class PushAnswer(TypedDict):
    steps: int


class CreateVariablesAnswer(TypedDict):
    created: int
    incarnation: str


class PingAnswer(TypedDict, total=False):
    incarnation: str  #: random per process start: a restarted task answers with a new one
    job: str
    task: int


class SaveShardsRequest(TypedDict):
    directory: str
    items: list[dict[str, Any]]  #: :class:`~kubeps.runtime.checkpoint.shards.SaveItem` as JSON


class RestoreShardsRequest(TypedDict):
    directory: str
    items: list[dict[str, Any]]  #: :class:`~kubeps.runtime.checkpoint.shards.RestoreItem` as JSON


class CreateResourceRequest(TypedDict):
    resource_id: str


#: ``ok`` (result), ``error`` (the function raised; non-retryable), ``resource_missing`` (a per-worker resource is
#: not there: the worker restarted), ``ps_unavailable`` (a parameter server could not be reached)
ClosureStatus = Literal["ok", "error", "resource_missing", "ps_unavailable"]


class ClosureAnswer(TypedDict, total=False):
    status: ClosureStatus
    pulls: int  #: ``ok``: how many reads the function's closure context sent
    type: str  #: ``error``: the exception's type name
    message: str
    traceback: str
    ps_index: int  #: ``ps_unavailable``: which ps
    restarted: bool  #: ``ps_unavailable``: the ps answered NOT_FOUND for a variable (it restarted empty)


def optimizer_key(config: dict[str, Any]) -> str:
    """The identity of one optimizer configuration, as canonical JSON: a ps keeps one optimizer object per key (its
    learning rate, schedule and other hyperparameters). Slots are *not* keyed by this: see :func:`slot_key`."""
    return json.dumps(config, sort_keys=True, separators=(",", ":"))


def slot_key(config: dict[str, Any]) -> str:
    """The key a variable's slots are kept under, on a ps, in a local variable and in checkpoints: the optimizer's
    class name (``"Adagrad"``), as TensorFlow keys a slot by its optimizer and slot name. So a learning-rate or
    other hyperparameter change keeps the slots (an Adagrad accumulator survives a resume with another rate), and a
    different optimizer (Ftrl after Adagrad) gets slots of its own."""
    name = config.get("class_name") if isinstance(config, dict) else None
    if not isinstance(name, str) or not name:
        raise ValueError(f"optimizer config field 'class_name' has invalid value {name!r}: must be the optimizer's "
                         f"class name, as in {{'class_name': 'Adagrad', 'config': {{...}}}}")
    return name


def legacy_slot_key(key: str) -> str:
    """A slot key as checkpoints before issue 23 wrote it (the optimizer's whole config as JSON) mapped to
    :func:`slot_key`; a current key is returned as it is."""
    if not key.startswith("{"):
        return key
    try:
        config = json.loads(key)
    except ValueError:
        raise ValueError(f"slot group key {key[:80]!r} is neither an optimizer class name nor an optimizer config "
                         f"(JSON)") from None
    return slot_key(config)
