"""The one logging setup: structured `key=value` lines, quiet by default.

py-libp2p logs noisily to the root logger (LIBP2P-NOTES.md), so `configure` silences third-party
loggers below WARNING unless asked for debug output, and routes ours through one formatter.
Use `get_logger(__name__)` and pass context as keyword arguments to `kv`:

    log.info(kv("allreduce done", round=3, peers=4, seconds=1.2))
"""

from __future__ import annotations

import logging
import os
import sys

_NOISY = ("libp2p", "multiaddr", "async_service", "trio", "asyncio", "urllib3")


def kv(event: str, **fields: object) -> str:
    """Render one structured log line: the event, then `key=value` pairs in a stable order."""
    if not fields:
        return event
    return event + " " + " ".join(f"{k}={v}" for k, v in fields.items())


def get_logger(name: str) -> logging.Logger:
    return logging.getLogger(name)


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
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s %(message)s"))
    root.addHandler(handler)
    root.setLevel(logging.WARNING)
    logging.getLogger("meshtrain").setLevel(level)
    # py-libp2p logs every failed dial to a departed peer at ERROR: noise for users.
    third_party = logging.DEBUG if os.environ.get("MESHTRAIN_LOG_LIBP2P") else logging.CRITICAL
    for name in _NOISY:
        logging.getLogger(name).setLevel(third_party)
