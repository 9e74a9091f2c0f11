"""NAT traversal for one node: reachability, relays and hole punching wired together.

`reachability.py`, `relay.py` and `holepunch.py` each do one job; this module only decides, from
the reachability verdict, what the node does about it — the policy the node layer would
otherwise re-implement:

- **public** (a fresh dial-back reached us): relay for others (`RelayService.enable_hop`), hold
  no reservations, announce our own addresses; connection type "public".
- **private** (every dial-back failed): keep reservations on relays from `relays()` (bootstrap
  or DHT-found public peers), announce our circuit addresses; connection type "relayed" while a
  reservation is held ("private" while none is).
- **unknown** (nobody answered yet): announce our addresses, retry soon.

`on_announce(callback)` hands every change to the membership layer, e.g.
`nat.on_announce(lambda conn, addrs: view.set_connection(conn, addrs))` with a `SwarmView`, and
first, at once, what is known already: the node registers it after building its model, and under
load a probe and a relay reservation can come first (the NAT lab: their one announcement went to
nobody, and the node's record named its listen address for the rest of the run).
Connecting to a peer at a circuit address (`host.connect`) and upgrading it (`upgrade`) are the
caller's call, because only the caller knows whom it needs.

UPnP (upnp.py, `NatConfig.upnp`): when on, our TCP ports — libp2p's and the data plane's — are
mapped on the LAN's gateway before the first probe; the probe then finds us public if the mapping
works. Off by default here; the node turns it on when it listens beyond loopback.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from contextlib import AsyncExitStack, suppress
from dataclasses import dataclass, field

import trio

from meshtrain.lifecycle import Service
from meshtrain.log import get_logger, kv
from meshtrain.transport.holepunch import HolePunchConfig, HolePunchService
from meshtrain.transport.host import Host
from meshtrain.transport.reachability import (
    PRIVATE,
    PUBLIC,
    ReachabilityConfig,
    ReachabilityError,
    ReachabilityReport,
    ReachabilityService,
    tcp_listen_ports,
)
from meshtrain.transport.relay import RelayConfig, RelayService
from meshtrain.transport.tensor_streams import TensorStreams
from meshtrain.transport.upnp import DEFAULT_DISCOVER_TIMEOUT, PortMapper

log = get_logger(__name__)

UNKNOWN_RETRY = 10.0  # seconds between probes while nobody has answered


@dataclass(frozen=True)
class NatConfig:
    reachability: ReachabilityConfig = field(default_factory=ReachabilityConfig)
    relay: RelayConfig = field(default_factory=RelayConfig)
    holepunch: HolePunchConfig = field(default_factory=HolePunchConfig)
    serve_relay_when_public: bool = True  # public nodes relay by default, so private ones find relays
    upnp: bool = False  # map our ports on the LAN's UPnP gateway (SSDP multicast on the LAN)
    upnp_discover_timeout: float = DEFAULT_DISCOVER_TIMEOUT


class NatTraversal(Service):
    """Reachability + relay + hole punching for one host; use as `async with`.

    host:    the running `Host`. streams: its `TensorStreams`, to punch the data plane too.
    relays:  returns relay addresses (ending in /p2p/<id>) to reserve on when private.
    servers: returns peer ids to ask for dial-backs (default: directly connected peers).
    """

    def __init__(
        self,
        host: Host,
        streams: TensorStreams | None = None,
        *,
        relays: Callable[[], Sequence[str]] = lambda: (),
        servers: Callable[[], Sequence[str]] | None = None,
        config: NatConfig | None = None,
    ) -> None:
        self.host = host
        self.config = config or NatConfig()
        self.reachability = ReachabilityService(host, servers=servers, config=self.config.reachability)
        self.relay = RelayService(host, self.config.relay)
        self.punch = HolePunchService(host, self.reachability, streams, self.config.holepunch)
        self.streams = streams
        self.upnp: PortMapper | None = None
        self._relays = relays
        self._announce: list[Callable[[str, list[str]], None]] = []
        self._nursery: trio.Nursery | None = None

    async def _start(self, stack: AsyncExitStack) -> None:
        if self.config.upnp:  # first, so the first probe already sees the mapped ports
            ports = tcp_listen_ports(self.host)
            if self.streams is not None and self.streams.port:
                ports.append(self.streams.port)
            self.upnp = await stack.enter_async_context(
                PortMapper(ports, discover_timeout=self.config.upnp_discover_timeout)
            )
        await stack.enter_async_context(self.reachability)
        await stack.enter_async_context(self.relay)
        await stack.enter_async_context(self.punch)
        self._nursery = await stack.enter_async_context(trio.open_nursery())
        self.reachability.on_change(self._on_reachability)
        self.relay.on_change(lambda _addrs: self._publish())
        self._nursery.start_soon(self._unknown_retry_loop)

    # -- what we announce -----------------------------------------------------------------

    def on_announce(self, callback: Callable[[str, list[str]], None]) -> None:
        """Call `callback(connection_type, addrs)` whenever either changes, and now, unless the
        status is still unknown (nothing to announce yet)."""
        self._announce.append(callback)
        if self.reachability.status != "unknown":
            callback(self.connection_type, self.addrs)

    @property
    def connection_type(self) -> str:
        status = self.reachability.status
        if status == PUBLIC:
            return "public"
        if status == PRIVATE:
            return "relayed" if self.relay.reservations else "private"
        return "unknown"

    @property
    def addrs(self) -> list[str]:
        """What we announce: circuit addresses while private; while public, first our listen
        ports at the IP the dial-backs saw (behind a port forward or a UPnP mapping that is the
        router's address, which no listen address names), then our own addresses. The IP is
        the servers' vote, never one server's word, and the ports are ours."""
        if self.reachability.status == PRIVATE and self.relay.circuit_addrs:
            return self.relay.circuit_addrs
        if self.reachability.status == PUBLIC and self.reachability.report.observed_ip:
            ip = self.reachability.report.observed_ip
            family = "ip6" if ":" in ip else "ip4"  # the ports of listen addresses of the IP's version
            seen = [
                f"/{family}/{ip}/tcp/{port}/p2p/{self.host.peer_id}" for port in tcp_listen_ports(self.host, family)
            ]
            return list(dict.fromkeys([*seen, *self.host.addrs]))
        return self.host.addrs

    def _publish(self) -> None:
        conn, addrs = self.connection_type, self.addrs
        for cb in list(self._announce):
            try:
                cb(conn, addrs)
            except Exception as e:  # a listener's bug must not stop NAT traversal
                log.warning(kv("nat announce listener failed", error=repr(e)))

    # -- policy ---------------------------------------------------------------------------

    def _on_reachability(self, report: ReachabilityReport) -> None:
        if report.status == PUBLIC and self.config.serve_relay_when_public:
            self.relay.enable_hop()
        if report.status == PRIVATE and not self.relay.keeping:
            self.relay.keep_reserved(self._relays)
        log.info(kv("nat status", status=report.status, observed_ip=report.observed_ip))
        self._publish()

    async def probe(self) -> ReachabilityReport:
        """Probe now (e.g. right after connecting to bootstrap peers) and apply the policy."""
        return await self.reachability.probe()

    async def _unknown_retry_loop(self) -> None:
        while True:
            await trio.sleep(UNKNOWN_RETRY)
            if self.reachability.status == "unknown":
                with suppress(ReachabilityError):  # still nobody to ask: try again later
                    await self.reachability.probe()

    async def upgrade(self, peer: str, timeout: float | None = None) -> bool:
        """Try to make our connection to `peer` direct (DCUtR); see `HolePunchService.upgrade`."""
        return await self.punch.upgrade(peer, timeout)
