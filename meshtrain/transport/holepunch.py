"""Hole punching: relayed libp2p connections become direct (DCUtR), and so does the data plane.

Two mechanisms, one job — a direct path between two peers behind NATs:

1. **libp2p connections: DCUtR.** py-libp2p >= 0.8.1 implements the spec (framed CONNECT/SYNC
   messages, RTT/2 timing, 3 rounds, dials bound to the listen port so a port-preserving NAT maps
   them to the address it advertised, responder-side upgrade of a merged simultaneous open). We
   run its `DCUtRProtocol` service (whose loop also retries relayed peers every 2 s) and call it
   at once after a relayed connect (`upgrade`), so the upgrade does not wait for that loop.

2. **The tensor data plane: a coordinated TCP simultaneous open.** The data plane is a separate
   TCP connection per peer pair (tensor_streams.py); a NAT that drops unsolicited SYNs blocks it
   even after DCUtR punched the libp2p connection, because it is a different port. So
   `DataPlanePunch` installs itself as `TensorStreams.direct_opener` and, over the libp2p
   channel, runs RPC `/meshtrain/dataplane-punch/1`:
   - `prepare`: the client binds a fresh socket and names its predicted public address (its
     observed public IP, see reachability.py, and the socket's port — port-preserving NATs keep
     it). The server answers `listen` (it is not known to be behind a NAT — public, or not
     probed yet: dial its data-plane port as usual) or, once its probe said private,
     `punch`: it binds its own socket and names its address, with a data-plane session (id, key)
     and a one-time token. The session key travels inside Noise, as for ordinary sessions.
   - `go`: the client measures the `prepare` round trip, sends `go`, waits RTT/2 and calls
     `connect()`; the server calls `connect()` when `go` arrives. Both SYNs cross; each NAT sees
     its own outgoing SYN first, so the other's SYN is an answer, not an unsolicited packet. A
     SYN that arrives too early is silently dropped by a cone NAT and the kernel re-sends it 1 s
     later. The exception is a public (un-NATed) end: its kernel would answer an early SYN with
     RST, which closes the other NAT's mapping, so the NATed end waits `public_first_margin`
     longer and the public end's SYN always leaves first.
   The connection that results is handed to the data plane (`adopt_connection` on the server,
   the usual session handshake on the client) and is as authenticated as any other.

   On a symmetric NAT the predicted port is wrong, `connect()` times out after
   `connect_timeout`, and the data plane falls back to libp2p streams (through the relay if the
   libp2p connection is relayed) — tensor_streams then retries the direct path after a minute.

Families. The punch's sockets are of the IP version of the peer's direct libp2p connection: IPv4 or
IPv6 alike; `punch_addr` takes a unicast address of either. Over a relayed connection the family is
a choice, and the client tries, in order: IPv6 when both ends may have a routable IPv6 address
(ours among our addresses; the peer's among those identify told us, or identify has not told us yet
— a server without one answers `NO_ADDRESS` at once), then the family of our observed public IP
(else IPv4); a failed attempt moves on to the next. IPv6 goes first because a home router's IPv6 is
usually a stateful firewall with no mapping to predict, punchable where the same home's IPv4 NAT
may be symmetric — seen in the NAT lab: dual-stack peers behind symmetric IPv4 NATs went over
libp2p until the punch tried IPv6. The price, where IPv6 is announced but filtered harder than a
stateful firewall, is one `connect_timeout` per attempt (tensor_streams retries the direct path
once a minute). IPv6 is tested between public peers on loopback (tests/test_ipv6.py), where the
server answers "listen", and in the NAT lab's IPv6 homes (scripts/labs/natlab/, `ipv6=True`):
behind a home router's stateful IPv6 firewall there is no mapping to predict — each end names its
own global address — but inbound SYNs are dropped as by a cone NAT, so both mechanisms punch
(tests/test_nat_traversal_v6.py); behind NAT66 the same as behind an IPv4 cone NAT.

Not here: deciding reachability (reachability.py), reservations and circuits (relay.py), and
UPnP (off: the lab has no gateway that offers it; py-libp2p's miniupnpc path is untested here).
"""

from __future__ import annotations

