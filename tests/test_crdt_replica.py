"""The CRDT replica and the swarm view on real py-libp2p hosts over loopback.

Peers are connected in a line, so a write must cross several gossip hops (or anti-entropy
exchanges) to reach the far end; partitions are made by closing connections, which the replica
never re-dials by itself.
"""

from __future__ import annotations

import math
import time
from contextlib import AsyncExitStack

import pytest
import trio
from hypothesis import given, settings
from hypothesis import strategies as st
from libp2p.network.stream.exceptions import StreamError
from libp2p.pubsub.gossipsub import PROTOCOL_ID_V11, GossipSub
from libp2p.pubsub.pubsub import Pubsub
from libp2p.tools.anyio_service import background_trio_service

from meshtrain.crdt import (
    CrdtError,
    CrdtSpec,
    GCounter,
    LWWMap,
    LWWRegister,
    MalformedCrdtData,
    NotSwarmOwner,
    Replica,
    ReplicaConfig,
    SignedEntry,
    SwarmView,
    gossip_topic,
    swarm_specs,
)
from meshtrain.crdt.anti_entropy import RPC_DIGEST
from meshtrain.crdt.entries import encode_entries
from meshtrain.crdt.gossip import decode_gossip, encode_gossip, split_batches
from meshtrain.crdt.heartbeat_rate import heartbeat_interval_for
from meshtrain.crdt.replica import EntryTooLarge
from meshtrain.crdt.strikes import Strike, record_of
from meshtrain.crdt.swarm_view import MEMBERSHIP, STRIKES
from meshtrain.crdt.types import now_ms
from meshtrain.transport.framing import packb
from meshtrain.transport.host import Host
from meshtrain.transport.identity import Identity
from meshtrain.transport.rpc import RemoteError

from .conftest import start_peers

SWARM = "test-swarm"
# Anti-entropy every 0.3 s keeps the tests short; gossip-only tests push it out of the way.
FAST = ReplicaConfig(anti_entropy_interval=0.3, rpc_timeout=3.0)
GOSSIP_ONLY = ReplicaConfig(anti_entropy_interval=600.0, rpc_timeout=3.0)
SPECS = [
    CrdtSpec("samples", "gcounter"),
    CrdtSpec("steps", "maxregister"),
    CrdtSpec("members", "orset"),
    CrdtSpec("notes", "lwwmap"),
]


# --- helpers --------------------------------------------------------------------------------------


async def start_hosts(stack: AsyncExitStack, n: int) -> list[Host]:
    hosts = []
    for _ in range(n):
        (peer,) = await start_peers(stack, 1, streams=False)
        hosts.append(peer.host)
    return hosts


async def start_replicas(stack, hosts, specs=SPECS, config=FAST) -> list[Replica]:
    return [await stack.enter_async_context(Replica(h, SWARM, specs, config=config)) for h in hosts]


async def connect_line(hosts: list[Host]) -> None:
    for left, right in zip(hosts, hosts[1:], strict=False):
        await right.connect(left.addrs[0])


async def wait_until(predicate, timeout: float, what: str) -> float:
    start = trio.current_time()
    try:
        with trio.fail_after(timeout):
            while not predicate():
                await trio.sleep(0.02)  # sleep: poll interval
    except trio.TooSlowError:
        raise AssertionError(f"not within {timeout} s: {what}") from None
    return trio.current_time() - start


def same_state(replicas: list[Replica]) -> bool:
    return len({r.fingerprint() for r in replicas}) == 1


def greetings_done(replicas: list[Replica]) -> int:
    """Anti-entropy exchanges the replicas started that ended, completed or failed."""
    return sum(r.stats.ae_exchanges + r.stats.ae_failed for r in replicas)


def gossip_meshed(replicas: list[Replica]) -> bool:
    """Every replica's gossipsub mesh holds every peer it is connected to."""
    for r in replicas:
        mesh = {p.to_base58() for p in r.pubsub.router.mesh.get(r.topic, set())}
        if not set(r.host.connected_peers()) <= mesh:
            return False
    return True


async def disconnect(a: Host, b: Host) -> None:
    """Close the link and forget the addresses, so that nothing in py-libp2p can re-dial it
    (a stream opened to an unconnected peer dials it from the peerstore)."""
    for x, y in ((a, b), (b, a)):
        x.libp2p.get_peerstore().clear_addrs(y.identity.peer_id)
        await x.disconnect(y.peer_id)
    await wait_until(lambda: not a.is_connected(b.peer_id) and not b.is_connected(a.peer_id), 5, "disconnect")


def write_everything(replica: Replica, i: int) -> None:
    replica.write("samples", lambda c, me: c.increment(me, 10 + i))
    replica.write("steps", lambda c, me: c.publish(me, 100 * i))
    replica.write("members", lambda c, me: c.add(me, me.peer_id_str))
    replica.write("notes", lambda c, me: c.set(me, f"peer-{i}", {"i": i}))


