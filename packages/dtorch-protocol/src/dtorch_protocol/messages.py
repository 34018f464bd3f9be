"""Every message DTorch sends, in one place: the single source of truth for the wire.

Messages are msgspec Structs encoded as msgpack maps. `dtorch_protocol.wire.decode`
validates each one on receipt against these types, so a malformed message is
refused with the field path that was wrong. Nothing here imports torch.

Naming: client -> controller messages are instructions (`Instr*`), controller ->
worker messages are commands (`Cmd*`). Tensor ids (`tid`) are chosen by the
client and unique within its session; a shard on a worker is keyed by
`(session, tid, device)` where `device` is the logical device id.

Op arguments (`args`, `kwargs`) are plain msgpack values in which a few map forms
stand for torch values (see `dtorch_protocol.values`): `{"$t": tid}` a DTensor's
local shard (the *tensor slot*: build, read and walk it only with `tensor_slot`,
`slot_tid` and `tensor_refs` below), `{"$dtype": "float32"}`, `{"$device": "cpu"}`,
`{"$layout": ...}`, `{"$mf": ...}` (memory format), `{"$lit": [dtype, shape, bytes]}`
a small plain tensor, `{"$c": [re, im]}` a complex number.

Meanings that code acts on travel as typed fields, never inside a message text: an
error's kind is an `ErrorKind` (`ErrorReport.kind`, `Chunk.kind`, and
`wire.RemoteError.kind` for a refused call); the text is for people.
"""

from __future__ import annotations

import enum
from typing import Annotated, Any, Literal

import msgspec
from msgspec import Meta, Struct

PROTOCOL_VERSION = "1.14"  # 1.1: CmdExpectReads, PullRequest.expected; 1.2: KeepAlive, scheduling fields;
# 1.3: Execute.memory_cap (workers enforce packed sessions' memory caps), CmdFetchShards.move and
# ShardsRequest.move (a frozen session's devices are pulled by their new worker); 1.4: error kinds
# (ErrorReport.kind, Chunk.kind, the kind of a refused call in its trailing metadata); 1.5: redistributions on
# collectives (CmdGroup, CmdCollective, RegisterWorker.rendezvous and .device_id,
# WorkerReport/WorkerStatus.received_bytes); API keys and capabilities (RegisterWorker.secret/.client_address,
# WorkerReport.proof, `caps` next to every location, Execute.caps for peers), anonymous counts in StatusReply,
# bounds on strings, lists and timeouts; OpenSession.expected_steps (a scheduling hint); 1.6: CmdGroup.key (a
# group's secret: the rendezvous store's keys are under it), captured programs (InstrDefine, InstrReplay:
# `dtorch.compile`; CmdProgram, CmdReplay: a program's commands kept on the workers); 1.7: Sync.instrs (a sync
# point's last batch rides in its Sync: one call instead of a Submit and a Sync);
# commands shared by every worker of a mesh (CmdMesh, CmdRun.mesh, CmdDelete.mesh; `dtorch_protocol.shared`);
# 1.8: same-host segments for client payloads (PutChunk.segment, PullRequest.segment, Chunk.in_segment,
# ShardsChunk.segment, ShardsRequest.segment, ErrorKind.NO_SEGMENT; `dtorch_protocol.segments`); InstrCall.writes and
# CmdKeepCopies (a snapshot keeps the copies of tensors unchanged since the last one instead of copying them again);
# InstrRead, CmdReadable and PullRequest.after (a sync point's read goes out with its Sync, not after its answer);
# 1.9: a capped session's capabilities carry its memory cap (`auth`, cap2), MeshPlaced.memory_cap and
# SyncReply.memory_cap; GroupOp.ranks, and GroupOp's layout and lengths in short forms (O(1) per rank, not
# O(ranks), where they are regular); 1.10: InstrCall.default_dtype and CmdRun.default_dtype (an op runs under the
# client's `torch.set_default_dtype`); 1.11: CmdFence (a lost worker is fenced by the workers that shared a session
# with it, whether or not the session is rebuilt), ErrorReport.peer (where a failed copy went), CmdFetchShards.rename
# (a replicated upload's device restored from a replica's copy); 1.12: SyncReply.reput and
# SubmitReply.reput (a rebuild asks the client to Put again the uploads whose bytes were only on the lost worker);
# 1.13: KeepAliveReply (a keep-alive hears those requests too: a client silent between sync points is asked),
# SubmitReply.safe and KeepAliveReply.safe (uploads whose copies are complete: the client lets them go before its
# next sync point), SyncReply.keep (those asked for again: kept past the Sync until a snapshot covers them),
# SessionOpened.recovery (False: no rebuild asks for uploads again, the client keeps none); 1.14: SyncReply.frozen and
# SyncReply.queue_position (a sync point of a preempted session waits for devices, not for workers: the client
# bounds that wait as it bounds the queue's, and says where it stands)