import ipaddress
import os
import socket
import time
from contextlib import AsyncExitStack
from dataclasses import dataclass
from typing import Any

import trio
from libp2p.relay.circuit_v2.dcutr import DCUtRProtocol
from libp2p.tools.anyio_service import background_trio_service

from meshtrain.lifecycle import Service
from meshtrain.log import get_logger, kv
from meshtrain.transport.framing import MalformedMessage
from meshtrain.transport.host import Host, addr_ips
from meshtrain.transport.identity import parse_peer_id
from meshtrain.transport.reachability import PRIVATE, PUBLIC, ReachabilityService
from meshtrain.transport.rpc import RemoteError, RpcError, RpcUnavailable
from meshtrain.transport.tensor_streams import NOT_A_MEMBER, HandshakeError, TensorStreams
from meshtrain.transport.validate import MALFORMED, require_map

log = get_logger(__name__)

PUNCH_RPC = "dataplane-punch"
NO_ADDRESS = "no_address"  # the server has no address of the client's IP version
DEFAULT_CONNECT_TIMEOUT = 4.0  # covers the kernel's SYN retransmit at 1 s and 3 s
DEFAULT_PUBLIC_FIRST_MARGIN = 0.25  # the NATed end's extra wait when the other end is public
DEFAULT_UPGRADE_TIMEOUT = 30.0  # DCUtR: 3 rounds of up to 5 s + 2 s pauses, plus the exchange
PENDING_TTL = 15.0  # a prepared punch not followed by `go` within this is dropped
MAX_PENDING_PER_PEER = 4


class PunchFailed(HandshakeError):
    """The simultaneous open did not produce a connection (symmetric NAT, timing, firewall)."""


@dataclass(frozen=True)
class HolePunchConfig:
    """connect_timeout: deadline of one simultaneous `connect()`.
    public_first_margin: extra seconds a NATed end waits when the other end is public.
    upgrade_timeout: deadline of one DCUtR upgrade attempt."""

    connect_timeout: float = DEFAULT_CONNECT_TIMEOUT
    public_first_margin: float = DEFAULT_PUBLIC_FIRST_MARGIN
    upgrade_timeout: float = DEFAULT_UPGRADE_TIMEOUT


@dataclass
class _Pending:
    peer: str
    sock: trio.socket.SocketType
    remote: tuple[str, int]
    delay: float
    created: float


def punch_addr(value: Any) -> tuple[str, int]:
    """A peer's `[ip, port]` from the punch RPC: a unicast IPv4 or IPv6 address and a TCP port, or
    `RemoteError` MALFORMED. The punch's sockets take the family of the IP."""
    if not (
        isinstance(value, list)
        and len(value) == 2
        and isinstance(value[0], str)
        and isinstance(value[1], int)
        and 0 < value[1] < 65536
    ):
        raise RemoteError(MALFORMED, "addr must be [ip, port]")
    try:
        ip = ipaddress.ip_address(value[0])
    except ValueError:
        raise RemoteError(MALFORMED, "addr ip is not an IP address") from None
    if ip.is_unspecified or ip.is_multicast:
        raise RemoteError(MALFORMED, "addr must be a unicast IP address")
    return str(ip), value[1]


def ip_version(ip: str | None) -> int | None:
    """4 or 6 for an IP address, None for none (or not an IP)."""
    try:
        return ipaddress.ip_address(ip).version if ip else None
    except ValueError:
        return None


async def _bound_socket(ip: str) -> trio.socket.SocketType:
    family = socket.AF_INET6 if ip_version(ip) == 6 else socket.AF_INET
    sock = trio.socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    await sock.bind((ip, 0))
    return sock


async def _simultaneous_connect(
    sock: trio.socket.SocketType, remote: tuple[str, int], timeout: float
) -> trio.SocketStream:
    try:
        with trio.fail_after(timeout):
            await sock.connect(remote)
    except trio.TooSlowError:
        sock.close()
        raise PunchFailed(
            f"simultaneous open to {remote[0]}:{remote[1]} timed out after "
            f"{timeout:g} s (symmetric NAT or a firewall in the way)"
        ) from None
    except OSError as e:
        sock.close()
        raise PunchFailed(f"simultaneous open to {remote[0]}:{remote[1]} failed: {e}") from None
    return trio.SocketStream(sock)


