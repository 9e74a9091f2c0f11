"""The libp2p host: identity, TCP listener, Noise, yamux, optional private-swarm key.

This is the only module that builds py-libp2p objects; everything above talks to `Host`.
Choices (measured, see docs/libp2p-notes.md):
- **TCP only.** py-libp2p 0.8.1's QUIC moved ~2 MB/s and failed 32/32 concurrent 2 MiB streams;
  bulk data goes over our own data plane anyway, so QUIC would buy nothing but flakiness.
- **Noise only.** py-libp2p's default security options also offer *plaintext* and secio; a peer
  that negotiated those would talk to us unauthenticated, so we pass exactly one: Noise.
- **yamux**, the default muxer (mplex measured ~9 MB/s).
- **`max_connections_per_peer=1`**: otherwise every dial sleeps a 250 ms happy-eyeballs delay.
- **No auto-dialling**: py-libp2p keeps dialling known peers toward 50 connections; we set the
  minimum to 0 so that only our own layers (DHT, membership, collectives) decide whom to dial.
- **A hard cap, not the bound** (`max_connections`, 300 by default; a node's is
  `host_connection_cap(max_peers)`): py-libp2p prunes at it whatever the connection carries, so
  it sits well above what a node keeps; node/presence.py keeps and trims its own bound.
- **Frame writes are made whole** (`libp2p_patches.py`): py-libp2p's yamux loses the connection
  when a task is cancelled while writing a frame, which our deadlines do routinely.
- **Pipelined protocol selection** (`propose_stream`, what the RPC layer uses). py-libp2p's
  multistream-select client waits for the peer's answer to its handshake, then to its protocol,
  before the first byte of the request: two round trips per stream. Over a 40 ms WAN path that made
  every RPC 120 ms, and one all-reduce round (join, report) ten round trips. `propose_stream` sends
  the handshake and the protocol in one write and returns at once; the caller writes its request
  behind them and calls `ProposedStream.confirm()` before reading the reply, which reads the
  peer's two answers and raises `StreamOpenError` if it does not serve the protocol (it answers
  `na`; the request bytes behind are then discarded with the stream). The wire is unchanged — the
  same messages in the same order, only not waited for (multistream-select's "lazy" mode, as
  rust-libp2p's `V1Lazy`) — so py-libp2p's own server side answers it as it is. A call to a peer
  that serves the protocol is then one round trip.
- **A listen address that fails is an error.** py-libp2p's `Swarm.listen` logs a failed bind (a
  port another program holds: a second node on one machine with the default 4001) at DEBUG and
  runs on with no listener; the node then started with no address at all, unreachable and
  silent about it. `Host` checks that every configured address got its listener and otherwise
  raises a `ConfigError` naming them.
- **Private swarms** use libp2p pnet (`swarm_key`, 32 bytes as 64 hex chars): a peer without the
  key cannot complete even the Noise handshake. py-libp2p implements pnet with Salsa20 and an
  8-byte nonce, which is *not* go-libp2p's XSalsa20 format, so closed swarms are py-only.

`Host` is an async context manager with a visible lifetime: entering starts the listener and a
nursery that higher layers use for their background tasks; leaving cancels them and closes every
connection.

**Connection events.** Liveness has one source: a libp2p notifee wakes `wait_until` /
`wait_disconnected` whenever a connection opens or closes, so the layers that must notice a dead
peer at once (the all-reduce's data phase, the pipeline runtime) wait on it instead of polling
`is_connected` in sleep loops. py-libp2p removes a closed connection before it notifies (and a
cancelled cleanup may never notify), so waiters also re-check every `CONNECTION_RECHECK` s.
`on_connected(listener)` hands each new connection's peer id to the layers that want it (the
DHT feeds its routing table from it), from the same notifee, and `connected_since(peer)` says
when our connection to a peer opened: a process that connects anew may be the peer restarted,
and what we heard from it before then may be its last life's (node/presence.py
`heard_since_connected`).
"""

from __future__ import annotations

import ipaddress
import logging
import re
import time
from collections.abc import Awaitable, Callable, Iterable, Sequence
from contextlib import AsyncExitStack
from dataclasses import dataclass, field
from typing import Any, cast