# --- replica ------------------------------------------------------------------------------------


async def test_eight_peers_in_a_line_converge_by_gossip_alone_after_concurrent_writes():
    async with AsyncExitStack() as stack:
        hosts = await start_hosts(stack, 8)
        replicas = await start_replicas(stack, hosts, config=GOSSIP_ONLY)
        await connect_line(hosts)
        await wait_until(lambda: gossip_meshed(replicas), 10, "gossipsub meshes formed")
        # New links are greeted by one anti-entropy exchange (started by the smaller id): let them pass.
        await wait_until(lambda: greetings_done(replicas) >= len(hosts) - 1, 10, "every link greeted")

        for i, r in enumerate(replicas):  # every peer writes every CRDT, all at once
            write_everything(r, i)
        await wait_until(lambda: same_state(replicas), 10, "identical digests on 8 peers")

        ids = {h.peer_id for h in hosts}
        for r in replicas:
            assert r.crdt("samples").value() == sum(10 + i for i in range(8))
            assert set(r.crdt("steps").value().values()) == {100 * i for i in range(8)}
            assert r.crdt("members").value() == ids
            assert r.crdt("notes").value() == {f"peer-{i}": {"i": i} for i in range(8)}
            # gossip crossed 7 hops on its own: anti-entropy moved nothing
            assert r.stats.ae_entries_pulled == 0 and r.stats.ae_entries_pushed == 0
            assert r.stats.entries_rejected == 0 and r.stats.gossip_invalid == 0
        # writes coalesce: four writes made back to back went out as one gossip message
        assert all(r.stats.gossip_published == 1 for r in replicas)


async def test_partitioned_halves_converge_by_anti_entropy_after_the_heal():
    async with AsyncExitStack() as stack:
        hosts = await start_hosts(stack, 8)
        replicas = await start_replicas(stack, hosts)
        await connect_line(hosts)
        await wait_until(lambda: gossip_meshed(replicas), 10, "gossipsub meshes formed")

        await disconnect(hosts[3], hosts[4])  # 0-1-2-3 | 4-5-6-7
        left, right = replicas[:4], replicas[4:]
        for i, r in enumerate(replicas):
            write_everything(r, i)
        await wait_until(lambda: same_state(left) and same_state(right), 10, "halves converge")
        # Outlast gossipsub's message-cache window (3 heartbeats of 1 s): py-libp2p replays
        # that window to a newly connected peer, which would heal a short partition by itself.
        await trio.sleep(3.5)  # sleep: the partition must outlast that window
        assert not hosts[3].is_connected(hosts[4].peer_id)  # nobody re-dialled
        assert left[0].fingerprint() != right[0].fingerprint()
        assert left[0].crdt("samples").value() == sum(10 + i for i in range(4))

        await hosts[4].connect(hosts[3].addrs[0])  # heal
        took = await wait_until(lambda: same_state(replicas), 10, "convergence after the heal")
        for r in replicas:
            assert r.crdt("samples").value() == sum(10 + i for i in range(8))
            assert len(r.crdt("members").value()) == 8
        # repaired by anti-entropy across the healed link, then re-gossiped to each side
        assert sum(r.stats.ae_entries_pulled + r.stats.ae_entries_pushed for r in replicas) > 0
        assert sum(r.stats.entries_regossiped for r in replicas) > 0
        assert took < 5.0


async def test_a_peer_that_missed_gossip_catches_up_by_anti_entropy():
    async with AsyncExitStack() as stack:
        hosts = await start_hosts(stack, 3)
        replicas = await start_replicas(stack, hosts[:2])
        await connect_line(hosts[:2])
        for i, r in enumerate(replicas):
            write_everything(r, i)
        await wait_until(lambda: same_state(replicas), 10, "first two converge")
        # a latecomer (state written before it existed is never gossiped again)
        late = await stack.enter_async_context(Replica(hosts[2], SWARM, SPECS, config=FAST))
        await hosts[2].connect(hosts[1].addrs[0])
        assert await late.recover(timeout=5)
        assert late.fingerprint() == replicas[0].fingerprint()


