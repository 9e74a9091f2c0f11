"""The DHT and discovery on real libp2p hosts over loopback: store/get, merging on the storing
node, hostile peers on both sides of a store and a get, bootstrap with dead addresses, restarts.

No mocks: every peer is a `Host` with a `Dht`. A lying peer is a real node whose `dht/find`
handler is replaced by one that adds invalid records to its honest answer.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import AsyncIterator, Sequence
from contextlib import AsyncExitStack, asynccontextmanager
from dataclasses import dataclass
from typing import Any

import pytest
import trio

from meshtrain.dht import (
    BootstrapError,
    Dht,
    DhtConfig,
    Discovery,
    DiscoveryConfig,
    InvalidRecord,
    Record,
    peers_key,
)
from meshtrain.dht.kademlia import FIND_RPC, STORE_RPC
from meshtrain.transport.framing import packb
from meshtrain.transport.host import Host
from meshtrain.transport.identity import Identity
from meshtrain.transport.rpc import RemoteError

SWARM = "test-swarm"
KEY = "/meshtrain/test-swarm/shared"
# kad's background routing-table refresh costs CPU the tests do not need: our own self-lookup
# at bootstrap already fills the tables of a swarm this small.
CONFIG = DhtConfig(refresh_after_bootstrap=False)


@asynccontextmanager
async def dht_node(
    bootstrap: Sequence[str] = (),
    *,
    identity: Identity | None = None,
    config: DhtConfig = CONFIG,
    swarm: str = SWARM,
) -> AsyncIterator[Dht]:
    async with Host(identity or Identity.generate()) as host, Dht(host, swarm, config) as dht:
        if bootstrap:
            await dht.bootstrap(bootstrap)
        yield dht


async def run_node(bootstrap: Sequence[str], config: DhtConfig, task_status: Any = trio.TASK_STATUS_IGNORED) -> None:
    """A node in its own task; `task_status` gets `(dht, cancel_scope)`: cancelling the scope
    crashes the node (nothing tells the others it left)."""
    with trio.CancelScope() as scope:
        async with dht_node(bootstrap, config=config) as dht:
            task_status.started((dht, scope))
            await trio.sleep_forever()


@dataclass
class Swarm:
    nodes: list[Dht]
    scopes: list[trio.CancelScope]

    def kill(self, i: int) -> None:
        self.scopes[i].cancel()

    async def bootstrap_knows_all(self, timeout: float = 10.0) -> None:
        """Until the first node's routing table holds every other node (each bootstrapped from
        it). Admission to a routing table is asynchronous (a node is checked before it is
        added), so a swarm that has just started may still route a lookup around a node."""
        others = {n.peer_id for n in self.nodes[1:]}
        with trio.fail_after(timeout):
            while not others <= set(self.nodes[0].routing_table_peers()):
                await trio.sleep(0.02)  # sleep: poll interval


@asynccontextmanager
async def swarm_of(n: int, config: DhtConfig = CONFIG) -> AsyncIterator[Swarm]:
    """`n` nodes, each bootstrapped from the first. One task per node, so that they can crash
    in any order and shut down concurrently (py-libp2p closes connections one at a time,
    ~0.2 s each: sequential teardown of 8 nodes would take 5 s)."""
    async with trio.open_nursery() as nursery:
        first, scope = await nursery.start(run_node, (), config)
        swarm = Swarm([first], [scope])
        for _ in range(n - 1):
            dht, scope = await nursery.start(run_node, [first.host.addrs[0]], config)
            swarm.nodes.append(dht)
            swarm.scopes.append(scope)
        yield swarm
        nursery.cancel_scope.cancel()


def later(seconds: float = 60) -> float:
    return time.time() + seconds


# --- store / get ------------------------------------------------------------------------------


async def test_values_stored_anywhere_are_read_everywhere_across_eight_nodes() -> None:
    async with swarm_of(8) as swarm:
        nodes = swarm.nodes
        for i, node in enumerate(nodes):
            replicas = await node.store(f"/k/{i}", {"writer": i}, later())
            assert replicas == CONFIG.replication
        for reader in nodes:
            for i in range(len(nodes)):
                assert await reader.get(f"/k/{i}") == {"writer": i}
        assert await nodes[3].get("/k/never-stored") is None


async def test_a_plain_value_is_replaced_by_a_later_expiry_from_any_writer() -> None:
    async with swarm_of(3) as swarm:
        a, b, c = swarm.nodes
        await a.store("/plain", "first", later(30))
        await b.store("/plain", "second", later(60))
        await a.store("/plain", "stale", later(45))  # an earlier expiry loses everywhere
        assert await c.get("/plain") == "second"


async def test_concurrent_subkey_stores_from_many_owners_all_survive() -> None:
    async with swarm_of(8) as swarm:
        nodes = swarm.nodes
        async with trio.open_nursery() as nursery:
            for node in nodes:
                nursery.start_soon(node.store, KEY, node.peer_id[-6:], later(), node.peer_id)
        expected = {n.peer_id: n.peer_id[-6:] for n in nodes}
        # Merged on the storing nodes, before any get could repair anything: every owner's entry
        # sits on `replication` nodes. Not necessarily the same five for every owner: a lookup
        # that finds a peer slow (a loaded machine) stores past it, on the next closest.
        now = time.time()
        for owner in expected:
            holders = [n for n in nodes if owner in n.local.get(KEY, now)]
            assert len(holders) >= CONFIG.replication, (owner, len(holders))
        for reader in nodes:
            assert await reader.get(KEY) == expected


async def test_values_survive_the_loss_of_three_of_eight_nodes() -> None:
    async with swarm_of(8) as swarm:
        for i in range(6):
            await swarm.nodes[i].store(f"/durable/{i}", i, later())
        for i in (2, 3, 4):  # three of eight crash, writers among them
            swarm.kill(i)
        for reader in swarm.nodes[:2] + swarm.nodes[5:]:
            for i in range(6):
                with trio.fail_after(CONFIG.lookup_timeout + CONFIG.rpc_timeout):
                    assert await reader.get(f"/durable/{i}") == i


async def test_store_refuses_an_invalid_record_before_touching_the_network() -> None:
    async with dht_node() as node:
        with pytest.raises(InvalidRecord) as e:
            await node.store(KEY, "x", later(), subkey="someone-else")
        assert e.value.reason == "not_owner"
        with pytest.raises(InvalidRecord) as e:
            await node.store(KEY, b"x" * (100 << 10), later())
        assert e.value.reason == "oversized"
        with pytest.raises(InvalidRecord) as e:
            await node.store(KEY, "x", time.time() - 1)
        assert e.value.reason == "expired"
        # alone in its swarm, a node is its own (only) replica
        assert await node.store(KEY, "mine", later()) == 1
        assert await node.get(KEY) == "mine"


# --- hostile peers ----------------------------------------------------------------------------


def bad_records(liar: Identity, victim: Identity) -> dict[str, Record]:
    """One invalid record per rule, each for `KEY` in `SWARM` unless the rule is about that."""
    now = time.time()
    honest = Record.create(victim, SWARM, KEY, "truth", now + 60, victim.peer_id_str)

    def signed(**kw: Any) -> Record:
        args: dict[str, Any] = {
            "swarm_id": SWARM,
            "key": KEY,
            "value": "lie",
            "expiry": now + 60,
            "subkey": liar.peer_id_str,
        } | kw
        return Record.create(liar, **args)

    return {
        "forged": dataclasses.replace(honest, value=packb("lie"), expiry=now + 3000),
        "unsigned": dataclasses.replace(signed(), signature=b""),
        "expired": signed(expiry=now - 5),
        "future": signed(expiry=now + 10 * 86400),
        "oversized": signed(value=b"x" * (65 << 10)),
        "other_swarm": signed(swarm_id="another-swarm"),
        "other_key": dataclasses.replace(signed(key="/some/other/key"), key=KEY),
        "not_owner": signed(subkey=victim.peer_id_str, expiry=now + 3000),
    }


EXPECTED_REASON = {
    "forged": "forged",
    "unsigned": "unsigned",
    "expired": "expired",
    "future": "future",
    "oversized": "oversized",
    "other_swarm": "forged",
    "other_key": "forged",
    "not_owner": "not_owner",
}


async def test_the_storing_node_refuses_invalid_records_sent_over_rpc() -> None:
    async with swarm_of(2) as swarm:
        storer, attacker = swarm.nodes
        bad = bad_records(attacker.host.identity, storer.host.identity)
        good = Record.create(attacker.host.identity, SWARM, KEY, "fine", later(), attacker.peer_id)
        request = {
            "swarm": SWARM,
            "key": KEY,
            "records": [r.to_wire() for r in bad.values()] + [good.to_wire(), "garbage"],
        }
        reply = await attacker.host.rpc.call(storer.peer_id, STORE_RPC, request)
        reasons = dict(zip([*bad, "good", "garbage"], reply["results"], strict=True))
        assert reasons == EXPECTED_REASON | {"good": None, "garbage": "malformed"}
        assert storer.local.get(KEY, time.time()) == {attacker.peer_id: good}

        with pytest.raises(RemoteError) as e:
            await attacker.host.rpc.call(storer.peer_id, STORE_RPC, request | {"swarm": "other"})
        assert e.value.code == "wrong-swarm"
        with pytest.raises(RemoteError) as e:
            await attacker.host.rpc.call(storer.peer_id, STORE_RPC, {"swarm": SWARM, "key": KEY})
        assert e.value.code == "malformed"
        with pytest.raises(RemoteError) as e:
            await attacker.host.rpc.call(storer.peer_id, FIND_RPC, {"swarm": SWARM, "target": b"", "key": None})
        assert e.value.code == "malformed"


async def test_a_reader_drops_invalid_records_returned_by_a_lying_node() -> None:
    # Patient lookups: under CI load the liar can answer later than the default straggler
    # patience, and a lookup that ends without its reply never sees the lies this test is about.
    patient = dataclasses.replace(CONFIG, straggler_min=5.0, straggler_max=5.0)
    async with swarm_of(4, config=patient) as swarm:
        await swarm.bootstrap_knows_all()  # so that the reader's lookup reaches the liar
        nodes = swarm.nodes  # all four are among the 5 closest to any key
        victim, liar, reader = nodes[1], nodes[2], nodes[3]
        await victim.store(KEY, "truth", later(), victim.peer_id)
        bad = bad_records(liar.host.identity, victim.host.identity)
        honest_find = liar._serve_find

        async def lying_find(peer: str, req: Any) -> dict[str, Any]:
            reply = await honest_find(peer, req)
            if req.get("key") == KEY:
                reply["records"] += [r.to_wire() for r in bad.values()] + [{"junk": 1}, 7]
            return reply

        liar.host.rpc.serve(FIND_RPC, lying_find)
        assert await reader.get(KEY) == {victim.peer_id: "truth"}
        assert reader.stats["rejected_from_peers"] >= len(bad)
        await trio.sleep(0.2)  # sleep: lets read repair run (below: it spread only the valid record)
        for node in (nodes[0], victim, reader):
            held = node.local.get(KEY, time.time())
            assert {sk: r.decoded for sk, r in held.items()} in ({}, {victim.peer_id: "truth"})


async def test_a_node_of_another_network_is_not_used() -> None:
    async with AsyncExitStack() as stack:
        ours = await stack.enter_async_context(dht_node())
        theirs = await stack.enter_async_context(dht_node(swarm="their-swarm"))
        await theirs.bootstrap([ours.host.addrs[0]])
        await theirs.store("/x", "theirs", later())  # stored only on itself: ours refused
        assert await ours.get("/x") is None
        assert await theirs.get("/x") == "theirs"


# --- bootstrap --------------------------------------------------------------------------------


async def test_bootstrap_skips_dead_addresses_and_fails_only_if_all_are_dead() -> None:
    async with swarm_of(3) as swarm:
        await swarm.bootstrap_knows_all()  # so that a lookup through b finds a, and a finds c
        a, b, c = swarm.nodes
        await a.store("/boot", "reachable", later())
        async with Host(Identity.generate()) as gone:
            gone_addr = gone.addrs[0]
        nobody = f"/ip4/127.0.0.1/tcp/1/p2p/{Identity.generate().peer_id_str}"
        config = dataclasses.replace(CONFIG, bootstrap_timeout=2.0)

        async with dht_node(config=config) as newcomer:
            reached = await newcomer.bootstrap([gone_addr, nobody, b.host.addrs[0]])
            assert reached == 1
            assert await newcomer.get("/boot") == "reachable"
            with trio.fail_after(10):  # learned a and c through b (admission is asynchronous)
                while len(newcomer.routing_table_peers()) < 2:
                    await trio.sleep(0.02)  # sleep: poll interval

        async with dht_node(config=config) as loner:
            with pytest.raises(BootstrapError):
                await loner.bootstrap([gone_addr, nobody])


async def test_connections_feed_the_routing_table() -> None:
    async with AsyncExitStack() as stack:
        a = await stack.enter_async_context(dht_node())
        b = await stack.enter_async_context(dht_node())
        await b.host.connect(a.host.addrs[0])  # a plain connect, no bootstrap
        with trio.fail_after(5):
            while a.peer_id not in b.routing_table_peers() or b.peer_id not in a.routing_table_peers():
                await trio.sleep(0.05)  # sleep: poll interval


# --- discovery --------------------------------------------------------------------------------

FAST = DiscoveryConfig(role="trainer", capabilities={"gpu": False}, ttl=3.0, refresh_interval=0.5)


async def test_discovery_lists_live_peers_and_forgets_dead_ones() -> None:
    async with AsyncExitStack() as stack:
        nodes = (await stack.enter_async_context(swarm_of(4))).nodes
        discos = [await stack.enter_async_context(Discovery(n, SWARM, FAST)) for n in nodes[:3]]
        async with Discovery(nodes[3], SWARM, FAST):
            peers = await discos[0].peers()
            assert [p.peer_id for p in peers] == sorted(n.peer_id for n in nodes)
            mine = next(p for p in peers if p.peer_id == nodes[3].peer_id)
            assert mine.addrs == tuple(nodes[3].host.addrs)
            assert (mine.role, mine.capabilities) == ("trainer", {"gpu": False})
        # node 3 stopped announcing: gone once its last announcement expires
        with trio.fail_after(FAST.ttl + 3):
            while len(await discos[1].peers()) != 3:
                await trio.sleep(0.2)  # sleep: poll interval
        assert peers_key(SWARM) == "/meshtrain/test-swarm/peers"


async def test_a_refresh_left_to_others_lets_the_announcement_expire_until_readdressed() -> None:
    """`refresh_needed` (node/presence.py leaves most refreshes to others in a large swarm): a
    node whose refreshes are skipped vanishes from the key once its announcement expires, and
    announces at once when its addresses change."""
    async with AsyncExitStack() as stack:
        nodes = (await stack.enter_async_context(swarm_of(3))).nodes
        reader = await stack.enter_async_context(Discovery(nodes[0], SWARM, FAST))
        quiet = await stack.enter_async_context(Discovery(nodes[1], SWARM, FAST, refresh_needed=lambda: False))
        assert nodes[1].peer_id in [p.peer_id for p in await reader.peers()]  # the first one is made
        with trio.fail_after(FAST.ttl + 3):
            while nodes[1].peer_id in [p.peer_id for p in await reader.peers()]:
                await trio.sleep(0.2)  # sleep: poll interval
        assert quiet.skipped >= 2 and nodes[0].peer_id in [p.peer_id for p in await reader.peers()]
        quiet.readdress()
        with trio.fail_after(5):
            while nodes[1].peer_id not in [p.peer_id for p in await reader.peers()]:
                await trio.sleep(0.1)  # sleep: poll interval


async def test_a_restarted_node_reannounces_under_the_same_subkey() -> None:
    async with AsyncExitStack() as stack:
        nodes = (await stack.enter_async_context(swarm_of(3))).nodes
        observer = await stack.enter_async_context(Discovery(nodes[0], SWARM, FAST))
        identity = Identity.generate()
        boot = [nodes[1].host.addrs[0]]
        async with dht_node(boot, identity=identity) as first_life, Discovery(first_life, SWARM, FAST):
            old_addrs = tuple(first_life.host.addrs)
            assert identity.peer_id_str in [p.peer_id for p in await observer.peers()]
        async with dht_node(boot, identity=identity) as second_life, Discovery(second_life, SWARM, FAST):
            new_addrs = tuple(second_life.host.addrs)
            assert new_addrs != old_addrs
            peers = await observer.peers()
            again = [p for p in peers if p.peer_id == identity.peer_id_str]
            assert len(again) == 1 and again[0].addrs == new_addrs
            assert len(peers) == 2  # the observer and the restarted node; the others never announced
