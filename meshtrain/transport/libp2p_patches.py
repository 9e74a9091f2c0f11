"""Workarounds for py-libp2p bugs that live in the library's own code paths, applied by `host.py`.

**A cancelled frame write kills the connection** (py-libp2p 0.8.x, `Yamux._write_frame`). Every
yamux frame goes out through `secured_conn.write`, and Noise *encrypts first* — using up the next
nonce — and only then awaits the socket. A trio cancellation landing in between (any `fail_after`
or `move_on_after` around a stream write or read: RPC deadlines, stream-open timeouts, a nursery
cancelled mid-transfer; reads send window updates from the reader's task) either sends nothing or
half a frame. The peer's next decrypt then fails ("Failed authentication of message"), its read
loop logs "Error reading header" at DEBUG and closes the whole connection; we see only a peer
that dropped. Measured on loopback: 4–6 randomly cancelled writes (one writer) or 17–38 (three)
drop the connection within 0.55 s; a stall alone does not (a peer SIGSTOPped for 65 s, idle or mid-
bulk, stays connected). Under CPU starvation more deadlines expire inside that window, which is
how the convergence benchmark's peers occasionally lost their connection to each other.

The fix: once the write lock is held, the frame is written whole — shielded from cancellation,
bounded by `FRAME_WRITE_LIMIT` so a peer that stops reading cannot hold a cancelled caller
forever (then the connection is closed: it is as good as dead, and a half-written frame would
desynchronise it anyway). Waiting for the lock stays cancellable, as nothing is encrypted yet.
Upstream's proper fix is the same shield inside `_write_frame`.

**No remote address on IPv6** (`TrioTCPStream.get_remote_address`). It accepts only a 2-tuple from
`getpeername()`, and an IPv6 socket returns four (host, port, flowinfo, scope id), so every IPv6
connection reports no address. The data plane dials the peer's IP as our libp2p connection sees
it (`Host.remote_ip`), so two peers on IPv6 sent their tensors over the slow libp2p fallback.
The fix reads the first two fields of either family. Upstream's: `len(remote_addr) >= 2`.

**DCUtR dials every family from one source address** (`DCUtRProtocol._perform_hole_punch`). It
binds each hole-punch dial to our listen address, as it must (the SYN has to leave from the port
the peer expects), but picks the *first* listen address for all of them, so a dual-stack peer
dials the other's IPv6 address from an IPv4 source or the reverse: that dial fails at once, and
only one side's SYN of the pair is ever sent. Seen in the NAT lab (`ipv6=True`): two dual-stack
peers behind symmetric IPv4 NATs and IPv6 firewalls never went direct, though both dialled each
other's global IPv6 address — one from the wrong family. The fix, in `_dial_peer`: a source of
the other family is swapped for our listen address of the dialled address's family (no source
if we have none). Upstream's: choose the source per address. (tests/test_nat_traversal_v6.py)

**Pubsub dials a peer whose connection just closed** (`Pubsub._handle_new_peer`). When a peer's
pubsub stream dies while its connection is closing, py-libp2p still counts the peer connected
(the muxer is not marked closed yet) and schedules a retry that opens a new pubsub stream with
`host.new_stream` — which, the connection gone by then, *dials the peer*. A connection the node
closed over its bound (node/bound.py) or a DHT query's one-off connection (transport/one_off.py)
came straight back that way (issue 32's census, 13 daemons: a dial from
`_peer_stream_retry_task` a few times a minute). Gossipsub here never needs its own dials:
pubsub registers every peer when a connection opens. The fix: no pubsub stream to a peer with
no connection (`_handle_new_peer` returns; the next connection's notifee registers the peer).
Upstream's: open the stream on the live connection, never through a dial.

**A stalled connection keeps getting every new stream** (`Swarm._best_connection`). With two
connections to one peer, py-libp2p opens a new stream on the direct one with the most open
streams (go-libp2p's `isBetterConn`), ties broken by object address. A connection that a
partition stalled collects streams that never finish, so it wins every later choice: after a
joiner found its donor deaf over the old connection and asked again over a fresh one
(node/state/fetch.py, "Silence"), the donor answered — and then opened its data-plane session to
the joiner on the old, stalled connection, which took its 10 s deadline and failed the chunk
(tests/test_state_sync.py, a stalled connection through a freezing relay). The fix: direct
first, then the *newest* connection (the swarm keeps them in the order they were added): the one
whose handshake completed last is the best evidence of a path that works. Upstream's rule
serves connection trimming, which keeps it; choosing where a new stream goes is another matter.
"""

from __future__ import annotations

import contextlib

