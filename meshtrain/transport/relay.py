"""Circuit relay v2: public peers relay for private ones; private peers hold reservations.

Why: a peer behind a NAT that drops unsolicited inbound connections cannot be dialled. It keeps a
connection to a public relay and a *reservation* there; others reach it at its circuit address
`<relay addr>/p2p/<relay>/p2p-circuit/p2p/<peer>`, and DCUtR (holepunch.py) then tries to upgrade
the relayed connection to a direct one. Pairs that cannot be punched (symmetric NATs) keep
training through the relay, so a relay's limits must fit a training workload.

What py-libp2p 0.8.1 gives and what we do on top (docs/libp2p-notes.md):
- `CircuitV2Protocol` serves HOP (relay) and STOP (be relayed to) but nothing registers it for a
  host: we run it as a service and register it ourselves. Its limits default to 1 h and 1 GiB per
  circuit and **4 reservations per relay**; `RelayConfig` makes every limit explicit.
- Its `_relay_data` shares one dict entry per *peer* between circuits, so when one circuit of a
  peer ends it closes another circuit of that peer (e.g. the relayed leg that DCUtR retires after
  an upgrade tears down the peer's other circuits); it also checks the duration limit only when
  data flows, and writes a HOP status message *into the relayed byte stream* when a limit trips.
  `MeshtrainRelayProtocol` replaces that one method: per-circuit cleanup, the duration enforced
  on idle circuits too, and limits end a circuit by resetting both legs.
- Its swarm never dials `/p2p-circuit` addresses and its `CircuitV2Transport.dial` makes a
  reservation on the relay before every outgoing circuit. `RelayService.connect` does the HOP
  CONNECT exchange itself (and is installed as `Host.circuit_dialer`, so `host.connect(circuit)`
  works), and `reserve` does the RESERVE exchange itself, returning what the relay granted.

Not here: deciding whether we are public (reachability.py), hole punching (holepunch.py), and
finding relays (the node passes bootstrap/DHT-found relay addresses to `keep_reserved`).
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Sequence
from contextlib import AsyncExitStack
from dataclasses import dataclass
from typing import Any

import multiaddr
import trio
from libp2p.connection_types import ConnectionType
from libp2p.network.connection.raw_connection import RawConnection
from libp2p.peer.id import ID
from libp2p.relay.circuit_v2.pb.circuit_pb2 import HopMessage
from libp2p.relay.circuit_v2.pb.circuit_pb2 import PeerId as CircuitPeerId
from libp2p.relay.circuit_v2.protocol import PROTOCOL_ID as HOP_PROTOCOL
from libp2p.relay.circuit_v2.protocol import STOP_PROTOCOL_ID as STOP_PROTOCOL
from libp2p.relay.circuit_v2.protocol import CircuitV2Protocol
from libp2p.relay.circuit_v2.protocol_buffer import StatusCode
from libp2p.relay.circuit_v2.resources import RelayLimits
from libp2p.relay.circuit_v2.utils import read_delimited_msg, write_delimited_msg
from libp2p.tools.anyio_service import background_trio_service
from libp2p.tools.constants import MAX_READ_LEN

from meshtrain.errors import MeshtrainError
from meshtrain.lifecycle import Service
from meshtrain.log import get_logger, kv
from meshtrain.transport.host import ConnectError, Host, StreamOpenError, peer_id_of
from meshtrain.transport.identity import parse_peer_id
from meshtrain.transport.rpc import close_quietly, reset_quietly

log = get_logger(__name__)

__all__ = [
    "HOP_PROTOCOL",
    "STOP_PROTOCOL",
    "RelayConfig",
    "RelayService",
    "Reservation",
    "RelayError",
    "ReservationRefused",
    "CircuitRefused",
    "split_circuit_addr",
]

# Defaults sized for training through a relay (py-libp2p: 1 h, 1 GiB, 4 reservations, 8 circuits).
DEFAULT_CIRCUIT_DURATION = 6 * 3600.0
DEFAULT_CIRCUIT_BYTES = 16 << 30
DEFAULT_MAX_RESERVATIONS = 128
DEFAULT_MAX_CIRCUITS_PER_PEER = 16
DEFAULT_RESERVATION_TTL = 3600.0
DEFAULT_REFRESH_FRACTION = 0.75  # refresh a reservation when this much of its TTL has passed
DEFAULT_KEEP_CHECK = 5.0  # seconds between checks of held reservations
DEFAULT_RELAY_TIMEOUT = 10.0


class RelayError(MeshtrainError):
    """A relay operation failed."""


class ReservationRefused(RelayError):
    """The relay answered our RESERVE with an error status (full, not a relay, ...)."""

    def __init__(self, relay: str, status: str) -> None:
        super().__init__(f"relay {relay} refused the reservation: {status}")
        self.relay = relay
        self.status = status


class CircuitRefused(ConnectError):
    """The relay would not open a circuit (peer has no reservation there, limits, ...)."""

    def __init__(self, target: str, status: str) -> None:
        super().__init__(f"relay refused a circuit to {target}: {status}")
        self.status = status


@dataclass(frozen=True)
class RelayConfig:
    """Relay behaviour of one host.

    serve:                 act as a relay (HOP) now; `RelayService.enable_hop()` turns it on
                           later (the node does when reachability says we are public).
    circuit_duration:      seconds a circuit may live (0: unlimited).
    circuit_bytes:         bytes a circuit may carry, both directions together (0: unlimited).
    max_reservations:      reservations this relay holds at once, all peers together.
    max_circuits_per_peer: concurrent circuits to one reserved peer.
    reservation_ttl:       seconds a reservation we grant is valid without a refresh.
    reservations:          relays a private peer keeps a reservation on (`keep_reserved`).
    refresh_fraction:      refresh a held reservation once this fraction of its TTL passed.
    timeout:               deadline of one RESERVE or CONNECT exchange.
    """

    serve: bool = False
    circuit_duration: float = DEFAULT_CIRCUIT_DURATION
    circuit_bytes: int = DEFAULT_CIRCUIT_BYTES
    max_reservations: int = DEFAULT_MAX_RESERVATIONS
    max_circuits_per_peer: int = DEFAULT_MAX_CIRCUITS_PER_PEER
    reservation_ttl: float = DEFAULT_RESERVATION_TTL
    reservations: int = 2
    refresh_fraction: float = DEFAULT_REFRESH_FRACTION
    timeout: float = DEFAULT_RELAY_TIMEOUT

    def __post_init__(self) -> None:
        if self.circuit_duration < 0 or self.circuit_bytes < 0:
            raise ValueError("circuit limits must be >= 0 (0 means unlimited)")
        if self.max_reservations < 1 or self.max_circuits_per_peer < 1:
            raise ValueError("max_reservations and max_circuits_per_peer must be >= 1")
        if self.reservation_ttl < 1:
            raise ValueError("reservation_ttl must be at least 1 s")
        if not 0.1 <= self.refresh_fraction < 1:
            raise ValueError("refresh_fraction must be in [0.1, 1)")

    def limits(self) -> RelayLimits:
        return RelayLimits(
            duration=int(self.circuit_duration),
            data=int(self.circuit_bytes),
            max_circuit_conns=self.max_circuits_per_peer,
            max_reservations=self.max_reservations,
            reservation_ttl=int(self.reservation_ttl),
        )


@dataclass(frozen=True)
class Reservation:
    """A slot a relay granted us: where others can reach us and until when."""

    relay: str  # peer id
    relay_addr: str  # the address we reached the relay at (ends in /p2p/<relay>)
    circuit_addrs: tuple[str, ...]  # our addresses through this relay
    expires_at: float  # unix time (the relay's clock)
    granted_at: float  # unix time (ours)
    circuit_duration: int  # the limits the relay announced (0: none announced)
    circuit_bytes: int
    refreshes: int = 0

    def refresh_due(self, fraction: float) -> float:
        return self.granted_at + fraction * max(1.0, self.expires_at - self.granted_at)


def split_circuit_addr(addr: str) -> tuple[str, str]:
    """`<relay addr>/p2p/<relay>/p2p-circuit/p2p/<target>` -> (relay addr, target peer id)."""
    if "/p2p-circuit" not in addr:
        raise RelayError(f"{addr} is not a circuit address")
    relay_part, _, rest = addr.partition("/p2p-circuit")
    target = rest.removeprefix("/p2p/").strip("/")
    if not target or "/" in target or "/p2p/" not in relay_part:
        raise RelayError(f"{addr}: expected <relay addr>/p2p/<relay>/p2p-circuit/p2p/<target>")
    return relay_part, target


def _status_name(value: int) -> str:
    try:
        return StatusCode(value).name
    except ValueError:
        return f"status {value}"


class MeshtrainRelayProtocol(CircuitV2Protocol):
    """py-libp2p's circuit relay v2 with a per-circuit data pump (module docstring says why)."""

    def __init__(self, host: Any, limits: RelayLimits, allow_hop: bool) -> None:
        super().__init__(host, limits, allow_hop=allow_hop)
        self.stats = {"bytes": 0, "limit_resets": 0}

    async def _relay_data(
        self,
        src_stream: Any,
        dst_stream: Any,
        peer_id: ID,
        deadline: float | None = None,
        circuit_data_limit: list[int] | None = None,
    ) -> None:
        """Copy src -> dst until EOF, a reset, or a limit; a limit or error resets both legs.

        The two directions of one circuit share `circuit_data_limit` (a one-element list) and
        `deadline`; the parent starts one call per direction."""
        reset = False
        # The parent's deadline is on time.monotonic(); trio's clock has its own offset.
        trio_deadline = float("inf") if deadline is None else trio.current_time() + (deadline - time.monotonic())
        try:
            while True:
                with trio.move_on_at(trio_deadline) as scope:
                    data = await src_stream.read(MAX_READ_LEN)
                if scope.cancelled_caught:
                    log.info(kv("relay circuit reached its duration limit", peer=str(peer_id)))
                    self.stats["limit_resets"] += 1
                    reset = True
                    return
                if not data:
                    return
                if circuit_data_limit is not None:
                    if len(data) > circuit_data_limit[0]:
                        log.info(kv("relay circuit reached its data limit", peer=str(peer_id)))
                        self.stats["limit_resets"] += 1
                        reset = True
                        return
                    circuit_data_limit[0] -= len(data)
                with trio.fail_after(self.write_timeout):
                    await dst_stream.write(data)
                self.stats["bytes"] += len(data)
        except trio.Cancelled:
            reset = True
            raise
        except Exception as e:  # a reset or dead leg ends this circuit, never the relay
            log.debug(kv("relay circuit ended", peer=str(peer_id), reason=repr(e)))
            reset = True
        finally:
            # EOF from src: half-close dst so the other direction can finish; a limit or an
            # error: reset both legs of this circuit (and only this one).
            with trio.CancelScope(shield=True), trio.move_on_after(2):
                for leg in (src_stream, dst_stream) if reset else (dst_stream,):
                    with contextlib.suppress(Exception):
                        await (leg.reset() if reset else leg.close())


