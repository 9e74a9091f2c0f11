"""Failures that explain themselves: the report hooks that `tests/conftest.py` installs.

A test that fails inside trio nurseries or libp2p fails with an exception group nested up to ten
deep, and pytest prints it outermost first: the assertion that says what went wrong sits at the
bottom of a screenful of nursery frames, and the short summary says only "ExceptionGroup:
Exceptions from Trio nursery". And a test of daemons fails with the daemons' side of the story in
log files nobody opens before they are deleted. So a failed test's report starts with its
assertion and a line for each other leaf exception, and ends with the tails of the log files its
daemons wrote: those under the temp folders made since the test began, those its fixtures' values
name, and every `spawn(..., stderr_path=)` of the test (conftest.py records them in
`SPAWNED_LOGS`).

A run of the whole suite prints its failures only at its end, an hour away on a loaded machine
(and a backgrounded run ignores Ctrl-C). With `MESHTRAIN_FAILURE_LOG=path` set, each failed
test's whole report — the message, the traceback, its sections (the daemon logs) — is appended to
that file as it arrives, by the process that prints the summary (the xdist controller, or pytest
itself without xdist). `scripts/stress_suite.sh` sets it per run.
"""

from __future__ import annotations

import contextlib
import dataclasses
import fnmatch
import os
import tempfile
import time
import traceback
from collections.abc import Iterator
from pathlib import Path

import pytest
from _pytest._code.code import ReprFileLocation, TerminalRepr

LOG_PATTERNS = ("*.log", "*.err", "stderr*")
LOG_FILES_SHOWN = 12
LOG_LINES_SHOWN = 50
LOG_LINE_CHARS = 300
LOG_TAIL_BYTES = 256 * 1024
LOG_SCAN_ENTRIES = 5000  # files and folders looked at per folder searched
# Attributes of a fixture's value that may name its logs (LabPeer.log_path, ProcSwarm.logs, ...).
LOG_ATTRS = ("log_path", "log", "logs", "log_dir", "logdir", "run_dir", "out", "root", "data_dir")
# Every `spawn(..., stderr_path=)` of this process: the logs of a test that keeps them in
# tempfile's folder rather than under its tmp_path.
SPAWNED_LOGS: list[Path] = []
FAILURE_LOG_ENV = "MESHTRAIN_FAILURE_LOG"


def leaf_exceptions(exc: BaseException) -> list[BaseException]:
    """The exceptions at the leaves of `exc`'s exception-group tree, depth first in the groups'
    order; `[exc]` for an exception that is no group."""
    if isinstance(exc, BaseExceptionGroup):
        return [leaf for sub in exc.exceptions for leaf in leaf_exceptions(sub)]
    return [exc]


def group_depth(exc: BaseException) -> int:
    """How many exception groups deep `exc`'s deepest leaf is (0 for an exception that is no group)."""
    if isinstance(exc, BaseExceptionGroup):
        return 1 + max(group_depth(sub) for sub in exc.exceptions)
    return 0


def is_assertion(exc: BaseException) -> bool:
    return isinstance(exc, AssertionError | pytest.fail.Exception)


def innermost_frame(exc: BaseException) -> traceback.FrameSummary | None:
    """Where `exc` was raised: its traceback's last frame that is not hidden the way pytest hides
    frames (`__tracebackhide__`, as in pytest.fail itself)."""
    frames = [
        (frame, lineno)
        for frame, lineno in traceback.walk_tb(exc.__traceback__)
        if not frame.f_locals.get("__tracebackhide__", frame.f_globals.get("__tracebackhide__", False))
    ]
    if not frames:
        return None
    frame, lineno = frames[-1]
    return traceback.FrameSummary(frame.f_code.co_filename, lineno, frame.f_code.co_name)


def where(exc: BaseException, root: Path) -> str:
    frame = innermost_frame(exc)
    if frame is None:
        return "(no traceback)"
    path = Path(frame.filename)
    with contextlib.suppress(ValueError):
        path = path.relative_to(root)
    return f"{path}:{frame.lineno} in {frame.name}"


def headline(exc: BaseException) -> str:
    message = str(exc)
    return f"{type(exc).__name__}: {message}" if message else type(exc).__name__


