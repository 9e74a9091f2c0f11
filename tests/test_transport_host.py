"""Identity, host and RPC on real py-libp2p hosts over loopback."""

from __future__ import annotations

import contextlib
import os
import random
import stat
import struct
from contextlib import AsyncExitStack
from functools import partial

import pytest
import trio
from libp2p.peer.id import ID

from meshtrain.crdt.gossip import start_gossipsub
from meshtrain.errors import ConfigError
from meshtrain.transport import one_off
from meshtrain.transport.framing import packb
from meshtrain.transport.host import ConnectError, Host, HostConfig, ProposedStream, StreamOpenError
from meshtrain.transport.identity import Identity, IdentityError, public_key_of, verify
from meshtrain.transport.rpc import RemoteError, RpcProtocolError, RpcTimeout, RpcUnavailable

from .conftest import start_peers

# -- identity ------------------------------------------------------------------------------------


def test_identity_persists_across_restarts(tmp_path):
    first = Identity.load_or_create(tmp_path / "node")
    again = Identity.load_or_create(tmp_path / "node")
    assert first.peer_id_str == again.peer_id_str
    key = tmp_path / "node" / "identity.key"
    assert stat.S_IMODE(key.stat().st_mode) == 0o600
    assert public_key_of(first.peer_id_str) == first.public_key


def test_identity_refuses_group_readable_key(tmp_path):
    Identity.load_or_create(tmp_path)
    os.chmod(tmp_path / "identity.key", 0o644)
    with pytest.raises(IdentityError, match="chmod 600"):
        Identity.load_or_create(tmp_path)


def test_identity_refuses_corrupt_key(tmp_path):
    Identity.load_or_create(tmp_path)
    (tmp_path / "identity.key").write_bytes(b"garbage")
    with pytest.raises(IdentityError, match="corrupt"):
        Identity.load_or_create(tmp_path)


def test_signatures_verify_only_for_their_signer():
    a, b = Identity.generate(), Identity.generate()
    sig = a.sign(b"round 3")
    assert verify(a.peer_id_str, b"round 3", sig)
    assert not verify(b.peer_id_str, b"round 3", sig)
    assert not verify(a.peer_id_str, b"round 4", sig)
    assert not verify("not-a-peer-id", b"round 3", sig)


# -- host ----------------------------------------------------------------------------------------


def test_bad_host_config_is_a_config_error():
    with pytest.raises(ConfigError):
        HostConfig(swarm_key="short")
    with pytest.raises(ConfigError):
        HostConfig(listen=("not a multiaddr",))


async def test_a_listen_address_that_cannot_be_bound_is_a_config_error_not_a_silent_host():
    """py-libp2p logs a failed bind at DEBUG and runs with no listener: a node on a port another
    node holds started with no address at all (transport/host.py)."""
    import socket

    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        port = held.getsockname()[1]
        for listen in ([f"/ip4/127.0.0.1/tcp/{port}"], ["/ip4/127.0.0.1/tcp/0", f"/ip4/127.0.0.1/tcp/{port}"]):
            with pytest.raises(ConfigError, match=f"cannot listen on /ip4/127.0.0.1/tcp/{port}: its port is in use"):
                async with Host(Identity.generate(), HostConfig(listen=tuple(listen))):
                    pass
    async with Host(Identity.generate(), HostConfig(listen=(f"/ip4/127.0.0.1/tcp/{port}",))) as host:
        assert host.addrs == [f"/ip4/127.0.0.1/tcp/{port}/p2p/{host.peer_id}"]  # free again: it binds


async def test_hosts_connect_and_know_each_other():
    async with AsyncExitStack() as stack:
        a, b = await start_peers(stack, 2, streams=False)
        assert b.host.is_connected(a.id) and a.host.is_connected(b.id)
        assert b.host.remote_ip(a.id) == "127.0.0.1"
        assert a.host.addrs[0].endswith(f"/p2p/{a.id}")


async def test_connection_events_wake_waiters_before_the_recheck():
    """Liveness has one source: a waiter on connection state wakes on the host's notifee, well
    before the `recheck` fallback would have looked again."""
    async with AsyncExitStack() as stack:
        a, b = await start_peers(stack, 2, streams=False)
        c = await stack.enter_async_context(Host(Identity.generate()))
        recheck = 30.0
        with trio.fail_after(10):
            async with trio.open_nursery() as nursery:
                nursery.start_soon(c.connect, a.host.addrs[0])
                await a.host.wait_until(lambda: a.host.is_connected(c.peer_id), recheck=recheck)
            async with trio.open_nursery() as nursery:
                nursery.start_soon(b.host.disconnect, a.id)
                assert await a.host.wait_disconnected([b.id, c.peer_id]) == [b.id]


