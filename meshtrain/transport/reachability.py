"""Reachability: can the internet dial us, and what address does it see us at?

Why our own: py-libp2p 0.8.1's AutoNAT v1 server dials back with `host.connect()`, which returns at
once when a connection to the peer already exists — and the peer asking *is* connected — so every
peer is reported PUBLIC (docs/libp2p-notes.md). A NAT traversal layer built on that would never reserve
a relay slot.

How it works. Any peer serves the RPC `/meshtrain/reach-dialback/1`. A peer that wants to know
its reachability asks a few peers it is directly connected to ("servers"); each one:
1. takes the IP address it observes on the asker's live, *direct* connection (it never dials an
   address the asker names, so it cannot be used to scan third parties, as the AutoNAT spec asks;
   a relayed asker is refused: its socket goes to the relay),
2. opens a *fresh* TCP connection to that IP at each listen port the asker names and runs the
   libp2p security handshake on it (Noise, plus pnet when the swarm is private), which proves the
   asker's peer id answered — a NAT that forwards the port to someone else does not count. The
   connection is closed right after the handshake and never enters the swarm's connection table
   (adding it there could make py-libp2p trim the asker's real connection, see `_fresh_handshake`),
3. answers with the observed address and which ports answered.

The asker is PUBLIC if at least one server reached it on a fresh connection, PRIVATE if every
server that answered failed to, and UNKNOWN if none answered. A probe nobody answered is no news:
it leaves a status an earlier probe concluded as it was (seen under load: a second probe right after
the first was refused by its servers' rate limit, and the UNKNOWN that replaced PRIVATE withdrew
the node's circuit addresses from its record until the next probe, so its peers dialled nothing
useful). The observed IPs in the answers are voted on (the most frequent wins): that is the
address hole punching predicts our NAT mappings on.

Families: the dial-back goes over the family the request came in on, and the observed IP is
IPv4 or IPv6 alike (identify's, before a probe concludes, too). Behind an IPv6 home router's
stateful firewall a peer is observed at its own global address and still found PRIVATE: the
NAT lab's `ipv6=True` homes (tests/test_nat_traversal_v6.py).

What it does not do: choose relays (relay.py), punch holes (holepunch.py), UPnP.
"""

from __future__ import annotations

import contextlib
import ipaddress
import time
from collections import Counter
from collections.abc import Callable, Sequence
from contextlib import AsyncExitStack
from dataclasses import dataclass, field, replace
from typing import Any, cast

import multiaddr
import trio
from libp2p.network.swarm import Swarm
from libp2p.peer.id import ID
from libp2p.security.pnet.protector import new_protected_conn

from meshtrain.errors import MeshtrainError
from meshtrain.lifecycle import Service
from meshtrain.log import get_logger, kv
from meshtrain.transport.framing import MalformedMessage
from meshtrain.transport.host import Host, addr_ips
from meshtrain.transport.identity import parse_peer_id
from meshtrain.transport.rpc import RemoteError, RpcError
from meshtrain.transport.validate import MALFORMED, require_map

log = get_logger(__name__)

DIALBACK_RPC = "reach-dialback"
PUBLIC, PRIVATE, UNKNOWN = "public", "private", "unknown"

DEFAULT_DIALBACK_TIMEOUT = 4.0  # one fresh dial + handshake; a NAT that drops SYNs costs all of it
DEFAULT_PROBE_INTERVAL = 600.0  # re-check every 10 min (addresses and NAT mappings change)
DEFAULT_MAX_SERVERS = 3  # ask this many servers per probe
MAX_PORTS = 4  # ports one request may ask us to dial back
MAX_CONCURRENT_DIALBACKS = 8  # a server dials at most this many back at once
MIN_REQUEST_INTERVAL = 5.0  # seconds between two dial-back requests of one peer


class ReachabilityError(MeshtrainError):
    """A reachability probe could not be run (no server to ask)."""


