"""The protocol between tasks: every service and method name, and the metadata each request and answer carries.

A call is ``(method, meta, arrays)``: ``meta`` is a JSON object, ``arrays`` the tensors of the wire frame
(:mod:`kubeps.runtime.rpc.wire`), in the order each method's docstring gives. Clients name methods with the constants
here, servers serve them under the same names (:mod:`kubeps.runtime.server.methods`), so a rename is one edit and a
typo is an ``AttributeError`` at import.

Every built-in method has one request and one answer declaration here, as ``TypedDict`` declarations, and that is
the one dialect of the protocol. A method's constant (``PS.PUSH``) is a :class:`Method`: its name, carrying both
declarations (:data:`PS_SPECS`, :data:`WORKER_SPECS` list them per service). Why this dialect:

- pure declarations cost nothing at run time and are the annotations of the handlers that serve a method, of the
  clients that build its request and of the answers clients read (a client's call of a :class:`Method` returns its
  answer declaration), so mypy checks every key read and written, at every use, on both sides (and a declaration
  nobody names would drift: ``tests/code_checks/test_protocol.py`` refuses one, and refuses a pydantic model that
  mirrors one);
- one runtime validator, from a well-kept library, at each edge: the server validates each request against its
  method's declaration once, where it dispatches, and the client each answer where it decodes it
  (:mod:`kubeps.runtime.rpc.validation`, pydantic's ``TypeAdapter``: strict types, no coercion, unknown keys
  refused, errors that name the field's path), so a handler receives a well-shaped value and checks only what the
  shape cannot say (tensor counts and shapes, names it holds, value ranges), and a caller reads declared keys of a
  well-shaped answer. Nobody writes a key check by hand, and no second model of the same message exists to drift
  from it.

Every declaration is closed: a key it does not list is refused. A method a user registers
(``register_ps_method``) has no declaration and receives the request as the decoded JSON object.

This module is pure declarations: no grpc, no numpy, no pydantic (``typing_extensions``' ``TypedDict`` is the one
pydantic reads on every Python this package supports).
"""

from __future__ import annotations

import json
from typing import Any, Generic, Literal, NamedTuple, TypeVar

from typing_extensions import NotRequired, TypedDict