def explain_group(group: BaseException, root: Path) -> tuple[str, BaseException]:
    """The text that opens a group failure's report: the first assertion among the group's leaves
    (the first leaf where none is an assertion) with its message and where it was raised, then one
    line for each other leaf. Returns it and the leaf it leads with."""
    leaves = leaf_exceptions(group)
    first = next((e for e in leaves if is_assertion(e)), leaves[0])
    lines = [headline(first), f"    at {where(first, root)}"]
    others = [e for e in leaves if e is not first]
    kind = f"{type(group).__name__}, {group_depth(group)} deep"
    if others:
        lines.append(f"the other {len(others)} leaf exception(s) of the {kind}:")
        for e in others:
            lines.append(f"    {headline(e).splitlines()[0][:LOG_LINE_CHARS]}  ({where(e, root)})")
    else:
        lines.append(f"the only leaf exception of the {kind}")
    return "\n".join(lines), first


@dataclasses.dataclass(eq=False)
class GroupFirstRepr(TerminalRepr):
    """A failure report that leads with `summary` and then shows the report pytest made; its
    `reprcrash` (the short summary line, junit's message) is the leading leaf's."""

    summary: str
    original: object
    reprcrash: ReprFileLocation | None

    def toterminal(self, tw) -> None:
        for i, line in enumerate(self.summary.splitlines()):
            tw.line(line, red=True, bold=i == 0)
        tw.sep("-", "the exception group as raised")
        if hasattr(self.original, "toterminal"):
            self.original.toterminal(tw)
        else:
            tw.line(str(self.original))


def is_log_name(name: str) -> bool:
    return any(fnmatch.fnmatch(name, pattern) for pattern in LOG_PATTERNS)


def paths_in(value: object, depth: int = 4) -> Iterator[Path]:
    """The absolute paths in a fixture's value: Paths and path strings, in containers and in the
    LOG_ATTRS of objects (read from the instance dict: no property runs)."""
    if isinstance(value, Path):
        if value.is_absolute():
            yield value
    elif isinstance(value, str):
        if value.startswith("/") and len(value) < 1024 and "\n" not in value:
            yield Path(value)
    elif depth <= 0:
        return
    elif isinstance(value, dict):
        for v in list(value.values())[:100]:
            yield from paths_in(v, depth - 1)
    elif isinstance(value, list | tuple | set | frozenset):
        for v in list(value)[:100]:
            yield from paths_in(v, depth - 1)
    else:
        attrs = getattr(value, "__dict__", None)
        if isinstance(attrs, dict):
            for name in LOG_ATTRS:
                if name in attrs:
                    yield from paths_in(attrs[name], depth - 1)


def logs_under(folder: Path) -> Iterator[Path]:
    seen = 0
    for dirpath, dirnames, filenames in os.walk(folder):
        seen += len(dirnames) + len(filenames)
        for name in filenames:
            if is_log_name(name):
                yield Path(dirpath, name)
        if seen > LOG_SCAN_ENTRIES:
            return


@dataclasses.dataclass(frozen=True)
class TestStart:
    """What was there when a test began: the files and folders written later are its own."""

    time: float
    tmp_folders: frozenset[str] | None  # the tmp_path_factory folders (None: no basetemp yet)
    spawned: int  # len(SPAWNED_LOGS)


STARTED = pytest.StashKey[TestStart]()


def basetemp_of(config: pytest.Config) -> Path | None:
    """pytest's basetemp, once a test has made one (looking does not make it)."""
    return getattr(getattr(config, "_tmp_path_factory", None), "_basetemp", None)


def tmp_folders(basetemp: Path | None) -> frozenset[str] | None:
    if basetemp is None:
        return None
    with contextlib.suppress(OSError):
        return frozenset(p.name for p in basetemp.iterdir() if not p.is_symlink() and p.is_dir())
    return frozenset()