class DataPlanePunch:
    """The data plane's simultaneous open (module docstring, part 2). Built by `HolePunchService`.

    Installs itself as `streams.direct_opener`; serves `PUNCH_RPC`.
    """

    def __init__(
        self, host: Host, streams: TensorStreams, reachability: ReachabilityService, config: HolePunchConfig
    ) -> None:
        self.host = host
        self.streams = streams
        self.reachability = reachability
        self.config = config
        self._pending: dict[bytes, _Pending] = {}
        self.stats = {"punched": 0, "punch_failed": 0, "listen": 0}
        host.rpc.serve(PUNCH_RPC, self._serve, handler_timeout=config.connect_timeout + 10)
        streams.direct_opener = self.open

    def _versions(self, peer: str) -> list[int]:
        """The IP versions to punch with `peer`, in the order tried (module docstring,
        "Families"): its direct libp2p connection's; relayed, 6 first where both ends may have a
        routable IPv6 address, then our observed public IP's version, else 4."""
        direct = ip_version(self.host.remote_ip(peer))
        if direct:
            return [direct]
        versions = [ip_version(self.reachability.observed_ip) or 4]
        mine = addr_ips(self.host.addrs)  # routable_ipv6 below keeps the IPv6 ones
        # The peer's addresses arrive by identify, which may not have run yet on a fresh relayed
        # connection: unknown, IPv6 is tried (a peer without it answers NO_ADDRESS at once);
        # known without a routable IPv6 address, it is not.
        theirs = self.host.known_ips(peer)
        they_may = not theirs or any(map(routable_ipv6, theirs))
        if versions != [6] and any(map(routable_ipv6, mine)) and they_may:
            versions.insert(0, 6)
        log.debug(kv("data plane punch versions", peer=peer, versions=versions, mine=mine, theirs=theirs))
        return versions

    def _local_ip(self, version: int) -> str:
        """The IP our punch sockets bind: the data plane's listen IP or the host's first listen IP
        of that version, else any."""
        listen = self.streams.config.listen_ip
        if listen and ip_version(listen) == version:
            return listen
        return first_ip(self.host, version)

    def _public(self) -> bool:
        return self.reachability.status == PUBLIC

    def _my_ip(self, version: int) -> str:
        """The IP we name for ourselves: the observed public one of that version (behind a NAT,
        what the NAT maps us to), else our own address of that version."""
        for observed in self.reachability.observed_ips():
            if ip_version(observed) == version:
                return observed
        local = self._local_ip(version)
        if not ipaddress.ip_address(local).is_unspecified:
            return local
        return first_ip(self.host, version, announced=True)

    # -- client ---------------------------------------------------------------------------

    async def open(self, peer: str) -> tuple[trio.SocketStream, bytes, bytes] | None:
        """Open a data-plane TCP connection to `peer`, trying each IP version `_versions` names;
        None means "dial its port as usual" (the peer does not speak this RPC). Raises
        `PunchFailed` (the last version's) when no direct path exists."""
        versions = self._versions(peer)
        for version in versions[:-1]:
            try:
                return await self._open(peer, version)
            except PunchFailed as e:
                log.info(
                    kv("data plane punch failed, trying the next IP version", peer=peer, version=version, error=str(e))
                )
        return await self._open(peer, versions[-1])

    async def _open(self, peer: str, version: int) -> tuple[trio.SocketStream, bytes, bytes] | None:
        sock = await _bound_socket(self._local_ip(version))
        close_sock = True  # until the punch (`_go`) owns it
        port = sock.getsockname()[1]
        try:
            t0 = time.monotonic()
            try:
                reply = await self.host.rpc.call(
                    peer,
                    PUNCH_RPC,
                    {"op": "prepare", "addr": [self._my_ip(version), port], "public": self._public()},
                )
            except RpcUnavailable:  # an older peer without this RPC (or gone: the plain path says)
                return None
            except RemoteError as e:
                raise PunchFailed(f"{peer} refused to punch: {e}") from None
            rtt = time.monotonic() - t0
            reply = require_map(reply, "mode", "sid", "key", "addr", error=MalformedMessage)
            sid, key = reply["sid"], reply["key"]
            if not (isinstance(sid, bytes) and isinstance(key, bytes) and len(key) == 32):
                raise PunchFailed("malformed punch reply")
            try:
                remote = punch_addr(reply["addr"])
            except RemoteError as e:
                raise PunchFailed(f"malformed punch reply: {e}") from None
            if reply["mode"] == "listen":  # a public peer: dial its data-plane port
                self.stats["listen"] += 1
                sock.close()
                ip = self.host.remote_ip(peer) or remote[0]
                try:
                    with trio.fail_after(self.config.connect_timeout):
                        stream = await trio.open_tcp_stream(ip, remote[1])
                except (OSError, trio.TooSlowError) as e:
                    raise PunchFailed(f"{peer}'s data plane at {ip}:{remote[1]} is unreachable: {e!r}") from None
                return stream, sid, key
            token = reply.get("token")
            if reply["mode"] != "punch" or not isinstance(token, bytes):
                raise PunchFailed("malformed punch reply")
            delay = rtt / 2
            if reply.get("public") is True and not self._public():
                delay += self.config.public_first_margin
            stream = await self._go(peer, token, sock, remote, delay)
            close_sock = False
            self.stats["punched"] += 1
            log.info(
                kv("data plane punched", peer=peer, remote=f"{remote[0]}:{remote[1]}", rtt_ms=round(rtt * 1000, 1))
            )
            return stream, sid, key
        except PunchFailed:
            self.stats["punch_failed"] += 1
            raise
        except RpcError as e:
            self.stats["punch_failed"] += 1
            raise PunchFailed(f"punch coordination with {peer} failed: {e}") from None
        finally:
            if close_sock:
                sock.close()

    async def _go(self, peer: str, token: bytes, sock: Any, remote: tuple[str, int], delay: float) -> trio.SocketStream:
        server_result: dict[str, Any] = {}

        async def tell_server() -> None:
            try:
                server_result["reply"] = await self.host.rpc.call(
                    peer, PUNCH_RPC, {"op": "go", "token": token}, timeout=self.config.connect_timeout + 10
                )
            except RpcError as e:
                server_result["error"] = str(e)

        stream: trio.SocketStream | None = None
        failure: PunchFailed | None = None
        async with trio.open_nursery() as nursery:
            nursery.start_soon(tell_server)
            await trio.sleep(delay)
            try:
                stream = await _simultaneous_connect(sock, remote, self.config.connect_timeout)
            except PunchFailed as e:  # raised below, outside the nursery (no ExceptionGroup)
                failure = e
            # Do not wait for the server's verdict: our connect succeeding means its did too.
            nursery.cancel_scope.cancel()
        if stream is None:
            raise PunchFailed(f"{failure} [server: {server_result or 'no answer yet'}]")
        return stream

    # -- server ---------------------------------------------------------------------------

    async def _serve(self, peer: str, request: Any) -> dict:
        req = require_map(request, "op", error=MalformedMessage)
        if req["op"] == "prepare":
            return await self._prepare(peer, require_map(req, "addr", "public", error=MalformedMessage))
        if req["op"] == "go":
            return await self._run_go(peer, require_map(req, "token", error=MalformedMessage))
        raise RemoteError(MALFORMED, "unknown op")

    async def _prepare(self, peer: str, req: dict) -> dict:
        remote = punch_addr(req["addr"])
        version = ip_version(remote[0]) or 4  # the client's family is the punch's
        if not await self.streams.admits(peer):  # data-plane sessions are for members only
            raise RemoteError(NOT_A_MEMBER, "only members of this swarm may open a data-plane session")
        if ipaddress.ip_address(self._my_ip(version)).is_unspecified:  # e.g. IPv6 asked, IPv4 only here
            raise RemoteError(NO_ADDRESS, f"no IPv{version} address here to punch from")
        sid, key = self.streams.new_session(peer)
        if self.reachability.status != PRIVATE:  # public, or not known to be behind a NAT
            self.stats["listen"] += 1
            return {
                "mode": "listen",
                "sid": sid,
                "key": key,
                "public": True,
                "addr": [self._my_ip(version), int(self.streams.port or 0)],
            }
        now = time.monotonic()
        for t, p in list(self._pending.items()):
            if now - p.created > PENDING_TTL:
                p.sock.close()
                del self._pending[t]
        if sum(1 for p in self._pending.values() if p.peer == peer) >= MAX_PENDING_PER_PEER:
            raise RemoteError("busy", "too many punches in flight")
        sock = await _bound_socket(self._local_ip(version))
        token = os.urandom(16)
        delay = self.config.public_first_margin if req["public"] is True else 0.0
        self._pending[token] = _Pending(peer, sock, remote, delay, now)
        return {
            "mode": "punch",
            "sid": sid,
            "key": key,
            "token": token,
            "public": False,
            "addr": [self._my_ip(version), sock.getsockname()[1]],
        }

    async def _run_go(self, peer: str, req: dict) -> dict:
        token = req["token"]
        pending = self._pending.pop(token, None) if isinstance(token, bytes) else None
        if pending is None or pending.peer != peer:
            if pending is not None:
                pending.sock.close()
            raise RemoteError("unknown_token", "no such punch (expired?)")
        await trio.sleep(pending.delay)
        try:
            stream = await _simultaneous_connect(pending.sock, pending.remote, self.config.connect_timeout)
        except PunchFailed as e:
            self.stats["punch_failed"] += 1
            return {"ok": False, "error": str(e)}
        self.stats["punched"] += 1
        self.streams.adopt_connection(stream)
        return {"ok": True}


