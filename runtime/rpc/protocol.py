"""The protocol between tasks: every service and method name, and the metadata each request and answer carries.

A call is ``(method, meta, arrays)``: ``meta`` is a JSON object, ``arrays`` the tensors of the wire frame
(:mod:`kubeps.runtime.rpc.wire`), in the order each method's docstring gives. Clients name methods with the constants
here, servers serve them under the same names (:mod:`kubeps.runtime.server.methods`), so a rename is one edit and a
typo is an ``AttributeError`` at import.

Every built-in method has one request and one answer declaration here (:data:`PS_SPECS`, :data:`WORKER_SPECS`), as
``TypedDict`` declarations, and that is the one dialect of the protocol. Why this one:

- pure declarations cost nothing at run time and are the annotations of the handlers that serve a method and of
  the clients that build its request, so mypy checks every key read and written, at every use, on both sides (and
  a declaration nobody names would drift: ``tests/code_checks/test_protocol.py`` refuses one);
- one runtime validator, from a well-kept library, at the edge: the server validates each request against its
  method's declaration once, where it dispatches (:mod:`kubeps.runtime.rpc.validation`, pydantic's ``TypeAdapter``:
  strict types, no coercion, unknown keys refused, errors that name the field's path), so a handler receives a
  well-shaped value and checks only what the shape cannot say (tensor counts and shapes, names it holds, value
  ranges). Nobody writes a key check by hand, and no second model of the same message exists to drift from it.

Every declaration is closed: a key it does not list is refused. A method a user registers
(``register_ps_method``) has no declaration and receives the request as the decoded JSON object.

This module is pure declarations: no grpc, no numpy, no pydantic (``typing_extensions``' ``TypedDict`` is the one
pydantic reads on every Python this package supports).
"""

from __future__ import annotations

import json
from typing import Any, Literal, NamedTuple

from typing_extensions import NotRequired, TypedDict

