"""Waiting for a coordinator's reply to our join, while it is still the round's coordinator.

Problem. A member joins a round at the lowest candidate of its view and waits for the reply that
fixes the group. Membership moves meanwhile: the coordinator may be excluded by strikes
(node/trust/strikes.py), or leave the swarm, while it stays connected and keeps our join open. The
others, who no longer count it, form the round at the next lowest candidate, and wait there for
us; we wait at a coordinator they will never join. Nothing ends that but the join deadline. A test
of real daemons saw 25 s of it: the swarm's lowest id was a liar that screening struck out in the
very round whose joins had gone out to it (prepared joins go out a second ahead: prepared.py),
and two honest peers waited at it while the third waited for them elsewhere.

Design. `await_join_reply` runs the wait beside a watcher that reads the round's candidates every
`CHECK_S`. Once the coordinator has been missing from them for `GONE_S` (two checks, so one odd
read of a moving view does not split a round), it cancels the wait and returns None; the round
loop then restarts the round at the next live candidate, where the others are, as for a
coordinator that died (`CoordinatorLost`: coordinator_client.py, member_round.py).

Withdrawing. Whenever the wait ends without the reply — given up here, or cancelled from outside
(the member found the coordinator silent, or its exchange was ended) — the join is withdrawn, in
the background (`withdraw`: coordinator_client.py). Out of *our* candidates is not out of the
coordinator's: a 30-minute soak's joiner gave up a restarted coordinator that did count it, and
that coordinator fixed a group with the join 2 s later, its own trainer away — the trainer, back,
was told "joined after the group was formed" for 27 s (coordinator.py "Withdrawn joins"). A
wait that ends with an error (refused, or unreachable) withdraws nothing: no join is held.

Wire. WITHDRAW_RPC (protocol.py) once the wait ends without a reply.

What "left" means. Out of the round's candidates *and* no longer present in the swarm, where the
collective knows (`SwarmCollective(present=...)`: live, admitted, connected, any role). A
restarted coordinator re-enters as "syncing" for a moment; its new record can reach us after we
joined it at its old one, and it keeps our join and counts us: a daemon test saw a peer leave
such a round, finish it alone, and the coordinator wait 20 s for its data and then finish it
alone too — two φ for one round. An excluded peer (strikes) or one that left is not present.

Failures. A connection that closes makes the wait fail by itself (the RPC ends) before the
watcher sees anything. A coordinator that drops out of our view and returns within `GONE_S` is
kept. One that drops out for longer while the others still follow it loses us to the next
candidate, which then hands the round back (`Moved`, the coordinator's hand-over) once our view
holds the lower id again.

Not here: who coordinates, joins and hand-overs (member_round.py, coordinator.py).
"""

from __future__ import annotations

import contextlib
from collections.abc import Awaitable, Callable
from typing import TypeVar

import trio

CHECK_S = 0.5  # seconds between two reads of the round's candidates
GONE_S = 1.0  # seconds the coordinator must be missing from them before we stop waiting

Reply = TypeVar("Reply")


async def await_join_reply(
    reply: Callable[[], Awaitable[Reply]],
    is_candidate: Callable[[], bool],
    nursery: trio.Nursery,
    withdraw: Callable[[], Awaitable[object]] | None = None,
) -> Reply | None:
    """`await reply()`, or None once `is_candidate()` has been false for `GONE_S` (the watcher
    runs in `nursery`, and ends with the wait). Ended without the reply (None, or cancelled),
    `withdraw()` runs in `nursery` ("Withdrawing")."""
    waiting, watching = trio.CancelScope(), trio.CancelScope()
    replied = False

    async def watch() -> None:
        with watching:
            gone_since = None
            while True:
                await trio.sleep(CHECK_S)
                if is_candidate():
                    gone_since = None
                elif gone_since is None:
                    gone_since = trio.current_time()
                elif trio.current_time() - gone_since >= GONE_S - 1e-9:
                    waiting.cancel()
                    return

    nursery.start_soon(watch)
    try:
        with waiting:
            try:
                got = await reply()
            except Exception:
                replied = True  # refused, or unreachable: no join is held there
                raise
            replied = True
            return got
    finally:
        watching.cancel()
        if not replied and withdraw is not None:
            with contextlib.suppress(RuntimeError):  # the collective is closing: nobody to tell
                nursery.start_soon(withdraw)
    return None  # the wait was cancelled: the coordinator left the round's candidates