async def test_forged_and_tampered_deltas_from_a_hostile_peer_are_rejected():
    async with AsyncExitStack() as stack:
        hosts = await start_hosts(stack, 4)
        owner = hosts[0].identity
        specs = [*SPECS, CrdtSpec("config", "lwwmap", writers=frozenset({owner.peer_id_str}))]
        replicas = await start_replicas(stack, hosts, specs=specs)
        await connect_line(hosts)
        for i, r in enumerate(replicas):
            write_everything(r, i)
        replicas[0].write("config", lambda c, me: c.set(me, "lr", 0.7))
        await wait_until(lambda: same_state(replicas), 10, "honest peers converge")
        before = replicas[0].fingerprint()

        # The hostile peer speaks raw gossipsub and raw RPC, next to honest peer 1.
        evil = await stack.enter_async_context(Host(Identity.generate()))
        router = GossipSub(
            [PROTOCOL_ID_V11],
            6,
            4,
            12,
            heartbeat_interval=1,
            spam_protection_enabled=False,
            adaptive_gossip_enabled=False,
        )
        pubsub = Pubsub(evil.libp2p, router)
        await stack.enter_async_context(background_trio_service(pubsub))
        await stack.enter_async_context(background_trio_service(router))
        await pubsub.wait_until_ready()
        await pubsub.subscribe(gossip_topic(SWARM))
        await evil.connect(hosts[1].addrs[0])
        await pubsub.wait_for_mesh(hosts[1].identity.peer_id, gossip_topic(SWARM), 10)

        victim = replicas[2].crdt("samples").entry(hosts[2].peer_id)
        tampered = SignedEntry(victim.owner, victim.seq + 1, victim.body + 10**6, victim.signature)
        impostor = SignedEntry(
            victim.owner, victim.seq + 1, victim.body + 1, evil.identity.sign(b"not what the owner signed")
        )
        rogue_cfg = LWWMap(SWARM, "config")  # no allow-list on the attacker's copy
        rogue_cfg.set(evil.identity, "lr", 1000.0)
        # above the 48 KiB entry limit, below the 56 KiB message limit
        big = LWWMap(SWARM, "notes").set(evil.identity, "blob", b"x" * (50 << 10))

        def gossip(name, type_tag, entries, ns=SWARM):
            return packb([1, ns, [[name, encode_entries(type_tag, entries)]]])

        messages = [
            gossip("samples", "gcounter", [tampered]),
            gossip("samples", "gcounter", [impostor]),
            gossip("config", "lwwmap", rogue_cfg.entries()),
            gossip("notes", "lwwmap", [big]),
            gossip("samples", "gcounter", [tampered], ns="another-swarm"),
            gossip("no-such-crdt", "gcounter", [tampered]),
            b"\xc1 definitely not msgpack",
            packb([1, SWARM, [["samples", b"\x93\x01"]]]),
        ]
        for payload in messages:
            await pubsub.publish(gossip_topic(SWARM), payload)

        rpc = evil.rpc
        target = hosts[1].peer_id
        forged_push = {
            "samples": encode_entries("gcounter", [tampered, impostor]),
            "config": encode_entries("lwwmap", rogue_cfg.entries()),
        }
        reply = await rpc.call(target, "crdt/pull", {"ns": SWARM, "d": {}, "p": forged_push})
        assert reply["rejected"] == 3
        for bad in ({"ns": SWARM}, ["not", "a", "map"], {"ns": SWARM, "fp": {f"x{i}": b"" for i in range(1000)}}):
            with pytest.raises(RemoteError):
                await rpc.call(target, "crdt/digest", bad)
        with pytest.raises(RemoteError, match="malformed"):
            await rpc.call(target, "crdt/pull", {"ns": SWARM, "d": {"samples": {"o": "x"}}, "p": {}})
        with pytest.raises(RemoteError, match="wrong-swarm"):
            await rpc.call(target, "crdt/digest", {"ns": "another-swarm", "fp": {}})

        neighbour = replicas[1].stats
        await wait_until(lambda: neighbour.gossip_invalid == len(messages), 5, "all judged")
        await trio.sleep(1.0)  # sleep: lets anything that slipped through spread (below: nothing did)
        assert all(r.fingerprint() == before for r in replicas)
        assert replicas[0].crdt("config").value() == {"lr": 0.7}
        assert neighbour.entries_rejected >= 4 + 3
        assert "signature does not verify for its owner in this namespace and CRDT" in (neighbour.rejections_by_reason)
        # invalid messages were not relayed: peers beyond the neighbour never saw them
        assert all(r.stats.gossip_invalid == 0 for r in (replicas[0], replicas[2], replicas[3]))

        replicas[3].write("samples", lambda c, me: c.increment(me, 1))  # still alive and well
        await wait_until(lambda: same_state(replicas), 10, "convergence after the attack")


async def test_an_oversized_local_write_is_refused_and_leaves_the_state_unchanged():
    async with AsyncExitStack() as stack:
        (host,) = await start_hosts(stack, 1)
        (replica,) = await start_replicas(stack, [host])
        before = replica.fingerprint()
        with pytest.raises(EntryTooLarge):
            replica.write("notes", lambda c, me: c.set(me, "blob", b"x" * (200 << 10)))
        with pytest.raises(CrdtError, match="no CRDT named"):
            replica.write("nope", lambda c, me: None)
        assert replica.fingerprint() == before


