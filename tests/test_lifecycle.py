"""`Service`: a start that fails half-way unwinds what it entered, even with tasks running."""

from __future__ import annotations

from contextlib import AsyncExitStack

import pytest
import trio

from meshtrain.lifecycle import Service


class _Failing(Service):
    def __init__(self) -> None:
        self.closed = False

    async def _start(self, stack: AsyncExitStack) -> None:
        stack.callback(setattr, self, "closed", True)
        self._nursery = await stack.enter_async_context(trio.open_nursery())
        self._nursery.start_soon(trio.sleep_forever)
        raise RuntimeError("start failed")


class _Counting(Service):
    def __init__(self) -> None:
        self.events: list[str] = []

    async def _start(self, stack: AsyncExitStack) -> None:
        stack.callback(self.events.append, "unwound")
        self._nursery = await stack.enter_async_context(trio.open_nursery())
        self._nursery.start_soon(trio.sleep_forever)

    async def _stop(self) -> None:
        assert self._nursery is not None  # still up when _stop runs
        self.events.append("stop")


async def test_failed_start_cancels_its_tasks_and_unwinds():
    svc = _Failing()
    with trio.fail_after(5), pytest.raises(RuntimeError, match="start failed"):
        async with svc:
            pass
    assert svc.closed and svc._nursery is None


async def test_stop_runs_first_then_tasks_are_cancelled_and_the_stack_unwinds():
    svc = _Counting()
    with trio.fail_after(5):
        async with svc:
            assert svc._nursery is not None
    assert svc.events == ["stop", "unwound"] and svc._nursery is None
    assert await svc.__aexit__(None, None, None) is None  # leaving twice is harmless
