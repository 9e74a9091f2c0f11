"""The tensor data plane between real hosts: direct AES-GCM TCP and the libp2p fallback."""

from __future__ import annotations

import os
import signal
import socket
import struct
import time
from contextlib import AsyncExitStack
from functools import partial

import pytest
import torch
import trio
import trio.testing

from meshtrain.transport.data_channel import ACCEPT, DATA, HEADER, MAX_CHUNK, DataChannel, payload_digest
from meshtrain.transport.framing import FramedStream, StreamClosed, packb, unpackb
from meshtrain.transport.host import HostConfig
from meshtrain.transport.rpc import RemoteError
from meshtrain.transport.tensor_inbox import Inbox
from meshtrain.transport.tensor_layout import specs_of
from meshtrain.transport.tensor_streams import (
    FALLBACK_PROTOCOL,
    MAGIC,
    DataPlaneConfig,
    DigestMismatch,
    TensorStreams,
    TransferError,
    TransferRefused,
)

from .conftest import read_json, spawn, start_peers


def sample_dict() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(7)
    return {
        "fp32": torch.randn(300, 301, generator=g),
        "fp16": torch.randn(1001, generator=g).half(),
        "bf16": torch.randn(17, 3, generator=g).bfloat16(),
        "int8": torch.randint(-128, 127, (999,), generator=g, dtype=torch.int8),
        "zero_dim": torch.tensor(3.25),
        "empty": torch.empty(0, 4),
        "big": torch.randn(3 << 20, generator=g),  # spans several chunks
    }


async def exchange(sender, receiver, tag, tensors, **recv_kwargs):
    out = {}
    async with trio.open_nursery() as nursery:

        async def rx():
            out["received"] = await receiver.ts.receive(sender.id, tag, **recv_kwargs)

        nursery.start_soon(rx)
        out["report"] = await sender.ts.send(receiver.id, tag, tensors)
    return out["report"], out["received"]


def assert_bit_exact(a: dict, b: dict) -> None:
    assert list(a) == list(b)
    for k in a:
        assert a[k].dtype == b[k].dtype and a[k].shape == b[k].shape, k
        assert torch.equal(
            a[k].view(-1).view(torch.uint8) if a[k].numel() else a[k],
            b[k].view(-1).view(torch.uint8) if b[k].numel() else b[k],
        ), k


@pytest.mark.parametrize("direct", [True, False], ids=["direct", "libp2p"])
async def test_tensor_dict_round_trip_is_bit_exact(direct):
    async with AsyncExitStack() as stack:
        a, b = await start_peers(stack, 2, dp=DataPlaneConfig(direct=direct))
        src = sample_dict()
        report, got = await exchange(a, b, "t", src)
        assert report.path == got.path == ("direct" if direct else "libp2p")
        assert_bit_exact(src, got.tensors)
        assert got.digest == report.digest == payload_digest(src)


def has_ipv6_loopback() -> bool:
    try:
        with socket.socket(socket.AF_INET6) as s:
            s.bind(("::1", 0))
        return True
    except OSError:
        return False


@pytest.mark.skipif(not has_ipv6_loopback(), reason="no IPv6 loopback (::1) on this machine")
@pytest.mark.parametrize(
    "listen", [["/ip6/::1/tcp/0"], ["/ip4/127.0.0.1/tcp/0", "/ip6/::1/tcp/0"]], ids=["ipv6", "dual-stack"]
)
async def test_ipv6_peers_move_tensors_on_the_direct_data_plane(listen):
    """Over IPv6 the data plane is dialled at the IP of the libp2p connection (py-libp2p reported
    none for IPv6 before transport/libp2p_patches.py); it listens on one port on every listen IP."""
    async with AsyncExitStack() as stack:
        a, b = await start_peers(stack, 2, host_config=HostConfig(listen=listen))
        for addr in listen:
            ip = addr.split("/")[2]
            with socket.create_connection((ip, a.ts.port), timeout=5):
                pass  # accepted: the data plane listens there
        report, received = await exchange(b, a, "w", {"w": torch.arange(1000.0)})
        assert received.path == "direct" and torch.equal(received.tensors["w"], torch.arange(1000.0))


async def test_receive_into_preallocated_buffers(pair):
    a, b = pair
    src = sample_dict()
    into = {k: torch.zeros_like(v) for k, v in src.items()}
    _, got = await exchange(a, b, "into", src, into=into)
    assert all(got.tensors[k] is into[k] for k in src)
    assert_bit_exact(src, into)