async def test_change_events_reach_subscribers_with_their_source():
    async with AsyncExitStack() as stack:
        hosts = await start_hosts(stack, 2)
        a, b = await start_replicas(stack, hosts, config=GOSSIP_ONLY)
        seen = []
        b.on_change(seen.append)
        events = b.subscribe()
        await connect_line(hosts)
        await wait_until(lambda: gossip_meshed([a, b]), 10, "gossipsub mesh formed")
        a.write("samples", lambda c, me: c.increment(me, 5))
        with trio.fail_after(5):
            event = await events.receive()
        assert (event.crdt, event.source, event.peer) == ("samples", "gossip", a.me)
        assert event.entries[0].body == 5 and seen == [event]


# --- swarm view ---------------------------------------------------------------------------------

# Short heartbeats and leases; a high swarm-wide heartbeat rate keeps the interval at 0.3 s.
VIEW = {"heartbeat_interval": 0.3, "ttl": 1.5, "recover_timeout": 2.0, "swarm_heartbeat_rate": 100.0}


async def start_views(stack, hosts, owner: str, **options) -> list[SwarmView]:
    replicas = await start_replicas(stack, hosts, specs=swarm_specs(owner))
    await connect_line(hosts)
    return [await stack.enter_async_context(SwarmView(r, owner, **{**VIEW, **options})) for r in replicas]


async def test_config_is_writable_by_the_swarm_owner_only_on_every_peer():
    async with AsyncExitStack() as stack:
        hosts = await start_hosts(stack, 4)
        owner = hosts[0].peer_id
        views = await start_views(stack, hosts, owner)
        views[0].set_config(lr=0.7, outer_steps=500)
        await wait_until(
            lambda: all(v.config() == {"lr": 0.7, "outer_steps": 500} for v in views), 10, "owner's config everywhere"
        )

        with pytest.raises(NotSwarmOwner, match="only the owner's key"):
            views[2].set_config(lr=99.0)
        # A non-owner that bypasses its own API: a validly signed config entry, pushed to every
        # peer by anti-entropy RPC and published on the gossip topic.
        rogue = LWWMap(SWARM, "config")
        entry = rogue.set(hosts[2].identity, "lr", 99.0)
        push = {"ns": SWARM, "d": {}, "p": {"config": encode_entries("lwwmap", [entry])}}
        for h in hosts:
            if h is not hosts[2]:
                await hosts[2].connect(h.addrs[0])
                reply = await hosts[2].rpc.call(h.peer_id, "crdt/pull", push)
                assert reply["rejected"] == 1
        await views[2].replica.pubsub.publish(
            views[2].replica.topic, packb([1, SWARM, [["config", encode_entries("lwwmap", [entry])]]])
        )
        await trio.sleep(1.0)  # sleep: lets the rogue entry spread if it could (below: it did not)
        for i, v in enumerate(views):
            assert v.config() == {"lr": 0.7, "outer_steps": 500}
            if i != 2:
                assert v.replica.stats.rejections_by_reason.get("owner is not an allowed writer of this CRDT", 0) >= 1


async def test_membership_drops_a_silent_peer_when_its_lease_ends_and_a_leaving_peer_at_once():
    async with AsyncExitStack() as stack:
        hosts = await start_hosts(stack, 4)
        owner = hosts[0].peer_id
        replicas = await start_replicas(stack, hosts, specs=swarm_specs(owner))
        await connect_line(hosts)
        views = [SwarmView(r, owner, **{**VIEW, "ttl": 3.0}) for r in replicas]  # 3 s leases
        async with trio.open_nursery() as nursery:
            scopes = []
            for v in views:

                async def run(view=v, task_status=trio.TASK_STATUS_IGNORED):
                    with trio.CancelScope() as scope:
                        async with view:
                            task_status.started(scope)
                            await trio.sleep_forever()

                scopes.append(await nursery.start(run))
            ids = sorted(h.peer_id for h in hosts)
            await wait_until(lambda: all(v.membership_snapshot() == ids for v in views), 10, "all four live everywhere")
            info = {p.peer_id: p for p in views[0].live_peers()}[hosts[3].peer_id]
            assert info.role == "trainer" and info.addrs == tuple(hosts[3].addrs)

            await views[3].leave()  # clean leave: gone at once, long before its 3 s lease
            await wait_until(
                lambda: all(hosts[3].peer_id not in v.membership_snapshot() for v in views[:3]),
                1.5,
                "a leaving peer disappears",
            )
            assert {p.peer_id: p for p in views[0].peers()}[hosts[3].peer_id].left

            scopes[2].cancel()  # peer 2 stops heartbeating without leaving (its host stays up)
            await wait_until(
                lambda: all(hosts[2].peer_id not in v.membership_snapshot() for v in views[:2]),
                6.0,
                "a silent peer expires when its lease ends",
            )
            silent = {p.peer_id: p for p in views[0].peers()}[hosts[2].peer_id]
            assert not silent.left  # dropped because its lease ran out, not because it left
            assert views[0].age(MEMBERSHIP, hosts[2].peer_id) > silent.lease_ms / 1000  # by our clock

            # peers that heard the same heartbeats agree on who is live
            await wait_until(lambda: same_state([views[0].replica, views[1].replica]), 5, "sync")
            assert views[0].membership_snapshot() == views[1].membership_snapshot()
            nursery.cancel_scope.cancel()


