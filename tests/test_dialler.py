"""Dialling a member (node/connections.py `Dialler`) at the addresses its record names, with real
hosts on loopback: every dialable address is tried in turn, and a listen address announced as it
was bound (0.0.0.0) is never dialled — it names the dialler's own machine. Seen in the NAT lab
under load: a private node's record still named only its listen address, the dialler tried that
first address alone, and the NAT peers never connected to each other."""

from __future__ import annotations

from contextlib import AsyncExitStack

import trio

from meshtrain.node.connections import Dialler
from meshtrain.transport.host import Host, HostConfig, dialable_addrs
from meshtrain.transport.identity import Identity


def test_dialable_addrs_leave_out_unspecified_ips_and_name_the_peer_once():
    peer = Identity.generate().peer_id_str
    got = dialable_addrs(
        [
            "/ip4/0.0.0.0/tcp/4001",
            "/ip6/::/tcp/4001",
            "not an address",
            "/ip4/10.0.0.2/tcp/4001",
            f"/ip4/10.0.0.2/tcp/4001/p2p/{peer}",
            "/dns4/node.example/tcp/4001",
        ],
        peer,
    )
    assert got == [f"/ip4/10.0.0.2/tcp/4001/p2p/{peer}", f"/dns4/node.example/tcp/4001/p2p/{peer}"]


async def test_a_dial_tries_each_address_until_one_connects():
    async with AsyncExitStack() as stack:
        me = await stack.enter_async_context(Host(Identity.generate()))
        target = await stack.enter_async_context(Host(Identity.generate()))
        with trio.socket.socket() as dead:  # a port nobody listens on: bound, never listening
            await dead.bind(("127.0.0.1", 0))
            dead_port = dead.getsockname()[1]
            port = target.addrs[0].split("/tcp/")[1].split("/")[0]
            results: list[tuple[str, bool]] = []
            async with trio.open_nursery() as nursery:
                dialler = Dialler(me, nursery, timeout=5, on_dialled=lambda p, ok: results.append((p, ok)))
                assert not dialler.dial(target.peer_id, [f"/ip4/0.0.0.0/tcp/{port}"])  # nothing to dial
                addrs = [f"/ip4/0.0.0.0/tcp/{port}", f"/ip4/127.0.0.1/tcp/{dead_port}", target.addrs[0]]
                assert dialler.dial(target.peer_id, addrs)
            assert results == [(target.peer_id, True)] and me.is_connected(target.peer_id)
            assert dialler.failures(target.peer_id) == 0


async def test_a_peer_none_of_whose_addresses_answers_is_backed_off():
    async with Host(Identity.generate(), HostConfig()) as me:
        gone = Identity.generate().peer_id_str
        with trio.socket.socket() as dead:
            await dead.bind(("127.0.0.1", 0))
            dead_port = dead.getsockname()[1]
            results: list[bool] = []
            async with trio.open_nursery() as nursery:
                dialler = Dialler(me, nursery, timeout=5, on_dialled=lambda p, ok: results.append(ok))
                assert dialler.dial(gone, [f"/ip4/127.0.0.1/tcp/{dead_port}", f"/ip4/127.0.0.2/tcp/{dead_port}"])
            assert results == [False] and dialler.failures(gone) == 1 and not dialler.ready(gone)
