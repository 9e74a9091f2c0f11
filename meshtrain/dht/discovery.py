"""Swarm discovery: every node announces itself under `/meshtrain/<swarm>/peers`.

Each node stores one record under that key with subkey = its own peer id (so only it can write
it, and the storing nodes merge everyone's announcements into one dictionary) and value =
`{"addrs", "role", "caps", "version"}`. The record expires after `ttl` seconds and the node
re-announces every `refresh_interval` seconds, so a crashed node disappears within `ttl`
without anyone deleting it, and a node restarted with the same identity overwrites its old
announcement (same subkey, later expiry) instead of appearing twice. A caller may leave a
refresh to others (`refresh_needed`): in a large swarm a newcomer needs a few live announcements,
not every member's, and each refresh costs the key's holders a lookup and a store.

The same announcement is also published, every `INTEROP_REFRESH_S` and whenever our addresses
change, as a standard kad record that go- and js-libp2p peers can read and verify (interop.py).

`peers()` reads the key and returns the live announcements that validate twice: as records
(signature, expiry, owner — `records.py`) and as announcements (shape, sizes, addresses that
name their owner). A malformed one is skipped and logged, never raised.

Not here: dialling the peers found (callers decide whom to connect to), LAN discovery over mDNS
(mdns.py, optional and off by default), leaving gracefully (an announcement
cannot be withdrawn before it expires; a shorter `ttl` makes departures visible sooner).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from contextlib import AsyncExitStack
from dataclasses import dataclass, field
from typing import Any

import trio

import meshtrain
from meshtrain.dht.interop import peer_key, seal
from meshtrain.dht.kademlia import Dht
from meshtrain.dht.records import DhtError, Record
from meshtrain.errors import ConfigError
from meshtrain.lifecycle import Service
from meshtrain.log import get_logger, kv
from meshtrain.transport.host import dialable_addrs, parse_multiaddr, peer_id_of

log = get_logger(__name__)

DEFAULT_TTL = 60.0
DEFAULT_REFRESH_INTERVAL = 20.0
DEFAULT_RETRY_INTERVAL = 2.0
INTEROP_TTL_S = 600.0  # the kad record for other stacks (interop.py) lives this long,
INTEROP_REFRESH_S = 300.0  # is published again this often, and at once when our addresses change
MAX_ANNOUNCED_ADDRS = 16
MAX_ROLE_CHARS = 64
MAX_VERSION_CHARS = 64


def peers_key(swarm_id: str) -> str:
    return f"/meshtrain/{swarm_id}/peers"


@dataclass(frozen=True)
class DiscoveryConfig:
    """What a node announces and how often.

    role: what the node does in the swarm (e.g. "trainer", "relay", "observer").
    capabilities: small msgpack-able map (device, memory, stages it can host, ...).
    ttl: seconds an announcement lives; a dead node vanishes from `peers()` within it.
    refresh_interval: seconds between re-announcements; must be well below `ttl`.
    retry_interval: seconds before retrying a failed announcement.
    """

    role: str = "peer"
    capabilities: dict[str, Any] = field(default_factory=dict)
    ttl: float = DEFAULT_TTL
    refresh_interval: float = DEFAULT_REFRESH_INTERVAL
    retry_interval: float = DEFAULT_RETRY_INTERVAL

    def __post_init__(self) -> None:
        if not 0 < self.refresh_interval < self.ttl:
            raise ConfigError("discovery refresh_interval must be positive and below ttl")
        if self.retry_interval <= 0:
            raise ConfigError("discovery retry_interval must be positive")
        if len(self.role) > MAX_ROLE_CHARS:
            raise ConfigError(f"role must be at most {MAX_ROLE_CHARS} characters")


@dataclass(frozen=True)
class Announcement:
    """One live peer as it announced itself."""

    peer_id: str
    addrs: tuple[str, ...]
    role: str
    capabilities: dict[str, Any]
    version: str
    expiry: float

    @classmethod
    def from_record(cls, record: Record) -> Announcement | None:
        """The announcement in a validated record, or None if it is not a well-formed one."""
        if record.subkey != record.owner:
            return None
        value = record.decoded
        if not isinstance(value, dict):
            return None
        addrs, role, caps, version = (value.get(k) for k in ("addrs", "role", "caps", "version"))
        if not isinstance(addrs, list) or len(addrs) > MAX_ANNOUNCED_ADDRS:
            return None
        if not isinstance(role, str) or len(role) > MAX_ROLE_CHARS:
            return None
        if not isinstance(caps, dict) or not isinstance(version, str) or len(version) > MAX_VERSION_CHARS:
            return None
        good = []
        for a in addrs:
            try:
                if isinstance(a, str) and peer_id_of(parse_multiaddr(a)) == record.owner:
                    good.append(a)
            except Exception:  # not a multiaddr of this owner: drop that address only
                continue
        return cls(record.owner, tuple(good), role, caps, version, record.expiry)


class Discovery(Service):
    """Announces this node and lists the swarm's live peers. `async with Discovery(dht, swarm) as d:`.

    dht: a running `Dht` (one DHT serves every swarm).
    swarm_id: the swarm whose peers' key (`peers_key`) we announce under and read.
    config: `DiscoveryConfig`.
    addrs: the addresses we announce, asked at each announcement (default: the host's own; a node
        behind NAT announces its circuit addresses, which its listen addresses are not —
        transport/nat.py `addrs`). Unspecified IPs (a listen address as bound: 0.0.0.0) are left
        out: they name the reader's machine, never ours (transport/host.py `dialable_addrs`).
    refresh_needed: asked at each due refresh, whether to make it (default: always). A node of a
        large swarm leaves most refreshes to the others (node/presence.py, "Discovery,
        sparingly"): every announcement is a lookup and a store at the key's few holders. The
        first announcement, one after `readdress()` and a retry after a failed one are always
        made; a skipped refresh still publishes the kad record for other stacks when that is due.

    Entering announces once (a failure is logged and retried every `retry_interval`) and starts
    the refresh task; leaving stops it. `readdress()` announces again at once (our addresses
    changed). Bootstrap the DHT first: a node that is still alone announces only to itself until
    its next refresh.
    """

    def __init__(
        self,
        dht: Dht,
        swarm_id: str,
        config: DiscoveryConfig | None = None,
        *,
        addrs: Callable[[], Sequence[str]] | None = None,
        refresh_needed: Callable[[], bool] | None = None,
    ) -> None:
        self.dht = dht
        self.swarm_id = swarm_id
        self.config = config or DiscoveryConfig()
        self.key = peers_key(swarm_id)
        self._addrs = addrs or (lambda: dht.host.addrs)
        self._refresh_needed = refresh_needed or (lambda: True)
        self.skipped = 0  # due refreshes left to others (`refresh_needed`)
        self._readdressed = trio.Event()
        self._interop_sent: tuple[float, tuple[str, ...]] | None = None  # (next due, monotonic; addrs)

    async def _start(self, stack: AsyncExitStack) -> None:
        self._nursery = await stack.enter_async_context(trio.open_nursery())
        ok = await self._announce_logged()
        self._nursery.start_soon(self._refresh_loop, ok)

    def readdress(self) -> None:
        """Our addresses changed: announce them now, not at the next refresh."""
        self._readdressed.set()

    def announcement_value(self) -> dict[str, Any]:
        return {
            "addrs": dialable_addrs(self._addrs(), self.dht.peer_id)[:MAX_ANNOUNCED_ADDRS],
            "role": self.config.role,
            "caps": dict(self.config.capabilities),
            "version": meshtrain.__version__,
        }

    async def announce(self) -> int:
        """Store our announcement now; returns the number of replicas. Raises `DhtError`."""
        expiry = time.time() + self.config.ttl
        value = self.announcement_value()
        replicas = await self.dht.store(self.key, value, expiry, subkey=self.dht.peer_id)
        self._to_other_stacks_when_due(value)
        return replicas

    def _to_other_stacks_when_due(self, value: dict[str, Any]) -> None:
        """Publish `value` for other stacks if it is due (every `INTEROP_REFRESH_S`, and at once
        when our addresses changed), in the background: it does not hold up our own."""
        addrs = tuple(value["addrs"])
        due = self._interop_sent is None or self._interop_sent[1] != addrs or time.monotonic() > self._interop_sent[0]
        if due and self._nursery is not None:
            self._interop_sent = (time.monotonic() + INTEROP_REFRESH_S, addrs)
            self._nursery.start_soon(self.announce_to_other_stacks, value)

    async def announce_to_other_stacks(self, value: dict[str, Any]) -> None:
        """Publish announcement `value` as a standard kad record (interop.py) for go- or
        js-libp2p peers; a failure is logged only (our own peers find us through `announce`)."""
        sealed = seal(
            self.dht.host.identity.libp2p_key_pair.private_key,
            self.swarm_id,
            self.dht.peer_id,
            value["addrs"],
            role=value["role"],
            version=value["version"],
            ttl=INTEROP_TTL_S,
        )
        try:
            await self.dht.put_interop(peer_key(self.swarm_id, self.dht.peer_id), sealed)
        except DhtError as e:
            log.info(kv("kad record for other stacks not stored", error=str(e)))

    async def peers(self) -> list[Announcement]:
        """The swarm's live, validated announcements (ours included), sorted by peer id."""
        out = []
        for record in (await self.dht.get_records(self.key)).values():
            ann = Announcement.from_record(record)
            if ann is None:
                log.warning(kv("malformed peer announcement", owner=record.owner))
                continue
            out.append(ann)
        return sorted(out, key=lambda a: a.peer_id)

    async def _announce_logged(self) -> bool:
        try:
            n = await self.announce()
        except DhtError as e:
            log.info(kv("announcement failed, will retry", error=e))
            return False
        log.debug(kv("announced", key=self.key, replicas=n))
        return True

    async def _refresh_loop(self, ok: bool) -> None:
        while True:
            readdressed = False
            with trio.move_on_after(self.config.refresh_interval if ok else self.config.retry_interval):
                await self._readdressed.wait()
                readdressed = True
            self._readdressed = trio.Event()
            if ok and not readdressed and not self._refresh_needed():
                self.skipped += 1
                self._to_other_stacks_when_due(self.announcement_value())
                continue
            ok = await self._announce_logged()