import trio
from libp2p.abc import INetConn
from libp2p.connection_types import ConnectionType
from libp2p.io import trio as _io_trio
from libp2p.io.exceptions import IOException
from libp2p.network.swarm import Swarm
from libp2p.pubsub.pubsub import Pubsub
from libp2p.relay.circuit_v2.dcutr import DCUtRProtocol
from libp2p.stream_muxer.yamux import yamux as _yamux

FRAME_WRITE_LIMIT = 30.0  # seconds one shielded frame write may take before the connection is closed

_applied = False


async def _write_frame_whole(self: _yamux.Yamux, data: bytes) -> None:
    async with self._write_lock:
        with trio.CancelScope(shield=True):
            with trio.move_on_after(FRAME_WRITE_LIMIT) as limit:
                await self.secured_conn.write(data)
            if limit.cancelled_caught:
                with trio.move_on_after(1), contextlib.suppress(Exception):
                    await self.secured_conn.close()
                raise IOException(f"yamux frame write stalled for {FRAME_WRITE_LIMIT:g} s; connection closed")
    await trio.lowlevel.checkpoint()


def _remote_address_any_family(self: _io_trio.TrioTCPStream) -> tuple[str, int] | None:
    if self._cached_remote_address is None:
        try:
            addr = self.stream.socket.getpeername()
        except (AttributeError, OSError):  # no socket, or closed: no address, as upstream
            return None
        if isinstance(addr, tuple) and len(addr) >= 2:  # IPv4 (host, port); IPv6 adds flowinfo, scope id
            self._cached_remote_address = (str(addr[0]), int(addr[1]))
    return self._cached_remote_address


_dcutr_dial_peer = DCUtRProtocol._dial_peer


def _family(ip: str) -> int:
    return 6 if ":" in ip else 4


def _source_of_family(host: object, family: int) -> tuple[str, int] | None:
    """Our first TCP listen address of IP `family` as (ip, port), or None."""
    try:
        addrs = [str(a) for a in host.get_addrs()]  # type: ignore[attr-defined]  # py-libp2p's IHost
    except Exception:
        return None
    for a in addrs:
        parts = a.split("/")  # "/ip6/<ip>/tcp/<port>/p2p/<id>"
        if "/p2p-circuit" not in a and len(parts) > 4 and parts[1] == f"ip{family}" and parts[3] == "tcp":
            try:
                return parts[2], int(parts[4])
            except ValueError:
                continue
    return None


async def _dial_peer_from_same_family(
    self: DCUtRProtocol,
    peer_id: object,
    addr: object,
    source: tuple[str, int] | None = None,
    as_responder: bool = False,
) -> None:
    parts = str(addr).split("/")
    if source is not None and len(parts) > 2 and parts[1] in ("ip4", "ip6"):
        family = 6 if parts[1] == "ip6" else 4
        if _family(source[0]) != family:
            source = _source_of_family(self.host, family)
    await _dcutr_dial_peer(self, peer_id, addr, source, as_responder)  # type: ignore[arg-type]


_pubsub_handle_new_peer = Pubsub._handle_new_peer


async def _pubsub_stream_only_if_connected(self: Pubsub, peer_id: object) -> None:
    if not self.host.get_network().get_connections(peer_id):  # type: ignore[arg-type]
        return  # closed meanwhile: never dial for pubsub (module docstring)
    await _pubsub_handle_new_peer(self, peer_id)  # type: ignore[arg-type]


def _newest_direct_connection(self: Swarm, connections: list[INetConn]) -> INetConn:
    """Direct before relayed, then the newest (module docstring); `connections` in age order."""

    def direct(conn: INetConn) -> bool:
        try:
            return bool(conn.get_connection_type() == ConnectionType.DIRECT)
        except Exception:
            return True

    return max(reversed(connections), key=direct)  # max keeps the first of equals: the newest


def apply() -> None:
    """Install the workarounds (idempotent)."""
    global _applied
    if _applied:
        return
    if not hasattr(_yamux.Yamux, "_write_frame"):  # a py-libp2p without the method: nothing to fix here
        raise RuntimeError("py-libp2p's Yamux has no _write_frame; re-check meshtrain/transport/libp2p_patches.py")
    _yamux.Yamux._write_frame = _write_frame_whole  # type: ignore[method-assign]  # the patch itself
    _io_trio.TrioTCPStream.get_remote_address = _remote_address_any_family  # type: ignore[method-assign]
    DCUtRProtocol._dial_peer = _dial_peer_from_same_family  # type: ignore[method-assign]
    Pubsub._handle_new_peer = _pubsub_stream_only_if_connected  # type: ignore[method-assign]
    Swarm._best_connection = _newest_direct_connection  # type: ignore[method-assign]
    _applied = True
