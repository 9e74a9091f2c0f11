"""Validators for untrusted input: one small set of checks every layer uses.

Everything that arrives from the network (RPC requests and replies, data-plane headers, CRDT
deltas, DHT records, downloaded state) is a msgpack value of unknown shape until checked. These
functions check one field each and return it typed, or raise. By default they raise `Malformed`,
which the RPC layer answers with the error code `malformed` (rpc.py) — so a handler just calls
them; a layer with its own error type passes `error=` (a callable taking the message), e.g.
`error=CrdtError`.

Two traps they close once for everyone: `bool` is a subclass of `int` in Python (`True` must not
pass as a round id), and a list or string from a peer may be arbitrarily long (the `max_len`
bounds). Checks are explicit `if`s, never `assert` (stripped under `-O`).

This module is pure (no I/O, no libp2p), so layers beside the stack (models/) may use it too.
Not here: the wire codec and frame limits (framing.py), what a valid message of a protocol is
(each protocol's own `parse`).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any, TypeGuard

from meshtrain.errors import MeshtrainError

# RPC error codes shared by several protocols: one spelling each.
MALFORMED = "malformed"  # the request does not have the shape the protocol expects
WRONG_SWARM = "wrong-swarm"  # the request names a swarm this peer does not serve
UNAVAILABLE = "unavailable"  # the service is not running (yet, or any more)


class Malformed(MeshtrainError):
    """Untrusted input failed a check. An RPC handler that raises it answers code `malformed`."""

    code = MALFORMED


ErrorFactory = Callable[[str], Exception]


def is_int(x: Any) -> TypeGuard[int]:
    """An int, and not a bool."""
    return isinstance(x, int) and not isinstance(x, bool)


def is_number(x: Any) -> TypeGuard[int | float]:
    """An int or a float, and not a bool (NaN and inf included: see `require_number`)."""
    return isinstance(x, int | float) and not isinstance(x, bool)


def require_map(value: Any, *keys: str, what: str = "message", error: ErrorFactory = Malformed) -> dict[Any, Any]:
    """A map holding at least `keys`."""
    if not isinstance(value, dict):
        raise error(f"{what}: expected a map, got {type(value).__name__}")
    missing = [k for k in keys if k not in value]
    if missing:
        raise error(f"{what} lacks fields {missing}")
    return value


def require_int(
    value: Any, what: str, lo: int | None = None, hi: int | None = None, *, error: ErrorFactory = Malformed
) -> int:
    """An int (not a bool) in lo..hi (inclusive; None: unbounded on that side)."""
    if not is_int(value):
        raise error(f"{what} must be an integer, got {type(value).__name__}")
    if (lo is not None and value < lo) or (hi is not None and value > hi):
        raise error(f"{what} {value} is outside {'' if lo is None else lo}..{'' if hi is None else hi}")
    return value


def require_number(
    value: Any,
    what: str,
    lo: float | None = None,
    hi: float | None = None,
    *,
    finite: bool = True,
    error: ErrorFactory = Malformed,
) -> float:
    """An int or float (not a bool), finite unless `finite=False`, in lo..hi (inclusive)."""
    if not is_number(value) or (finite and not math.isfinite(value)):
        raise error(f"{what} must be a {'finite ' if finite else ''}number, got {value!r:.40}")
    if (lo is not None and value < lo) or (hi is not None and value > hi):
        raise error(f"{what} {value} is outside {'' if lo is None else lo}..{'' if hi is None else hi}")
    return value


def require_bool(value: Any, what: str, *, error: ErrorFactory = Malformed) -> bool:
    if not isinstance(value, bool):
        raise error(f"{what} must be a bool")
    return value


def require_str(value: Any, what: str, max_len: int | None = None, *, error: ErrorFactory = Malformed) -> str:
    if not isinstance(value, str) or (max_len is not None and len(value) > max_len):
        raise error(f"{what} must be a string" + (f" of at most {max_len} characters" if max_len else ""))
    return value


def require_bytes(
    value: Any, what: str, *, length: int | None = None, max_len: int | None = None, error: ErrorFactory = Malformed
) -> bytes:
    if (
        not isinstance(value, bytes)
        or (length is not None and len(value) != length)
        or (max_len is not None and len(value) > max_len)
    ):
        size = f" of {length} bytes" if length is not None else (f" of at most {max_len} bytes" if max_len else "")
        raise error(f"{what} must be bytes{size}")
    return value


def require_list(
    value: Any, what: str, *, length: int | None = None, max_len: int | None = None, error: ErrorFactory = Malformed
) -> list[Any]:
    """A list of exactly `length`, or at most `max_len`, items."""
    if (
        not isinstance(value, list)
        or (length is not None and len(value) != length)
        or (max_len is not None and len(value) > max_len)
    ):
        size = f" of {length} items" if length is not None else (f" of at most {max_len} items" if max_len else "")
        raise error(f"{what} must be a list{size}")
    return value


def require_str_list(value: Any, what: str, max_len: int, *, error: ErrorFactory = Malformed) -> list[str]:
    """A list of at most `max_len` strings."""
    items = require_list(value, what, max_len=max_len, error=error)
    if not all(isinstance(x, str) for x in items):
        raise error(f"{what} must hold strings only")
    return items