async def test_progress_and_metrics_reach_every_peer():
    async with AsyncExitStack() as stack:
        hosts = await start_hosts(stack, 3)
        views = await start_views(stack, hosts, hosts[0].peer_id)
        for i, v in enumerate(views):
            v.report_progress(step=10 * i, samples=1000 * i)
            v.report_metrics({"loss": 2.5 - i, "tokens_per_s": 100.0})
        views[1].report_progress(outer_round=3)  # a round change is written at once
        await wait_until(lambda: views[2].outer_round() == 3, 2, "outer round")

        def done(v):
            prog, met = v.progress(), v.metrics()
            return (
                len(prog) == 3
                and sorted(p.step for p in prog.values()) == [0, 10, 20]
                and len(met) == 3
                and v.total_samples() == 3000
            )

        await wait_until(lambda: all(done(v) for v in views), 5, "progress and metrics")
        assert views[0].metrics()[hosts[2].peer_id].values == {"loss": 0.5, "tokens_per_s": 100.0}
        with pytest.raises(CrdtError):
            views[0].report_progress(step=-1)


async def test_round_changes_are_written_at_once_at_most_once_per_gap_in_a_stretched_swarm():
    """Every peer's round end floods a record to every peer: in a swarm stretched past the
    shortest heartbeat, our progress writes are spaced by `progress_gap()`, and a change sooner is
    written once the gap has passed. A small swarm (gap 0) writes every round change at once."""
    async with AsyncExitStack() as stack:
        hosts = await start_hosts(stack, 3)
        # 3 live peers at 2 heartbeats a second, swarm-wide: a 1.5 s interval, a 1.2 s gap
        views = await start_views(stack, hosts, hosts[0].peer_id, swarm_heartbeat_rate=2.0)
        me = hosts[0].peer_id
        await wait_until(lambda: all(len(v.peers()) == 3 for v in views), 5, "all live")
        assert views[0].progress_gap() == pytest.approx(1.2)
        mine = views[0].progress

        views[0].report_progress(step=10, outer_round=1)
        assert mine()[me].outer_round == 1  # at once: nothing written before
        t0 = trio.current_time()
        views[0].report_progress(step=20, outer_round=2)
        views[0].progress_live = True  # a trainer's: its heartbeats rewrite progress, within the gap too
        assert mine()[me].outer_round == 1  # within the gap: waits ...
        await wait_until(lambda: mine()[me].outer_round == 2, 3, "written once the gap has passed")
        assert trio.current_time() - t0 >= 1.1  # ... for it, not for the next heartbeat alone
        await trio.sleep(views[0].progress_gap())  # sleep: a gap after the last write is what is tested
        views[0].report_progress(step=30, outer_round=3)
        assert mine()[me].outer_round == 3  # a gap after the last write: at once again

        pair = await start_hosts(stack, 2)
        small = await start_views(stack, pair, pair[0].peer_id)
        assert small[0].progress_gap() == 0.0
        for r in (1, 2, 3):
            small[0].report_progress(outer_round=r)
            assert small[0].progress()[pair[0].peer_id].outer_round == r


async def test_an_announced_step_is_written_at_once_and_handed_to_a_peer_before_the_writer_goes_on():
    """A node that starts training announces its step: written at once (a plain step waits for
    the next heartbeat), and `hand_out` has a connected peer hold it when it returns — a group
    left behind trained 100 steps past a restarted trainer in the second gossip took to graft
    the new connection (tests/test_chaos_regressions.py, the peer ahead)."""
    async with AsyncExitStack() as stack:
        hosts = await start_hosts(stack, 2)
        views = await start_views(stack, hosts, hosts[0].peer_id, heartbeat_interval=30.0, ttl=90.0)
        me = hosts[1].peer_id
        views[1].report_progress(step=10)
        assert views[1].progress_of(me) is None  # a plain step: with the next heartbeat, 30 s away
        views[1].report_progress(step=145, announce=True)
        assert views[1].progress_of(me) is not None and views[1].progress_of(me).step == 145
        assert await views[1].hand_out() == 1
        theirs = views[0].progress_of(me)
        assert theirs is not None and theirs.step == 145  # held by the peer as hand_out returns


