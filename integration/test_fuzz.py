"""A few thousand malformed and hostile messages to every RPC of both services of real processes (`_fuzz.py`;
`nox -s fuzz` sends 100,000): no unhandled exception, no process dies, memory stays put, and a real computation
afterwards still matches torch."""

from __future__ import annotations

from _fuzz import run

from dtorch_protocol import wire


def test_hostile_messages_to_every_rpc_leave_the_cluster_working(tmp_path):
    report = run(tmp_path, messages=2000, seed=1)
    print(report.render())
    assert not report.unhandled, report.render()
    assert all(report.alive.values()) and not any(report.tracebacks.values()), report.render()
    assert report.computation == "same", report.render()
    assert len(report.calls) == sum(map(len, wire.SERVICES.values()))
    assert all(sum(c.values()) >= 100 for c in report.calls.values())
    through = {name for name, c in report.calls.items() if c.get("OK", 0)}
    assert len(through) >= 14, f"most RPCs must also get through sometimes, only {sorted(through)} did"
    for name, before in report.rss_before.items():
        assert report.rss_after[name] < before + (256 << 10), report.render()  # KiB: no runaway growth
