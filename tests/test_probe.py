"""The silence probe (collective/probe.py) over real hosts on loopback: a peer that leaves a WHERE
probe unanswered may be silent — unless our own loop ran late past the probe's deadline, when the
answer may be lying unread and the probe proves nothing."""

from __future__ import annotations

import time
from contextlib import AsyncExitStack

import trio

from meshtrain.collective.probe import LATE_S, probe_where
from meshtrain.collective.protocol import PROBE_EVERY, WHERE_RPC

from .test_allreduce import connected_peers


async def stopped(sender: str, request: object) -> object:
    """A WHERE handler that never answers: a SIGSTOPped peer, as its prober sees it."""
    await trio.sleep_forever()


async def test_an_unanswered_probe_may_be_silence_but_not_when_our_own_loop_ran_late():
    async with AsyncExitStack() as stack:
        us, them = await connected_peers(stack, 2)
        them.host.rpc.serve(WHERE_RPC, stopped)
        # Our loop on time: the deadline passed with no answer, and the peer may be silent.
        assert await probe_where(us.host, them.id, "f0", 7) is True

        # Our loop starved past the deadline (a loaded machine; in-process peers share one
        # loop): the unanswered probe proves nothing of the peer.
        verdict: list[object] = []

        async def probe() -> None:
            verdict.append(await probe_where(us.host, them.id, "f0", 7))

        async with trio.open_nursery() as nursery:
            nursery.start_soon(probe)
            await trio.sleep(0.1)  # sleep: the probe is out
            time.sleep(PROBE_EVERY + 2 * LATE_S)  # sleep: blocks our loop past the deadline, what is tested
        assert verdict == [False]
