"""UPnP port mapping: ask the home gateway to forward our TCP ports, so a node behind it is public.

Why: a volunteer whose router speaks UPnP IGD needs neither a relay nor a hole punch — one
request and the router forwards our ports. Discovery and mapping are py-libp2p's `UpnpManager`
(miniupnpc, already a py-libp2p dependency); what this module adds is the policy around it:

- **which ports**: every TCP port the libp2p host listens on *and* the tensor data plane's port
  (a separate listener, see tensor_streams.py — mapping only the libp2p port would leave bulk
  tensors on the relay). External port = internal port, as `UpnpManager` requests them, so the
  addresses peers learn from the dial-back (reachability.py) are the ones that work;
- **a deadline** on discovery (SSDP waits for answers; a LAN without a gateway must not hold up
  start-up), and a quiet, bounded removal of our mappings on exit;
- **no verdict of its own**: a mapped port proves nothing (the gateway may sit behind a carrier
  NAT). The dial-back probe that runs after it decides whether we are public.

When it runs: `NatTraversal` starts it before the first probe when `NatConfig.upnp` is on. The
node turns it on only when it listens on a non-loopback address — SSDP multicasts on the LAN, and a
loopback-only node (tests, the demo) has no gateway to ask.

What is not proven here: a mapping on a real gateway. In the NAT lab every "public" address is in
a reserved range (198.18.0.0/15), and both ends refuse that: miniupnpd (Debian's
miniupnpd-nftables) disables forwarding when its WAN address is reserved ("Port forwarding is
impossible"), and `UpnpManager.discover` treats a gateway with a private external IP as a double
NAT and reports no gateway. The tests cover the path every node without a gateway takes.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Sequence
from contextlib import AsyncExitStack
from dataclasses import dataclass, field
from typing import Any

import trio

from meshtrain.lifecycle import Service
from meshtrain.log import get_logger, kv

log = get_logger(__name__)


class _OneLineDiscoveryErrors(logging.Filter):
    """py-libp2p's `UpnpManager.discover` logs a failed SSDP search (no route, no gateway: the
    normal case off a home LAN) with `logger.exception`, a full traceback at ERROR in every node's
    log. The failure is already reported by us in one line (`upnp gateway=False ...`), so its
    record is cut to one line at INFO."""

    def filter(self, record: logging.LogRecord) -> bool:
        if record.exc_info and record.exc_info[1] is not None:
            record.msg = f"{record.getMessage()}: {record.exc_info[1]!r}"
            record.args = ()
            record.exc_info = record.exc_text = None
            record.levelno, record.levelname = logging.INFO, "INFO"
        return True


logging.getLogger("libp2p.discovery.upnp.upnp").addFilter(_OneLineDiscoveryErrors())

DEFAULT_DISCOVER_TIMEOUT = 5.0  # SSDP search (miniupnpc waits ~2 s) + reading the IGD description
REMOVE_TIMEOUT = 3.0  # per mapping, on exit


@dataclass(frozen=True)
class UpnpResult:
    """What the gateway granted. `gateway` is False when none answered (the usual case)."""

    gateway: bool
    external_ip: str | None = None
    mapped_ports: tuple[int, ...] = ()
    failed_ports: tuple[int, ...] = ()
    error: str | None = None


@dataclass
class PortMapper(Service):
    """Maps `ports` on the LAN's UPnP gateway for as long as it is entered; use as `async with`.

    ports:            TCP ports to forward (external = internal).
    discover_timeout: how long discovery may take before we give up on a gateway.
    `result` says what happened; nothing here raises for a missing or unwilling gateway.
    """

    ports: Sequence[int]
    discover_timeout: float = DEFAULT_DISCOVER_TIMEOUT
    result: UpnpResult = field(default_factory=lambda: UpnpResult(gateway=False))
    _manager: Any = field(default=None, init=False, repr=False)  # set once a gateway answered

    async def _start(self, stack: AsyncExitStack) -> None:
        stack.push_async_callback(self._unmap)
        self.result = await self._map()
        log.info(
            kv(
                "upnp",
                gateway=self.result.gateway,
                external_ip=self.result.external_ip,
                mapped=list(self.result.mapped_ports),
                failed=list(self.result.failed_ports),
                error=self.result.error,
            )
        )

    async def _unmap(self) -> None:
        manager, self._manager = self._manager, None
        if manager is None:
            return
        with trio.CancelScope(shield=True):
            for port in self.result.mapped_ports:
                with trio.move_on_after(REMOVE_TIMEOUT), contextlib.suppress(Exception):
                    await manager.remove_port_mapping(port, "TCP")

    async def _map(self) -> UpnpResult:
        try:
            from libp2p.discovery.upnp.upnp import UpnpManager  # imports miniupnpc
        except ImportError as e:
            return UpnpResult(gateway=False, error=f"miniupnpc unavailable: {e}")
        try:
            manager = UpnpManager()
        except Exception as e:  # miniupnpc could not even build its client
            return UpnpResult(gateway=False, error=repr(e))
        found = False
        with trio.move_on_after(self.discover_timeout):
            # miniupnpc runs in a worker thread that trio cannot interrupt: the deadline applies
            # between its calls (its own SSDP wait is short, `discoverdelay` 200 ms by default)
            found = await manager.discover()
        if not found:
            return UpnpResult(gateway=False)
        self._manager = manager
        mapped: list[int] = []
        failed: list[int] = []
        for port in dict.fromkeys(self.ports):
            (mapped if await manager.add_port_mapping(port, "TCP") else failed).append(port)
        return UpnpResult(
            gateway=True, external_ip=manager.get_external_ip(), mapped_ports=tuple(mapped), failed_ports=tuple(failed)
        )