async def test_private_swarm_key_mismatch_refuses_connection():
    key_a, key_b = os.urandom(32).hex(), os.urandom(32).hex()
    async with (
        Host(Identity.generate(), HostConfig(swarm_key=key_a)) as a,
        Host(Identity.generate(), HostConfig(swarm_key=key_b)) as b,
        Host(Identity.generate(), HostConfig(swarm_key=key_a)) as c,
    ):
        with pytest.raises(ConnectError):
            await b.connect(a.addrs[0], timeout=3)
        assert not b.is_connected(a.peer_id)
        assert await c.connect(a.addrs[0]) == a.peer_id  # the same key connects


async def test_open_host_cannot_join_private_swarm():
    async with (
        Host(Identity.generate(), HostConfig(swarm_key=os.urandom(32).hex())) as a,
        Host(Identity.generate()) as b,
    ):
        with pytest.raises(ConnectError):
            await b.connect(a.addrs[0], timeout=3)


async def test_host_closes_cleanly_with_live_connections():
    with trio.fail_after(15):
        async with AsyncExitStack() as stack:
            peers = await start_peers(stack, 3, streams=False)
            assert len(peers[0].host.connected_peers()) == 2


# -- rpc -----------------------------------------------------------------------------------------


async def _serve_echo(host: Host) -> None:
    async def echo(peer, req):
        if req == "fail":
            raise RemoteError("nope", "asked to fail")
        if req == "bug":
            raise ZeroDivisionError
        if req == "slow":
            await trio.sleep(5)  # sleep: a slow handler (the delay is what is tested)
        return {"from": peer, "echo": req}

    host.rpc.serve("echo", echo)


async def test_rpc_round_trip_and_typed_errors(pair):
    a, b = pair
    await _serve_echo(a.host)
    assert await b.host.rpc.call(a.id, "echo", [1, "x", b"\0"]) == {"from": b.id, "echo": [1, "x", b"\0"]}
    with pytest.raises(RemoteError) as err:
        await b.host.rpc.call(a.id, "echo", "fail")
    assert err.value.code == "nope"
    with pytest.raises(RemoteError) as err:
        await b.host.rpc.call(a.id, "echo", "bug")
    assert err.value.code == "internal"
    with pytest.raises(RpcTimeout):
        await b.host.rpc.call(a.id, "echo", "slow", timeout=0.5)
    with pytest.raises(RpcUnavailable):
        await b.host.rpc.call(a.id, "no-such-protocol", 1)
    assert (await b.host.rpc.call(a.id, "echo", 7))["echo"] == 7  # host unaffected


class _Answers:
    """The bytes a peer sent back on a proposed stream, read as a libp2p stream reads."""

    def __init__(self, data: bytes) -> None:
        self.data = data

    async def read(self, n: int | None = None) -> bytes:
        n = len(self.data) if n is None else n
        out, self.data = self.data[:n], self.data[n:]
        return out


def _delim(text: bytes) -> bytes:
    return bytes([len(text) + 1]) + text + b"\n"


@pytest.mark.parametrize(
    "answers",
    [
        b"",  # the peer reset the stream
        _delim(b"/multistream/1.0.0"),  # cut after the handshake
        _delim(b"/multistream/1.0.0") + _delim(b"na"),  # not served
        _delim(b"/multistream/2.0.0") + _delim(b"/meshtrain/echo/1"),  # another multistream
        _delim(b"/multistream/1.0.0") + _delim(b"/meshtrain/other/1"),  # another protocol
        b"\xff\xff\xff\xff\xff\xff\xff\xff\xff\x01",  # a varint past any length
        b"\x05hello",  # no newline delimiter
    ],
)
async def test_a_wrong_answer_to_a_proposed_protocol_is_a_stream_open_error(answers):
    with pytest.raises(StreamOpenError):
        await ProposedStream(_Answers(answers), "/meshtrain/echo/1").confirm()
    await ProposedStream(
        _Answers(_delim(b"/multistream/1.0.0") + _delim(b"/meshtrain/echo/1")), "/meshtrain/echo/1"
    ).confirm()


async def test_an_rpc_request_written_before_the_protocol_is_confirmed_is_served(pair):
    """The request travels behind the protocol proposal (host.py, pipelined protocol selection)."""
    a, b = pair
    await _serve_echo(a.host)
    proposed = await b.host.propose_stream(a.id, "/meshtrain/echo/1")
    body = packb({"q": "early"})
    await proposed.stream.write(struct.pack(">I", len(body)) + body)
    await proposed.confirm()
    reply = await proposed.stream.read(4096)
    assert b"early" in reply
    unserved = await b.host.propose_stream(a.id, "/meshtrain/nothing/1")
    await unserved.stream.write(struct.pack(">I", len(body)) + body)
    with pytest.raises(StreamOpenError, match="does not serve"):
        await unserved.confirm()
    assert (await b.host.rpc.call(a.id, "echo", 3))["echo"] == 3  # the connection is unharmed


