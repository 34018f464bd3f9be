"""The wire: every message validated on receipt, versions checked, torch never imported by the protocol."""

from __future__ import annotations

import subprocess
import sys

import msgspec
import pytest
import torch

from dtorch_protocol import messages as m
from dtorch_protocol import wire
from dtorch_protocol.values import decode_value, encode_value, tensor_from_bytes, tensor_to_bytes
from dtorch_protocol.writes import UNDECLARED_WRITES, undeclared_writes


def test_round_trip_of_an_instruction_batch():
    batch = m.Submit(session="s", seq=3, instrs=[
        m.InstrCall(op="aten.add.Tensor", mesh=0, args=[{"$t": 1}, 2.5], kwargs={},
                    outs=[m.OutSpec(2, m.TensorSpec([4], "float32", 0, ["S0"]))], local={1: [[{"$t": 1}, 1], {}]}),
        m.InstrDelete(tids=[1])])
    assert wire.decode(m.Submit, wire.encode(batch)) == batch


def test_error_kinds_travel_as_typed_fields_and_unknown_ones_are_refused():
    report = m.ErrorReport(op="copy shards to x", src="", message="refused", seq=3, kind=m.ErrorKind.COPY)
    assert wire.decode(m.ErrorReport, wire.encode(report)).kind is m.ErrorKind.COPY
    assert wire.decode(m.ErrorReport, wire.encode(m.ErrorReport(op="a", src="", message="b"))).kind is m.ErrorKind.OP
    chunk = m.Chunk(data=b"", error="moved: logical device 0 ...", kind=m.ErrorKind.MOVED)
    assert wire.decode(m.Chunk, wire.encode(chunk)).kind is m.ErrorKind.MOVED
    raw = msgspec.msgpack.encode({"op": "a", "src": "", "message": "b", "kind": "exploded"})
    with pytest.raises(wire.ProtocolError, match="kind"):
        wire.decode(m.ErrorReport, raw)


def test_the_tensor_slot_has_one_spelling():
    args = [m.tensor_slot(1), {"x": [m.tensor_slot(2), 3]}, {"$dtype": "float32"}, {"$t": 4, "y": 5}]
    assert list(m.tensor_refs(args)) == [1, 2]  # a map with more keys is not a slot
    assert m.slot_tid(m.tensor_slot(7)) == 7 and m.slot_tid({"$dtype": "float32"}) is None and m.slot_tid(7) is None
    assert decode_value(args[0], lambda tid: f"shard {tid}", "cpu") == "shard 1"


def test_tensor_refs_lists_every_slot_in_order_however_nested():
    """The controller's walk (slots and empty containers taken inline) against the plain recursion it replaces, on
    every pair of argument kinds nested two deep in lists, tuples and maps: empty containers, slots holding
    anything, maps with more keys than a slot."""

    def reference(value):
        if isinstance(value, dict):
            if len(value) == 1 and m.TENSOR_SLOT in value:
                return [value[m.TENSOR_SLOT]]
            value = list(value.values())
        elif not isinstance(value, (list, tuple)):
            return []
        return [t for v in value for t in reference(v)]

    atoms = [1, "a", None, [], {}, (), m.tensor_slot(3), {m.TENSOR_SLOT: "x"},
             {m.TENSOR_SLOT: 4, "y": m.tensor_slot(5)}]
    values = [*atoms, *((a,) for a in atoms)]
    for a in atoms:
        for b in atoms:
            values += [[a, b], {"k": a, "l": [b, (a,)]}, [[a], {"m": (b, [a])}]]
    for value in values:
        assert m.tensor_refs(value) == reference(value), value
        assert m.tensor_refs([value, value]) == reference(value) * 2, value


def test_bad_message_names_the_field():
    raw = msgspec.msgpack.encode({"session": "s", "seq": "one", "instrs": []})
    with pytest.raises(wire.ProtocolError, match=r"bad Submit message: .*seq"):
        wire.decode(m.Submit, raw)
    with pytest.raises(wire.ProtocolError, match="bad Submit"):
        wire.decode(m.Submit, b"\xc1garbage")
    unknown = msgspec.msgpack.encode({"session": "s", "seq": 1, "instrs": [{"type": "exec_python", "code": "x"}]})
    with pytest.raises(wire.ProtocolError):
        wire.decode(m.Submit, unknown)


def test_a_workers_stats_are_bounded_so_their_sums_stay_encodable():
    """Two sessions of 2**64 - 1 bytes on one worker made its byte total unencodable: every admin Status failed."""
    huge = msgspec.msgpack.encode({"worker": "w1", "completed": 0,
                                   "sessions": {"a": {"tensors": 1, "bytes": 2**64 - 1}}})
    with pytest.raises(wire.ProtocolError, match=r"bad WorkerReport message: .*bytes"):
        wire.decode(m.WorkerReport, huge)
    many = msgspec.msgpack.encode({"worker": "w1", "completed": 0,
                                   "sessions": {str(i): {"tensors": 1, "bytes": 1} for i in range(m.MAX_REPORTED + 1)}})
    with pytest.raises(wire.ProtocolError, match="sessions"):
        wire.decode(m.WorkerReport, many)
    assert m.MAX_REPORTED * 2**46 < 2**63  # the worst sum a worker can report