async def test_a_hand_out_goes_to_the_peers_named_first_and_one_that_never_answers_holds_no_other():
    """`hand_out(first=...)` hands our records to the named peers before any other, side by side:
    peer 2 takes the digest request and never answers (a stopped process keeps its connections),
    and peer 0, named after it, still holds our step when `hand_out` returns. One exchange after
    the other, the silent peer took the whole second and peer 0 got nothing."""
    async with AsyncExitStack() as stack:
        hosts = await start_hosts(stack, 4)
        views = await start_views(stack, hosts, hosts[0].peer_id, heartbeat_interval=30.0, ttl=90.0)
        answered = trio.Event()

        async def never_answers(peer: str, request: object) -> dict:
            answered.set()  # it was asked
            await trio.sleep_forever()
            raise AssertionError("unreachable")

        hosts[2].rpc.serve(RPC_DIGEST, never_answers)
        me = hosts[1].peer_id
        views[1].report_progress(step=145, announce=True)
        confirmed = await views[1].hand_out(peers=2, first=[hosts[2].peer_id, hosts[0].peer_id])
        assert answered.is_set()  # the named silent peer was asked, first
        assert confirmed == 1
        theirs = views[0].progress_of(me)
        assert theirs is not None and theirs.step == 145  # held by peer 0 as hand_out returns


async def test_our_strikes_record_carries_the_capabilities_our_membership_has_now():
    """The strikes record carries our membership's capabilities (whoever counts a strike checks
    the reporter's admission from it); a pipeline peer adds its stage to them after the view
    started (node/stages/announce.py), and its strikes must carry that too."""
    async with AsyncExitStack() as stack:
        hosts = await start_hosts(stack, 3)
        views = await start_views(stack, hosts, hosts[0].peer_id)
        me, ids = hosts[0].peer_id, tuple(sorted(h.peer_id for h in hosts))
        views[0].capabilities = {**views[0].capabilities, "pipeline": {"stage": 1}}
        views[0].report_strikes([Strike(me, 20, "", hosts[1].peer_id, ids, b"\x01" * 32, ids.index(me), 9.0, -0.5)])
        entry = views[0].replica.crdt(STRIKES).entry(me)
        assert entry is not None and record_of(entry).capabilities == {"pipeline": {"stage": 1}}


async def test_a_live_progress_record_stays_fresh_without_news_and_a_plain_one_ages():
    """A trainer held inside a round reports nothing new, yet trains: with `progress_live` its
    record is rewritten every heartbeat (a joiner then sees a donor); without, it ages."""
    async with AsyncExitStack() as stack:
        hosts = await start_hosts(stack, 3)
        views = await start_views(stack, hosts, hosts[0].peer_id)
        views[0].report_progress(step=7, outer_round=1)
        views[1].report_progress(step=7, outer_round=1)
        views[0].progress_live = True
        ids = [h.peer_id for h in hosts[:2]]
        await wait_until(lambda: all(p in views[2].progress() for p in ids), 5, "both records arrive")
        first = {p: views[2].progress()[p].updated_ms for p in ids}

        def updated() -> dict[str, int]:
            return {p: views[2].progress()[p].updated_ms for p in ids}

        # Several heartbeats (0.3 s), no report: the live record is rewritten for a second and more.
        await wait_until(lambda: updated()[ids[0]] - first[ids[0]] >= 1000, 5, "rewritten beat after beat")
        later = updated()
        assert later[ids[0]] - first[ids[0]] >= 1000  # rewritten beat after beat
        assert later[ids[1]] == first[ids[1]]  # nothing new: the record ages
        assert views[2].progress()[ids[0]].step == 7


async def test_an_admission_filter_hides_a_refused_peer_until_the_owners_config_admits_it():
    async with AsyncExitStack() as stack:
        hosts = await start_hosts(stack, 3)
        owner, outsider = hosts[0].peer_id, hosts[2].peer_id
        views = await start_views(stack, hosts, owner)

        def rule(view):  # admitted: anyone but the outsider, unless the owner's config says so
            return lambda p: p.peer_id != outsider or view.config_get("allow/" + outsider) is True

        for v in views[:2]:
            v.admit = rule(v)
        for v in views:
            v.report_progress(step=5)
            v.report_metrics({"loss": 1.0})
        await wait_until(
            lambda: all(len(v.peers()) + len(v.ignored_peers()) == 3 for v in views[:2]), 5, "every record everywhere"
        )
        await wait_until(lambda: len(views[0].progress()) == 2 and len(views[2].progress()) == 3, 5, "progress")
        for v in views[:2]:
            assert [p.peer_id for p in v.ignored_peers()] == [outsider]
            assert outsider not in v.membership_snapshot() and outsider not in v.progress()
            assert outsider not in v.metrics() and not await v.wait_live(outsider, 0.2)
        assert views[2].is_live(outsider) and views[2].ignored_peers() == []  # no filter, no one ignored

        async def admitted_in_time(task_status=trio.TASK_STATUS_IGNORED) -> None:
            task_status.started()  # no checkpoint before `wait_live` waits: the config changes after
            assert await views[1].wait_live(outsider, 5.0)  # woken by the config change, not a timeout

        async with trio.open_nursery() as nursery:
            await nursery.start(admitted_in_time)
            views[0].set_config({"allow/" + outsider: True})
        assert all(outsider in v.membership_snapshot() and outsider in v.progress() for v in views[:2])


