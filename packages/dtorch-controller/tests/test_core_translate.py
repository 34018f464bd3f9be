"""Translation of deletes (core/translate.py): one command per worker and device set, whatever the meshes."""

from __future__ import annotations

from _core_helpers import Harness, cmds_of, create
from dtorch_protocol import messages as m


def test_a_delete_sends_each_worker_one_command_per_device_set_across_meshes():
    h = Harness()
    h.register("10.0.0.1:7000")
    h.register("10.0.0.2:7000")
    sid = h.open_session()
    assert h.open_mesh(sid, 1, [0, 1]).placed and h.open_mesh(sid, 2, [0]).placed  # mesh 2: device 0 only
    s = h.core.sessions[sid]
    first, second = s.devices[0], s.devices[1]
    assert first != second
    h.submit(sid, 1, [create(1), create(2), create(3, mesh=2), create(4, mesh=2)])
    h.report_all()
    h.take_sent()
    h.submit(sid, 2, [m.InstrDelete(tids=[1, 2])])  # one mesh
    sent = h.take_sent()
    assert cmds_of(sent, first, m.CmdDelete) == [m.CmdDelete(tids=[1, 2], devices=[0])]
    assert cmds_of(sent, second, m.CmdDelete) == [m.CmdDelete(tids=[1, 2], devices=[1])]
    h.report_all()
    h.submit(sid, 3, [create(5), m.InstrDelete(tids=[3, 5, 4, 99])])  # two meshes, device 0 in both; 99 unknown
    sent = h.take_sent()
    (both,) = cmds_of(sent, first, m.CmdDelete)
    assert sorted(both.tids) == [3, 4, 5] and both.devices == [0]
    assert cmds_of(sent, second, m.CmdDelete) == [m.CmdDelete(tids=[5], devices=[1])]
    assert set(s.tensors) == set()