@pytest.mark.parametrize("role, theirs, refused", [
    ("client", "1.3", None), ("client", "1.0", None), ("worker", "1.3", None), ("worker", "1.9", None),
    ("client", "1.4", "upgrade dtorch-controller"), ("worker", "1.2", "upgrade dtorch-worker"),
    ("client", "2.0", "majors must be equal"), ("worker", "0.9", "majors must be equal"),
    ("client", "one", "expected MAJOR.MINOR"),
])
def test_a_controller_serves_older_clients_and_newer_workers(role, theirs, refused):
    hello = m.Hello(theirs, "9.9.9", role)
    if refused is None:
        wire.check_hello(hello, role, ours="1.3")
        return
    with pytest.raises(wire.ProtocolError) as err:
        wire.check_hello(hello, role, ours="1.3")
    line = str(err.value)
    assert "\n" not in line and refused in line
    assert f"{role} speaks {theirs} (package 9.9.9), this side speaks 1.3" in line


@pytest.mark.parametrize("version", ["1." + "9" * 5000, "1.\u00b2", "1.3\nINFO forged log line", "x" * 10_000])
def test_a_hostile_hello_gets_a_short_one_line_refusal(version):
    with pytest.raises(wire.ProtocolError) as err:
        wire.check_hello(m.Hello(version, version, "client"), "client", ours="1.3")
    assert "\n" not in str(err.value) and len(str(err.value)) < 300


def test_a_hello_of_another_role_is_refused():
    with pytest.raises(wire.ProtocolError, match="expected a worker hello, got role 'client'"):
        wire.check_hello(m.Hello(m.PROTOCOL_VERSION, "0.1.0", "client"), "worker")
    with pytest.raises(wire.ProtocolError, match="unknown role 'admin'"):
        wire.check_hello(m.Hello(m.PROTOCOL_VERSION, "0.1.0", "admin"))


def test_protocol_does_not_import_torch():
    code = ("import sys, dtorch_protocol.wire, dtorch_protocol.messages, dtorch_protocol.layout, "
            "dtorch_protocol.process; print('torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


@pytest.mark.parametrize("shape", [[3, 5], []], ids=["2-d", "0-d"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int64, torch.bool, torch.float16])
def test_tensor_bytes_round_trip(dtype, shape):
    """A 0-d bfloat16 tensor (a scalar argument: `torch.where(mask, x, torch.tensor(0.0, dtype=torch.bfloat16))`,
    a bfloat16 loss) could not be viewed as bytes ("self.dim() cannot be 0 to view BFloat16 as Byte")."""
    t = (torch.randn(shape) * 10).to(dtype)
    assert torch.equal(tensor_from_bytes(tensor_to_bytes(t), str(dtype)[6:], shape), t)


def test_argument_values_round_trip():
    args = [torch.float16, torch.device("cpu"), torch.strided, torch.contiguous_format, 1 + 2j, [1, 2], None,
            torch.tensor([1.0, 2.0])]
    wire_form = encode_value(args, lambda t: None)
    back = decode_value(msgspec.msgpack.decode(msgspec.msgpack.encode(wire_form)), lambda tid: None, "cpu")
    assert back[:7] == [torch.float16, "cpu", torch.strided, torch.contiguous_format, 1 + 2j, [1, 2], None]
    assert torch.equal(back[7], torch.tensor([1.0, 2.0]))
    with pytest.raises(ValueError, match="unknown"):
        decode_value({"$dtype": "os.system"}, lambda tid: None, "cpu")
    with pytest.raises(TypeError):
        encode_value(object(), lambda t: None)


def test_chunks_stay_below_the_message_limit():
    data = bytes(wire.CHUNK_BYTES * 2 + 5)
    parts = list(wire.chunks(data))
    assert [len(p) for p in parts] == [wire.CHUNK_BYTES, wire.CHUNK_BYTES, 5]
    assert wire.CHUNK_BYTES < wire.MAX_MESSAGE_BYTES
    assert [len(p) for p in wire.chunks(b"")] == [0]


def test_undeclared_writes_name_real_arguments_torch_does_not_mark():
    for op, (written, flag) in UNDECLARED_WRITES.items():
        _aten, name, overload = op.split(".")
        schema = getattr(getattr(torch.ops.aten, name), overload)._schema
        args = {a.name: a for a in schema.arguments}
        assert (not flag or flag in args) and all(w in args and args[w].alias_info is None for w in written), op
    names = ["input", "weight", "bias", "running_mean", "running_var", "training", "momentum", "eps"]
    op = "aten.native_batch_norm.default"
    assert undeclared_writes(op, names, [None] * 5 + [True, 0.1, 1e-5]) == {"running_mean", "running_var"}
    assert undeclared_writes(op, names, [None] * 5 + [False, 0.1, 1e-5]) == frozenset()
    assert undeclared_writes(op, names, [None] * 5, {"training": True}) == {"running_mean", "running_var"}
    assert undeclared_writes(op, names) == {"running_mean", "running_var"}  # no args: whatever it may write
    assert undeclared_writes("aten.add_.Tensor", ["self", "other", "alpha"], []) == frozenset()
    stats = ["input", "running_mean", "running_var", "momentum"]
    assert undeclared_writes("aten.batch_norm_update_stats.default", stats, [None] * 4) == {"running_mean",
                                                                                            "running_var"}