async def test_mismatched_receive_buffers_refuse_the_transfer(pair):
    a, b = pair
    async with trio.open_nursery() as nursery:

        async def rx():
            with pytest.raises(TransferRefused):
                await b.ts.receive(a.id, "bad", into={"w": torch.zeros(11)})

        nursery.start_soon(rx)
        with pytest.raises(TransferRefused, match="do not match"):
            await a.ts.send(b.id, "bad", {"w": torch.randn(10)})


async def test_sender_waits_for_late_receiver_then_delivers(pair):
    a, b = pair
    src = {"w": torch.randn(1000)}
    async with trio.open_nursery() as nursery:
        got = {}

        async def late_rx():
            await trio.sleep(1.0)  # sleep: a late receiver is what is tested
            got["r"] = await b.ts.receive(a.id, "late")

        nursery.start_soon(late_rx)
        await a.ts.send(b.id, "late", src)
    assert torch.equal(got["r"].tensors["w"], src["w"])


async def test_announced_digest_mismatch_is_detected_on_both_sides(pair):
    a, b = pair
    src = {"w": torch.randn(5000)}
    async with trio.open_nursery() as nursery:

        async def rx():
            with pytest.raises(DigestMismatch):
                await b.ts.receive(a.id, "dig")

        nursery.start_soon(rx)
        with pytest.raises(DigestMismatch):
            await a.ts.send(b.id, "dig", src, digest=b"\0" * 32)


async def test_many_transfers_reuse_pooled_connections(pair):
    a, b = pair
    for i in range(5):
        _, got = await exchange(a, b, f"r{i}", {"x": torch.full((10,), float(i))})
        assert got.tensors["x"][0] == i
    assert sum(len(v) for v in a.ts._idle.values()) == 1  # one connection, reused


async def test_resume_after_connection_cut_mid_transfer(pair):
    a, b = pair
    src = {"w": torch.randn(64 << 20 >> 2)}  # 64 MiB
    async with trio.open_nursery() as nursery:
        got = {}

        async def rx():
            got["r"] = await b.ts.receive(a.id, "cut")

        nursery.start_soon(rx)

        async def cut_once_started():
            while b.ts.stats["bytes_received"] == 0 and not any(
                p.done > (8 << 20) for p in b.ts.inbox.partials.values()
            ):
                await trio.sleep(0.001)  # sleep: poll interval
            for ch in list(b.ts.active):
                ch.framed.stream.socket.shutdown(socket.SHUT_RDWR)

        nursery.start_soon(cut_once_started)
        report = await a.ts.send(b.id, "cut", src)
    assert report.resumes >= 1
    assert torch.equal(got["r"].tensors["w"], src["w"])
    assert got["r"].digest == payload_digest(src)


async def test_a_sender_that_starts_over_replaces_its_interrupted_transfer(pair):
    """The sender's first transfer breaks mid-way and is kept for resuming (15 s); the sender
    does not resume — it restarted, say — but sends the same receive again under a new transfer
    id. The new transfer takes the receive at once (it was refused as unclaimed, and the receive
    waited out the resume window for nothing: CI, a restarted peer's sparse-gather payload)."""
    a, b = pair
    first, second = {"w": torch.zeros(16 << 20 >> 2)}, {"w": torch.randn(16 << 20 >> 2)}
    got = {}
    async with trio.open_nursery() as nursery:

        async def rx():
            got["r"] = await b.ts.receive(a.id, "again", timeout=30)

        nursery.start_soon(rx)
        with trio.CancelScope() as first_send:

            async def cut_once_started():
                while not any(p.done > 0 for p in b.ts.inbox.partials.values()):
                    await trio.sleep(0.001)  # sleep: poll interval
                first_send.cancel()
                for ch in list(b.ts.active):
                    ch.framed.stream.socket.shutdown(socket.SHUT_RDWR)

            nursery.start_soon(cut_once_started)
            await a.ts.send(b.id, "again", first)
        while any(p.active for p in b.ts.inbox.partials.values()):  # the receiver saw the cut
            await trio.sleep(0.01)  # sleep: poll interval
        assert b.ts.inbox.partials, "the first transfer is kept for resuming"
        t0 = trio.current_time()
        await a.ts.send(b.id, "again", second, timeout=10)
    assert trio.current_time() - t0 < 5
    assert torch.equal(got["r"].tensors["w"], second["w"])
    assert not b.ts.inbox.partials