__all__ = [
    "ANSWER_ID_KEY",
    "ANSWER_PARKED",
    "COLLECT",
    "COLLECT_SPEC",
    "ERROR_REASON_KEY",
    "LIMIT",
    "PING",
    "PS",
    "PS_SERVICE",
    "PS_SPECS",
    "TOO_MANY_CALLS",
    "UNARY_PREFIX",
    "UNKNOWN_VARIABLE",
    "WORKER",
    "WORKER_SERVICE",
    "WORKER_SPECS",
    "AssignRequest",
    "ClosureAnswer",
    "AssignOp",
    "ClosureStatus",
    "EvictPolicy",
    "TableDtype",
    "CollectRequest",
    "CreateDynamicRequest",
    "CreateResourceRequest",
    "CreateVariablesAnswer",
    "DynamicInfoAnswer",
    "DynamicInfoRequest",
    "DynamicLookup",
    "DynamicTableInfo",
    "EmptyAnswer",
    "EmptyRequest",
    "ExportDynamicAnswer",
    "InitializerSpec",
    "ListVariablesAnswer",
    "LookupDynamicRequest",
    "MethodSpec",
    "NamesRequest",
    "PingAnswer",
    "PushAnswer",
    "PushLookupDynamicRequest",
    "PushReadRequest",
    "PushRequest",
    "ReadManyRequest",
    "RestoreDynamicAnswer",
    "RestoreDynamicRequest",
    "RestoreItem",
    "RestoreShardsAnswer",
    "RestoreShardsRequest",
    "RestoreTableItem",
    "RunClosureRequest",
    "RunClosuresAnswer",
    "RunClosuresRequest",
    "SaveDynamicRequest",
    "SaveItem",
    "SaveShardsRequest",
    "SaveTableItem",
    "SavedAnswer",
    "TableConfigSpec",
    "TableNameRequest",
    "UpdateKind",
    "UpdateSpec",
    "VariableInfo",
    "legacy_slot_key",
    "optimizer_key",
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
    #: ``{}`` -> ``{"variables": [{name, shape, dtype, updates, rows_read, bytes_read, rows_pushed, bytes_pushed}]}``
    LIST_VARIABLES = "ListVariables"
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
    #: :class:`RunClosuresRequest` + one uint8 tensor per function -> :class:`RunClosuresAnswer` + the result tensors
    #: of each function that ran, in order (the coordinator sends several queued functions in one call)
    RUN_CLOSURES = "RunClosures"


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
class EmptyRequest(TypedDict):
    """A request that carries nothing in its metadata (``Ping``, ``ListVariables``)."""


class EmptyAnswer(TypedDict):
    """An answer that carries nothing in its metadata: the tensors say it all (``Read``, ``Assign``)."""


class CollectRequest(TypedDict):
    id: str  #: the parked answer's id, from the unary call's trailing metadata :data:`ANSWER_ID_KEY`


class NamesRequest(TypedDict):
    names: list[str]


class ReadManyRequest(TypedDict):
    names: list[str]  #: whole values, answered first
    rows: NotRequired[list[str]]  #: variables read by rows, one index array each, answered after the values


#: what an ``Assign`` does to a variable: set it to the value, or add the value to it
AssignOp = Literal["assign", "add"]


class AssignRequest(TypedDict):
    names: list[str]
    ops: NotRequired[list[AssignOp]]  #: one per name; default all ``assign``


#: dense: one tensor (the gradient); sparse: two (indices, values); dynamic: two (int64 keys, gradient rows), to a
#: dynamic embedding table
UpdateKind = Literal["dense", "sparse", "dynamic"]


class UpdateSpec(TypedDict):
    name: str
    kind: NotRequired[UpdateKind]  #: default ``dense``


class PushRequest(TypedDict):
    optimizer: dict[str, Any]  #: the optimizer's ``get_config()``
    updates: list[UpdateSpec]


class PushReadRequest(PushRequest):
    names: list[str]  #: required, as ``ReadMany``'s (``[]`` reads no whole value); without it the call is a ``Push``
    rows: NotRequired[list[str]]


class DynamicLookup(TypedDict):
    name: str
    train: bool  #: count the keys, admit and create rows (a training step); else read only


class LookupDynamicRequest(TypedDict):
    names: NotRequired[list[str]]  #: as :class:`ReadManyRequest`'s
    rows: NotRequired[list[str]]
    dynamic: NotRequired[list[DynamicLookup]]


class PushLookupDynamicRequest(PushReadRequest):
    dynamic: NotRequired[list[DynamicLookup]]


class PushAnswer(TypedDict):
    steps: list[int]  #: per variable update, in request order: the variable's update count after it
    #: per table update (``kind: dynamic``), in request order: the table's update count after it; absent without one
    dynamic_steps: NotRequired[list[int]]


class CreateVariablesAnswer(TypedDict):
    created: int
    incarnation: str


class VariableInfo(TypedDict):
    name: str
    shape: list[int]
    dtype: str
    updates: int
    #: the traffic the variable served since the ps started (the chief's hot-spot detection compares the ps by it):
    #: rows and bytes read, rows and bytes of gradients pushed
    rows_read: int
    bytes_read: int
    rows_pushed: int
    bytes_pushed: int


class ListVariablesAnswer(TypedDict):
    variables: list[VariableInfo]


class PingAnswer(TypedDict):
    incarnation: str  #: random per process start: a restarted task answers with a new one
    job: str
    task: int


class InitializerSpec(TypedDict):
    """A dynamic table's row initializer; which keys a kind takes is checked by the table
    (:class:`~kubeps.runtime.variables.dynamic_table.TableConfig`)."""

    kind: Literal["zeros", "constant", "uniform", "normal"]
    value: NotRequired[float]  #: constant
    minval: NotRequired[float]  #: uniform
    maxval: NotRequired[float]  #: uniform
    mean: NotRequired[float]  #: normal
    stddev: NotRequired[float]  #: normal
    seed: NotRequired[int]  #: uniform, normal


#: the dtypes of a dynamic table's rows; the orders in which its rows are evicted at capacity
TableDtype = Literal["float16", "float32", "float64"]
EvictPolicy = Literal["lru", "lfu"]


class TableConfigSpec(TypedDict):
    """What a dynamic table is (:class:`~kubeps.runtime.variables.dynamic_table.TableConfig` as JSON); the ranges
    (``dim >= 1``, ...) are the table's to check."""

    dim: int
    dtype: NotRequired[TableDtype]
    initializer: NotRequired[InitializerSpec]
    default_value: NotRequired[float]
    filter_freq: NotRequired[int]
    max_pending: NotRequired[int]
    bloom_counters: NotRequired[int]
    bloom_hashes: NotRequired[int]
    steps_to_live: NotRequired[int]
    capacity: NotRequired[int]
    evict_policy: NotRequired[EvictPolicy]
    sweep_every: NotRequired[int]


class CreateDynamicRequest(TypedDict):
    name: str
    config: TableConfigSpec


class DynamicInfoRequest(TypedDict):
    names: NotRequired[list[str]]  #: default: every table of the ps


class DynamicTableInfo(TypedDict):
    name: str
    size: int  #: live rows on this ps
    updates: int
    evicted: int  #: rows evicted so far
    nbytes: int  #: bytes the table holds on this ps (rows, slots, metadata, index, filter)
    capacity: int


class DynamicInfoAnswer(TypedDict):
    tables: list[DynamicTableInfo]


class TableNameRequest(TypedDict):
    name: str


class ExportDynamicAnswer(TypedDict):
    slots: list[list[str]]  #: ``[optimizer key, slot name]`` per slot array, in the order of the tensors
    updates: int


# -- checkpoints: the items a save or restore request carries; the manifest's own entries (``TensorEntry``,
# ``DynamicTableEntry``, ``SavedShard``) are the manifest format's (kubeps.runtime.checkpoint.format), which checks
# them where it reads them
class SaveItem(TypedDict):
    """Save shard ``key`` as rows ``start..stop-1`` of logical variable ``name`` (of full shape ``shape``)."""

    key: str
    name: str
    start: int
    stop: int
    shape: list[int]


class RestoreItem(TypedDict):
    """Load rows ``start..stop-1`` of the checkpointed ``value`` (and slots) into shard ``key``."""

    key: str
    name: str
    start: int
    stop: int
    value: dict[str, Any]  #: the manifest's ``TensorEntry``
    slots: NotRequired[dict[str, dict[str, dict[str, Any]]]]  #: ``{optimizer key: {slot: TensorEntry}}``


class SaveTableItem(TypedDict):
    """Save this ps's shard ``shard`` of table ``key`` (``name`` in the checkpoint)."""

    key: str
    name: str
    shard: int


class RestoreTableItem(TypedDict):
    """Load into this ps's table ``key`` -- shard ``shard`` of ``num_shards`` -- the keys of checkpointed ``table``
    (``name`` in the checkpoint) that hash to it."""

    key: str
    name: str
    shard: int
    num_shards: int
    table: dict[str, Any]  #: the manifest's ``DynamicTableEntry``


class SaveShardsRequest(TypedDict):
    directory: str
    items: list[SaveItem]


class RestoreShardsRequest(TypedDict):
    directory: str
    items: list[RestoreItem]


class SaveDynamicRequest(TypedDict):
    directory: str
    items: list[SaveTableItem]


class RestoreDynamicRequest(TypedDict):
    directory: str
    items: list[RestoreTableItem]


class SavedAnswer(TypedDict):
    saved: list[dict[str, Any]]  #: per item: the manifest's ``SavedShard`` (variables) or ``DynamicShardEntry``


class RestoreShardsAnswer(TypedDict):
    restored: int  #: shards loaded


class RestoreDynamicAnswer(TypedDict):
    restored: list[int]  #: rows loaded per item


# -- the worker service ----------------------------------------------------------------------------------------------
class RunClosureRequest(TypedDict):
    closure_id: NotRequired[int]  #: the coordinator's id of the closure (logs)


class RunClosuresRequest(TypedDict):
    closure_ids: list[int]  #: the coordinator's ids of the functions, in the order of their tensors (logs)


class CreateResourceRequest(TypedDict):
    resource_id: str
    closure_id: NotRequired[int]


#: ``ok`` (result), ``error`` (the function raised; non-retryable), ``resource_missing`` (a per-worker resource is
#: not there: the worker restarted), ``ps_unavailable`` (a parameter server could not be reached)
ClosureStatus = Literal["ok", "error", "resource_missing", "ps_unavailable"]


class ClosureAnswer(TypedDict, total=False):
    status: ClosureStatus
    pulls: int  #: ``ok``: how many reads the function's closure context sent
    in_pass: int  #: ``ok``: records the worker's iterators handed out in their passes under way, after the function
    reread: int  #: ``ok``, ``CreateResource`` of an iterator there already: those records of the iterator replaced
    type: str  #: ``error``: the exception's type name
    message: str
    traceback: str
    ps_index: int  #: ``ps_unavailable``: which ps
    restarted: bool  #: ``ps_unavailable``: the ps answered NOT_FOUND for a variable (it restarted empty)


class RunClosuresAnswer(TypedDict):
    """The functions of a ``RunClosures`` call run one after the other; the first whose answer is not ``ok`` is the
    last to run (the others are not run: the coordinator queues them again). ``answers[i]`` is the ``i``-th
    function's :class:`ClosureAnswer`, ``counts[i]`` how many of the call's result tensors are its own."""

    status: Literal["ok"]
    answers: list[ClosureAnswer]
    counts: list[int]
    in_pass: int  #: as :class:`ClosureAnswer`'s, after the last function that ran


# -- the method tables -----------------------------------------------------------------------------------------------
class MethodSpec(NamedTuple):
    """What a method's request and answer metadata are, and whether its request carries tensors (one that does
    not is refused, by the frame decoder, when it brings any)."""

    request: type
    answer: type
    tensors: bool


#: every method of the parameter-server service; the server serves exactly these (and the user's)
PS_SPECS: dict[str, MethodSpec] = {
    PING: MethodSpec(EmptyRequest, PingAnswer, tensors=False),
    PS.CREATE_VARIABLES: MethodSpec(NamesRequest, CreateVariablesAnswer, tensors=True),
    PS.READ: MethodSpec(NamesRequest, EmptyAnswer, tensors=False),
    PS.READ_ROWS: MethodSpec(NamesRequest, EmptyAnswer, tensors=True),
    PS.READ_MANY: MethodSpec(ReadManyRequest, EmptyAnswer, tensors=True),
    PS.ASSIGN: MethodSpec(AssignRequest, EmptyAnswer, tensors=True),
    PS.PUSH: MethodSpec(PushRequest, PushAnswer, tensors=True),
    PS.PUSH_READ: MethodSpec(PushReadRequest, PushAnswer, tensors=True),
    PS.LIST_VARIABLES: MethodSpec(EmptyRequest, ListVariablesAnswer, tensors=False),
    PS.SAVE_SHARDS: MethodSpec(SaveShardsRequest, SavedAnswer, tensors=False),
    PS.RESTORE_SHARDS: MethodSpec(RestoreShardsRequest, RestoreShardsAnswer, tensors=False),
    PS.CREATE_DYNAMIC: MethodSpec(CreateDynamicRequest, CreateVariablesAnswer, tensors=False),
    PS.LOOKUP_DYNAMIC: MethodSpec(LookupDynamicRequest, EmptyAnswer, tensors=True),
    PS.PUSH_LOOKUP_DYNAMIC: MethodSpec(PushLookupDynamicRequest, PushAnswer, tensors=True),
    PS.DYNAMIC_INFO: MethodSpec(DynamicInfoRequest, DynamicInfoAnswer, tensors=False),
    PS.EXPORT_DYNAMIC: MethodSpec(TableNameRequest, ExportDynamicAnswer, tensors=False),
    PS.SAVE_DYNAMIC: MethodSpec(SaveDynamicRequest, SavedAnswer, tensors=False),
    PS.RESTORE_DYNAMIC: MethodSpec(RestoreDynamicRequest, RestoreDynamicAnswer, tensors=False),
}
#: every method of the worker service
WORKER_SPECS: dict[str, MethodSpec] = {
    PING: MethodSpec(EmptyRequest, PingAnswer, tensors=False),
    WORKER.RUN_CLOSURE: MethodSpec(RunClosureRequest, ClosureAnswer, tensors=True),
    WORKER.CREATE_RESOURCE: MethodSpec(CreateResourceRequest, ClosureAnswer, tensors=True),
    WORKER.RUN_CLOSURES: MethodSpec(RunClosuresRequest, RunClosuresAnswer, tensors=True),
}
#: ``Collect``, the reserved method of both services (its answer is the parked answer's chunks)
COLLECT_SPEC = MethodSpec(CollectRequest, EmptyAnswer, tensors=False)


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
    """A slot key as older checkpoints wrote it (the optimizer's whole config as JSON) mapped to
    :func:`slot_key`; a current key is returned as it is."""
    if not key.startswith("{"):
        return key
    try:
        config = json.loads(key)
    except ValueError:
        raise ValueError(f"slot group key {key[:80]!r} is neither an optimizer class name nor an optimizer config "
                         f"(JSON)") from None
    return slot_key(config)
