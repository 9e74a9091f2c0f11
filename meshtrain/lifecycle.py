"""`Service`: the one lifecycle of our long-lived async context managers.

The host, the data plane, the DHT, discovery, the CRDT replica and swarm view, the NAT-traversal
services, the collective, the pipeline runtime and the outer optimizer each enter several
resources in order — py-libp2p services, a nursery for background tasks, RPC handlers, notifees —
which must unwind in reverse when the service is left *and* when starting fails half-way. One
`AsyncExitStack` per service carries both; this base class owns it, so a subclass only says what
to start (`_start`) and, if anything must happen while everything is still up, what to do first
on the way out (`_stop`). Leaving cancels the service's nursery before unwinding the stack, so
background tasks stop before the resources under them close.
"""

from __future__ import annotations

from contextlib import AsyncExitStack
from typing import Any, Self

import trio


class Service:
    """Subclasses implement `_start(stack)`: enter resources on `stack`, and put a nursery for
    background tasks in `self._nursery` if they have one."""

    _stack: AsyncExitStack | None = None
    _nursery: trio.Nursery | None = None

    async def _start(self, stack: AsyncExitStack) -> None:
        raise NotImplementedError

    async def _stop(self) -> None:
        """Runs first when leaving, while the nursery and every resource are still up."""

    async def __aenter__(self) -> Self:
        stack = AsyncExitStack()
        await stack.__aenter__()
        try:
            await self._start(stack)
        except BaseException:
            # Tasks already started must not keep the half-started service's nursery open.
            if self._nursery is not None:
                self._nursery.cancel_scope.cancel()
            self._nursery = None
            await stack.aclose()
            raise
        self._stack = stack
        return self

    async def __aexit__(self, *exc: Any) -> bool | None:
        stack, self._stack = self._stack, None
        if stack is None:  # never entered, or already left
            return None
        try:
            await self._stop()
        finally:  # even if stopping failed: cancel the tasks and unwind
            if self._nursery is not None:
                self._nursery.cancel_scope.cancel()
            try:
                suppress = await stack.__aexit__(*exc)
            finally:
                self._nursery = None
        return suppress