class ErrorKind(str, enum.Enum):
    """What went wrong, as code reacts to it. One owner: every package reads and writes these, never text."""

    OP = "op"  # an op (any command with outputs) failed on a worker: its outputs are poisoned
    REFUSED = "refused"  # the controller could not route an instruction (unknown tensor, bad placements, ...)
    MEMORY_CAP = "memory_cap"  # the session went over its memory cap on a worker
    COPY = "copy"  # a copy of shards between workers failed (snapshot, upload backup, move): internal, never shown
    WORKER_LOST = "worker_lost"  # a worker was lost with the session's data (or unfinished commands)
    MOVED = "moved"  # the logical device left this worker (migration, drain, relocation): ask the controller
    MISSING = "missing"  # no such shard here, even after waiting
    POISONED = "poisoned"  # the shard was poisoned by an earlier failure (its report rides along)
    NO_SEGMENT = "no_segment"  # a Put named a shared-memory segment this worker cannot open: stream the bytes
    STALE_COPY = "stale_copy"  # copies a snapshot would keep no longer match their tensors (memory they share was
    # written, or is shared with a tensor the snapshot copies): internal, never shown; copy everything from then on


# Bounds checked on receipt (msgspec refuses a message outside them, naming the field): what a peer may send.
MAX_TIMEOUT_S = 3600.0  # any timeout in a request: finite, >= 0 and at most an hour (NaN and inf are refused)
MAX_SUBMIT_INSTRS = 4096  # instructions per Submit (the client batches at most this many)
MAX_NAME = 128  # session names: they show up in every Status and event line
MAX_DIMS = 64  # tensor and mesh dimensions
Timeout = Annotated[float, Meta(ge=0.0, le=MAX_TIMEOUT_S)]
Name = Annotated[str, Meta(max_length=MAX_NAME)]
Ident = Annotated[str, Meta(max_length=256)]  # ids, addresses, versions, dtype names, capabilities, labels
Dims = Annotated[list[int], Meta(max_length=MAX_DIMS)]


class Hello(Struct, frozen=True):
    """Opens every connection: refused when the protocol major differs."""

    protocol_version: Annotated[str, Meta(max_length=32)]
    package_version: Annotated[str, Meta(max_length=64)]
    role: Annotated[str, Meta(max_length=16)]  # "client" | "worker"


class ErrorReport(Struct, frozen=True):
    """An op that failed on a worker (or a refused instruction), as the user will see it."""

    op: str
    src: str  # the user's source line, "file.py:12"
    message: str
    tid: int = -1  # an output of the failed op, when known
    seq: int = 0  # the reporting worker's Execute seq of the failed command (0: not from a worker batch)
    kind: ErrorKind = ErrorKind.OP
    peer: str = ""  # a failed copy to another worker (kind COPY): that worker's address (1.11)


# ---------------------------------------------------------------- the tensor slot in op arguments

TENSOR_SLOT = "$t"  # `{"$t": tid}` in op arguments: the local shard of tensor `tid`


def tensor_slot(tid: int) -> dict[str, int]:
    """The op-argument form of tensor `tid`."""
    return {TENSOR_SLOT: tid}


def slot_tid(value: Any) -> Any:
    """The tensor id in a tensor slot (as sent: validate it before use), or None when `value` is not one."""
    if type(value) is dict and len(value) == 1 and TENSOR_SLOT in value:
        return value[TENSOR_SLOT]
    return None


def tensor_refs(value: Any) -> list[Any]:
    """The tensor ids of every tensor slot in op arguments, however deeply nested (as sent: validate them)."""
    out: list[Any] = []
    _tensor_refs(value, out)
    return out


def _tensor_refs(value: Any, out: list[Any]) -> None:  # a list, not a generator: the controller's hot path
    # exact types, not isinstance (a tenth of this path): what msgpack decodes, and what clients build
    t = type(value)
    if t is dict:
        if len(value) == 1 and TENSOR_SLOT in value:
            out.append(value[TENSOR_SLOT])
            return
        value = value.values()
    elif t is not list and t is not tuple:
        return
    for v in value:  # a slot inline and an empty container skipped: most arguments are one or the other
        t = type(v)
        if t is dict:
            if len(v) == 1 and TENSOR_SLOT in v:
                out.append(v[TENSOR_SLOT])
            elif v:
                _tensor_refs(v, out)
        elif (t is list or t is tuple) and v:
            _tensor_refs(v, out)


# ---------------------------------------------------------------- tensors and meshes


class TensorSpec(Struct, frozen=True, gc=False):
    """Global metadata of a distributed tensor."""

    shape: list[int]
    dtype: str  # torch dtype name without "torch.", e.g. "float32"
    mesh: int  # mesh id, defined by OpenMesh
    placements: list[str]  # Placement.to_wire(), one per mesh dim


class OutSpec(Struct, frozen=True, gc=False):
    tid: int
    spec: TensorSpec


# ---------------------------------------------------------------- client -> controller


class OpenSession(Struct, frozen=True):
    hello: Hello
    name: Name = ""
    priority: Ident = "normal"  # "high" | "normal" | "low"
    kind: Ident = "batch"  # "batch" | "realtime"
    memory_cap: Annotated[int, Meta(ge=0)] = 0  # bytes each device may hold (0: whole devices; > 0: may share one)
    expected_steps: Annotated[int, Meta(ge=0)] = 0  # sync points the program expects to reach (0: unknown): a hint