class RelayService(Service):
    """Circuit relay v2 for one host: relay for others, reserve slots, dial circuits.

    Use as `async with RelayService(host, RelayConfig(...)) as relay:`. Every host that enters it
    accepts relayed connections (STOP); with `config.serve` (or after `enable_hop()`) it relays.
    A private peer calls `reserve(relay_addr)` once or `keep_reserved(provider)` to hold
    `config.reservations` reservations, refreshed before they expire and re-made when a relay
    connection drops; `circuit_addrs` are the addresses to announce, and `on_change` callbacks
    fire when they change. `connect(circuit_addr)` (also reachable as `host.connect`) dials a
    peer through its relay.
    """

    def __init__(self, host: Host, config: RelayConfig | None = None) -> None:
        self.host = host
        self.config = config or RelayConfig()
        self.protocol = MeshtrainRelayProtocol(host.libp2p, self.config.limits(), allow_hop=self.config.serve)
        self.reservations: dict[str, Reservation] = {}
        self._callbacks: list[Callable[[list[str]], None]] = []
        self._connect_locks: dict[str, trio.Lock] = {}
        self._nursery: trio.Nursery | None = None
        self._keeping = False

    # -- lifecycle ------------------------------------------------------------------------

    async def _start(self, stack: AsyncExitStack) -> None:
        await stack.enter_async_context(background_trio_service(self.protocol))
        await self.protocol.event_started.wait()
        self._nursery = await stack.enter_async_context(trio.open_nursery())
        self.host.circuit_dialer = self.connect

    async def _stop(self) -> None:
        if self.host.circuit_dialer == self.connect:
            self.host.circuit_dialer = None

    @property
    def keeping(self) -> bool:
        """Whether `keep_reserved` runs."""
        return self._keeping

    @property
    def serving(self) -> bool:
        return self.protocol.allow_hop

    def enable_hop(self) -> None:
        """Start relaying for others (a public peer). Idempotent."""
        if not self.protocol.allow_hop:
            self.protocol.allow_hop = True
            self.host.set_stream_handler(HOP_PROTOCOL, self.protocol._handle_hop_stream)
            log.info(kv("relay service on", peer=self.host.peer_id))

    def on_change(self, callback: Callable[[list[str]], None]) -> None:
        """Call `callback(circuit_addrs)` whenever our circuit addresses change."""
        self._callbacks.append(callback)

    @property
    def circuit_addrs(self) -> list[str]:
        return [a for r in self.reservations.values() for a in r.circuit_addrs]

    def _changed(self) -> None:
        addrs = self.circuit_addrs
        for cb in list(self._callbacks):
            try:
                cb(addrs)
            except Exception as e:  # a listener's bug must not stop the keeper
                log.warning(kv("relay listener failed", error=repr(e)))

    # -- client: reservations -------------------------------------------------------------

    async def reserve(self, relay_addr: str) -> Reservation:
        """Make (or refresh) a reservation on the relay at `relay_addr` (ends in /p2p/<id>).

        Raises `ConnectError` if the relay cannot be reached, `ReservationRefused` with the
        relay's status if it says no, `RelayError` on a malformed or late answer."""
        relay = peer_id_of(relay_addr)
        with trio.fail_after(self.config.timeout * 2):
            await self.host.connect(relay_addr)
        resp, _ = await self._hop_exchange(relay, HopMessage(type=HopMessage.RESERVE))
        if resp.status != StatusCode.OK:
            raise ReservationRefused(relay, _status_name(resp.status))
        if not resp.HasField("reservation"):
            raise RelayError(f"relay {relay} answered OK without a reservation")
        granted = []
        for raw in resp.reservation.addrs:
            try:
                a = str(multiaddr.Multiaddr(raw))
            except Exception:
                continue
            if "/p2p-circuit" not in a and "/p2p/" in a:
                granted.append(a)
        bases = granted or [relay_addr]
        me = self.host.peer_id
        circuits = tuple(f"{b}/p2p-circuit/p2p/{me}" for b in dict.fromkeys(bases))
        old = self.reservations.get(relay)
        res = Reservation(
            relay=relay,
            relay_addr=relay_addr,
            circuit_addrs=circuits,
            expires_at=float(resp.reservation.expire),
            granted_at=time.time(),
            circuit_duration=int(resp.limit.duration) if resp.HasField("limit") else 0,
            circuit_bytes=int(resp.limit.data) if resp.HasField("limit") else 0,
            refreshes=(old.refreshes + 1) if old else 0,
        )
        self.reservations[relay] = res
        log.info(
            kv(
                "relay reservation held",
                relay=relay,
                expires_in=round(res.expires_at - time.time()),
                refreshes=res.refreshes,
            )
        )
        if old is None or old.circuit_addrs != res.circuit_addrs:
            self._changed()
        return res

    def drop(self, relay: str) -> None:
        """Forget our reservation on `relay` (it lapses on the relay at its expiry)."""
        if self.reservations.pop(relay, None) is not None:
            self._changed()

    def keep_reserved(self, relays: Callable[[], Sequence[str]]) -> None:
        """Hold `config.reservations` reservations on relays from `relays()` (addresses ending in
        /p2p/<id>, best first) in the background, until the service exits."""
        if self._nursery is None:
            raise RelayError("the relay service is not running")
        if self._keeping:
            raise RelayError("keep_reserved is already running")
        self._keeping = True
        self._nursery.start_soon(self._keep_loop, relays)

    async def _keep_loop(self, relays: Callable[[], Sequence[str]]) -> None:
        failed_until: dict[str, float] = {}
        while True:
            now = time.time()
            for relay, res in list(self.reservations.items()):
                lost = not self.host.is_connected(relay)
                if lost or now >= res.refresh_due(self.config.refresh_fraction) or now >= res.expires_at:
                    try:
                        await self.reserve(res.relay_addr)
                    except (RelayError, ConnectError, StreamOpenError, trio.TooSlowError) as e:
                        log.info(kv("relay reservation lost", relay=relay, error=str(e)))
                        self.drop(relay)
                        failed_until[relay] = now + 30
            for addr in relays():
                if len(self.reservations) >= self.config.reservations:
                    break
                try:
                    relay = peer_id_of(addr)
                except Exception:
                    continue
                if relay in self.reservations or relay == self.host.peer_id:
                    continue
                if failed_until.get(relay, 0) > now:
                    continue
                try:
                    await self.reserve(addr)
                except (RelayError, ConnectError, StreamOpenError, trio.TooSlowError) as e:
                    log.info(kv("relay reservation failed", relay=relay, error=str(e)))
                    failed_until[relay] = time.time() + 30
            wake = min(
                [DEFAULT_KEEP_CHECK]
                + [r.refresh_due(self.config.refresh_fraction) - time.time() for r in self.reservations.values()]
            )
            await trio.sleep(max(0.2, wake))

    # -- client: circuits -----------------------------------------------------------------

    async def _hop_exchange(self, relay: str, msg: HopMessage) -> tuple[HopMessage, Any]:
        """Send one HOP message, read the STATUS answer. Returns (answer, stream): the stream is
        the circuit after a successful CONNECT, else already closed."""
        try:
            stream = await self.host.open_stream(relay, HOP_PROTOCOL, timeout=self.config.timeout)
        except StreamOpenError as e:
            raise RelayError(f"{relay} does not relay for us: {e}") from None
        try:
            with trio.fail_after(self.config.timeout):
                await write_delimited_msg(stream, msg)
                resp = await read_delimited_msg(stream, HopMessage)
        except trio.TooSlowError:
            await reset_quietly(stream)
            raise RelayError(f"relay {relay} did not answer within {self.config.timeout:g} s") from None
        except Exception as e:
            await reset_quietly(stream)
            raise RelayError(f"relay {relay}: {type(e).__name__}: {e}") from None
        if resp.type != HopMessage.STATUS:
            await reset_quietly(stream)
            raise RelayError(f"relay {relay} answered with message type {resp.type}, not STATUS")
        if msg.type == HopMessage.RESERVE:
            await close_quietly(stream)
        elif resp.status != StatusCode.OK:
            await reset_quietly(stream)
        return resp, stream

    async def connect(self, circuit_addr: str, timeout: float | None = None) -> str:
        """Connect to the peer at `circuit_addr` through its relay; returns its peer id.

        A no-op if we are already connected to it. Raises `ConnectError` (`CircuitRefused` when the
        relay says no, e.g. NO_RESERVATION)."""
        relay_addr, target = split_circuit_addr(circuit_addr)
        if target == self.host.peer_id:
            return target
        lock = self._connect_locks.setdefault(target, trio.Lock())
        deadline = timeout or self.config.timeout * 2
        try:
            with trio.fail_after(deadline):
                async with lock:
                    if self.host.is_connected(target):
                        return target
                    relay = await self.host.connect(relay_addr)
                    msg = HopMessage(type=HopMessage.CONNECT, peer=CircuitPeerId(id=parse_peer_id(target).to_bytes()))
                    try:
                        resp, stream = await self._hop_exchange(relay, msg)
                    except RelayError as e:
                        raise ConnectError(f"could not connect to {circuit_addr}: {e}") from None
                    if resp.status != StatusCode.OK:
                        raise CircuitRefused(target, _status_name(resp.status))
                    raw = RawConnection(
                        stream=stream,
                        initiator=True,
                        connection_type=ConnectionType.RELAYED,
                        addresses=[multiaddr.Multiaddr(f"/p2p/{relay}/p2p-circuit/p2p/{target}")],
                    )
                    try:
                        await self.host.libp2p.upgrade_outbound_connection(raw, parse_peer_id(target))
                    except Exception as e:
                        await reset_quietly(stream)
                        raise ConnectError(f"relayed connection to {target} failed its handshake: {e}") from None
        except trio.TooSlowError:
            raise ConnectError(f"could not connect to {circuit_addr} within {deadline:g} s") from None
        finally:
            if not lock.locked() and self._connect_locks.get(target) is lock:
                del self._connect_locks[target]
        log.info(kv("connected through relay", peer=target, relay=relay))
        return target