async def test_receive_times_out_cleanly_without_sender(pair):
    a, b = pair
    with pytest.raises(TransferError, match="within"):
        await b.ts.receive(a.id, "never", timeout=0.5)


async def test_wrong_session_key_is_refused(pair):
    a, b = pair
    reply = await a.host.rpc.call(b.id, "dataplane", {"op": "open"})
    with trio.fail_after(10):
        stream = await trio.open_tcp_stream("127.0.0.1", reply["port"])
        await stream.send_all(MAGIC + reply["sid"] + os.urandom(16))
        snonce = await stream.receive_some(16)
        assert len(snonce) == 16
        # A frame sealed with the wrong key: the server must drop the connection.
        await stream.send_all(struct.pack(">IB", 1 + 100, 1) + os.urandom(100))
        assert await _closed_by_peer(stream)
    assert b.ts.stats["handshake_failures"] >= 1


async def test_unknown_session_and_garbage_are_refused(pair):
    a, b = pair
    for opening in (MAGIC + os.urandom(32), b"GET / HTTP/1.1\r\n\r\n" + b"x" * 40):
        stream = await trio.open_tcp_stream("127.0.0.1", b.ts.port)
        await stream.send_all(opening)
        assert await _closed_by_peer(stream)
    _, got = await exchange(a, b, "after", {"x": torch.ones(3)})  # still serving
    assert got.tensors["x"].sum() == 3


async def test_replayed_connection_is_refused(pair):
    """Record the client's bytes of a real connection, then replay them on a new one."""
    a, b = pair
    port = b.ts.port
    recorded = bytearray()
    proxy_ready = trio.Event()

    async def recording_proxy(client: trio.SocketStream):
        upstream = await trio.open_tcp_stream("127.0.0.1", port)
        async with trio.open_nursery() as n:

            async def up():
                while data := await client.receive_some(1 << 16):
                    recorded.extend(data)
                    await upstream.send_all(data)

            async def down():
                while data := await upstream.receive_some(1 << 16):
                    await client.send_all(data)

            n.start_soon(up)
            n.start_soon(down)

    async with trio.open_nursery() as nursery:
        listeners = await nursery.start(partial(trio.serve_tcp, recording_proxy, 0, host="127.0.0.1"))
        proxy_port = listeners[0].socket.getsockname()[1]
        proxy_ready.set()
        # Point a's session for b at the proxy (same ip, proxy port), then transfer for real.
        reply = await a.host.rpc.call(b.id, "dataplane", {"op": "open"})
        a.ts._client_sessions[b.id] = (reply["sid"], reply["key"], "127.0.0.1", proxy_port)
        _, got = await exchange(a, b, "rec", {"x": torch.arange(100.0)})
        assert got.path == "direct"
        failures = b.ts.stats["handshake_failures"]
        replay = await trio.open_tcp_stream("127.0.0.1", port)
        await replay.send_all(bytes(recorded))
        assert await _closed_by_peer(replay)
        assert b.ts.stats["handshake_failures"] > failures
        nursery.cancel_scope.cancel()


async def _closed_by_peer(stream: trio.SocketStream) -> bool:
    with trio.fail_after(10):
        try:
            while await stream.receive_some(1 << 16):
                pass
        except trio.BrokenResourceError:
            pass
    return True


async def test_oversized_data_frame_is_refused(pair):
    """A sender announcing a 1 GiB data frame is cut off before anything is allocated."""
    a, b = pair
    async with trio.open_nursery() as nursery:

        async def rx():
            with pytest.raises(TransferError):  # the connection dropped, or at the latest its timeout
                await b.ts.receive(a.id, "huge", timeout=3)

        nursery.start_soon(rx)
        ch = await a.ts._channel(b.id)
        await ch.send_msg(
            1,
            {"tag": "huge", "xfer": os.urandom(16), "specs": [["w", "float32", [1 << 28]]], "meta": {}, "digest": None},
        )
        kind, _ = await ch.recv_msg(2, 6)
        assert kind == 2  # accepted the header (1 GiB is under the default limit)
        await ch.framed.write(struct.pack(">IB", (1 << 30) + 17, 3))
        # The receiver drops the connection at the frame header: our writes start failing.
        with pytest.raises(StreamClosed):
            for _ in range(1000):
                await ch.framed.write(b"\0" * 65536)
                await trio.sleep(0.001)  # sleep: paces the writes until one fails