@pytest.mark.parametrize("meets_swarm_first", [True, False])
async def test_a_restarted_peer_keeps_its_identity_and_its_seq_continues(meets_swarm_first):
    async with AsyncExitStack() as stack:
        hosts = await start_hosts(stack, 2)
        owner = hosts[0].peer_id
        views = await start_views(stack, hosts, owner)
        identity = Identity.generate()

        async with AsyncExitStack() as first_life:
            host = await first_life.enter_async_context(Host(identity))
            replica = await first_life.enter_async_context(Replica(host, SWARM, swarm_specs(owner), config=FAST))
            await host.connect(hosts[1].addrs[0])
            view = await first_life.enter_async_context(SwarmView(replica, owner, **VIEW))
            view.report_progress(step=500, samples=64_000, outer_round=2)
            await wait_until(
                lambda: (
                    view.membership_snapshot() == views[0].membership_snapshot()
                    and len(views[0].membership_snapshot()) == 3
                ),
                10,
                "joined",
            )

            def seen_seq() -> int:
                rec = {p.peer_id: p for p in views[0].peers()}.get(identity.peer_id_str)
                return 0 if rec is None else rec.seq

            await wait_until(lambda: seen_seq() >= 3, 10, "a few heartbeats")
            old = {p.peer_id: p for p in views[0].peers()}[identity.peer_id_str]
        # left cleanly; now the same identity comes back on a new host with no state
        await wait_until(lambda: identity.peer_id_str not in views[0].membership_snapshot(), 5, "first life left")

        host = await stack.enter_async_context(Host(identity))
        replica = await stack.enter_async_context(Replica(host, SWARM, swarm_specs(owner), config=FAST))
        if meets_swarm_first:
            await host.connect(hosts[1].addrs[0])
            view = await stack.enter_async_context(SwarmView(replica, owner, **VIEW))
        else:  # starts alone, writes seq 1, and only then meets the swarm
            view = await stack.enter_async_context(SwarmView(replica, owner, **{**VIEW, "recover_timeout": 0.1}))
            assert replica.crdt("membership").entry(identity.peer_id_str).seq == 1
            await host.connect(hosts[1].addrs[0])

        def recognised(v):
            peers = {p.peer_id: p for p in v.peers()}
            me = peers.get(identity.peer_id_str)
            return (
                len(peers) == 3
                and me is not None
                and me.seq > old.seq
                and not me.left
                and me.addrs == tuple(host.addrs)
            )

        await wait_until(lambda: all(recognised(v) for v in [*views, view]), 10, "recognised")
        assert sorted(views[0].membership_snapshot()) == sorted([*(h.peer_id for h in hosts), identity.peer_id_str])
        # the old incarnation's progress came back with the state
        assert view.progress()[identity.peer_id_str].step == 500
        if not meets_swarm_first:
            assert replica.stats.own_superseded >= 1


def test_heartbeat_interval_is_unchanged_in_small_swarms_and_bounds_gossip_by_log_n():
    # up to 12 live peers every peer heartbeats every 3 s, as before the log-N rule
    assert [heartbeat_interval_for(n) for n in range(13)] == [3.0] * 13
    # the swarm's heartbeat rate (what every peer forwards) at 16, 64, 256 and 1024 peers: 4, 6, 8, 10/s
    rates = [n / heartbeat_interval_for(n) for n in (16, 64, 256, 1024)]
    assert rates == pytest.approx([4.0, 6.0, 8.0, 10.0])
    assert heartbeat_interval_for(256) == pytest.approx(32.0)
    assert heartbeat_interval_for(10**6) == 300.0  # the cap: beyond ~3,500 peers gossip grows again


@settings(max_examples=300, deadline=None)
@given(st.integers(1, 5000), st.integers(1, 5000))
def test_heartbeat_interval_grows_with_the_swarm_and_the_swarm_rate_by_at_most_log_n(a, b):
    small, big = sorted((a, b))
    assert heartbeat_interval_for(small) <= heartbeat_interval_for(big) <= 300.0
    rate_small, rate_big = small / heartbeat_interval_for(small), big / heartbeat_interval_for(big)
    assert rate_small <= rate_big * (1 + 1e-9)
    # per-peer gossip ∝ the swarm's rate, which is at most 4·max(1, log₁₆ N) below the cap
    if heartbeat_interval_for(big) < 300.0:
        assert rate_big <= 4.0 * max(1.0, math.log(big, 16)) * (1 + 1e-9)