@pytest.mark.parametrize("side", ["write", "read"])
async def test_cancelled_stream_io_does_not_kill_the_connection(pair, side):
    """py-libp2p's yamux encrypts a frame (using a Noise nonce) before it awaits the socket, so a
    task cancelled in between desynchronised the connection and the peer closed it: a few
    randomly cancelled writes (or reads, which send window updates) dropped it within a second
    (meshtrain/transport/libp2p_patches.py). Our deadlines cancel stream I/O routinely."""
    a, b = pair
    proto = "/meshtrain/test/cancel-io/1"
    chunk = b"x" * 2000

    async def handler(stream):
        with contextlib.suppress(Exception):
            if side == "write":
                while await stream.read(1 << 16):
                    pass
            else:
                while True:
                    await stream.write(chunk)

    b.host.set_stream_handler(proto, handler)
    stream = await a.host.open_stream(b.id, proto)
    rng = random.Random(7)
    cancelled = 0
    with trio.move_on_after(3):
        while cancelled < 400:
            async with trio.open_nursery() as nursery:
                for _ in range(3):

                    async def one():
                        nonlocal cancelled
                        with trio.move_on_after(rng.uniform(0, 0.0005)) as cs:
                            await (stream.write(chunk) if side == "write" else stream.read(4096))
                        cancelled += cs.cancelled_caught

                    nursery.start_soon(one)
            assert a.host.is_connected(b.id) and b.host.is_connected(a.id), f"dropped after {cancelled} cancellations"
    assert cancelled >= 20  # the test exercised what it is about
    await _serve_echo(b.host)
    assert (await a.host.rpc.call(b.id, "echo", 1, timeout=5))["echo"] == 1


async def test_concurrent_rpcs_on_one_connection(pair):
    a, b = pair
    await _serve_echo(a.host)
    results = []
    async with trio.open_nursery() as nursery:
        for i in range(40):

            async def one(i=i):
                results.append((await b.host.rpc.call(a.id, "echo", i))["echo"])

            nursery.start_soon(one)
    assert sorted(results) == list(range(40))


async def test_rpc_oversized_and_garbage_frames_do_not_hurt_the_host(pair):
    a, b = pair
    await _serve_echo(a.host)
    proto = "/meshtrain/echo/1"
    # A frame announcing 100 MB: refused before reading it.
    s = await b.host.open_stream(a.id, proto)
    await s.write(struct.pack(">I", 100 << 20))
    reply = await s.read(4096)
    assert b"malformed" in reply
    # msgpack garbage of a legal length.
    s = await b.host.open_stream(a.id, proto)
    body = b"\xc1\xc1\xc1"
    await s.write(struct.pack(">I", len(body)) + body)
    assert b"malformed" in await s.read(4096)
    # A well-formed value of the wrong shape.
    s = await b.host.open_stream(a.id, proto)
    body = packb([1, 2, 3])
    await s.write(struct.pack(">I", len(body)) + body)
    assert b"malformed" in await s.read(4096)
    # A truncated frame, then the stream is closed.
    s = await b.host.open_stream(a.id, proto)
    await s.write(struct.pack(">I", 50) + b"abc")
    await s.close()
    # The host still serves well-formed calls.
    assert (await b.host.rpc.call(a.id, "echo", "ok"))["echo"] == "ok"


async def test_rpc_reply_larger_than_client_limit_is_a_protocol_error(pair):
    a, b = pair

    async def big(peer, req):
        return b"x" * 200_000

    a.host.rpc.serve("big", big)
    with pytest.raises(RpcProtocolError):
        await b.host.rpc.call(a.id, "big", None, max_response=100_000)
    assert len(await b.host.rpc.call(a.id, "big", None)) == 200_000


async def test_host_does_not_auto_dial_known_peers():
    """py-libp2p's auto-connector would dial every peer in the address book; ours is off."""
    async with AsyncExitStack() as stack:
        a, b = await start_peers(stack, 2, streams=False)
        await b.host.disconnect(a.id)
        await trio.sleep(0.2)  # sleep: time for an auto-dial if there were one (below: none)
        assert not b.host.is_connected(a.id)
        await b.host.libp2p.get_network().auto_connector.maybe_connect()  # what its timer runs
        await trio.sleep(0.5)  # sleep: time for an auto-dial if there were one (below: none)
        assert not b.host.is_connected(a.id)