class SessionOpened(Struct, frozen=True):
    session: str  # unguessable id; naming it is the right to its tensors
    controller_version: str
    keepalive_s: float = 0.0  # send KeepAlive this often (0: not needed); a silent session is closed
    recovery: bool = True  # sessions are rebuilt after a worker loss: keep uploads until they are safe (1.13)


class KeepAlive(Struct, frozen=True):
    """The client is still there: a session silent for the controller's session timeout is closed."""

    session: Ident


class KeepAliveReply(Struct, frozen=True):
    ok: bool = True  # False: the controller does not know the session (closed, timed out, another tenant's)
    message: str = ""
    reput: dict[int, list[int]] = {}  # as SyncReply.reput, when the session had no Submit or Sync to tell it (1.13)
    safe: list[int] = []  # as SubmitReply.safe (1.13)


class OpenMesh(Struct, frozen=True):
    """Ask for a mesh's logical devices to be placed on workers (all-or-nothing)."""

    session: Ident
    mesh: int
    devices: Annotated[list[int], Meta(max_length=1 << 16)]  # logical ids, row-major
    shape: Dims
    min_devices: int = 0  # elastic range (0: exactly len(set(devices)))


class MeshPlaced(Struct, frozen=True):
    mesh: int
    placed: bool
    queue_position: int = 0  # when not placed yet
    locations: dict[int, str] = {}  # logical device -> worker address
    message: str = ""
    caps: dict[str, str] = {}  # worker address -> this session's client capability there (auth.py)
    device_types: dict[int, str] = {}  # logical device -> its worker's device type, e.g. "cuda" (1.8)
    memory_cap: int = 0  # bytes per device the session's leases carry (0: whole devices); its `caps` carry it (1.9)


class InstrCreate(Struct, frozen=True, gc=False, tag="create"):
    """A factory: rand, randn, zeros, ones, full, empty, arange."""

    tid: int
    spec: TensorSpec
    init: str
    value: float | int | bool | None = None  # fill value for "full"
    arange: list[float | int] | None = None  # start, end, step
    seed: int = 0  # random factories: values depend on the seed only, never on the layout
    src: str = ""


class InstrAdopt(Struct, frozen=True, tag="adopt"):
    """Shards the client already uploaded with Worker.Put (distribute_tensor)."""

    tid: int
    spec: TensorSpec


DefaultDtype = Literal["", "float64", "float16", "bfloat16"]  # what `torch.set_default_dtype` takes besides float32


class InstrCall(Struct, frozen=True, gc=False, tag="call"):
    """Run one aten op on every device of `mesh`, on local shards."""

    op: str  # aten overload name, "aten.add.Tensor"
    mesh: int
    args: list[Any]
    kwargs: dict[str, Any]
    outs: list[OutSpec | None]  # flattened tensor outputs; None: output ignored
    local: dict[int, list[Any]] | None = None  # device -> [args, kwargs] where they differ per device
    src: str = ""
    seed: int | None = None  # random ops: every device runs the op under this seed (inputs are replicated)
    writes: list[int] = []  # tensors (ids among the arguments) the op writes in place besides its `outs`
    # (`_foreach_add_`'s lists, batch norm's running statistics): a snapshot copies them again
    default_dtype: DefaultDtype = ""  # the client's `torch.get_default_dtype()`, "" for float32: the op runs under
    # it (what `x / 3` or `x.sqrt()` of an integer x gives)


class InstrRedistribute(Struct, frozen=True, tag="redistribute"):
    """Make `dst` hold `src`'s value laid out as `dst_spec` (maybe on another mesh)."""

    src: int
    dst: int
    src_spec: TensorSpec
    dst_spec: TensorSpec
    src_line: str = ""


class InstrDelete(Struct, frozen=True, gc=False, tag="delete"):
    tids: list[int]


class InstrRead(Struct, frozen=True, tag="read"):
    """The client reads `tid` once the instructions before this one ran: its pulls name `mark` (`PullRequest.after`)
    and go out with the Sync instead of after its answer. A hint: an unknown tensor is no error (nothing is sent)."""

    tid: int
    mark: int  # the session's read marks only grow


StepInstr = InstrCreate | InstrCall | InstrRedistribute | InstrDelete  # what a captured program holds


class InstrDefine(Struct, frozen=True, tag="define"):
    """Keep `instrs` as program `program` of this session: a captured step (`dtorch.compile`), replayed later.

    Its tensor ids are *slots*: tid n stands for `tids[n]` of each `InstrReplay`; the seed of a random op or
    factory is an index into the replay's `seeds` (`dtorch_protocol.programs` fills and checks them).
    """

    program: int
    instrs: list[StepInstr]
    ntids: int  # every replay names this many tensor ids
    nseeds: int = 0  # and this many seeds
    nscalars: int = 0  # and this many numbers for the `{"$s": k}` holes in op arguments


class InstrReplay(Struct, frozen=True, tag="replay"):
    """Run program `program` again with these tensor ids, seeds and numbers (the only per-step data)."""

    program: int
    tids: list[int]
    seeds: list[int] = []
    scalars: list[float] = []