async def test_header_over_receive_limit_is_refused(pair):
    a, b = pair
    async with trio.open_nursery() as nursery:

        async def rx():
            with pytest.raises(TransferRefused):
                await b.ts.receive(a.id, "limited", max_bytes=1000)

        nursery.start_soon(rx)
        with pytest.raises(TransferRefused, match="exceeds"):
            await a.ts.send(b.id, "limited", {"w": torch.zeros(1000)})


# -- eager transfers (small payloads sent with their header) ---------------------------------


async def abandon(receiver, sender, tag: str) -> None:
    """A receive of `tag` that gave up (timed out): a sender arriving now is refused at once."""
    with pytest.raises(TransferError):
        await receiver.ts.receive(sender.id, tag, timeout=0.01)


@pytest.mark.parametrize("eager_bytes", [256 << 10, 0], ids=["eager", "rendezvous"])
async def test_a_small_transfer_is_on_the_wire_before_its_receive_is_posted(eager_bytes):
    """Eager: the payload goes with its header, so it waits at the receiver, not at the sender;
    rendezvous (eager_bytes 0): nothing is sent until the receive is posted."""
    async with AsyncExitStack() as stack:
        a, b = await start_peers(stack, 2, dp=DataPlaneConfig(eager_bytes=eager_bytes))
        src = {"w": torch.randn(1000), "i": torch.arange(7)}
        async with trio.open_nursery() as nursery:
            nursery.start_soon(partial(a.ts.send, b.id, "early", src, timeout=20))
            await _wait_until(lambda: b.ts.inbox.waiting.get(a.id) == 1)
            await trio.sleep(0.3)  # sleep: time for the payload to go out if it would (rendezvous: it must not)
            payload_bytes = sum(t.numel() * t.element_size() for t in src.values())
            assert a.ts.stats["bytes_sent"] == (payload_bytes if eager_bytes else 0)
            got = await b.ts.receive(a.id, "early", timeout=20)
        assert_bit_exact(src, got.tensors)
        # Past the limit, the payload waits for ACCEPT as before.
        big = {"w": torch.randn((256 << 10) // 4 + 1)}
        sent = a.ts.stats["bytes_sent"]
        async with trio.open_nursery() as nursery:
            nursery.start_soon(partial(a.ts.send, b.id, "big", big, timeout=20))
            await _wait_until(lambda: b.ts.inbox.waiting.get(a.id) == 1)
            await trio.sleep(0.3)  # sleep: time for the payload to go out if it would (before ACCEPT it must not)
            assert a.ts.stats["bytes_sent"] == sent
            got = await b.ts.receive(a.id, "big", timeout=20)
        assert torch.equal(got.tensors["w"], big["w"])


async def test_refused_eager_transfers_keep_the_connection_in_step(pair):
    """A refusal reads the eager payload away first: the sender gets the ERROR's reason (not a
    reset), and the receiver goes on serving that connection."""
    a, b = pair
    ch = await a.ts._channel(b.id)
    payload = torch.arange(4, dtype=torch.float32)
    for i in range(3):  # receives that gave up: their senders are refused at once
        await abandon(b, a, f"gone/{i}")
        await ch.send_msg(1, {**header(f"gone/{i}"), "eager": True})
        await ch.send(3, memoryview(payload.numpy()).cast("B"))
        await ch.send_msg(4, {"digest": payload_digest({"w": payload})})
        kind, msg = await ch.recv_msg(2, 6)
        assert kind == 6 and msg["code"] == "unclaimed"
    # The same connection then carries a real transfer.
    async with trio.open_nursery() as nursery:
        got = {}

        async def rx():
            got["r"] = await b.ts.receive(a.id, "real", timeout=10)

        nursery.start_soon(rx)
        await _wait_until(lambda: (a.id, "real") in b.ts.inbox.slots)
        await ch.send_msg(1, {**header("real"), "eager": True})
        await ch.send(3, memoryview(payload.numpy()).cast("B"))
        await ch.send_msg(4, {"digest": payload_digest({"w": payload})})
        assert (await ch.recv_msg(2, 6))[0] == 2
        assert (await ch.recv_msg(5, 6))[0] == 5
    assert torch.equal(got["r"].tensors["w"], payload)
    assert b.ts.refused["unclaimed"] == 3


@pytest.mark.parametrize("case", ["over-limit", "bad-specs", "not-a-bool", "frames-past-total", "no-trailer"])
async def test_hostile_eager_headers_end_the_connection_and_nothing_else(pair, case):
    a, b = pair
    ch = await a.ts._channel(b.id)
    h = {**header("nobody"), "eager": True}
    if case == "over-limit":
        h["specs"] = [["w", "float32", [(256 << 10) // 4 + 1]]]
    elif case == "bad-specs":
        h["specs"] = [["w", "float99", [4]]]
    elif case == "not-a-bool":
        h["eager"] = 1
    await abandon(b, a, "nobody")  # refused at once, whatever the header says
    await ch.send_msg(1, h)
    if case == "frames-past-total":
        await ch.send(3, b"\0" * 64)  # 64 bytes of a 16-byte payload
    elif case == "no-trailer":
        await ch.send(3, b"\0" * 16)
        await ch.send_msg(1, header("next"))  # a HEADER where the TRAILER belongs
    assert await _closed_by_peer(ch.framed.stream)
    _, got = await exchange(a, b, "after", {"x": torch.ones(3)})  # the receiver serves on
    assert got.tensors["x"].sum() == 3


# -- separate processes: stall, kill ---------------------------------------------------------


def _start_pair(mib: int, *extra: str):
    rx = spawn("tests/proc_peer.py", "receiver", "--mib", str(mib), *extra)
    info = read_json(rx)
    tx = spawn("tests/proc_peer.py", "sender", "--to", info["addr"], "--mib", str(mib), *extra)
    tx_info = read_json(tx)
    rx.stdin.write(tx_info["peer"] + "\n")
    rx.stdin.flush()
    tx.stdin.write("go\n")
    tx.stdin.flush()
    assert read_json(tx) == {"sending": True}
    return rx, tx


def _cleanup(*procs):
    for p in procs:
        if p.poll() is None:
            p.kill()
        p.wait()


@pytest.mark.slow
@pytest.mark.parametrize("direct", ["1", "0"], ids=["direct", "libp2p"])
def test_receiver_stalled_10s_then_resumes(direct):
    """SIGSTOP the receiving process for 7 s mid-transfer; the transfer must still complete.
    (A py-libp2p yamux stream would have been reset after 5 s.)"""
    rx, tx = _start_pair(256, "--direct", direct)
    try:
        time.sleep(0.2)  # sleep: stops the receiver some way into the transfer (sending has begun)
        os.kill(rx.pid, signal.SIGSTOP)
        time.sleep(7)  # sleep: the receiver stays SIGSTOPped past yamux's 5 s (what is tested)
        os.kill(rx.pid, signal.SIGCONT)
        got, sent = read_json(rx), read_json(tx)
        assert "ok" in got and "ok" in sent, (got, sent)
        assert got["ok"] == sent["ok"]
    finally:
        _cleanup(rx, tx)


@pytest.mark.slow
@pytest.mark.parametrize("victim", ["receiver", "sender"])
def test_peer_killed_mid_transfer_gives_peer_gone_to_the_other(victim):
    rx, tx = _start_pair(512, "--resume-window", "2")
    try:
        time.sleep(0.3)  # sleep: the kill lands some way into the transfer
        (rx if victim == "receiver" else tx).kill()
        t0 = time.monotonic()
        result = read_json(tx if victim == "receiver" else rx)
        assert result.get("error") == "PeerGone", result
        assert time.monotonic() - t0 < 10
    finally:
        _cleanup(rx, tx)


async def test_receiver_cancelled_mid_transfer_refuses_sender_and_host_survives(pair):
    a, b = pair
    src = {"w": torch.randn(64 << 20 >> 2)}
    async with trio.open_nursery() as nursery:

        async def rx():
            with trio.move_on_after(0.05):
                await b.ts.receive(a.id, "gave-up")

        nursery.start_soon(rx)
        with pytest.raises(TransferError):
            await a.ts.send(b.id, "gave-up", src, timeout=30)
    _, got = await exchange(a, b, "after-cancel", {"x": torch.ones(4)})  # both still serve
    assert got.tensors["x"].sum() == 4


# -- who may use the data plane; how many early senders may wait ------------------------------


def members(*peers):
    """An `authorize` hook admitting exactly `peers`, recording whom it was asked about."""
    allowed = {p.id for p in peers}
    asked = []

    async def authorize(peer: str) -> bool:
        asked.append(peer)
        return peer in allowed

    authorize.asked = asked
    return authorize


def header(tag: str) -> dict:
    return {"tag": tag, "xfer": os.urandom(16), "specs": [["w", "float32", [4]]], "meta": {}, "digest": None}


@pytest.mark.parametrize("direct", [True, False], ids=["direct", "libp2p"])
async def test_non_member_cannot_send_but_member_can(direct):
    async with AsyncExitStack() as stack:
        b, member, stranger = await start_peers(stack, 3, dp=DataPlaneConfig(direct=direct))
        b.ts.authorize = members(member)  # set after construction, as the node does
        async with trio.open_nursery() as nursery:

            async def rx_never():  # a receive is waiting: only the refusal keeps the data out
                with pytest.raises(TransferError, match="within"):
                    await b.ts.receive(stranger.id, "t", timeout=2)

            nursery.start_soon(rx_never)
            with pytest.raises(TransferRefused, match="not-a-member"):
                await stranger.ts.send(b.id, "t", {"x": torch.ones(3)}, timeout=10)
        assert b.ts.refused["not-a-member"] >= 1
        assert not any(s.peer == stranger.id for s in b.ts._sessions.values())
        report, got = await exchange(member, b, "t", {"x": torch.arange(5.0)})
        assert got.path == report.path == ("direct" if direct else "libp2p")
        assert torch.equal(got.tensors["x"], torch.arange(5.0))


async def test_session_rpc_answers_not_a_member_and_hands_no_key(pair):
    a, b = pair
    b.ts.authorize = members()
    with pytest.raises(RemoteError) as refused:
        await a.host.rpc.call(b.id, "dataplane", {"op": "open"})
    assert refused.value.code == "not-a-member"
    assert b.ts._sessions == {}
    assert b.ts.authorize.asked == [a.id]
    assert b.ts.refused["not-a-member"] == 1


async def test_fallback_stream_of_non_member_gets_one_error_frame_and_is_closed(pair):
    a, b = pair
    b.ts.authorize = members()
    served = []
    async with trio.open_nursery() as nursery:

        async def rx():
            with trio.move_on_after(2):
                served.append(await b.ts.receive(a.id, "fb"))

        nursery.start_soon(rx)
        stream = await a.host.open_stream(b.id, FALLBACK_PROTOCOL)
        framed = FramedStream(stream)
        body = packb(header("fb"))
        await framed.write(struct.pack(">IB", len(body) + 1, 1) + body)
        with trio.fail_after(10):
            length, kind = struct.unpack(">IB", await framed.read_exactly(5))
            assert kind == 6  # ERROR
            assert unpackb(await framed.read_exactly(length - 1))["code"] == "not-a-member"
            assert await framed.at_eof()  # and nothing more: the stream was closed
    assert served == []  # the header never reached the waiting receive
    assert b.ts.refused["not-a-member"] == 1


async def test_session_key_handed_to_a_stranger_opens_no_connection(pair):
    """A session made outside the RPC (hole punching's `new_session`), or kept by a peer that has
    since left: the connection is closed before the server's nonce, so no keys are derived."""
    a, b = pair
    b.ts.authorize = members()
    sid, _key = b.ts.new_session(a.id)
    with trio.fail_after(10):
        stream = await trio.open_tcp_stream("127.0.0.1", b.ts.port)
        await stream.send_all(MAGIC + sid + os.urandom(16))
        assert await stream.receive_some(16) == b""
    assert b.ts.refused["not-a-member"] == 1
    assert sid not in b.ts._sessions  # a refusal forgets the peer's sessions


async def test_member_that_leaves_is_refused_new_connections(pair):
    a, b = pair
    admitted = {a.id}

    async def authorize(peer: str) -> bool:
        return peer in admitted

    b.ts.authorize = authorize
    await exchange(a, b, "in", {"x": torch.ones(2)})
    admitted.clear()
    for ch in a.ts._idle.pop(b.id, []):  # pooled connections outlive membership (documented)
        await ch.aclose()
    with pytest.raises(TransferRefused, match="not-a-member"):
        await a.ts.send(b.id, "out", {"x": torch.ones(2)}, timeout=10)
    assert b.ts.refused["not-a-member"] >= 1


async def test_slow_or_broken_authorize_refuses_within_its_deadline():
    async def never(peer: str) -> bool:
        await trio.sleep_forever()

    async def broken(peer: str) -> bool:
        raise RuntimeError("membership not loaded")

    async with AsyncExitStack() as stack:
        a, b = await start_peers(stack, 2, streams=False)
        ts = await stack.enter_async_context(
            TensorStreams(b.host, DataPlaneConfig(authorize_timeout=0.3), authorize=never)
        )
        t0 = time.monotonic()
        with pytest.raises(RemoteError) as refused:
            await a.host.rpc.call(b.id, "dataplane", {"op": "open"})
        assert refused.value.code == "not-a-member"
        assert 0.3 <= time.monotonic() - t0 < 3
        assert ts.refused["authorize-timeout"] == 1
        ts.authorize = broken
        with pytest.raises(RemoteError, match="not-a-member"):
            await a.host.rpc.call(b.id, "dataplane", {"op": "open"})
        assert ts.refused["authorize-error"] == 1
        assert ts._sessions == {}


async def _wait_until(predicate, seconds: float = 10) -> None:
    with trio.fail_after(seconds):
        while not predicate():
            await trio.sleep(0.01)  # sleep: poll interval


async def test_flood_of_unclaimed_headers_is_refused_beyond_the_bound_per_peer():
    async with AsyncExitStack() as stack:
        b, flooder, other = await start_peers(stack, 3, dp=DataPlaneConfig(max_pending_per_peer=4, max_pending=16))
        flood = []
        for i in range(4):  # each early header holds a connection: open four
            ch = await flooder.ts._channel(b.id)
            await ch.send_msg(1, header(f"nobody/{i}"))
            flood.append(ch)
        await _wait_until(lambda: b.ts.inbox.waiting.get(flooder.id) == 4)
        t0 = time.monotonic()
        with pytest.raises(TransferRefused, match="too-many-pending"):
            await flooder.ts.send(b.id, "nobody/4", {"w": torch.ones(4)}, timeout=10)
        assert time.monotonic() - t0 < 5  # refused at once, not after claim_timeout
        assert b.ts.refused["too-many-pending"] == 1

        # Another peer's early sender still waits and delivers; and the flooder's transfer to a
        # receive that is already waiting never counts against its bound.
        async with trio.open_nursery() as nursery:
            nursery.start_soon(partial(other.ts.send, b.id, "early", {"x": torch.ones(3)}, timeout=10))
            await _wait_until(lambda: b.ts.inbox.waiting.get(other.id) == 1)
            got = await b.ts.receive(other.id, "early", timeout=10)
        assert got.tensors["x"].sum() == 3
        _, got = await exchange(flooder, b, "claimed", {"x": torch.ones(2)})
        assert got.tensors["x"].sum() == 2

        # The flooder hangs up: its places are freed at once, not after claim_timeout.
        for ch in flood:
            await ch.aclose()
        await _wait_until(lambda: b.ts.inbox.waiting == {}, seconds=5)
        assert not any(peer == flooder.id for peer, _ in b.ts.inbox.slots)
        async with trio.open_nursery() as nursery:
            nursery.start_soon(partial(flooder.ts.send, b.id, "later", {"x": torch.ones(1)}, timeout=10))
            await _wait_until(lambda: b.ts.inbox.waiting.get(flooder.id) == 1)
            got = await b.ts.receive(flooder.id, "later", timeout=10)
        assert got.tensors["x"].sum() == 1


async def test_early_headers_are_bounded_across_peers():
    async with AsyncExitStack() as stack:
        b, p, q = await start_peers(stack, 3, dp=DataPlaneConfig(max_pending_per_peer=3, max_pending=4))
        held = []
        for sender, n in ((p, 3), (q, 1)):
            for i in range(n):
                ch = await sender.ts._channel(b.id)
                await ch.send_msg(1, header(f"nobody/{i}"))
                held.append(ch)
        await _wait_until(lambda: sum(b.ts.inbox.waiting.values()) == 4)
        with pytest.raises(TransferRefused, match="too-many-pending"):
            await q.ts.send(b.id, "one-too-many", {"w": torch.ones(4)}, timeout=10)
        _, got = await exchange(q, b, "claimed", {"x": torch.ones(2)})  # a waiting receive: fine
        assert got.tensors["x"].sum() == 2
        assert b.ts.refused["too-many-pending"] == 1
        for ch in held:
            await ch.aclose()
        await _wait_until(lambda: b.ts.inbox.waiting == {}, seconds=5)


async def test_a_data_plane_whose_port_is_taken_fails_to_start_and_leaves_nothing_running():
    """The listener opens before the nursery (lifecycle.Service): a busy port is an OSError out
    of `async with`, and the host around it still closes at once (nothing leaked)."""
    from meshtrain.transport.host import Host
    from meshtrain.transport.identity import Identity

    busy = socket.socket()
    busy.bind(("127.0.0.1", 0))
    busy.listen()
    try:
        with trio.fail_after(15):
            async with Host(Identity.generate()) as host:
                streams = TensorStreams(host, DataPlaneConfig(listen_ip="127.0.0.1", port=busy.getsockname()[1]))
                with pytest.raises(OSError):
                    async with streams:
                        pass
                assert streams._nursery is None
    finally:
        busy.close()


# -- bulk connections for long transfers --------------------------------------------------------


@pytest.mark.parametrize("direct", [True, False], ids=["direct", "libp2p"])
async def test_long_transfers_have_a_connection_pool_of_their_own(direct):
    """At least `bulk_bytes`: a connection apart from the pool of the smaller transfers, opened by
    the first and reused by the next; smaller ones keep reusing theirs."""
    async with AsyncExitStack() as stack:
        a, b = await start_peers(stack, 2, dp=DataPlaneConfig(bulk_bytes=1 << 20, direct=direct))
        small = {"x": torch.arange(1000, dtype=torch.float32)}
        big = {"w": torch.randn((1 << 20) // 4)}  # exactly bulk_bytes
        await exchange(a, b, "s0", small)
        assert a.ts.stats["connections_opened"] == 1
        for i in range(3):
            report, got = await exchange(a, b, f"big{i}", big)
            assert torch.equal(got.tensors["w"], big["w"]) and report.nbytes == 1 << 20
            assert a.ts.stats["connections_opened"] == 2  # opened once, then reused
        await exchange(a, b, "s1", small)
        assert a.ts.stats["connections_opened"] == 2
        assert [len(a.ts._idle[b.id]), len(a.ts._bulk[b.id])] == [1, 1]


def test_bulk_bytes_must_not_be_negative():
    assert DataPlaneConfig(bulk_bytes=0).bulk_bytes == 0  # 0: one pool for all
    with pytest.raises(ValueError, match="bulk_bytes"):
        DataPlaneConfig(bulk_bytes=-1)


async def test_a_receive_abandoned_on_a_connection_already_broken_ends_only_that_connection(autojump_clock):
    """The receiver gave up on a transfer in flight (its round was aborted) while the sender's
    connection had already broken: telling the sender "cancelled" fails to write. That failure
    ends this connection's handler quietly; raised past its handlers, it ended a soak's daemon
    ("stream closed while writing")."""
    inbox = Inbox(DataPlaneConfig(), {}, {"bytes_received": 0, "handshake_failures": 0}, set())
    ours, theirs = trio.testing.memory_stream_pair()
    rx = DataChannel(FramedStream(ours, max_frame=MAX_CHUNK + 64), "libp2p", None)
    tx = DataChannel(FramedStream(theirs, max_frame=MAX_CHUNK + 64), "libp2p", None)
    src = {"w": torch.zeros(4096)}
    header = {
        "tag": "t",
        "xfer": b"x" * 16,
        "specs": [s.to_wire() for s in specs_of(src)],
        "meta": {},
        "digest": None,
        "eager": False,
    }
    async with trio.open_nursery() as nursery:
        inbox.nursery = nursery

        async def gives_up() -> None:
            with pytest.raises(TransferError):
                await inbox.receive("p", "t", timeout=1.0)

        nursery.start_soon(gives_up)
        served = trio.Event()

        async def serve() -> None:
            await inbox.serve_channel(rx, "p")  # returns: the connection ended, the node did not
            served.set()

        nursery.start_soon(serve)
        await tx.send_msg(HEADER, header)
        await tx.recv_msg(ACCEPT)
        await trio.sleep(2.0)  # sleep: virtual time (MockClock), past the receive's timeout
        await tx.send(DATA, bytes(1024))
        await theirs.aclose()  # the sender's side is gone before the receiver answers
        with trio.fail_after(10):
            await served.wait()
        nursery.cancel_scope.cancel()
