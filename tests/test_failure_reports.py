"""A failed test's report explains itself (tests/failure_reports.py): a failure inside exception groups
leads with its assertion and one line for each other leaf exception, before the group's
traceback; and a failed test's report ends with the tails of the log files its daemons wrote.

The flattening and the log tails alone, then both through a real inner pytest run (pytester)
with this project's conftest.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from .failure_reports import (
    LOG_LINE_CHARS,
    LOG_LINES_SHOWN,
    LOG_TAIL_BYTES,
    explain_group,
    group_depth,
    leaf_exceptions,
    log_tail,
    paths_in,
)

pytest_plugins = ["pytester"]

CONFTEST = Path(__file__).with_name("conftest.py")


def raised(exc: BaseException) -> BaseException:
    """`exc`, raised and caught: with a traceback, as a task's exception has."""
    try:
        raise exc
    except BaseException as e:
        return e


def test_leaf_exceptions_flattens_nested_groups_depth_first_in_order():
    a, b, c, d = AssertionError("a"), RuntimeError("b"), ValueError("c"), pytest.fail.Exception("d")
    group = BaseExceptionGroup(
        "top", [ExceptionGroup("x", [b, ExceptionGroup("y", [a])]), c, BaseExceptionGroup("z", [d])]
    )
    assert leaf_exceptions(group) == [b, a, c, d]
    assert group_depth(group) == 3
    assert leaf_exceptions(c) == [c] and group_depth(c) == 0

    deep: BaseException = a
    for i in range(10):  # as deep as trio nurseries inside libp2p nest them
        deep = ExceptionGroup(f"level {i}", [deep])
    assert leaf_exceptions(deep) == [a] and group_depth(deep) == 10


def test_the_assertion_leads_and_every_other_leaf_gets_one_line(tmp_path):
    boom = raised(RuntimeError("peer went away\nsecond line"))
    wrong = raised(AssertionError("two peers where three were expected\nassert 2 == 3"))
    group = ExceptionGroup(
        "outer", [ExceptionGroup("mid", [boom, ExceptionGroup("inner", [wrong])]), raised(OSError())]
    )
    text, first = explain_group(group, Path(__file__).parent.parent)
    lines = text.splitlines()
    assert first is wrong
    assert lines[:2] == ["AssertionError: two peers where three were expected", "assert 2 == 3"]
    assert lines[2].startswith("    at tests/test_failure_reports.py:") and lines[2].endswith(" in raised")
    assert lines[3] == "the other 2 leaf exception(s) of the ExceptionGroup, 3 deep:"
    assert lines[4].startswith("    RuntimeError: peer went away  (tests/test_failure_reports.py:")
    assert lines[5].startswith("    OSError  (tests/test_failure_reports.py:")
    assert len(lines) == 6

    only = explain_group(ExceptionGroup("g", [raised(KeyError("k"))]), tmp_path)[0]
    assert only.splitlines()[0] == "KeyError: 'k'" and only.endswith(
        "the only leaf exception of the ExceptionGroup, 1 deep"
    )