import multiaddr
import trio
from libp2p import new_host
from libp2p.abc import INotifee
from libp2p.crypto.x25519 import create_new_key_pair as create_x25519_key_pair
from libp2p.custom_types import TProtocol
from libp2p.network.config import ConnectionConfig
from libp2p.network.swarm import Swarm
from libp2p.peer.id import ID
from libp2p.peer.peerinfo import info_from_p2p_addr
from libp2p.peer.peerstore import PeerStoreError
from libp2p.protocol_muxer.multiselect import MULTISELECT_PROTOCOL_ID as MULTISTREAM_PROTOCOL
from libp2p.security.noise.transport import PROTOCOL_ID as NOISE_PROTOCOL_ID
from libp2p.security.noise.transport import Transport as NoiseTransport
from libp2p.utils import encode_delim, read_delim
from multiaddr.utils import get_thin_waist_addresses

from meshtrain.errors import ConfigError, MeshtrainError
from meshtrain.lifecycle import Service
from meshtrain.log import get_logger, kv, quiet_third_party
from meshtrain.transport import libp2p_patches
from meshtrain.transport.identity import Identity, parse_peer_id
from meshtrain.transport.one_off import OneOffConnections
from meshtrain.transport.rpc import Rpc, reset_quietly
from meshtrain.transport.rpc import stream_peer as stream_peer  # re-exported: it lived here

log = get_logger(__name__)
libp2p_patches.apply()
quiet_third_party()  # importing py-libp2p (above) reset its loggers to print bare lines (meshtrain/log.py)

DEFAULT_LISTEN = ("/ip4/127.0.0.1/tcp/0",)
DEFAULT_CONNECT_TIMEOUT = 10.0
DEFAULT_STREAM_OPEN_TIMEOUT = 10.0
_HEX64 = re.compile(r"^[0-9a-fA-F]{64}$")


class ConnectError(MeshtrainError):
    """A peer could not be reached (unreachable, wrong peer id, or a different swarm key)."""


class StreamOpenError(MeshtrainError):
    """A stream to a connected peer could not be opened (peer gone, protocol not supported)."""


@dataclass(frozen=True)
class ProposedStream:
    """A libp2p stream whose protocol was proposed but not yet confirmed (`Host.propose_stream`):
    write to `stream` at once; `confirm()` before the first read."""

    stream: Any
    protocol: str

    async def confirm(self) -> None:
        """Read the peer's answers to our handshake and protocol; `StreamOpenError` unless both
        echo ours (a peer that does not serve the protocol answers `na`)."""
        try:
            hello = (await read_delim(self.stream)).decode(errors="replace")
            answer = (await read_delim(self.stream)).decode(errors="replace")
        except Exception as e:  # reset, EOF or garbage instead of the answers
            raise StreamOpenError(f"{self.protocol}: no answer to the protocol proposal ({type(e).__name__})") from None
        if hello != MULTISTREAM_PROTOCOL:
            raise StreamOpenError(f"{self.protocol}: the peer does not speak {MULTISTREAM_PROTOCOL} ({hello[:40]!r})")
        if answer != self.protocol:
            raise StreamOpenError(f"the peer does not serve {self.protocol} (it answered {answer[:40]!r})")


DEFAULT_MAX_CONNECTIONS = 300  # the host's hard cap: py-libp2p refuses and prunes beyond it


def host_connection_cap(max_peers: int) -> int:
    """The hard cap for a node that keeps `max_peers` connections (node/presence.py): well above
    it, for inbound dials, DHT lookups and a round's partners beyond the bound, which presence
    closes or keeps itself; the cap only stops a flood (py-libp2p prunes at it, wanted or not)."""
    return max(DEFAULT_MAX_CONNECTIONS, 4 * max_peers)


@dataclass(frozen=True)
class HostConfig:
    """How a host listens and who may connect."""

    listen: Sequence[str] = DEFAULT_LISTEN
    swarm_key: str | None = None  # 64 hex chars: a private swarm; None: open
    announce: Sequence[str] = ()  # addresses to advertise instead of the listen addresses
    max_connections: int = DEFAULT_MAX_CONNECTIONS
    connect_timeout: float = DEFAULT_CONNECT_TIMEOUT
    extra: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.swarm_key is not None and not _HEX64.match(self.swarm_key):
            raise ConfigError("swarm_key must be 64 hexadecimal characters (32 random bytes)")
        for a in (*self.listen, *self.announce):
            parse_multiaddr(a)
        if self.max_connections < 1:
            raise ConfigError("max_connections must be at least 1")


