"""Peer announcements as standard kad records other libp2p stacks read (meshtrain/dht/interop.py):
a node's `Discovery` publishes one, another node's kad GET_VALUE (py-libp2p's, the protocol a
go- or js-libp2p peer speaks) fetches and verifies it over real hosts on loopback, and the
validator refuses every forged, stale, misplaced or malformed value — on PUT_VALUE too. The
js-libp2p side is tests/test_interop_js.py."""

from __future__ import annotations

import json
import time
from contextlib import AsyncExitStack, suppress

import pytest
import trio
from hypothesis import given, settings
from hypothesis import strategies as st
from libp2p.peer.envelope import Envelope, make_unsigned

from meshtrain.dht import DhtError, Discovery, DiscoveryConfig
from meshtrain.dht.interop import (
    DOMAIN,
    MAX_TTL_S,
    MAX_VALUE_BYTES,
    PAYLOAD_TYPE,
    InteropValidator,
    InvalidInteropRecord,
    open_record,
    peer_key,
    seal,
)
from meshtrain.transport.identity import Identity

from .test_dht import SWARM, swarm_of

FAST = DiscoveryConfig(role="trainer", ttl=3.0, refresh_interval=0.5)


def key_of(identity: Identity) -> tuple[object, str, str]:
    """(private key, peer id, its record's key)"""
    peer = identity.peer_id_str
    return identity.libp2p_key_pair.private_key, peer, peer_key(SWARM, peer)


def envelope(private_key, payload: bytes, *, domain: str = DOMAIN, payload_type: bytes = PAYLOAD_TYPE) -> bytes:
    sig = private_key.sign(make_unsigned(domain, payload_type, payload))
    return Envelope(private_key.get_public_key(), payload_type, payload, sig).marshal_envelope()


def body(key: str, peer: str, **changes) -> bytes:
    b = {
        "key": key,
        "seq": 1,
        "expiry": time.time() + 60,
        "addrs": [f"/ip4/10.0.0.1/tcp/4001/p2p/{peer}"],
        "role": "trainer",
        "version": "0.1",
    }
    b.update(changes)
    return json.dumps(b).encode()


def test_a_sealed_announcement_opens_for_its_key_and_the_newest_is_selected():
    private, peer, key = key_of(Identity.generate())
    addrs = [f"/ip4/10.0.0.1/tcp/4001/p2p/{peer}", f"/ip4/10.0.0.2/tcp/4001/p2p/{peer}/p2p-circuit/p2p/{peer}"]
    older = seal(private, SWARM, peer, addrs, role="trainer", version="9.9", ttl=60)
    time.sleep(0.002)  # sleep: the next record's seq (ms) must be later
    newer = seal(private, SWARM, peer, addrs[:1], role="trainer", version="9.9", ttl=60)
    record = open_record(key, older)
    assert (record.peer, record.addrs, record.role, record.version) == (peer, tuple(addrs), "trainer", "9.9")
    assert InteropValidator().select(key, [older, newer, b"junk"]) == 1
    assert InteropValidator().select(key, [newer, older]) == 0


def test_the_validator_refuses_what_another_stack_must_refuse():
    private, peer, key = key_of(Identity.generate())
    other_private, other, other_key = key_of(Identity.generate())
    good = body(key, peer)
    cases = {
        "signed by another peer": envelope(other_private, good),
        "signed for another key": envelope(private, body(other_key, peer)),
        "another domain": envelope(private, good, domain="libp2p-peer-record"),
        "another payload type": envelope(private, good, payload_type=b"\x03\x01"),
        "expired": envelope(private, body(key, peer, expiry=time.time() - 1)),
        "too far ahead": envelope(private, body(key, peer, expiry=time.time() + MAX_TTL_S + 3600)),
        "an address of another peer": envelope(private, body(key, peer, addrs=[f"/ip4/10.0.0.1/tcp/1/p2p/{other}"])),
        "an address without a peer": envelope(private, body(key, peer, addrs=["/ip4/10.0.0.1/tcp/1"])),
        "not JSON": envelope(private, b"\xff\xfe"),
        "a field too many": envelope(private, body(key, peer, caps={})),
        "a boolean seq": envelope(private, body(key, peer, seq=True)),
        "oversized": envelope(private, body(key, peer, role="x" * MAX_VALUE_BYTES)),
        "not an envelope": b"\x0a\x03abc",
    }
    for why, value in cases.items():
        with pytest.raises(InvalidInteropRecord):
            open_record(key, value)
            pytest.fail(why)
    for bad_key in (f"/ipns/{peer}", f"/meshtrain/{SWARM}/peers", f"/meshtrain//peer/{peer}", key + "/x"):
        with pytest.raises(InvalidInteropRecord):
            open_record(bad_key, envelope(private, body(bad_key, peer)))
    open_record(key, envelope(private, good))  # the positive control


@settings(max_examples=200, deadline=None)
@given(st.binary(max_size=3000))
def test_any_bytes_are_a_record_or_an_invalid_one_never_an_error(value):
    with suppress(InvalidInteropRecord):
        open_record(peer_key(SWARM, Identity.from_seed(b"\x01" * 32).peer_id_str), value)


async def test_a_node_announcement_is_a_kad_record_another_node_fetches_and_a_forgery_is_refused():
    async with AsyncExitStack() as stack:
        nodes = (await stack.enter_async_context(swarm_of(4))).nodes
        announcer, reader = nodes[1], nodes[3]
        await stack.enter_async_context(Discovery(announcer, SWARM, FAST))
        key = peer_key(SWARM, announcer.peer_id)
        with trio.fail_after(20):
            while (got := await reader.get_interop(key)) is None:
                await trio.sleep(0.2)  # sleep: poll interval while the PUT_VALUE spreads
        assert got.peer == announcer.peer_id and got.role == "trainer"
        assert list(got.addrs) == announcer.host.addrs
        # A stranger cannot overwrite it: its PUT_VALUE is refused where it starts, and by the
        # peers (py-libp2p's kad handler runs the same validator on every PUT_VALUE it serves).
        forger = Identity.generate().libp2p_key_pair.private_key
        forged = envelope(forger, body(key, announcer.peer_id, seq=2**53))
        with pytest.raises(DhtError, match="kad refused"):
            await reader.put_interop(key, forged)
        assert (await reader.get_interop(key)) == got