__all__ = [
    "ANSWER_ID_KEY",
    "ANSWER_PARKED",
    "COLLECT",
    "COLLECT_SPEC",
    "ERROR_REASON_KEY",
    "LIMIT",
    "Method",
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
    "LeaseGrant",
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
    "SaveSince",
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
#: method-name prefix of the unary twin of every method: ``/kubeps.ParameterServer/Unary.Read``
UNARY_PREFIX = "Unary."


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
class SaveSince(TypedDict):
    """The save a delta is taken against: the ps's change record (``source``) and that save's ``generation``."""

    source: str
    generation: int


class SaveItem(TypedDict):
    """Save shard ``key`` as rows ``start..stop-1`` of logical variable ``name`` (of full shape ``shape``).

    With ``since`` (an incremental save) the ps records which save the rows are, and, where ``since`` names an
    earlier save of the same rows, writes only the rows changed since it (None: every row)."""

    key: str
    name: str
    start: int
    stop: int
    shape: list[int]
    since: NotRequired[SaveSince | None]


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
    saved: list[dict[str, object]]  #: per item: the manifest's ``SavedShard`` (variables) or ``DynamicShardEntry``


class RestoreShardsAnswer(TypedDict):
    restored: int  #: shards loaded


class RestoreDynamicAnswer(TypedDict):
    restored: list[int]  #: rows loaded per item


# -- the worker service ----------------------------------------------------------------------------------------------
class LeaseGrant(TypedDict):
    """Shards of an exactly-once dataset leased to a worker with a call (:mod:`kubeps.runtime.data.leases`)."""

    shards: list[list[int]]  #: ``[epoch, index, start, end]`` each (end -1: a file's end), in reading order
    final: bool  #: no more shards will come (the dataset's epochs are all leased)


class RunClosureRequest(TypedDict):
    closure_id: NotRequired[int]  #: the coordinator's id of the closure (logs)
    leases: NotRequired[dict[str, LeaseGrant]]  #: per exactly-once dataset (its resource id), shards to read


class RunClosuresRequest(TypedDict):
    closure_ids: list[int]  #: the coordinator's ids of the functions, in the order of their tensors (logs)
    leases: NotRequired[dict[str, LeaseGrant]]  #: as :class:`RunClosureRequest`'s


class CreateResourceRequest(TypedDict):
    resource_id: str
    closure_id: NotRequired[int]


#: ``ok`` (result), ``error`` (the function raised; non-retryable), ``resource_missing`` (a per-worker resource is
#: not there: the worker restarted), ``ps_unavailable`` (a parameter server could not be reached)
ClosureStatus = Literal["ok", "error", "resource_missing", "ps_unavailable", "needs_input"]


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
    #: ``ok``: per exactly-once dataset, ``[epoch, index, position, done]`` of the shards its consumer read, after
    #: the function (what the chief commits as trained)
    positions: dict[str, list[list[int]]]


class RunClosuresAnswer(TypedDict):
    """The functions of a ``RunClosures`` call run one after the other; the first whose answer is not ``ok`` is the
    last to run (the others are not run: the coordinator queues them again). ``answers[i]`` is the ``i``-th
    function's :class:`ClosureAnswer`, ``counts[i]`` how many of the call's result tensors are its own."""

    status: Literal["ok"]
    answers: list[ClosureAnswer]
    counts: list[int]
    in_pass: int  #: as :class:`ClosureAnswer`'s, after the last function that ran


# -- the methods -----------------------------------------------------------------------------------------------------
class MethodSpec(NamedTuple):
    """What a method's request and answer metadata are, and whether its request carries tensors (one that does
    not is refused, by the frame decoder, when it brings any)."""

    request: type
    answer: type
    tensors: bool


AnswerT = TypeVar("AnswerT", covariant=True)


class Method(str, Generic[AnswerT]):
    """A built-in method: its name -- a ``str``, so servers, the wire, logs and metrics use it as the name it is --
    carrying its declarations (:attr:`spec`). mypy reads the answer's type from it: the client of ``PS.PUSH``
    (:meth:`kubeps.runtime.rpc.transport.PSTransport.call`) gets a :class:`PushAnswer`, checked at every key it
    reads, and the client validates the answer against the same declaration at the edge
    (:mod:`kubeps.runtime.rpc.validation`). (The type names the answer only: a type holding ``Any``, as a request
    with an optimizer config does, would make mypy give up on the clients' overloads and type the answer ``Any``;
    an answer declaration holds ``object`` where it holds any JSON value, for that reason.)"""

    spec: MethodSpec

    def __new__(cls, name: str, request: type, answer: type[AnswerT], *, tensors: bool) -> Method[AnswerT]:
        method = super().__new__(cls, name)
        method.spec = MethodSpec(request, answer, tensors)
        return method

    def __getnewargs_ex__(self) -> tuple[tuple[str, type, type], dict[str, bool]]:
        # pickle and copy make a Method again with its declarations (str's own would pass the name alone)
        return (str(self), self.spec.request, self.spec.answer), {"tensors": self.spec.tensors}


#: answered by both services: the failure detector's heartbeat
PING = Method("Ping", EmptyRequest, PingAnswer, tensors=False)
#: reserved stream-stream method of both services: the request is a parked answer's id, the answer its chunks
COLLECT = Method("Collect", CollectRequest, EmptyAnswer, tensors=False)


class PS:
    """Methods of the parameter-server service. A method's comment gives the tensors (``arrays``) of its request,
    then, after ``->``, of its answer (no comment, no tensors); its metadata are its declarations."""

    CREATE_VARIABLES = Method("CreateVariables", NamesRequest, CreateVariablesAnswer, tensors=True)  #: one value per name ->
    READ = Method("Read", NamesRequest, EmptyAnswer, tensors=False)  #: -> one value per name
    #: one index array per name -> one row block per name
    READ_ROWS = Method("ReadRows", NamesRequest, EmptyAnswer, tensors=True)
    #: one index array per ``rows`` name -> values, then row blocks
    READ_MANY = Method("ReadMany", ReadManyRequest, EmptyAnswer, tensors=True)
    ASSIGN = Method("Assign", AssignRequest, EmptyAnswer, tensors=True)  #: one value per name ->
    PUSH = Method("Push", PushRequest, PushAnswer, tensors=True)  #: the updates' tensors ->
    #: a ``Push`` and then a ``ReadMany`` in one call: the tensors of both -> the read's
    PUSH_READ = Method("PushRead", PushReadRequest, PushAnswer, tensors=True)
    LIST_VARIABLES = Method("ListVariables", EmptyRequest, ListVariablesAnswer, tensors=False)
    #: answers the manifest's ``SavedShard`` per item
    SAVE_SHARDS = Method("SaveShards", SaveShardsRequest, SavedAnswer, tensors=False)
    RESTORE_SHARDS = Method("RestoreShards", RestoreShardsRequest, RestoreShardsAnswer, tensors=False)
    #: dynamic embedding tables (:mod:`kubeps.runtime.ps.dynamic`)
    CREATE_DYNAMIC = Method("CreateDynamic", CreateDynamicRequest, CreateVariablesAnswer, tensors=False)
    #: one index array per ``rows`` name + ``(keys, counts)`` per ``dynamic`` table -> values, then row blocks, then
    #: one row block per table (a ``ReadMany`` with table lookups)
    LOOKUP_DYNAMIC = Method("LookupDynamic", LookupDynamicRequest, EmptyAnswer, tensors=True)
    #: a ``Push`` and then a ``LookupDynamic`` in one call: the tensors of both -> the lookup's
    PUSH_LOOKUP_DYNAMIC = Method("PushLookupDynamic", PushLookupDynamicRequest, PushAnswer, tensors=True)
    DYNAMIC_INFO = Method("DynamicInfo", DynamicInfoRequest, DynamicInfoAnswer, tensors=False)
    #: -> keys, values, freqs, steps, then one array per slot
    EXPORT_DYNAMIC = Method("ExportDynamic", TableNameRequest, ExportDynamicAnswer, tensors=False)
    #: checkpoints of dynamic tables: answers the manifest's ``DynamicShardEntry`` per item
    SAVE_DYNAMIC = Method("SaveDynamic", SaveDynamicRequest, SavedAnswer, tensors=False)
    RESTORE_DYNAMIC = Method("RestoreDynamic", RestoreDynamicRequest, RestoreDynamicAnswer, tensors=False)

    #: the methods that only read: a worker's closure context may batch them
    READS = frozenset({READ, READ_ROWS, READ_MANY})


class WORKER:
    """Methods of the worker service (comments as :class:`PS`'s)."""

    #: one uint8 tensor (the pickled function) -> the result tensors
    RUN_CLOSURE = Method("RunClosure", RunClosureRequest, ClosureAnswer, tensors=True)
    #: one uint8 tensor (the pickled creator) ->
    CREATE_RESOURCE = Method("CreateResource", CreateResourceRequest, ClosureAnswer, tensors=True)
    #: one uint8 tensor per function -> the result tensors of each function that ran, in order (the coordinator
    #: sends several queued functions in one call)
    RUN_CLOSURES = Method("RunClosures", RunClosuresRequest, RunClosuresAnswer, tensors=True)


def _table(*methods: Method[Any]) -> dict[str, MethodSpec]:
    return {method: method.spec for method in methods}


#: every method of the parameter-server service; the server serves exactly these (and the user's)
PS_SPECS: dict[str, MethodSpec] = _table(
    PING, PS.CREATE_VARIABLES, PS.READ, PS.READ_ROWS, PS.READ_MANY, PS.ASSIGN, PS.PUSH, PS.PUSH_READ,
    PS.LIST_VARIABLES, PS.SAVE_SHARDS, PS.RESTORE_SHARDS, PS.CREATE_DYNAMIC, PS.LOOKUP_DYNAMIC,
    PS.PUSH_LOOKUP_DYNAMIC, PS.DYNAMIC_INFO, PS.EXPORT_DYNAMIC, PS.SAVE_DYNAMIC, PS.RESTORE_DYNAMIC)
#: every method of the worker service
WORKER_SPECS: dict[str, MethodSpec] = _table(PING, WORKER.RUN_CLOSURE, WORKER.CREATE_RESOURCE, WORKER.RUN_CLOSURES)
#: ``Collect``, the reserved method of both services (its answer is the parked answer's chunks)
COLLECT_SPEC = COLLECT.spec


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
