"""Usage records (usage.py): what accrues per session and interval, the durable file, and `dtorch-controller usage`."""

from __future__ import annotations

import json
import os

import pytest

from dtorch_controller import cli
from dtorch_controller.usage import Accounting, Record, UsageLog, read, summarise
from dtorch_protocol import messages as m


class Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def status(*sessions: tuple[str, str, float, dict[int, str]]) -> m.StatusReply:
    return m.StatusReply(workers=[], events=[], sessions=[
        m.SessionStatus(session=sid, name="job", priority="normal", state="open", devices=devices, tensors=0,
                        schedule="running" if devices else "idle", tenant=tenant, attained_s=attained)
        for sid, tenant, attained, devices in sessions])


def test_each_interval_records_what_accrued_and_a_session_gone_gets_its_last_record():
    clock = Clock()
    acc = Accounting(clock=clock, run="r1")
    acc.opened("s1", "alice", "job")
    acc.submitted("s1", 7)
    acc.reported("w0", {"s1": m.ShardStats(tensors=1, bytes=100, moved_bytes=40),
                        "s1#s1": m.ShardStats(tensors=1, bytes=100, moved_bytes=999)})  # a copy: not billed
    acc.reported("w1", {"s1": m.ShardStats(tensors=1, bytes=300, moved_bytes=10)})
    clock.t += 10
    (r,) = acc.take(status(("s1", "alice", 20.0, {0: "w0", 1: "w1"})))
    assert (r.tenant, r.session, r.devices, r.device_seconds, r.moved_bytes, r.instructions) == (
        "alice", "s1", 2, 20.0, 50, 7)
    assert (r.start, r.end, r.final, r.memory_byte_seconds) == (1000.0, 1010.0, False, 0.0)  # bytes seen from now
    acc.reported("w0", {"s1": m.ShardStats(tensors=1, bytes=100, moved_bytes=5)})  # w0 restarted: counts anew
    clock.t += 5
    (r2,) = acc.take(status(("s1", "alice", 30.0, {0: "w0", 1: "w1"})))
    assert (r2.device_seconds, r2.moved_bytes, r2.memory_byte_seconds, r2.start) == (10.0, 5, 400 * 5, 1010.0)
    assert acc.take(status(("s1", "alice", 30.0, {0: "w0", 1: "w1"}))) == []  # nothing accrued: no record
    clock.t += 1
    (last,) = acc.take(status())  # closed (or expired) meanwhile
    assert last.final and last.session == "s1" and last.device_seconds == 0 and [r.seq for r in (r, r2, last)] == [
        1, 2, 3]
    assert acc.take(status()) == []
    assert acc.totals == {"alice": (30.0, 55)}


def test_only_settles_one_session_and_tenant_totals_include_what_accrued_since():
    clock = Clock()
    acc = Accounting(clock=clock, run="r1")
    acc.opened("a", "alice", "")
    acc.opened("b", "bob", "")
    st = status(("a", "alice", 4.0, {0: "w0"}), ("b", "bob", 6.0, {0: "w1"}))
    assert acc.tenant_totals(st) == {"alice": (4.0, 0), "bob": (6.0, 0)}
    (r,) = acc.take(st, only="b")
    assert r.session == "b" and r.device_seconds == 6.0
    assert acc.tenant_totals(st) == {"alice": (4.0, 0), "bob": (6.0, 0)}  # nothing counted twice


def _record(seq: int, session: str = "s1", tenant: str = "alice", end: float = 1010.0, run: str = "r1") -> Record:
    return Record(run, seq, tenant, session, "job", 2, 10.0, 5.0, 100, 3, end - 10, end)