@dataclass(frozen=True)
class ReachabilityConfig:
    """How reachability is probed and served.

    dialback_timeout: a server's deadline for one fresh dial back + security handshake.
    probe_interval:   seconds between automatic probes while the service runs (0: only on demand).
    max_servers:      servers asked per probe.
    serve:            answer other peers' dial-back requests.
    """

    dialback_timeout: float = DEFAULT_DIALBACK_TIMEOUT
    probe_interval: float = DEFAULT_PROBE_INTERVAL
    max_servers: int = DEFAULT_MAX_SERVERS
    serve: bool = True


@dataclass(frozen=True)
class DialbackAnswer:
    """One server's answer: the address it sees us at and which of our listen addrs it reached."""

    server: str
    observed: str  # "ip:port" of our connection to it
    reached: tuple[str, ...]  # multiaddrs that completed a fresh handshake
    failed: tuple[str, ...]


@dataclass(frozen=True)
class ReachabilityReport:
    status: str  # PUBLIC | PRIVATE | UNKNOWN
    observed_ip: str | None  # the voted public IP, None if no server answered
    public_addrs: tuple[str, ...]  # addresses a server reached on a fresh connection
    answers: tuple[DialbackAnswer, ...] = ()
    errors: tuple[str, ...] = ()
    at: float = field(default_factory=time.monotonic)


def tcp_listen_ports(host: Host, family: str | None = None) -> list[int]:
    """The TCP ports our libp2p host listens on (not relay addresses); `family` ("ip4", "ip6"):
    only those of listen addresses of that IP version."""
    ports: list[int] = []
    for a in host.libp2p.get_transport_addrs():
        s = str(a)
        if "/p2p-circuit" in s or (family is not None and not s.startswith(f"/{family}/")):
            continue
        try:
            port = int(multiaddr.Multiaddr(s).value_for_protocol("tcp"))
        except Exception:
            continue
        if port not in ports:
            ports.append(port)
    return ports


def identify_observed_ips(host: Host) -> list[str]:
    """The IPs (v4 and v6) at which peers told us, over identify, that they see us; first seen
    first. Before this read /ip6/ too, a peer speaking only IPv6 that had not concluded a probe
    named no address for itself in a data-plane punch ("addr must be a unicast IP address"), and
    its tensors went over libp2p (tests/test_nat_traversal_v6.py)."""
    manager = getattr(host.libp2p, "_observed_addr_manager", None)
    if manager is None:
        return []
    try:
        return addr_ips(manager.addrs(min_observers=1))
    except Exception:  # py-libp2p's bookkeeping: no observation is no news
        return []


async def _fresh_handshake(host: Host, maddr: multiaddr.Multiaddr, peer: ID) -> None:
    """Dial `maddr` on a new TCP connection and complete the security handshake with `peer`.

    Deliberately below the swarm: `network.dial_addr` would register the connection, and with
    `max_connections_per_peer=1` py-libp2p's trimmer may then close the *existing* connection
    (the one the dial-back request is on) instead of ours. Raises on any failure.
    """
    network = cast(Swarm, host.libp2p.get_network())  # py-libp2p types it as the interface
    transport = network.transport_manager.transport_for_dialing(maddr)
    if transport is None:
        raise ReachabilityError(f"no transport can dial {maddr}")
    raw = await transport.dial(multiaddr.Multiaddr(f"{maddr}/p2p/{peer.to_base58()}"))
    try:
        psk = getattr(network, "psk", None)
        if psk is not None:
            raw = new_protected_conn(raw, psk)
        secured = await network.upgrader.upgrade_security(raw, True, peer)
        await secured.close()
    finally:
        with trio.CancelScope(shield=True), trio.move_on_after(1), contextlib.suppress(Exception):
            await raw.close()