Instr = (InstrCreate | InstrAdopt | InstrCall | InstrRedistribute | InstrDelete | InstrDefine | InstrReplay
         | InstrRead)


class Submit(Struct, frozen=True):
    session: Ident
    seq: int  # batches are numbered from 1 and applied in order
    instrs: Annotated[list[Instr], Meta(max_length=MAX_SUBMIT_INSTRS)]


class SubmitReply(Struct, frozen=True):
    accepted: int  # highest batch seq applied
    reput: dict[int, list[int]] = {}  # as SyncReply.reput: told to the session's first Submit or Sync after it (1.12)
    # uploads (tensor ids) whose copies for recovery are complete, or, for one a rebuild asked for again, that a
    # snapshot holds: the client need not keep them any longer (1.13)
    safe: list[int] = []


class Sync(Struct, frozen=True):
    """Wait until every worker of the session has executed batches up to `upto`. Non-empty `instrs` are batch `upto`
    itself, not submitted before: accepted first, exactly as `Submit(session, upto, instrs)` would be (1.7)."""

    session: Ident
    upto: int
    timeout_s: Timeout = 60.0
    instrs: Annotated[list[Instr], Meta(max_length=MAX_SUBMIT_INSTRS)] = []


class SyncReply(Struct, frozen=True):
    done: bool
    errors: list[ErrorReport] = []
    locations: dict[int, str] = {}  # logical device -> worker address, for fetches
    message: str = ""
    caps: dict[str, str] = {}  # worker address -> this session's client capability there
    memory_cap: int = 0  # as MeshPlaced.memory_cap (1.9)
    # tensor id -> logical devices whose shard of that upload only the lost worker had: Put it again, then Sync (1.12)
    reput: dict[int, list[int]] = {}
    keep: list[int] = []  # done: uploads asked for again that no snapshot covers yet: keep them until `safe` (1.13)
    # not done because the session is frozen (preempted) with batches held: it waits for devices, at this position
    # in the queue to resume (0: for its own devices to free up) (1.14)
    frozen: bool = False
    queue_position: int = 0


class CloseSession(Struct, frozen=True):
    session: Ident


class StatusRequest(Struct, frozen=True):
    pass


class WorkerStatus(Struct, frozen=True):
    worker: str
    address: str
    state: str
    device_type: str
    memory_bytes: int
    labels: dict[str, str]
    tensors: int  # live shards
    bytes: int  # bytes held by live shards
    devices: list[str] = []  # "session:logical" bound here
    utilization: float = -1.0  # fraction of the last report interval spent executing (-1: not reported)
    backup_bytes: int = 0  # host memory held by copies for recovery (snapshots, uploads), not in `bytes`
    node: str = ""
    received_bytes: int = 0  # tensor bytes received from peer workers so far (pieces and collectives)
    leases: dict[str, int] = {}  # session -> memory cap leased here (0: the whole device)


class SessionStatus(Struct, frozen=True):
    session: str
    name: str
    priority: str
    state: str
    devices: dict[int, str]  # logical device -> worker id
    tensors: int
    queue_position: int = 0
    snapshot_batch: int = -1  # client batch of the last complete snapshot (-1: none, a loss is not recoverable)
    replay_batches: int = 0  # batches a recovery would replay on top of it
    snapshot_bytes: int = 0  # bytes of its copies (each copy held twice: on the worker and on another)
    snapshot_copied_bytes: int = 0  # of them, those copied when it was taken (the rest were kept unchanged)
    recoveries: int = 0  # worker losses this session recovered from
    migrations: int = 0  # logical-device moves (migrate, drain)
    kind: str = ""
    schedule: str = ""  # idle | waiting | running | frozen
    memory_cap: int = 0
    attained_s: float = 0.0  # device-seconds of service so far
    tenant: str = ""
    caps: dict[str, str] = {}  # the caller's own sessions: worker address -> client capability there
    batches: int = 0  # Submit batches accepted so far (`dtorch-controller top` shows their rate)


class StatusReply(Struct, frozen=True):
    """An admin sees everything; a tenant its own sessions, the workers they use and the events about them,
    and everyone else's work only as the anonymous counts below."""

    workers: list[WorkerStatus]
    sessions: list[SessionStatus]
    events: list[str]
    policy: str = ""
    queued: int = 0  # sessions waiting or frozen
    other_sessions: int = 0  # tenants: other tenants' open sessions
    other_devices: int = 0  # tenants: logical devices other tenants' sessions hold
    other_workers: int = 0  # tenants: workers not used by the caller's sessions


# ---------------------------------------------------------------- worker <-> controller


class RegisterWorker(Struct, frozen=True):
    hello: Hello
    address: Ident  # where the controller and peers reach this worker's gRPC server (its mutual-TLS port)
    device_type: Ident
    memory_bytes: Annotated[int, Meta(ge=0)]
    labels: Annotated[dict[Ident, Ident], Meta(max_length=32)] = {}
    secret: Ident = ""  # the worker's own secret (auth.WorkerAuth): the controller derives its credentials from it
    client_address: Ident = ""  # where clients reach it ("" = `address`; differs under TLS)
    rendezvous: Ident = ""  # host:port of this worker's TCPStore for process groups ("": it joins no collectives)
    device_id: Ident = ""  # the physical device ("host/GPU-uuid"; "" for CPUs): workers sharing one join no group