def parse_multiaddr(addr: str | multiaddr.Multiaddr) -> multiaddr.Multiaddr:
    if isinstance(addr, multiaddr.Multiaddr):
        return addr
    try:
        return multiaddr.Multiaddr(addr)
    except Exception as e:
        raise ConfigError(f"not a multiaddr: {addr!r} ({e})") from None


def peer_id_of(addr: str | multiaddr.Multiaddr) -> str:
    """The peer id in a `/p2p/<id>` multiaddr."""
    try:
        return info_from_p2p_addr(parse_multiaddr(addr)).peer_id.to_base58()
    except ConfigError:
        raise
    except Exception:
        raise ConfigError(f"{addr!s} has no /p2p/<peer id> part") from None


def addr_ips(addrs: Iterable[Any]) -> list[str]:
    """The distinct IPs of the direct /ip4 and /ip6 addresses among `addrs` (circuit addresses
    left out: their IP is the relay's), in order."""
    ips: list[str] = []
    for a in map(str, addrs):
        parts = a.split("/")
        if len(parts) > 2 and parts[1] in ("ip4", "ip6") and "/p2p-circuit" not in a and parts[2] not in ips:
            ips.append(parts[2])
    return ips


def dialable_addrs(addrs: Iterable[str], peer: str) -> list[str]:
    """`peer`'s addresses that another machine can dial, in their order, once each, each ending in
    `/p2p/<peer>`. An unspecified IP (0.0.0.0, ::: a listen address announced as it was bound,
    before a node knows how it is reached) names the dialler's own machine, never the peer's, so
    it is left out; so is anything that does not parse."""
    out: list[str] = []
    for a in addrs:
        try:
            first = parse_multiaddr(a).items()[0]  # (protocol, value): where the address starts
        except Exception:
            continue
        if first[0].name in ("ip4", "ip6") and ipaddress.ip_address(str(first[1])).is_unspecified:
            continue
        full = a if "/p2p/" in a else f"{a}/p2p/{peer}"
        if full not in out:
            out.append(full)
    return out


PEERSTORE_TTL = 120  # seconds: what py-libp2p's own connect() keeps a dialled peer's addresses for
StreamHandler = Callable[[Any], Awaitable[None]]
# Streams a connection carries for its whole life, not a use of it (`Host.streams_in_use`):
# gossipsub's (crdt/gossip.py), identify's and ping's.
STANDING_PROTOCOLS = ("/meshsub/", "/ipfs/id/", "/ipfs/ping/")
CONNECTION_RECHECK = 1.0  # waiters on connection state re-check this often even without an event


class _ConnectionEvents(INotifee):
    """Wakes the host's waiters when a connection opens or closes, and tells the listeners of
    `Host.on_connected` (never blocks libp2p)."""

    def __init__(self, host: Host) -> None:
        self.host = host

    async def connected(self, network: Any, conn: Any) -> None:
        peer = getattr(getattr(conn, "muxed_conn", None), "peer_id", None)
        if peer is not None:
            # every new connection restarts it: one whose close went unnoticed must not date a restart's
            self.host._connected_since[peer.to_base58()] = time.monotonic()
            for listener in list(self.host._on_connected):
                listener(peer.to_base58())
        self.host._connections_changed()

    async def disconnected(self, network: Any, conn: Any) -> None:
        peer = getattr(getattr(conn, "muxed_conn", None), "peer_id", None)
        if peer is not None and not self.host.is_connected(peer.to_base58()):
            self.host._connected_since.pop(peer.to_base58(), None)
        self.host._connections_changed()

    async def opened_stream(self, network: Any, stream: Any) -> None:
        pass

    async def closed_stream(self, network: Any, stream: Any) -> None:
        pass

    async def listen(self, network: Any, multiaddr: Any) -> None:
        pass

    async def listen_close(self, network: Any, multiaddr: Any) -> None:
        pass