def failed_test_logs(item: pytest.Item) -> list[Path]:
    """The log files a test's daemons may have written: under its tmp_path and the other
    tmp_path_factory folders its fixtures name or that were made since it began; under a
    temporary folder a fixture names; a log file a fixture names; a log `spawn` opened since the
    test began, or one written to since (a module fixture's daemon)."""
    start = item.stash.get(STARTED, None) or TestStart(time.time(), None, 0)
    basetemp = basetemp_of(item.config)
    tmp = Path(tempfile.gettempdir())
    folders: set[Path] = set()
    files: set[Path] = set()
    if basetemp is not None:
        before = start.tmp_folders or frozenset()
        folders.update(basetemp / name for name in (tmp_folders(basetemp) or frozenset()) - before)
    for value in getattr(item, "funcargs", {}).values():
        for path in paths_in(value):
            if basetemp is not None and path.is_relative_to(basetemp) and path != basetemp:
                folders.add(basetemp / path.relative_to(basetemp).parts[0])
            elif path.is_file():
                if is_log_name(path.name):
                    files.add(path)
            elif path.is_dir() and path.is_relative_to(tmp) and path != tmp:
                folders.add(path)
    files.update(SPAWNED_LOGS[start.spawned :])
    for path in SPAWNED_LOGS[: start.spawned]:
        with contextlib.suppress(OSError):
            # a daemon of a module fixture, still writing (0.05 s: file times tick coarser than time.time())
            if path.stat().st_mtime >= start.time - 0.05:
                files.add(path)
    for folder in folders:
        files.update(logs_under(folder))
    return sorted({p.resolve() for p in files if p.is_file() and not p.is_symlink()})


def log_tail(path: Path, lines: int = LOG_LINES_SHOWN, width: int = LOG_LINE_CHARS) -> list[str]:
    """The last `lines` lines of the file at `path`, each cut to `width` characters."""
    with open(path, "rb") as f:
        size = f.seek(0, os.SEEK_END)
        f.seek(max(0, size - LOG_TAIL_BYTES))
        text = f.read().decode("utf-8", "replace").splitlines()
    if size > LOG_TAIL_BYTES:
        text = text[1:]  # the first one read is likely cut
    return [line if len(line) <= width else line[: width - 3] + "..." for line in text[-lines:]]


def daemon_logs(item: pytest.Item) -> str:
    """The tails of a failed test's log files, the most recently written first (at most
    LOG_FILES_SHOWN of them, non-empty ones before empty ones); "" when it wrote none."""

    def recency(path: Path) -> tuple[bool, float]:
        try:
            st = path.stat()
        except OSError:
            return True, 0.0
        return st.st_size == 0, -st.st_mtime

    found = sorted(failed_test_logs(item), key=recency)
    if not found:
        return ""
    out: list[str] = []
    for path in found[:LOG_FILES_SHOWN]:
        try:
            tail_lines = log_tail(path)
        except OSError as e:
            tail_lines = [f"(unreadable: {e})"]
        out.append(f"==> {path} <== ({f'its last {len(tail_lines)} lines' if tail_lines else 'empty'})")
        out.extend(tail_lines)
    if len(found) > LOG_FILES_SHOWN:
        rest = found[LOG_FILES_SHOWN:]
        out.append(
            f"({len(rest)} more log files not shown: {', '.join(map(str, rest[:8]))}{' ...' if len(rest) > 8 else ''})"
        )
    return "\n".join(out)


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    path = os.environ.get(FAILURE_LOG_ENV)
    if not path or not report.failed or is_xdist_worker():
        return
    sections = "".join(f"\n----- {title}\n{text}" for title, text in report.sections)
    with contextlib.suppress(OSError), open(path, "a", encoding="utf-8") as f:
        f.write(f"===== {report.nodeid} ({report.when}, {time.strftime('%H:%M:%S')})\n")
        f.write(f"{report.longreprtext}{sections}\n\n")


def is_xdist_worker() -> bool:
    """In an xdist worker: its reports reach the controller, which writes them."""
    return "PYTEST_XDIST_WORKER" in os.environ


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item: pytest.Item) -> None:
    """Before any fixture: the files written from now on are this test's."""
    item.stash[STARTED] = TestStart(time.time(), tmp_folders(basetemp_of(item.config)), len(SPAWNED_LOGS))


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo):
    outcome = yield
    report = outcome.get_result()
    if not report.failed:
        return
    group = call.excinfo.value if call.excinfo is not None else None
    if isinstance(group, BaseExceptionGroup) and report.longrepr is not None:
        with contextlib.suppress(Exception):  # a report that explains less beats none
            summary, first = explain_group(group, item.config.rootpath)
            frame = innermost_frame(first)
            crash = ReprFileLocation(frame.filename, frame.lineno, headline(first)) if frame else None
            report.longrepr = GroupFirstRepr(summary, report.longrepr, crash)
    try:
        logs = daemon_logs(item)
    except Exception as e:  # never turn a failure report into an internal error
        logs = f"(could not collect the daemon logs: {e!r})"
    if logs:
        report.sections.append(("daemon logs", logs))
