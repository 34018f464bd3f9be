"""dtorch.compile's number holes (_capture.py rule 6): which key changes may be numbers, how holes are found."""

from __future__ import annotations

from dtorch import _capture
from dtorch_protocol import messages as m


def test_only_float_arguments_may_differ():
    key = (7, 3, (float, 0.1), (list, ((float, 1.0), (int, 2))))
    assert _capture._numbers_differ(key, (7, 3, (float, 0.2), (list, ((float, 3.0), (int, 2)))))
    assert not _capture._numbers_differ(key, (7, 3, (float, 0.1), (list, ((float, 1.0), (int, 5)))))  # an int
    assert not _capture._numbers_differ(key, (7, 4, (float, 0.1), (list, ((float, 1.0), (int, 2)))))  # a spec id
    assert not _capture._numbers_differ(key, (7, 3, (float, 0.1)))


def _call(args, seed=None):
    return _capture._plain(m.InstrCall(op="aten.mul.Tensor", mesh=1, args=args, kwargs={}, outs=[], seed=seed))


def test_a_changed_number_in_the_arguments_is_a_hole_and_elsewhere_a_mismatch():
    found, numbers = [], {}
    assert _capture._match(_call([{"$t": 0}, 0.5, {"$s": 0}]), _call([{"$t": 0}, 0.25, 3.0]), [],
                        lambda path, v: found.append((path, v)), numbers)
    assert found == [(["args", 1], 0.25)] and numbers == {0: 3.0}
    assert not _capture._match(_call([{"$t": 0}, 0.5]), _call([{"$t": 1}, 0.5]), [], lambda *a: None, {})
    assert not _capture._match(_call([{"$t": 0}, 0.5]), _call([{"$t": 0}, 1]), [], lambda *a: None, {})  # int
    assert not _capture._match(_call([], seed=0), _call([], seed=1), [], lambda *a: None, {})


def test_hole_positions_are_learned_only_when_each_value_sits_at_one_place_or_every_float_is_a_hole():
    op = _capture._Op(key=None, leaf_slots=(), made=0, seeds=0, start=0, end=1, result=None)
    _capture._learn_positions(op, (1, (float, 0.9), (float, 0.01)), {3: 0.01}, [3])
    assert op.numbers == [(1, 3)] and op.fixed == [(0, 0.9)] and op.nfloats == 2
    _capture._learn_positions(op, (1, (float, 0.01), (float, 0.01)), {3: 0.01}, [3])  # ambiguous: planned every step
    assert op.numbers is None
    # a _foreach_ op's list of equal step sizes, every float a hole: in the order the instructions hold them
    key = (1, ((float, 0.01), (float, 0.01), (float, 0.01)))
    _capture._learn_positions(op, key, {5: 0.01, 4: 0.01, 6: 0.01}, [4, 5, 6])
    assert op.numbers == [(0, 4), (1, 5), (2, 6)] and op.fixed == [] and op.nfloats == 3
    _capture._learn_positions(op, key, {4: 0.01, 5: 0.01}, [4, 5])  # a float that is not a hole: ambiguous
    assert op.numbers is None