def test_the_file_is_append_only_a_torn_line_is_dropped_and_records_count_once(tmp_path):
    path = tmp_path / "usage.jsonl"
    log = UsageLog(path)
    log.append([_record(1), _record(2, "s2", "bob")])
    log.close()
    with open(path, "a") as f:  # a crash in the middle of a line
        f.write('{"run":"r1","seq":3,"ten')
    log = UsageLog(path)  # the next run cuts it
    assert path.read_text().endswith("\n") and len(path.read_text().splitlines()) == 2
    log.append([_record(1, run="r2")])
    log.close()
    with open(path, "a") as f:  # the same record again (a copy of the file merged in): counted once
        f.write(json.dumps(_record(1).__dict__) + "\n")
    records = list(read(path))
    assert [(r.run, r.seq) for r in records] == [("r1", 1), ("r1", 2), ("r2", 1)]
    by_tenant = {row.key: row for row in summarise(records, "tenant")}
    assert by_tenant["alice"].device_seconds == 20.0 and by_tenant["alice"].sessions == {"s1"}
    assert by_tenant["bob"].moved_bytes == 100
    assert [row.key for row in summarise(records, "session", since=1005.0)] == ["s1", "s2"]
    assert summarise(records, "session", since=2000.0) == []


def test_an_unwritable_file_is_one_line_and_no_records(tmp_path, capsys):
    os.chmod(tmp_path, 0o500)
    try:
        if os.access(tmp_path, os.W_OK):
            pytest.skip("running as root: every directory is writable")
        log = UsageLog(tmp_path / "usage.jsonl")
    finally:
        os.chmod(tmp_path, 0o700)
    assert not log.enabled
    log.append([_record(1)])  # nothing, no error
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "cannot write usage records to" in err and "running without usage" in err


def test_a_directory_as_the_usage_file_is_one_line(tmp_path, capsys):
    log = UsageLog(tmp_path)  # root cannot open a directory for writing either
    assert not log.enabled
    assert capsys.readouterr().err.count("\n") == 1