class ReachabilityService(Service):
    """Serves dial-backs and probes our own reachability; use as `async with`.

    host:    the running `Host`.
    servers: returns the peer ids worth asking (default: every peer we hold a direct connection
             to). Peers that do not serve the RPC are skipped.
    config:  `ReachabilityConfig`.

    `status` / `observed_ip` hold the latest conclusive probe's outcome; `on_change(callback)`
    runs a callback (synchronously, with the new report) whenever the status or the observed IP
    changes. `probe()` never raises for a single failing server; when nobody answered it returns
    the last conclusive report (with this probe's errors), UNKNOWN before the first.
    """

    def __init__(
        self,
        host: Host,
        *,
        servers: Callable[[], Sequence[str]] | None = None,
        config: ReachabilityConfig | None = None,
    ) -> None:
        self.host = host
        self.config = config or ReachabilityConfig()
        self._servers = servers
        self.report = ReachabilityReport(UNKNOWN, None, ())
        self._callbacks: list[Callable[[ReachabilityReport], None]] = []
        self._dialbacks = trio.Semaphore(MAX_CONCURRENT_DIALBACKS)
        self._last_request: dict[str, float] = {}
        self._nursery: trio.Nursery | None = None

    @property
    def status(self) -> str:
        return self.report.status

    @property
    def observed_ip(self) -> str | None:
        """Our public IP as the voted dial-back answers saw it, else as identify saw it (an IPv4
        address first, else an IPv6 one: a peer that speaks only IPv6 has only those)."""
        if self.report.observed_ip:
            return self.report.observed_ip
        seen = identify_observed_ips(self.host)
        return next((ip for ip in seen if ":" not in ip), None) or next(iter(seen), None)

    def observed_ips(self) -> list[str]:
        """Every public IP we know of for ourselves, best first: the voted probe answer's, then
        identify's (a dual-stack peer is seen at one IP per family)."""
        ips = [self.report.observed_ip] if self.report.observed_ip else []
        return list(dict.fromkeys([*ips, *identify_observed_ips(self.host)]))

    def on_change(self, callback: Callable[[ReachabilityReport], None]) -> None:
        self._callbacks.append(callback)

    # -- lifecycle ------------------------------------------------------------------------

    async def _start(self, stack: AsyncExitStack) -> None:
        if self.config.serve:
            self.host.rpc.serve(
                DIALBACK_RPC, self._serve_dialback, handler_timeout=self.config.dialback_timeout * MAX_PORTS + 5
            )
        self._nursery = await stack.enter_async_context(trio.open_nursery())
        if self.config.probe_interval > 0:
            self._nursery.start_soon(self._probe_loop)

    async def _probe_loop(self) -> None:
        while True:
            try:
                await self.probe()
            except ReachabilityError as e:
                log.debug(kv("reachability probe skipped", reason=str(e)))
            await trio.sleep(self.config.probe_interval)

    # -- client ---------------------------------------------------------------------------

    def _candidate_servers(self) -> list[str]:
        if self._servers is not None:
            peers = list(self._servers())
        else:
            peers = [p for p in self.host.connected_peers() if self.host.connection_type(p) == "direct"]
        return [p for p in peers if p != self.host.peer_id]

    async def probe(self, servers: Sequence[str] | None = None) -> ReachabilityReport:
        """Ask up to `max_servers` servers to dial us back; update and return the report."""
        candidates = list(servers) if servers is not None else self._candidate_servers()
        if not candidates:
            raise ReachabilityError(
                "no directly connected peer to ask for a dial-back; connect to a bootstrap or relay node first"
            )
        ports = tcp_listen_ports(self.host)[:MAX_PORTS]
        answers: list[DialbackAnswer] = []
        errors: list[str] = []

        async def ask(server: str) -> None:
            try:
                reply = await self.host.rpc.call(
                    server, DIALBACK_RPC, {"ports": ports}, timeout=self.config.dialback_timeout * MAX_PORTS + 10
                )
                reply = require_map(reply, "observed", "reached", "failed", error=MalformedMessage)
                answers.append(
                    DialbackAnswer(
                        server,
                        str(reply["observed"])[:64],
                        tuple(str(a)[:128] for a in reply["reached"][:MAX_PORTS]),
                        tuple(str(a)[:128] for a in reply["failed"][:MAX_PORTS]),
                    )
                )
            except (RpcError, Exception) as e:  # one server's failure is one missing vote
                errors.append(f"{server[-8:]}: {type(e).__name__}: {e}")

        async with trio.open_nursery() as nursery:
            for server in candidates[: self.config.max_servers]:
                nursery.start_soon(ask, server)
        report = _decide(answers, errors)
        if report.status == UNKNOWN and self.report.status != UNKNOWN:
            report = replace(self.report, errors=report.errors)  # no news: the last conclusive one stands
        self._set(report)
        log.info(
            kv(
                "reachability probed",
                status=report.status,
                observed_ip=report.observed_ip,
                answers=len(answers),
                errors=len(errors),
            )
        )
        return report

    def _set(self, report: ReachabilityReport) -> None:
        old = self.report
        self.report = report
        if (old.status, old.observed_ip) != (report.status, report.observed_ip):
            for cb in list(self._callbacks):
                try:
                    cb(report)
                except Exception as e:  # a listener's bug must not stop the probe loop
                    log.warning(kv("reachability listener failed", error=repr(e)))

    # -- server ---------------------------------------------------------------------------

    async def _serve_dialback(self, peer: str, request: Any) -> dict:
        req = require_map(request, "ports", error=MalformedMessage)
        ports = req["ports"]
        if (
            not isinstance(ports, list)
            or not ports
            or len(ports) > MAX_PORTS
            or not all(isinstance(p, int) and 0 < p < 65536 for p in ports)
        ):
            raise RemoteError(MALFORMED, f"ports must be 1..{MAX_PORTS} TCP ports")
        now = time.monotonic()
        if now - self._last_request.get(peer, -1e9) < MIN_REQUEST_INTERVAL:
            raise RemoteError("rate_limited", f"at most one dial-back per {MIN_REQUEST_INTERVAL:g} s")
        self._last_request = {p: t for p, t in self._last_request.items() if now - t < 60}
        self._last_request[peer] = now
        observed = self.host.remote_addr(peer)
        if observed is None:
            raise RemoteError("not_direct", "you reach me through a relay: I cannot observe you")
        ip, obs_port = observed
        try:
            version = ipaddress.ip_address(ip).version
        except ValueError:
            raise RemoteError("internal", "unparseable observed address") from None
        proto = "ip4" if version == 4 else "ip6"
        reached, failed = [], []
        async with self._dialbacks:
            for port in ports:
                maddr = multiaddr.Multiaddr(f"/{proto}/{ip}/tcp/{port}")
                try:
                    with trio.fail_after(self.config.dialback_timeout):
                        await _fresh_handshake(self.host, maddr, parse_peer_id(peer))
                    reached.append(str(maddr))
                except Exception as e:  # unreachable, refused, wrong peer: all mean "not this one"
                    log.debug(kv("dial-back failed", peer=peer, addr=str(maddr), error=repr(e)))
                    failed.append(str(maddr))
        return {"observed": f"{ip}:{obs_port}", "reached": reached, "failed": failed}


def _decide(answers: list[DialbackAnswer], errors: list[str]) -> ReachabilityReport:
    if not answers:
        return ReachabilityReport(UNKNOWN, None, (), (), tuple(errors))
    votes = Counter(a.observed.rsplit(":", 1)[0] for a in answers)
    observed_ip = votes.most_common(1)[0][0]
    reached = tuple(dict.fromkeys(r for a in answers for r in a.reached))
    status = PUBLIC if reached else PRIVATE
    return ReachabilityReport(status, observed_ip, reached, tuple(answers), tuple(errors))
