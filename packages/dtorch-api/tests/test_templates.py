"""Wire templates (`_templates`) and the fast plans' encoders built on them: filling a template gives exactly the
bytes of encoding the message itself, so the controller cannot tell them apart."""

from __future__ import annotations

import sys

import msgspec
import torch

from dtorch._planner import plan
from dtorch._templates import SRC_HOLE, Template, sentinel
from dtorch_protocol import messages as m
from dtorch_protocol import wire
from dtorch_protocol.placement_types import Replicate, Shard

aten = torch.ops.aten
SPEC = m.TensorSpec(shape=[4], dtype="float32", mesh=0, placements=[])


def call(a: int, b: int, out: int, src: str) -> m.InstrCall:
    return m.InstrCall("aten.add.Tensor", 0, [{"$t": a}, {"$t": b}, 2.5], {}, [m.OutSpec(out, SPEC)], None, src)


def test_a_filled_template_is_the_encoding_of_the_message():
    template = Template.of(call(sentinel(0), sentinel(1), sentinel(2), SRC_HOLE),
                           [sentinel(0), sentinel(1), sentinel(2), SRC_HOLE])
    for values in [(1, 2, 3, "train.py:7"), (70000, 1, 1 << 40, ""), (5, 5, 6, "ü" * 300)]:
        raw = template.fill(values)
        assert bytes(raw) == msgspec.msgpack.encode(call(*values))
    batch = wire.encode(m.Submit(session="s", seq=1, instrs=[template.fill((1, 2, 3, "a.py:1")), call(4, 5, 6, "")]))
    assert msgspec.msgpack.decode(batch, type=m.Submit).instrs == [call(1, 2, 3, "a.py:1"), call(4, 5, 6, "")]


def test_no_template_when_a_hole_cannot_be_found_once():
    assert Template.of(call(sentinel(0), sentinel(0), 3, "x"), [sentinel(0)]) is None  # twice
    assert Template.of(call(1, 2, 3, "x"), [sentinel(0)]) is None  # absent


def _here() -> tuple:
    """(code, instruction offset, "file:line") of the caller's frame, as the dispatcher records it."""
    f = sys._getframe(1)
    return f.f_code, f.f_lasti, f"{f.f_code.co_filename}:{f.f_lineno}"


def test_a_fast_plan_encodes_its_record_as_the_instruction_it_stands_for(spec, mesh2):
    a, b = spec((4, 2), [Shard(0)], mesh2), spec((4, 2), [Replicate()], mesh2)
    p = plan(aten.mul.Tensor, (a, a), {})
    out = m.OutSpec(9, p.outputs.wire)
    code, lasti, line = _here()
    got = p.encode((p.encode, 3, 4, 9, code, lasti))  # the line is worked out here, from where the frame was
    assert msgspec.msgpack.decode(bytes(got), type=m.Instr) == m.InstrCall(
        "aten.mul.Tensor", mesh2.id, [{"$t": 3}, {"$t": 4}], {}, [out], None, line)
    scalar = plan(aten.add.Tensor, (b, 1.5), {})
    got = scalar.encode((scalar.encode, 7, 8, None, 0))
    assert msgspec.msgpack.decode(bytes(got), type=m.Instr).args == [{"$t": 7}, 1.5]