class Registered(Struct, frozen=True):
    worker: str
    heartbeat_interval_s: float


Stat = Annotated[int, Meta(ge=0, le=2**46)]  # counts and bytes a worker reports: 64 TiB at most, so that sums over
# MAX_REPORTED sessions stay below 2**62 (a Status with a sum past 2**64 could not be encoded at all)
MAX_REPORTED = 65536  # sessions (and namespaces) one report may name


class ShardStats(Struct, frozen=True):
    tensors: Stat
    bytes: Stat
    moved_bytes: Stat = 0  # tensor bytes moved for the session here so far: in from peers and clients, out to clients


class WorkerReport(Struct, frozen=True):
    """Heartbeat and completion report in one: sent periodically and whenever a batch finishes."""

    worker: Ident
    completed: int  # highest Execute seq finished
    errors: Annotated[dict[str, list[ErrorReport]], Meta(max_length=MAX_REPORTED)] = {}  # session -> new failures
    sessions: Annotated[dict[str, ShardStats], Meta(max_length=MAX_REPORTED)] = {}  # live shards per session
    utilization: float = -1.0  # fraction of the time since the last report spent executing (-1: unknown)
    received_bytes: Annotated[int, Meta(ge=0)] = 0  # tensor bytes received from peers since it started
    proof: Ident = ""  # auth.report_proof(secret): only the process that registered can report for the worker


class ReportReply(Struct, frozen=True):
    ok: bool
    message: str = ""  # e.g. "fenced": the worker was declared lost and must re-register


# ---------------------------------------------------------------- controller -> worker


class CmdCreate(Struct, frozen=True, gc=False, tag="create"):
    tid: int
    dtype: str
    shape: list[int]  # global shape
    init: str
    boxes: dict[int, list[list[int]]]  # device -> [[start, length], ...] of its shard
    zero: list[int] = []  # devices that hold zeros (Partial("sum") away from coordinate 0)
    value: float | int | bool | None = None
    arange: list[float | int] | None = None
    seed: int = 0
    src: str = ""


class CmdRun(Struct, frozen=True, gc=False, tag="run"):
    op: str
    devices: list[int]  # empty in a shared command (`mesh` >= 0): this worker's devices of that mesh
    args: list[Any]
    kwargs: dict[str, Any]
    outs: list[int | None]
    local: dict[int, list[Any]] | None = None
    src: str = ""
    seed: int | None = None  # run under torch.manual_seed(seed), restoring the RNG state after
    mesh: int = -1  # >= 0: one command for every worker of this mesh, run on the devices its CmdMesh names (1.7)
    default_dtype: DefaultDtype = ""  # InstrCall.default_dtype (1.10)


class CmdMesh(Struct, frozen=True, gc=False, tag="mesh"):
    """This worker's logical devices of mesh `mesh` of the session, for the shared commands naming that mesh
    (`CmdRun.mesh`, `CmdDelete.mesh`) after it in the same batch (`dtorch_protocol.shared`; 1.7)."""

    mesh: int
    devices: list[int]


class Piece(Struct, frozen=True, array_like=True):
    """Copy `size` elements at `src_offset` of device `device`'s shard into `dst_offset` of the new shard."""

    address: str  # worker holding the source shard ("" for this worker)
    device: int
    src_offset: list[int]
    dst_offset: list[int]
    size: list[int]


class ShardPlan(Struct, frozen=True):
    """How one device builds its new shard: reduce(`reduce`) over groups of pieces that tile it."""

    shape: list[int]
    groups: list[list[Piece]]  # empty: the shard is zeros
    reduce: str = "sum"  # combines groups: "sum" | "avg" | "max" | "min"


class CmdReadable(Struct, frozen=True, tag="readable"):
    """The client's reads of this session up to `mark` may be served (`PullRequest.after`): every command before this
    one in the stream ran. Sent for an InstrRead to each worker of the read tensor's mesh."""

    mark: int


class CmdRedistribute(Struct, frozen=True, tag="redistribute"):
    src: int
    dst: int
    dtype: str
    plans: dict[int, ShardPlan]  # destination device -> plan
    src_line: str = ""


class CmdExpectReads(Struct, frozen=True, tag="expect_reads"):
    """Peers will pull pieces of `tid` (for a redistribution at this point of the stream): hold in-place writes.

    Sent to each source worker in the same batch as the CmdRedistribute that makes other workers read its
    shards. Until that many `PullRequest(expected=True)` for a device's shard are served, the worker holds
    any command that writes the shard's storage in place (bounded wait).
    """

    tid: int
    reads: dict[int, int]  # source logical device -> remote pulls planned of its shard
    dst: int = -1  # the redistribution's new tensor: peers' pulls for it are served only once this ran



