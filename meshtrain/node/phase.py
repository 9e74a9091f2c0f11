"""Where a node is in its life and how it is stopped: `Phase`, `StopRequest`, `NodeError`.

`Phase` is the node's state (starting, preparing, syncing, training, stopping) with its recent history, so
a console polling slower than the changes still prints each one; the status document, the
console and the training run read it, the run state and the training run set it. `StopRequest`
is how a stop reaches the trainer's thread (a `threading.Event`) and the trio tasks (a
`trio.Event`): `Node.stop`, a signal, `node stop` through the status endpoint. `NodeError` is a
node that cannot start or continue as asked, with a message that says why; `StoppedWhileStarting`
a stop that came before the first step (nothing to save: the CLI exits 130).
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Awaitable, Callable
from typing import TypeVar

import trio

from meshtrain.errors import MeshtrainError

T = TypeVar("T")

STATE_LOG = 8  # the status document keeps this many recent states


class NodeError(MeshtrainError):
    """The node cannot start or continue (no spec, swarm unreachable, state download failed)."""


class StoppedWhileStarting(NodeError):
    """Stopped (Ctrl-C, SIGTERM, `node stop`) before the node trained: nothing to save. The CLI
    exits 130, as for any interrupt."""


class Phase:
    """The node's state — starting, preparing, syncing, training, stopping — and its last `STATE_LOG`
    values, with how many changes there were (`meshtrain.node.status.console` prints each)."""

    def __init__(self) -> None:
        self._states: deque[str] = deque(["starting"], maxlen=STATE_LOG)
        self.changes = 0
        self._listeners: list[Callable[[str], None]] = []

    def on_change(self, listener: Callable[[str], None]) -> None:
        """Call `listener(new_state)` on every change from now on (on the caller's thread)."""
        self._listeners.append(listener)

    @property
    def value(self) -> str:
        return self._states[-1]

    def set(self, value: str) -> None:
        if value != self._states[-1]:
            self._states.append(value)
            self.changes += 1
            for listener in self._listeners:
                listener(value)

    def recent(self) -> list[str]:
        return list(self._states)


class StopRequest:
    """A stop, seen by the trainer's thread (`flag`) and by trio tasks (`requested`). `set()` is
    called on the trio thread (`Node.stop` hops there)."""

    def __init__(self) -> None:
        self.flag = threading.Event()
        self.requested = trio.Event()

    def set(self) -> None:
        self.flag.set()
        self.requested.set()

    def is_set(self) -> bool:
        return self.flag.is_set()

    async def sleep(self, seconds: float) -> None:
        """Sleep, or return early when a stop is requested."""
        with trio.move_on_after(seconds):
            await self.requested.wait()

    async def before_stop(self, start: Callable[[], Awaitable[T]], why: str) -> T:
        """`await start()`, a step of start-up, cancelled by a stop: its result, or
        `StoppedWhileStarting(why)` when the stop came first."""
        done: list[T] = []
        async with trio.open_nursery() as nursery:

            async def cancel_on_stop() -> None:
                await self.requested.wait()
                nursery.cancel_scope.cancel()

            nursery.start_soon(cancel_on_stop)
            done.append(await start())
            nursery.cancel_scope.cancel()
        if not done:
            raise StoppedWhileStarting(why)
        return done[0]