def routable_ipv6(ip: str) -> bool:
    """An IPv6 address another host could reach us at: not loopback, link-local, unspecified or
    multicast (documentation and unique local addresses count: the NAT lab uses them)."""
    try:
        addr = ipaddress.ip_address(ip)
    except ValueError:
        return False
    return addr.version == 6 and not (
        addr.is_loopback or addr.is_link_local or addr.is_unspecified or addr.is_multicast
    )


def first_ip(host: Host, version: int, *, announced: bool = False) -> str:
    """The host's first listen IP of IP `version` (`announced`: of its dialable addresses, an
    unspecified listen IP expanded), else the unspecified address of that version."""
    addrs = host.addrs if announced else [str(a) for a in host.config.listen]
    proto = "ip6" if version == 6 else "ip4"
    for a in addrs:
        parts = a.split("/")
        if len(parts) > 2 and parts[1] == proto:
            return parts[2]
    return "::" if version == 6 else "0.0.0.0"


class HolePunchService(Service):
    """DCUtR for libp2p connections, plus `DataPlanePunch` when given the data plane.

    Use as `async with HolePunchService(host, reachability, streams) as punch:`; then
    `await punch.upgrade(peer)` right after a relayed connect (True once a direct connection
    exists), `punch.connection_type(peer)` for membership.
    """

    def __init__(
        self,
        host: Host,
        reachability: ReachabilityService,
        streams: TensorStreams | None = None,
        config: HolePunchConfig | None = None,
    ) -> None:
        self.host = host
        self.config = config or HolePunchConfig()
        self.dcutr = DCUtRProtocol(host.libp2p)
        self.data_plane = DataPlanePunch(host, streams, reachability, self.config) if streams is not None else None

    async def _start(self, stack: AsyncExitStack) -> None:
        await stack.enter_async_context(background_trio_service(self.dcutr))
        await self.dcutr.event_started.wait()

    def connection_type(self, peer: str) -> str | None:
        return self.host.connection_type(peer)

    async def upgrade(self, peer: str, timeout: float | None = None) -> bool:
        """Try to turn our relayed connection to `peer` into a direct one (DCUtR). True if a
        direct connection exists afterwards; never raises for a failed punch."""
        if self.host.connection_type(peer) == "direct":
            return True
        try:
            with trio.move_on_after(timeout or self.config.upgrade_timeout):
                await self.dcutr.initiate_hole_punch(parse_peer_id(peer))
        except Exception as e:  # the library logs and returns False for most failures
            log.info(kv("hole punch failed", peer=peer, error=repr(e)))
        return self.host.connection_type(peer) == "direct"