def test_log_tail_keeps_the_last_lines_cut_short(tmp_path):
    log = tmp_path / "node.log"
    log.write_text("".join(f"line {i}\n" for i in range(200)) + "x" * 1000 + "\n")
    tail = log_tail(log)
    assert len(tail) == LOG_LINES_SHOWN and tail[0] == "line 151" and tail[-2] == "line 199"
    assert len(tail[-1]) == LOG_LINE_CHARS and tail[-1].endswith("...")

    big = tmp_path / "big.log"  # read from its end only, without the cut first line
    big.write_text("".join(f"{i:09d} " * 7 + "\n" for i in range(2 * LOG_TAIL_BYTES // 70)))
    tail = log_tail(big, lines=10**6)
    assert tail[-1].startswith(f"{2 * LOG_TAIL_BYTES // 70 - 1:09d} ") and all(len(line) == 70 for line in tail)
    (tmp_path / "empty.log").touch()
    assert log_tail(tmp_path / "empty.log") == []


def test_paths_in_finds_paths_in_fixture_values():
    class Peer:
        def __init__(self) -> None:
            self.log_path = "/tmp/x/peer.log"
            self.secret = Path("/tmp/not/this")

        @property
        def out(self) -> Path:
            raise AssertionError("no property runs")

    value = ({"run_dir": Path("/tmp/run"), "n": 3, "peers": {"m0": Peer()}}, ["relative.log", "/tmp/a.log"])
    assert sorted(map(str, paths_in(value))) == ["/tmp/a.log", "/tmp/run", "/tmp/x/peer.log"]


INNER = """
import os

import pytest


@pytest.fixture(scope="module")
def swarm(tmp_path_factory):
    run = tmp_path_factory.mktemp("swarm")
    (run / "peer0").mkdir()
    (run / "peer0" / "stderr.txt").write_text("peer0 says: no route to host\\n")
    return {"run_dir": run, "peers": 1}


def caught(f):
    try:
        f()
    except Exception as e:
        return e


def boom():
    raise RuntimeError("peer went away")


def wrong():
    assert len(["a", "b"]) == 3, "two peers where three were expected"


def test_passes(tmp_path):
    (tmp_path / "quiet.log").write_text("nothing to see\\n")


def test_deep(tmp_path, swarm):
    (tmp_path / "node.log").write_text("".join(f"node line {i}\\n" for i in range(80)))
    raise ExceptionGroup("outer", [ExceptionGroup("middle", [caught(boom), ExceptionGroup("inner", [caught(wrong)])])])


def test_later(swarm):
    assert swarm["peers"] == 2


def test_spawned():
    from conftest import spawn

    code = "import sys; print('daemon: bind failed', file=sys.stderr)"
    proc = spawn("-c", code, stderr_path=os.environ["SPAWN_LOG"])
    proc.communicate()
    assert proc.returncode == 1
"""


def test_a_failing_inner_run_leads_with_its_assertion_and_shows_its_logs(pytester: pytest.Pytester, monkeypatch):
    pytester.makeconftest(CONFTEST.read_text())
    pytester.makepyfile(test_deep=INNER)
    spawn_log = pytester.path / "elsewhere" / "daemon.log"  # not under the inner run's basetemp
    spawn_log.parent.mkdir()
    monkeypatch.setenv("SPAWN_LOG", str(spawn_log))
    failure_log = pytester.path / "failures.txt"
    monkeypatch.setenv("MESHTRAIN_FAILURE_LOG", str(failure_log))
    # The inner run prints its own summary, though this test may run in an xdist worker.
    monkeypatch.delenv("PYTEST_XDIST_WORKER", raising=False)
    result = pytester.runpytest("-rf", "-p", "no:cacheprovider")
    result.assert_outcomes(failed=3, passed=1)
    out = result.stdout.str()
    deep = out[out.index(" test_deep ") : out.index(" test_later ")]
    later = out[out.index(" test_later ") : out.index(" test_spawned ")]
    spawned = out[out.index(" test_spawned ") : out.index("short test summary info")]
    lines = deep.splitlines()

    # The first thing under the failure's header: the assertion, its message, where it was raised.
    assert lines[1] == "AssertionError: two peers where three were expected", out
    assert lines[2:4] == ["assert 2 == 3", " +  where 2 = len(['a', 'b'])"], out
    assert lines[4].startswith("    at test_deep.py:") and lines[4].endswith(" in wrong"), out
    assert lines[5] == "the other 1 leaf exception(s) of the ExceptionGroup, 3 deep:"
    assert lines[6].startswith("    RuntimeError: peer went away  (test_deep.py:"), out
    # ... and then the group's traceback as pytest prints it, and the logs
    assert "the exception group as raised" in lines[7]
    assert deep.index("Exception Group Traceback") < deep.index("daemon logs")
    result.stdout.fnmatch_lines(
        [
            "FAILED test_deep.py::test_deep - AssertionError: two peers*",
            "FAILED test_deep.py::test_later - assert 1 == 2",
        ]
    )

    # The daemon logs: the tail of the test's own node.log, and of the module fixture's run_dir.
    logs = deep[deep.index("daemon logs") :]
    assert "node.log <== (its last 50 lines)" in logs and "node line 79" in logs and "node line 30" in logs
    assert "node line 29" not in logs and logs.count("node.log <==") == 1  # not again through test_deepcurrent
    assert "stderr.txt <== (its last 1 lines)" in logs and "peer0 says: no route to host" in logs
    # a passing test dumps nothing, and its logs are not the failing test's, though just written
    assert "quiet.log" not in out and "nothing to see" not in out
    # A plain failure keeps pytest's report; a test gets the logs of the module fixture it uses, made
    # by an earlier test, and not that test's own.
    assert "exception group" not in later and "assert 1 == 2" in later
    assert "peer0 says: no route to host" in later and "node line" not in later
    # A log that conftest's `spawn` wrote, wherever it is, is the test's that spawned it.
    assert f"==> {spawn_log} <== (its last 1 lines)\ndaemon: bind failed" in spawned
    assert "daemon: bind failed" not in out.replace(spawned, "")

    # MESHTRAIN_FAILURE_LOG: each failure's whole report, written as it failed (stress_suite.sh).
    written = failure_log.read_text()
    assert [line.split(" (")[0] for line in written.splitlines() if line.startswith("===== ")] == [
        "===== test_deep.py::test_deep",
        "===== test_deep.py::test_later",
        "===== test_deep.py::test_spawned",
    ], written
    assert "AssertionError: two peers where three were expected" in written and "daemon: bind failed" in written
