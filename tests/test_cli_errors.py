"""How `meshtrain` ends on an error that arrives inside exception groups (node/cli.py `main`):
its last line on the console says what went wrong, and the traceback goes to the log — at ERROR
for a broken stream or transfer, which is never the user's mistake; at DEBUG for the rest."""

from __future__ import annotations

import logging

import pytest

from meshtrain.errors import ConfigError
from meshtrain.node import cli
from meshtrain.transport.framing import StreamClosed


def deep(exc: BaseException) -> BaseExceptionGroup:
    try:
        raise exc
    except BaseException as e:
        return BaseExceptionGroup("outer", [ExceptionGroup("inner", [e])])


@pytest.mark.parametrize(
    ("error", "level", "code"),
    [
        (StreamClosed("stream closed while writing (BrokenResourceError)"), logging.ERROR, 1),
        (ConfigError("bad H"), logging.DEBUG, 2),
    ],
)
def test_the_error_that_ended_a_run_is_one_line_and_its_traceback_is_logged(
    monkeypatch, capsys, caplog, error, level, code
):
    def failing(argv, *, exit_at_once=False):
        raise deep(error)

    monkeypatch.setattr(cli, "_main", failing)
    with caplog.at_level(logging.DEBUG, logger="meshtrain.node.cli"):
        assert cli.main(["node", "start"]) == code
    last = capsys.readouterr().err.strip().splitlines()[-1]  # the console's last word: one line
    assert last.startswith("meshtrain: ") and last.endswith(str(error)), last
    [record] = [r for r in caplog.records if r.message == "the error that ended the run"]
    assert record.levelno == level and record.exc_info is not None
