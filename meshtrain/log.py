"""The one logging setup: structured `key=value` lines, quiet by default.

py-libp2p logs noisily to the root logger (docs/libp2p-notes.md), so `configure` silences third-party
loggers below WARNING unless asked for debug output, and routes ours through one formatter.
py-libp2p also resets its own logger when it is first imported (level WARNING, no handler, not
propagating): its errors then went to Python's last-resort handler as bare lines on stderr ("fail
to upgrade mux for peer …", a seven-line "Failed to open stream" per failed dial) in every node's
console. `quiet_third_party` undoes that; transport/host.py, where py-libp2p is imported, calls it.
Use `get_logger(__name__)` and pass context as keyword arguments to `kv`:

    log.info(kv("allreduce done", round=3, peers=4, seconds=1.2))
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
from collections.abc import Callable
from contextlib import AbstractContextManager

_NOISY = ("libp2p", "multiaddr", "async_service", "trio", "asyncio", "urllib3")

_third_party_level = logging.CRITICAL  # the least level of a _NOISY logger's line we write (`quiet_third_party`)

# Entered around every log line written (see `set_emit_guard`); None: nothing to guard.
_emit_guard: Callable[[], AbstractContextManager[None]] | None = None


def kv(event: str, **fields: object) -> str:
    """Render one structured log line: the event, then `key=value` pairs in a stable order."""
    if not fields:
        return event
    return event + " " + " ".join(f"{k}={v}" for k, v in fields.items())


def get_logger(name: str) -> logging.Logger:
    return logging.getLogger(name)


def set_emit_guard(guard: Callable[[], AbstractContextManager[None]] | None) -> None:
    """Have every log line written inside `guard()` (None: unguarded). A live status line on the
    terminal (`meshtrain.node.status.console`) uses it to clear itself before a log line and redraw
    itself after, so the two never print over each other."""
    global _emit_guard
    _emit_guard = guard


class _Handler(logging.StreamHandler):
    """Writes to whatever `sys.stderr` is when a line is logged, not what it was at `configure`
    (as the standard library's last-resort handler does): a stream swapped out and closed since
    (pytest's capture, a redirected CLI run in-process) would turn every later line into a
    "Logging error" traceback."""

    @property  # type: ignore[override]
    def stream(self):  # noqa: ANN201 - the base class's attribute, made to follow sys.stderr
        return sys.stderr

    @stream.setter
    def stream(self, value: object) -> None:
        pass

    def emit(self, record: logging.LogRecord) -> None:
        # Third-party loggers that set their own level (py-libp2p's auto-connector: INFO) pass the
        # level set on their parent: the bar is held here too (`quiet_third_party`).
        if record.levelno < _third_party_level and record.name.partition(".")[0] in _NOISY:
            return
        guard = _emit_guard
        with guard() if guard is not None else contextlib.nullcontext():
            super().emit(record)


def configure(level: str | int | None = None) -> None:
    """Configure logging once for a process. Level from the argument, else MESHTRAIN_LOG, else WARNING."""
    level = level or os.environ.get("MESHTRAIN_LOG", "WARNING")
    if isinstance(level, str):
        level = logging.getLevelName(level.upper())
        if not isinstance(level, int):
            level = logging.WARNING
    root = logging.getLogger()
    for h in list(root.handlers):
        root.removeHandler(h)
    handler = _Handler()
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s %(message)s"))
    root.addHandler(handler)
    root.setLevel(logging.WARNING)
    logging.getLogger("meshtrain").setLevel(level)
    quiet_third_party()


def quiet_third_party() -> None:
    """Third-party loggers at CRITICAL (DEBUG with MESHTRAIN_LOG_LIBP2P=1), through the root
    logger's handler. py-libp2p logs every failed dial to a departed peer at ERROR: noise for users."""
    global _third_party_level
    _third_party_level = logging.DEBUG if os.environ.get("MESHTRAIN_LOG_LIBP2P") else logging.CRITICAL
    for name in _NOISY:
        logger = logging.getLogger(name)
        logger.setLevel(_third_party_level)
        logger.propagate = True