class Host(Service):
    """A running libp2p host with our identity. Use as `async with Host(identity, config) as h:`."""

    def __init__(self, identity: Identity, config: HostConfig | None = None) -> None:
        self.identity = identity
        self.config = config or HostConfig()
        kp = identity.libp2p_key_pair
        self.libp2p = new_host(
            key_pair=kp,
            sec_opt={NOISE_PROTOCOL_ID: NoiseTransport(kp, noise_privkey=create_x25519_key_pair().private_key)},
            connection_config=ConnectionConfig(
                max_connections_per_peer=1,
                max_connections=self.config.max_connections,
                high_watermark=self.config.max_connections,
                min_connections=0,  # see the auto-connector note in _start
                low_watermark=0,
            ),
            psk=self.config.swarm_key.lower() if self.config.swarm_key else None,
            announce_addrs=[parse_multiaddr(a) for a in self.config.announce] or None,
        )
        # NAT traversal hook (meshtrain.transport.relay): py-libp2p's swarm never dials
        # `/p2p-circuit` addresses itself, so `connect` hands them to this dialer when one is set.
        self.circuit_dialer: Callable[[str, float], Awaitable[str]] | None = None
        self.rpc = Rpc(self)  # built here, used everywhere
        self._changed = trio.Event()  # set (and replaced) whenever a connection opens or closes
        self._events = _ConnectionEvents(self)
        self._on_connected: list[Callable[[str], None]] = []
        self._connected_since: dict[str, float] = {}  # peer -> when (monotonic) our connection to it opened
        self.one_off = OneOffConnections(self)  # connections dialled for one query (one_off.py)

    @property
    def peer_id(self) -> str:
        return self.identity.peer_id_str

    @property
    def addrs(self) -> list[str]:
        """Our dialable multiaddrs, each ending in `/p2p/<peer id>`: the announced ones, else the
        listen addresses, an unspecified IP (0.0.0.0, ::) expanded into this machine's interface
        addresses (py-libp2p reports it as bound, and a peer dialling it reaches its own machine)."""
        out: list[str] = []
        for a in self.libp2p.get_addrs():
            bare = str(a).split("/p2p/")[0]
            proto, ip = a.items()[0]
            if proto.name in ("ip4", "ip6") and ipaddress.ip_address(str(ip)).is_unspecified:
                loopback = bare.replace(f"/{ip}/", "/127.0.0.1/" if proto.name == "ip4" else "/::1/", 1)
                found = [str(m) for m in get_thin_waist_addresses(parse_multiaddr(bare))] or [loopback]
            else:
                found = [bare]
            out.extend(f"{x}/p2p/{self.peer_id}" for x in found)
        return list(dict.fromkeys(out))

    @property
    def nursery(self) -> trio.Nursery | None:
        """The host's nursery, for higher layers' background tasks (None unless running)."""
        return self._nursery

    async def _start(self, stack: AsyncExitStack) -> None:
        await stack.enter_async_context(self.libp2p.run([parse_multiaddr(a) for a in self.config.listen]))
        listening = self.libp2p.get_network().listeners
        failed = [str(a) for a in self.config.listen if str(parse_multiaddr(a)) not in listening]
        if failed:
            raise ConfigError(
                f"cannot listen on {', '.join(failed)}: its port is in use (another node on this machine?) or it "
                f"is not an address of this machine; pick another --listen (/tcp/0: any free port)"
            )
        self._nursery = await stack.enter_async_context(trio.open_nursery())
        # On the way out the nursery is cancelled first, then this closes every connection,
        # then the nursery and the listener unwind.
        stack.push_async_callback(self._close_network)
        # py-libp2p's auto-connector dials known peers toward the midpoint of its connection
        # watermarks (150 by default) every 30 s; the watermarks must stay for pruning, so
        # stop the connector itself: our membership layer decides whom to connect to.
        await cast(Swarm, self.libp2p.get_network()).auto_connector.stop()  # typed as the interface
        network = self.libp2p.get_network()
        network.register_notifee(self._events)
        stack.callback(network.remove_notifee, self._events)
        log.info(kv("host started", peer=self.peer_id, addrs=",".join(self.addrs)))

    async def _close_network(self) -> None:
        with trio.CancelScope(shield=True), trio.move_on_after(5):
            try:
                await self.libp2p.get_network().close()
            except Exception as e:  # closing is best effort; the exit stack still runs
                log.debug(kv("network close failed", error=repr(e)))

    # -- connections -----------------------------------------------------------------------

    async def connect(self, addr: str | multiaddr.Multiaddr, timeout: float | None = None) -> str:
        """Dial a `/p2p/`-terminated multiaddr; returns the peer id. Raises `ConnectError`."""
        maddr = parse_multiaddr(addr)
        try:
            info = info_from_p2p_addr(maddr)
        except Exception:
            raise ConfigError(f"{addr!s} has no /p2p/<peer id> part") from None
        if info.peer_id == self.identity.peer_id:
            return self.peer_id
        if "/p2p-circuit" in str(maddr):
            if self.circuit_dialer is None:
                raise ConnectError(
                    f"{addr!s} is a relay (circuit) address and this host has no "
                    "relay client: start a RelayService on it"
                )
            return await self.circuit_dialer(str(maddr), timeout or self.config.connect_timeout)
        self._dial_this_address(info)
        try:
            with trio.fail_after(timeout or self.config.connect_timeout):
                await self.libp2p.connect(info)
        except trio.TooSlowError:
            raise ConnectError(
                f"could not connect to {addr!s} within {timeout or self.config.connect_timeout:g} s "
                "(unreachable, or it uses a different swarm key)"
            ) from None
        except MeshtrainError:
            raise
        except Exception as e:
            raise ConnectError(f"could not connect to {addr!s}: {e}") from None
        return info.peer_id.to_base58()

    def _dial_this_address(self, info: Any) -> None:
        """Make py-libp2p's next dial of `info.peer_id` go to `info.addrs`. It dials one address per
        transport (TCP: the first its peerstore holds for the peer, however old), and for 60 s
        after every address of a peer failed it refuses every dial to it (its "negative cache"),
        even at an address it never tried: a stale or unusable address learnt first kept a peer's
        good one from ever being dialled (the NAT lab under load). So the address asked for goes
        first, and the block is lifted: an explicit dial is its caller's decision (ours back off
        on their own: node/connections.py); dials the library makes itself keep the block."""
        store = self.libp2p.get_peerstore()
        try:
            known = [a for a in store.addrs(info.peer_id) if a not in info.addrs]
        except PeerStoreError:
            known = []
        store.clear_addrs(info.peer_id)
        store.add_addrs(info.peer_id, [*info.addrs, *known], PEERSTORE_TTL)
        cast(Swarm, self.libp2p.get_network()).unblock_peer(info.peer_id)

    def is_connected(self, peer: str) -> bool:
        return bool(self.libp2p.get_network().connections.get(parse_peer_id(peer)))

    def streams_in_use(self, peer: str) -> int:
        """How many streams are open on our connections to `peer`, but for those a connection
        carries for its whole life (`STANDING_PROTOCOLS`: gossipsub's, opened on every new one)."""
        conns = self.libp2p.get_network().connections.get(parse_peer_id(peer), [])
        return sum(
            not str(s.get_protocol() or "").startswith(STANDING_PROTOCOLS) for c in conns for s in c.get_streams()
        )

    def connected_since(self, peer: str) -> float | None:
        """When (`time.monotonic()`) our connection to `peer` opened, kept while one stays open;
        None: not connected (module docstring, "Connection events")."""
        return self._connected_since.get(peer) if self.is_connected(peer) else None

    def on_connected(self, listener: Callable[[str], None]) -> Callable[[], None]:
        """Call `listener(peer_id)` on every new connection (on the trio thread; it must not
        block). Returns the function that stops it."""
        self._on_connected.append(listener)
        return lambda: self._on_connected.remove(listener)

    def _connections_changed(self) -> None:
        changed, self._changed = self._changed, trio.Event()
        changed.set()

    async def wait_until(self, predicate: Callable[[], bool], *, recheck: float = CONNECTION_RECHECK) -> None:
        """Return once `predicate()` (about connection state) holds; it is evaluated now, after
        every connection event, and at least every `recheck` seconds."""
        while not predicate():
            changed = self._changed
            with trio.move_on_after(recheck):
                await changed.wait()

    async def wait_disconnected(self, peers: Iterable[str]) -> list[str]:
        """Wait until at least one of `peers` has no connection; return those that have none."""
        peers = list(peers)
        await self.wait_until(lambda: any(not self.is_connected(p) for p in peers))
        return [p for p in peers if not self.is_connected(p)]

    def connected_peers(self) -> list[str]:
        return sorted(p.to_base58() for p, c in self.libp2p.get_network().connections.items() if c)

    async def disconnect(self, peer: str) -> None:
        try:
            await self.libp2p.disconnect(parse_peer_id(peer))
        except Exception as e:
            log.debug(kv("disconnect failed", peer=peer, error=repr(e)))

    def connection_type(self, peer: str) -> str | None:
        """ "direct" if a live connection to `peer` runs over its own socket, "relayed" if we only
        reach it through a circuit relay, None if not connected."""
        conns = self.libp2p.get_network().connections.get(parse_peer_id(peer), [])
        kinds = {"relayed" if is_relayed_connection(c) else "direct" for c in conns}
        return "direct" if "direct" in kinds else ("relayed" if kinds else None)

    def remote_ip(self, peer: str) -> str | None:
        """The IP address our live connection to `peer` goes to, if any (for the data plane)."""
        addr = self.remote_addr(peer)
        return addr[0] if addr else None

    def known_ips(self, peer: str) -> list[str]:
        """The IPs of `peer`'s direct (non-circuit) addresses in our peerstore: what it told us
        over identify (relayed, too) or what we dialled; empty if none."""
        try:
            return addr_ips(self.libp2p.get_peerstore().addrs(parse_peer_id(peer)))
        except (PeerStoreError, ValueError):
            return []

    def remote_addr(self, peer: str) -> tuple[str, int] | None:
        """(ip, port) of `peer`'s end of our direct connection to it, if any.

        Relayed connections are skipped: their socket goes to the relay, not to the peer."""
        for conn in self.libp2p.get_network().connections.get(parse_peer_id(peer), []):
            if is_relayed_connection(conn):
                continue
            try:
                # every muxer py-libp2p has (yamux, mplex) has it; its interface (IMuxedConn) does not
                addr = conn.muxed_conn.get_remote_address()  # type: ignore[attr-defined]
            except Exception:
                addr = None
            if addr:
                return str(addr[0]), int(addr[1])
        return None

    # -- streams ---------------------------------------------------------------------------

    def _note_stream_dial(self, pid: ID, protocol: str) -> None:
        """A stream to a peer we are not connected to dials it (py-libp2p, from the peerstore's
        addresses): logged at DEBUG by protocol, to tell which layer opens connections that the
        node's bound then closes (node/presence.py)."""
        if log.isEnabledFor(logging.DEBUG) and not self.libp2p.get_network().connections.get(pid):
            log.debug(kv("stream dials", peer=pid.to_base58()[-8:], protocol=protocol))

    def set_stream_handler(self, protocol: str, handler: StreamHandler) -> None:
        self.libp2p.set_stream_handler(TProtocol(protocol), handler)

    async def open_stream(self, peer: str, protocol: str, timeout: float | None = None) -> Any:
        """Open a stream for `protocol` to an already-known peer; raises `StreamOpenError`."""
        try:
            pid = parse_peer_id(peer)
        except Exception:
            raise StreamOpenError(f"not a peer id: {peer!r:.60}") from None
        self._note_stream_dial(pid, protocol)
        try:
            with trio.fail_after(timeout or DEFAULT_STREAM_OPEN_TIMEOUT):
                return await self.libp2p.new_stream(pid, [TProtocol(protocol)])
        except trio.TooSlowError:
            raise StreamOpenError(f"opening {protocol} to {peer} timed out") from None
        except Exception as e:
            raise StreamOpenError(f"cannot open {protocol} to {peer}: {e}") from None

    async def propose_stream(self, peer: str, protocol: str, timeout: float | None = None) -> ProposedStream:
        """Open a stream to an already-known peer and propose `protocol` without waiting for the
        answer (module docstring: pipelined protocol selection); raises `StreamOpenError` if no
        stream can be opened. Write the request, then `confirm()` before reading."""
        try:
            pid = parse_peer_id(peer)
        except Exception:
            raise StreamOpenError(f"not a peer id: {peer!r:.60}") from None
        stream = None
        self._note_stream_dial(pid, protocol)
        try:
            with trio.fail_after(timeout or DEFAULT_STREAM_OPEN_TIMEOUT):
                stream = await self.libp2p.get_network().new_stream(pid)
                await stream.write(encode_delim(MULTISTREAM_PROTOCOL.encode()) + encode_delim(protocol.encode()))
        except Exception as e:
            if stream is not None:
                await reset_quietly(stream)
            if isinstance(e, trio.TooSlowError):
                raise StreamOpenError(f"opening {protocol} to {peer} timed out") from None
            raise StreamOpenError(f"cannot open {protocol} to {peer}: {e}") from None
        stream.set_protocol(TProtocol(protocol))
        return ProposedStream(stream, protocol)


def is_relayed_connection(conn: Any) -> bool:
    """Whether a py-libp2p swarm connection runs through a circuit relay (`/p2p-circuit`)."""
    try:
        addrs = conn.get_transport_addresses() or []
    except Exception:
        return False
    return any("/p2p-circuit" in str(a) for a in addrs)