class CmdGroup(Struct, frozen=True, tag="group"):
    """Join communication group `group` of this batch's session as `rank` (sent before its first op).

    The worker builds the process group in the background (rendezvous on the TCPStore at `store`, under a
    prefix naming the group's secret `key`, the group and the generation), so the batch goes on; the group's
    first op waits for it. A CmdGroup of a newer generation fences the session's groups of older ones on this
    worker (their ops in flight finish first, then they are shut down and later ops naming them are refused).
    """

    group: str  # unique within the session
    generation: int  # bumped whenever the session's devices move: older generations are fenced
    rank: int
    members: list[str]  # each rank's worker, "w3 at host:port", for messages naming a missing one
    store: str  # host:port of rank 0's worker's TCPStore
    timeout_s: float = 60.0  # bound on the rendezvous and on each op: past it the op fails naming who is missing
    key: str = ""  # the group's secret, drawn per group and generation and sent to its members only: the store
    # keys are under it, so no one else who reaches the store can meet or disturb the group (1.6; "" from 1.5)


class GroupOp(Struct, frozen=True, array_like=True):
    """This worker's part of one collective: one mesh group of a step (docs: Redistribution on collectives)."""

    group: str  # "" when every position is on this worker (nothing moves)
    generation: int
    seq: int  # the op's number in the group: members issue a group's ops in this order
    rank: int  # this worker's rank in the group
    layout: list[list[int]]  # positions hosted by each rank, in rank order; [] (1.9): rank r hosts position r only
    devices: dict[int, int]  # position -> this worker's logical device
    sizes: list[int]  # per position: length along the step's dim (all_gather: input; others: output); one (1.9):
    # every position's
    src_sizes: list[int] = []  # all_to_all: per position, input length along src_dim; one (1.9): every position's
    ranks: Annotated[int, Meta(ge=0, le=1 << 20)] = 0  # with an empty layout: the group's ranks (1.9)


class CollectiveStep(Struct, frozen=True, array_like=True):
    kind: str  # "all_gather" | "all_to_all" | "reduce_scatter" | "all_reduce" | "slice"
    dim: int  # tensor dim gathered (all_gather) or scattered to; -1 for all_reduce
    src_dim: int  # all_to_all: the tensor dim that was sharded; else -1
    reduce: str  # "sum" | "avg" | "max" | "min": how Partial values combine (in position order)
    ops: list[GroupOp]  # one per mesh group this worker takes part in, in mesh-group order


class CmdCollective(Struct, frozen=True, tag="collective"):
    """Redistribute `src` into `dst` on this worker's devices of one mesh through collective steps, in order.

    Only the last step may still be in flight when the next command runs: its outputs are waited for at their
    first use (or before the batch counts as completed).
    """

    src: int
    dst: int
    dtype: str
    steps: list[CollectiveStep]
    in_shapes: dict[int, list[int]]  # this worker's logical device -> shape of its shard of `src`
    out_shapes: dict[int, list[int]]  # this worker's logical device -> shape of its shard of `dst`
    src_line: str = ""


class CmdDelete(Struct, frozen=True, gc=False, tag="delete"):
    tids: list[int]
    devices: list[int]  # empty in a shared command (`mesh` >= 0), as CmdRun's
    mesh: int = -1  # >= 0: one command for every worker of this mesh (1.7)


class CmdCloseSession(Struct, frozen=True, tag="close"):
    pass


class CmdSendShards(Struct, frozen=True, tag="send"):
    """Copy whole shards of this batch's session into the store of `to` under `namespace` (fault tolerance).

    Runs at its place in this worker's stream, so it copies exactly the values every earlier command left.
    Shards that share storage here share it in the copy too (views stay views). `to` "" or this worker's
    own address makes a local copy. Snapshots and upload backups use a namespace derived from the session
    (`{session}#...`); moving devices uses the session itself. With `background` (upload backups), the copy is
    made off the stream: later commands run meanwhile (one writing the shards in place waits for the copy to
    have read them), and the batch counts as completed once the copy is done.
    """

    devices: dict[int, list[int]]  # logical device -> tids to copy
    namespace: str  # the copies' session key at the destination
    to: str = ""  # destination worker address ("" = this worker)
    host: bool = False  # keep the copies in host memory (backups of GPU shards)
    move: list[int] = []  # devices leaving this worker: every shard of theirs is sent (uploads not adopted
    # yet too) and, from this command on, client Puts for them are refused and Pulls of missing shards
    # are answered "moved:" so the client asks the controller where they went
    background: bool = False  # copy off the stream (bounded bytes in flight per worker)


class CmdKeepCopies(Struct, frozen=True, tag="keep"):
    """File this worker's copies of `devices`' tensors held under namespace `source` under `namespace` too (no
    byte moves): a snapshot keeps the copies of tensors nothing wrote since the one that made them. A copy that
    is not here fails the command (a failed copy, ErrorKind.COPY). With `check` (the worker holding the tensors),
    it first makes sure each tensor's memory is as it was copied (its version counter, which every write through
    any alias moves) and shared with no tensor of the device that is not kept; else ErrorKind.STALE_COPY."""

    devices: dict[int, list[int]]  # logical device -> tids
    source: str  # a namespace of this session's copies here (`{session}#s{n}`, `{session}#a{n}`)
    namespace: str
    check: bool = False


