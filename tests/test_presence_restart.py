"""What a restarted node's presence (node/presence.py) takes from its last life, with real hosts
on loopback: its progress record of the last life is not a sign that this life trains, to
itself or to its peers.

The coordinator waits for its own trainer while it trains (`reported_step` of ourselves: a fresh
progress record) and goes on without it once it fetches a state (collective/missing_peers.py
`_own_trainer_away`). A record from our last life, replicated back to us by a peer, is dated
fresh as it arrives; read as this life's, it made a restarted coordinator that was still
downloading look like one that trains. To its peers the same record stayed fresh for a few
heartbeats after the restart (it was rewritten every heartbeat while the peer trained): the
only other trainer's round then counted as a solo round beside a live trainer (a 30-minute
soak's fourth solo round, stop 64), and a coordinator took the restart for a peer about to join.
The membership record of each life now says when it began (swarm_records.py, "A peer's life").
A restart connects to its peers before that record reaches them, though: until a progress record
comes after the new connection, its last life's still count for nothing (`heard_since_connected`).
"""

from __future__ import annotations

from contextlib import AsyncExitStack

from meshtrain.crdt.types import now_ms
from meshtrain.transport.identity import Identity

from .test_strikes import presence, swarm_spec, until


async def test_our_progress_record_from_a_last_life_is_not_this_lifes(tmp_path) -> None:
    ids = [Identity.generate() for _ in range(2)]
    signed = swarm_spec(ids[0])
    async with AsyncExitStack() as outer:
        b = await presence(outer, signed, ids[1], entry=None, data_dir=tmp_path / "b")
        async with AsyncExitStack() as first_life:
            a = await presence(first_life, signed, ids[0], entry=b.host.addrs[0], data_dir=tmp_path / "a")
            assert a.view is not None
            a.view.report_progress(step=40, outer_round=4)
            await until(lambda: a.reported_step(a.me) == 40, "a's own record of this life")
            await until(lambda: b.reported_step(a.me) == 40, "a's record to reach b")
            last_write = a.view.progress_of(a.me)
            assert last_write is not None
        await until(lambda: now_ms() > last_write.updated_ms, "the wall clock to pass the first life's last write")
        a = await presence(outer, signed, ids[0], entry=b.host.addrs[0], data_dir=tmp_path / "a")
        assert a.view is not None
        await until(lambda: (r := a.view.progress_of(a.me)) is not None and r.step == 40, "b to hand back a's record")
        assert a.reported_step(a.me) is None  # fresh as it arrived, but not this life's
        await until(lambda: b.view.life_of(a.me) == a.started_ms, "a's membership record of this life to reach b")
        assert b.reported_step(a.me) is None  # to b too: still fresh by b's clock, but of a's last life
        assert a.me not in b.training_peers(connected=False)
        a.view.report_progress(step=44, outer_round=5)
        await until(lambda: a.reported_step(a.me) == 44, "a's record of this life")
        await until(lambda: b.reported_step(a.me) == 44, "a's record of this life to reach b")
        assert a.me in b.training_peers(connected=False)


async def test_a_peer_connected_anew_has_not_been_heard_training_until_it_reports_again(tmp_path) -> None:
    """Stop 67's 30-minute soak: a round alone was counted solo beside a partner killed 9 s
    before — its restart's host had connected to us 1 s before the round ended, its new
    membership record not yet here, so its last life's records (fresh, of that life) read as a
    trainer's. Here a's connection to b closes and a new one opens, as a restart's would: the
    records b holds from before say nothing about the process at the other end now."""
    ids = [Identity.generate() for _ in range(2)]
    signed = swarm_spec(ids[0])
    async with AsyncExitStack() as outer:
        b = await presence(outer, signed, ids[1], entry=None, data_dir=tmp_path / "b")
        a = await presence(outer, signed, ids[0], entry=b.host.addrs[0], data_dir=tmp_path / "a")
        assert a.view is not None
        a.view.report_progress(step=40, outer_round=4)
        await until(lambda: b.reported_step(a.me) == 40, "a's record to reach b")
        assert a.me in b.training_peers(connected=True) and b.heard_since_connected(a.me)
        await b.host.disconnect(a.me)
        assert not b.heard_since_connected(a.me)
        await a.host.connect(b.host.addrs[0])
        await until(lambda: b.host.is_connected(a.me), "a new connection")
        assert a.me in b.training_peers(connected=True)  # its records from before, still fresh ...
        assert not b.heard_since_connected(a.me)  # ... but none heard over this connection
        a.view.report_progress(step=44, outer_round=5)
        await until(lambda: b.heard_since_connected(a.me) and b.reported_step(a.me) == 44, "a's next record")
