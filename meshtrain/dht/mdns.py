"""LAN discovery over mDNS: peers of one swarm on the same LAN find each other with no bootstrap.

Optional and off by default (`NodeConfig.mdns`): the DHT with a bootstrap address works on every
network; mDNS only saves typing the first address when several machines share a LAN (a lab, a
home with two GPUs). It multicasts on every interface, so it never runs in tests outside a network
namespace of their own.

The protocol is py-libp2p's `MDNSDiscovery` (zeroconf, the libp2p mDNS spec). What we add:

- **one service per swarm**: the service type is `_p2p-<10 hex of the swarm id's hash>._udp`,
  the spec's private-network form, so a node only hears peers of its own swarm (DNS-SD service
  names are at most 15 characters, hence the short fingerprint);
- **a trio-safe hand-off**: zeroconf calls back on its own thread, and py-libp2p's
  `peerDiscovery` emitter is one process-wide list of handlers. Our handler only puts the peer on
  a bounded trio channel (from that thread, through the trio token), dropping it when full —
  the next announcement brings it again;
- **validation**: a peer id that does not parse, our own id, or an address that is not a TCP
  multiaddr is skipped; at most `MAX_ADDRS` addresses per peer are tried.

`on_peer(peer_id, addrs)` is awaited for every discovery (again on re-announcements, so the
callback must be idempotent — `host.connect` to a connected peer returns at once).
"""

from __future__ import annotations

import hashlib
from collections.abc import Awaitable, Callable
from contextlib import AsyncExitStack, suppress
from typing import Any

import trio
from libp2p.discovery.events.peerDiscovery import peerDiscovery
from libp2p.discovery.mdns.mdns import create_mdns_discovery

from meshtrain.lifecycle import Service
from meshtrain.log import get_logger, kv
from meshtrain.transport.host import Host

log = get_logger(__name__)

QUEUE_SIZE = 64
MAX_ADDRS = 8
FINGERPRINT_HEX = 10  # "p2p-" + 10 hex + the leading "_" stays within DNS-SD's 15 characters


def swarm_fingerprint(swarm_id: str) -> str:
    return hashlib.sha256(swarm_id.encode()).hexdigest()[:FINGERPRINT_HEX]


class LanDiscovery(Service):
    """Announce ourselves on the LAN and hand peers of our swarm to `on_peer`; `async with`.

    host:     the running `Host` (its TCP listen addresses are announced).
    swarm_id: peers announce and listen under a service type derived from it.
    on_peer:  `await on_peer(peer_id, tcp_multiaddrs)` for each peer heard.
    """

    def __init__(self, host: Host, swarm_id: str, on_peer: Callable[[str, list[str]], Awaitable[None]]) -> None:
        self.host = host
        self.swarm_id = swarm_id
        self.on_peer = on_peer
        self.found: dict[str, list[str]] = {}
        self._send, self._recv = trio.open_memory_channel[tuple[str, list[str]]](QUEUE_SIZE)
        self._mdns: Any = None
        self._token: trio.lowlevel.TrioToken | None = None

    async def _start(self, stack: AsyncExitStack) -> None:
        self._token = trio.lowlevel.current_trio_token()
        addrs = [a.split("/p2p/")[0] for a in self.host.addrs if "/tcp/" in a]
        port = int(addrs[0].split("/tcp/")[1].split("/")[0]) if addrs else 0
        self._mdns = create_mdns_discovery(
            self.host.libp2p.get_network(),
            port=port,
            listen_addrs=addrs,
            private_network_fingerprint=swarm_fingerprint(self.swarm_id),
            host=self.host.libp2p,
        )
        peerDiscovery.register_peer_discovered_handler(self._heard)
        stack.callback(self._unregister)
        # on the trio thread: it spawns a trio system task (zeroconf's registration blocks
        # the loop for a moment, once, at start-up)
        self._mdns.start()
        stack.callback(self._stop_mdns)
        self._nursery = await stack.enter_async_context(trio.open_nursery())
        self._nursery.start_soon(self._deliver)
        log.info(kv("lan discovery on", service=self._mdns.service_type, port=port))

    async def _stop(self) -> None:
        self._unregister()  # no more announcements queued ...
        self._recv.close()  # ... and none delivered

    def _unregister(self) -> None:
        with suppress(Exception):  # already unregistered
            peerDiscovery.unregister_peer_discovered_handler(self._heard)

    def _stop_mdns(self) -> None:
        with suppress(Exception):
            self._mdns.stop()  # unregisters (a goodbye packet) and cancels its system task

    def _heard(self, info: Any) -> None:
        """Runs on zeroconf's thread (or ours): validate, then queue for the trio side."""
        try:
            peer = info.peer_id.to_base58()
            addrs = [str(a).split("/p2p/")[0] for a in info.addrs][:MAX_ADDRS]
        except Exception:
            return
        addrs = [a for a in addrs if a.startswith("/ip4/") and "/tcp/" in a]
        if peer == self.host.peer_id or not addrs or self._token is None:
            return
        with suppress(trio.RunFinishedError):
            self._token.run_sync_soon(self._enqueue, peer, addrs)

    def _enqueue(self, peer: str, addrs: list[str]) -> None:
        with suppress(trio.WouldBlock, trio.ClosedResourceError):
            self._send.send_nowait((peer, addrs))

    async def _deliver(self) -> None:
        async for peer, addrs in self._recv:
            self.found[peer] = addrs
            try:
                await self.on_peer(peer, addrs)
            except Exception as e:  # one unreachable LAN peer must not stop discovery
                log.info(kv("lan peer not usable", peer=peer[-8:], error=str(e)))