def test_the_usage_command_sums_by_tenant_or_session_as_table_csv_or_json(tmp_path, capsys):
    path = tmp_path / "usage.jsonl"
    log = UsageLog(path)
    log.append([_record(1), _record(2), _record(3, "s2", "bob", end=5000.0)])
    log.close()
    assert cli.main(["usage", "--usage-file", str(path), "--format", "json"]) == 0
    rows = {r["tenant"]: r for r in json.loads(capsys.readouterr().out)}
    assert rows["alice"]["device_seconds"] == 20.0 and rows["alice"]["instructions"] == 6
    assert rows["bob"]["sessions"] == 1
    assert cli.main(["usage", "--usage-file", str(path), "--by", "session", "--format", "csv",
                     "--since", "4000"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith("session,tenant,sessions,devices,device_seconds") and len(lines) == 2
    assert lines[1].startswith("s2,bob,1,2,10.0")
    assert cli.main(["usage", "--usage-file", str(path)]) == 0
    out = capsys.readouterr().out
    assert "alice" in out and "bob" in out and "device-hours" in out
    assert cli.main(["usage", "--usage-file", str(path), "--since", "yesterday"]) == 2
    assert capsys.readouterr().err.startswith("dtorch-controller usage: bad --since 'yesterday'")
    assert cli.main(["usage", "--usage-file", str(tmp_path / "none.jsonl")]) == 1
    assert "cannot read" in capsys.readouterr().err


def test_lines_that_are_not_usage_records_are_named_not_summed_in_silence(tmp_path, capsys):
    """Another file given as the usage file (the key file) printed an empty table and said nothing; a record whose
    fields had the wrong types (a hand-edited or foreign line) was summed until a comparison raised."""
    keys = tmp_path / "keys.json"
    keys.write_text(json.dumps({"version": 1, "keys": []}, indent=1) + "\n")
    assert cli.main(["usage", "--usage-file", str(keys)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"{keys} holds no usage records (line 1 is not one)" in err
    path = tmp_path / "usage.jsonl"
    log = UsageLog(path)
    log.append([_record(1)])
    log.close()
    with open(path, "a") as f:
        f.write(json.dumps({**_record(2).__dict__, "devices": "4"}) + "\n\n")  # a string count, then an empty line
        f.write(json.dumps({**_record(3).__dict__, "device_seconds": True}) + "\n")
    foreign: list[int] = []
    assert [r.seq for r in read(path, foreign)] == [1] and foreign == [2, 4]
    assert cli.main(["usage", "--usage-file", str(path), "--format", "json"]) == 0
    out = capsys.readouterr()
    assert json.loads(out.out)[0]["device_seconds"] == 10.0
    assert out.err == f"dtorch-controller usage: skipped 2 lines of {path} that are not usage records (first: line 2)\n"


def test_a_line_that_is_not_utf8_is_skipped_as_a_foreign_line_not_the_end_of_the_report(tmp_path, capsys):
    """One damaged byte anywhere in the file ended `dtorch-controller usage` with Python's codec error and no file
    name: every record of the file went unreported."""
    path = tmp_path / "usage.jsonl"
    log = UsageLog(path)
    log.append([_record(1)])
    with open(path, "ab") as f:
        f.write(json.dumps(_record(2).__dict__).encode().replace(b"alice", b"al\xffce") + b"\n")
    log = UsageLog(path)
    log.append([_record(3, run="r2")])
    log.close()
    assert cli.main(["usage", "--usage-file", str(path), "--format", "json"]) == 0
    out = capsys.readouterr()
    assert json.loads(out.out)[0]["device_seconds"] == 20.0
    # one line, in the singular: it said "skipped 1 lines of ... that are not usage records"
    assert out.err == f"dtorch-controller usage: skipped 1 line of {path} that is not a usage record (first: line 2)\n"


def test_the_usage_table_shows_a_records_names_as_plain_text(tmp_path, capsys):
    """A record is the file's text: a tenant or session edited into '[/]' crashed the table with a MarkupError."""
    path = tmp_path / "usage.jsonl"
    log = UsageLog(path)
    log.append([_record(1, session="s[/]1", tenant="a[/]b\x1b[2J")])
    log.close()
    for by in ("tenant", "session"):
        assert cli.main(["usage", "--usage-file", str(path), "--by", by]) == 0
        out = capsys.readouterr().out
        assert "a[/]b\\x1b[2J" in out and "\x1b" not in out


@pytest.mark.parametrize("since", ["1e20", "nan", "inf", "99999999999d"])
def test_a_since_no_date_can_show_is_one_line(tmp_path, capsys, since):
    """Each was a traceback (OverflowError, 'year 3170843 is out of range') from the table's title."""
    path = tmp_path / "usage.jsonl"
    log = UsageLog(path)
    log.append([_record(1)])
    log.close()
    assert cli.main(["usage", "--usage-file", str(path), f"--since={since}"]) == 2
    assert capsys.readouterr().err == (f"dtorch-controller usage: bad --since {since!r}: out of range (no date falls "
                                       "there)\n")


@pytest.mark.parametrize("edit", [{"start": -1e300}, {"start": 1e300, "end": 1e301}, {"end": 1e20}, {"start": -5.0},
                                  {"start": 2000.0, "end": 1000.0}, {"device_seconds": 1e308},
                                  {"device_seconds": -10.0}, {"moved_bytes": -1}, {"instructions": 2**63}])
def test_a_record_with_absurd_values_is_a_foreign_line_not_a_crash(tmp_path, capsys, edit):
    """A hand-edited record whose times no date can show was a traceback (OverflowError: timestamp out of range) from
    the table and the JSON; huge amounts summed to inf (JSON's Infinity), negative ones were billed."""
    path = tmp_path / "usage.jsonl"
    log = UsageLog(path)
    log.append([_record(1)])
    log.close()
    with open(path, "a") as f:
        f.write(json.dumps({**_record(2).__dict__, **edit}) + "\n")
        f.write(json.dumps({**_record(3).__dict__, **edit}) + "\n")
    for fmt in ("table", "json", "csv"):
        assert cli.main(["usage", "--usage-file", str(path), "--format", fmt]) == 0
        out = capsys.readouterr()
        assert out.err == (f"dtorch-controller usage: skipped 2 lines of {path} that are not usage records (first: "
                           "line 2)\n")
    assert cli.main(["usage", "--usage-file", str(path), "--format", "json"]) == 0
    assert json.loads(capsys.readouterr().out)[0]["device_seconds"] == 10.0