class CmdFetchShards(Struct, frozen=True, tag="fetch"):
    """Copy whole shards from `namespace` on `address` ("" = this worker) into this batch's session.

    With `move`, those logical devices move here from `address` (a frozen session relocating: its work on
    `address` is done, and pulling is served at once, not after the other work queued there): the source
    refuses client uploads for them from then on and hands over its uploads not adopted yet too.
    """

    devices: dict[int, list[int]]  # logical device -> tids
    namespace: str
    address: str = ""
    move: list[int] = []
    rename: dict[int, int] = {}  # a device's copies are stored as another's: a replica's restore (1.11)


class CmdAbandon(Struct, frozen=True, tag="abandon"):
    """Start the session over on this worker (recovery after a lost worker).

    Acts when the batch ARRIVES: the session's batches with a lower seq are skipped, its waits end, its
    peers' planned reads are forgotten, pulls from the `lost` addresses fail at once, and client Pulls of
    its shards wait until CmdRebuilt. In order: `tids` are dropped on every device (uploads not adopted
    yet are left alone) and "moved" marks are cleared.
    """

    tids: list[int]
    lost: list[str] = []


class CmdFence(Struct, frozen=True, tag="fence"):
    """The workers at `addresses` were declared lost; new workers registered at `lifted` (1.11).

    Acts when the batch ARRIVES, for every session on this worker: calls in flight to `addresses` end now, groups
    with a member at one of them are aborted (their waits end, their ops fail), and they are not reached again until
    a CmdFence lifts the address (a worker restarting at it, once the old one was declared lost). Sent to the workers
    that shared a session with a lost worker, whether or not the session is rebuilt: nothing of theirs waits on a
    worker that will never answer (a stopped one keeps its connections open).
    """

    addresses: list[str] = []
    lifted: list[str] = []


class CmdRebuilt(Struct, frozen=True, tag="rebuilt"):
    """The session's shards on this worker are rebuilt: client Pulls may read them again."""


class CmdStay(Struct, frozen=True, tag="stay"):
    """A move of these devices away from this worker was called off: clear their "moved" marks."""

    devices: list[int]


StepCmd = (CmdCreate | CmdRun | CmdRedistribute | CmdExpectReads | CmdDelete | CmdCollective
           | CmdMesh)  # what a program holds


class CmdProgram(Struct, frozen=True, tag="program"):
    """Keep `cmds` as this worker's part of the session's captured program `program` (`InstrDefine`), as the
    controller translated it for the session's current binding. Its tensor ids, seeds and numbers are slots, and
    each collective's op number is an offset into its group's: a CmdReplay fills them in
    (`dtorch_protocol.programs.fill_cmds`). Replaces the session's program of that id on this worker.
    """

    program: int
    version: int  # which translation of it this is: a CmdReplay names the one it was sent for
    cmds: list[StepCmd]
    ntids: int
    nseeds: int = 0
    nscalars: int = 0


class CmdReplay(Struct, frozen=True, tag="replay"):
    """Run this worker's part of program `program` (translation `version`) here and now, its slots filled with these
    tensor ids, seeds and numbers, each group's op numbers going on from `groups` (group -> its last op number)."""

    program: int
    version: int
    tids: list[int]
    seeds: list[int] = []
    scalars: list[float] = []
    groups: dict[str, int] = {}


Cmd = (CmdCreate | CmdRun | CmdRedistribute | CmdExpectReads | CmdDelete | CmdCloseSession | CmdSendShards
       | CmdKeepCopies | CmdFetchShards | CmdAbandon | CmdRebuilt | CmdStay | CmdGroup | CmdCollective | CmdProgram
       | CmdReplay | CmdMesh | CmdReadable | CmdFence)


class Execute(Struct, frozen=True):
    """One ordered batch for one worker; workers run batches strictly in `seq` order."""

    seq: int
    session: Ident
    cmds: list[Cmd]
    memory_cap: int = 0  # bytes the session may hold on this worker (0: no cap; the latest Execute's value holds)
    caps: dict[str, str] = {}  # peer address -> a peer capability for this session there (pulls, shard copies)


class Ack(Struct, frozen=True):
    ok: bool = True
    message: str = ""


# ---------------------------------------------------------------- data plane (client/worker -> worker)


class PullRequest(Struct, frozen=True):
    """Read (a box of) one shard; waits up to `timeout_s` for it to be produced."""

    session: Ident
    tid: int
    device: int
    offset: Dims | None = None
    size: Dims | None = None
    timeout_s: Timeout = 60.0
    expected: bool = False  # a peer's planned read, announced by CmdExpectReads: counted as served when done
    dst: int = -1  # with `expected`: served only after the source ran the CmdExpectReads of redistribution `dst`
    segment: Annotated[str, Meta(max_length=64)] = ""  # a client's same-host segment for the bytes (segments.py)
    after: int = -1  # a client's read: served only once this worker ran the session's CmdReadable of this mark


class Chunk(Struct, frozen=True):
    """A piece of a tensor payload: raw little-endian bytes; dtype and shape ride on the first chunk."""

    data: bytes
    dtype: str = ""
    shape: list[int] = []
    error: str = ""  # set instead of data when the shard could not be produced
    report: ErrorReport | None = None  # with `error` when the shard is poisoned: the original failure
    kind: ErrorKind | None = None  # with `error`: what went wrong (MOVED: ask the controller where the device went)
    in_segment: bool = False  # the bytes were written into the request's segment: this is the only chunk