async def test_pubsub_never_dials_a_peer_whose_connection_closed():
    """libp2p_patches.py: pubsub's stream retry, run after the connection closed (as its retry
    task does when a pubsub stream dies while the connection is closing), does not dial the peer
    back — py-libp2p 0.8.1's `new_stream` would."""
    async with AsyncExitStack() as stack:
        (a,), (b,) = await start_peers(stack, 1, streams=False), await start_peers(stack, 1, streams=False)
        pubsubs = [await start_gossipsub(stack, p.host, (6, 4, 12), 1) for p in (a, b)]
        await b.host.connect(a.host.addrs[0])  # pubsub registers a peer when a connection opens
        with trio.fail_after(10):
            await b.host.wait_until(lambda: ID.from_base58(a.id) in pubsubs[1].peers)
        await b.host.disconnect(a.id)
        with trio.fail_after(10):
            await b.host.wait_until(lambda: not b.host.is_connected(a.id) and not a.host.is_connected(b.id))
        await pubsubs[1]._handle_new_peer_with_retry(ID.from_base58(a.id), 1.0)
        assert not b.host.is_connected(a.id)
        await b.host.connect(a.host.addrs[0])  # a new connection registers the peer again
        with trio.fail_after(10):
            await b.host.wait_until(lambda: ID.from_base58(a.id) in pubsubs[1].peers)


# -- one-off connections (transport/one_off.py) ---------------------------------------------------


async def _known_not_connected(stack: AsyncExitStack) -> tuple[Host, Host]:
    """Two hosts serving `echo`; the first knows the second's address but is not connected."""
    b, a = await start_peers(stack, 2, streams=False)  # the second dialled the first: it knows its address
    await _serve_echo(b.host)
    await a.host.disconnect(b.id)
    with trio.fail_after(10):
        await a.host.wait_until(lambda: not a.host.is_connected(b.id))
    return a.host, b.host


async def test_a_connection_dialled_for_one_query_is_hung_up_after_it_unless_kept():
    async with AsyncExitStack() as stack:
        a, b = await _known_not_connected(stack)
        a.one_off.keep = lambda peer: False
        dialled: list[str] = []
        stack.callback(a.on_connected(dialled.append))
        async with a.one_off.use(b.peer_id):  # the query dials b
            assert (await a.rpc.call(b.peer_id, "echo", 1))["echo"] == 1
        assert a.is_connected(b.peer_id) and a.one_off.in_use() == 1  # it lingers...
        async with a.one_off.use(b.peer_id):  # ...so a store that follows its lookup reuses it
            assert (await a.rpc.call(b.peer_id, "echo", 2))["echo"] == 2
        assert dialled == [b.peer_id]
        with trio.fail_after(10):
            await a.wait_until(lambda: not a.is_connected(b.peer_id))
        assert a.one_off.closed == 1 and a.one_off.in_use() == 0


async def test_a_one_off_connection_the_policy_keeps_stays():
    async with AsyncExitStack() as stack:
        a, b = await _known_not_connected(stack)  # the default policy keeps every connection
        async with a.one_off.use(b.peer_id):
            await a.rpc.call(b.peer_id, "echo", 1)
        with trio.move_on_after(one_off.LINGER_S + 1):  # past the linger: nothing closes it
            await a.wait_until(lambda: not a.is_connected(b.peer_id))
        assert a.is_connected(b.peer_id) and a.one_off.closed == 0


async def test_a_query_on_a_connection_that_was_open_before_never_closes_it():
    async with AsyncExitStack() as stack:
        peers = await start_peers(stack, 2, streams=False)
        a, b = peers[0].host, peers[1].host
        await _serve_echo(b)
        a.one_off.keep = lambda peer: False
        async with a.one_off.use(b.peer_id):
            await a.rpc.call(b.peer_id, "echo", 1)
        with trio.move_on_after(one_off.LINGER_S + 1):
            await a.wait_until(lambda: not a.is_connected(b.peer_id))
        assert a.is_connected(b.peer_id) and a.one_off.closed == 0


async def test_a_one_off_connection_with_a_stream_still_open_is_closed_only_after_it():
    """Something else (a membership exchange) opened a stream on it: that stream finishes first."""
    async with AsyncExitStack() as stack:
        a, b = await _known_not_connected(stack)
        a.one_off.keep = lambda peer: False
        async with a.one_off.use(b.peer_id):
            await a.rpc.call(b.peer_id, "echo", 1)
        with trio.fail_after(15):
            async with trio.open_nursery() as nursery:
                slow = partial(a.rpc.call, b.peer_id, "echo", "slow", timeout=one_off.LINGER_S + 2)
                nursery.start_soon(_expect_timeout, slow)
                with trio.move_on_after(one_off.LINGER_S + 1):  # the linger ends while it runs
                    await a.wait_until(lambda: not a.is_connected(b.peer_id))
                assert a.is_connected(b.peer_id) and a.one_off.closed == 0
            await a.wait_until(lambda: not a.is_connected(b.peer_id))  # closed once it is done
        assert a.one_off.closed == 1


async def _expect_timeout(call) -> None:
    with pytest.raises(RpcTimeout):
        await call()