async def test_heartbeats_stretch_and_leases_grow_with_the_swarm():
    host = Host(Identity.generate())  # never started: this test merges records by hand
    owner = host.peer_id
    replica = Replica(host, SWARM, swarm_specs(owner))
    view = SwarmView(
        replica,
        owner,
        addrs=[],
        heartbeat_interval=3.0,
        ttl=12.0,
        swarm_heartbeat_rate=4.0,
        max_heartbeat_interval=15.0,
    )
    view.heartbeat()
    assert view.current_interval() == 3.0
    assert view.peers()[0].lease_ms == 12_000

    def record(identity, **changes):
        value = {
            "addrs": [],
            "role": "trainer",
            "caps": {},
            "conn": "direct",
            "lease": 12_000,
            "left": False,
            **changes,
        }
        return LWWRegister(SWARM, "membership").set(identity, value, timestamp=now_ms())

    others = [Identity.generate() for _ in range(39)]
    outcome = replica.merge_entries("membership", [record(i) for i in others], "gossip", others[0].peer_id_str)
    assert len(outcome.accepted) == 39 and len(view.live_peers()) == 40
    view.heartbeat()  # 40 live peers heartbeat 4·log₁₆ 40 ≈ 5.3 times a second swarm-wide
    interval = 40 / (4.0 * math.log(40, 16))  # ≈ 7.52 s, lease four times that
    assert view.current_interval() == pytest.approx(interval)
    assert abs({p.peer_id: p for p in view.peers()}[owner].lease_ms - interval * 4000) <= 1
    # a lease vouches for exactly its length on our clock; after that the peer is gone
    at = time.monotonic()
    written = at - view.age(MEMBERSHIP, others[0].peer_id_str, at)
    assert others[0].peer_id_str in view.membership_snapshot(at=written + 12.0)
    assert others[0].peer_id_str not in view.membership_snapshot(at=written + 12.001)

    # records that break the membership rules are rejected, the same way on every peer
    strangers = [Identity.generate() for _ in range(4)]
    bad = [
        record(strangers[0], lease=10**9),
        record(strangers[1], role="x" * 100),
        record(strangers[2], left="no"),
        record(strangers[3], extra=1),
    ]
    before = replica.fingerprint()
    assert len(replica.merge_entries("membership", bad, "gossip", None).rejected) == 4
    assert replica.fingerprint() == before


async def test_a_malformed_gossip_frame_does_not_take_the_host_down():
    # py-libp2p 0.8.1 lets a protobuf DecodeError escape its pubsub stream handler, which kills
    # the receiving host; the replica's gossipsub contains it (resets that stream only).
    from libp2p.utils import encode_varint_prefixed

    async with AsyncExitStack() as stack:
        victim, attacker, other = await start_hosts(stack, 3)
        (replica,) = await start_replicas(stack, [victim])
        await attacker.connect(victim.addrs[0])
        stream = await attacker.open_stream(victim.peer_id, "/meshsub/1.1.0")
        await stream.write(encode_varint_prefixed(b"\xff\xff\xff\xff not protobuf"))
        with trio.fail_after(5), pytest.raises(StreamError):  # the victim judged the frame: it reset the stream
            while True:
                await stream.read()
        await other.connect(victim.addrs[0])
        reply = await other.rpc.call(victim.peer_id, "crdt/digest", {"ns": SWARM, "fp": {}})
        assert set(reply["d"]) == set(replica.names)


def test_a_big_delta_is_split_into_gossip_messages_that_each_fit_the_limit():
    crdts = {"notes": LWWMap(SWARM, "notes"), "samples": GCounter(SWARM, "samples")}
    writers = [Identity.generate() for _ in range(60)]
    entries = {
        "notes": [crdts["notes"].set(w, "blob", b"x" * 2000) for w in writers],
        "samples": [crdts["samples"].increment(w, 7) for w in writers],
    }
    limit = 56 << 10
    chunks = split_batches(entries, limit - 1024)
    payloads = [encode_gossip(SWARM, chunk, crdts) for chunk in chunks]
    assert len(payloads) >= 3 and all(len(p) <= limit for p in payloads)
    decoded: dict[str, set] = {"notes": set(), "samples": set()}
    for payload in payloads:
        for name, batch in decode_gossip(payload, SWARM, crdts, limit):
            decoded[name] |= set(batch)
    assert decoded == {name: set(es) for name, es in entries.items()}
    with pytest.raises(MalformedCrdtData):
        decode_gossip(payloads[0], "another-swarm", crdts, limit)
    with pytest.raises(MalformedCrdtData):
        decode_gossip(payloads[0], SWARM, crdts, len(payloads[0]) - 1)