class PutChunk(Struct, frozen=True):
    session: Ident
    tid: int
    device: int
    dtype: Ident
    shape: Dims
    data: bytes
    segment: Annotated[str, Meta(max_length=64)] = ""  # the bytes are in this same-host segment (segments.py)


class ShardView(Struct, frozen=True, array_like=True):
    """One whole shard in a ShardsChunk stream: a view of storage number `storage` (-1: poisoned)."""

    tid: int
    device: int
    storage: int
    dtype: str
    shape: list[int]
    stride: list[int]
    offset: int  # storage offset, in elements of `dtype`
    report: ErrorReport | None = None  # the original failure, for a poisoned shard


class ShardsRequest(Struct, frozen=True):
    """PullShards: whole shards of `session` (any namespace) on this worker, waiting for missing ones."""

    session: Ident
    devices: dict[int, list[int]]  # logical device -> tids
    timeout_s: Timeout = 60.0
    move: list[int] = []  # devices moving to the puller (CmdFetchShards.move)
    segment: Annotated[str, Meta(max_length=64)] = ""  # the puller's empty same-host segment for these shards
    # (segments.for_shards): the peer may append the storages there; its reply's header then names it


class ShardsChunk(Struct, frozen=True):
    """A stream of whole shards keeping their aliasing: the first message lists the views and the storage
    sizes, then the storages' bytes follow in order (raw, little-endian, in pieces below the message limit)."""

    views: list[ShardView] = []
    storages: list[int] = []  # byte size of each storage
    data: bytes = b""
    namespace: str = ""  # PutShards: where the receiver stores them
    sender: str = ""  # PutShards: the sending worker (refused when fenced there)
    host: bool = False  # PutShards: keep them in host memory
    move: list[int] = []  # PutShards: devices moving to the receiver (clears its "moved" marks for them)
    error: str = ""
    segment: Annotated[str, Meta(max_length=64)] = ""  # the storages, one after another, are in this same-host
    # segment (segments.py; made for the namespace, tid and device -1): the sender's (PutShards) or the puller's
    # (PullShards, ShardsRequest.segment); no data chunks follow


# ---------------------------------------------------------------- profiles (client -> worker)


class ProfileRequest(Struct, frozen=True):
    """`dtorch.profile()`: start recording the session's commands on this worker, or stop and return them."""

    session: Ident
    start: bool


class OpRecord(Struct, frozen=True, array_like=True):
    """One command a worker ran for the profiled session."""

    op: str  # the aten op, or create, redistribute, copy_shards, restore_shards
    src: str  # the user's source line
    tid: int  # its (first) output tensor (-1: none)
    comm: bool  # moves data (redistributions, copies) rather than computing
    start: float  # wall-clock time (seconds since the epoch) it started on the worker
    seconds: float
    moved_bytes: int  # bytes it pulled from other workers
    out_bytes: int  # bytes of its outputs on this worker
    devices: int  # the logical devices it ran for here
    landed: float = 0.0  # a collective: wall-clock time its last transfer here finished (0: none ran on a lane here)


class ProfileReply(Struct, frozen=True):
    records: list[OpRecord] = []
    started: float = 0.0  # wall-clock time the window opened
    window_s: float = 0.0  # from start to stop on this worker
    busy_s: float = 0.0  # time this worker ran any session's commands in the window
    session_s: float = 0.0  # ... of which the profiled session's (its bookkeeping commands included)
    dropped: int = 0  # records past the worker's bound
    message: str = ""  # why there is nothing (no profile was started)


# ---------------------------------------------------------------- admin: drain and migration


class DrainRequest(Struct, frozen=True):
    """Move every tensor off `worker` (devices to other workers, backups re-made elsewhere), then release it."""

    worker: Ident
    timeout_s: Timeout = 300.0


class MigrateRequest(Struct, frozen=True):
    """Move logical device `device` of `session` (an id or a unique prefix) to worker `to_worker`."""

    session: Ident
    device: int
    to_worker: Ident
    timeout_s: Timeout = 300.0


class MoveReport(Struct, frozen=True):
    session: str
    devices: list[int]
    from_worker: str
    to_worker: str
    tensors: int  # shards moved
    bytes: int  # their logical size
    downtime_s: float  # how long the session's dispatch was paused for the copy


class AdminReply(Struct, frozen=True):
    ok: bool
    message: str = ""
    moves: list[MoveReport] = []
    seconds: float = 0.0  # from the request to the answer


def all_message_types() -> list[type]:
    return [v for v in globals().values() if isinstance(v, type) and issubclass(v, Struct) and v is not Struct]


__all__ = [name for name, v in globals().items() if isinstance(v, type) and issubclass(v, msgspec.Struct)] + [
    "Instr", "StepInstr", "Cmd", "PROTOCOL_VERSION", "ErrorKind", "TENSOR_SLOT", "tensor_slot", "slot_tid",
    "tensor_refs"]
