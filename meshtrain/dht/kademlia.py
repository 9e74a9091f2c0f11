"""`Dht`: Kademlia routing from py-libp2p, our own signed-record STORE/GET over meshtrain RPC.

The problem. Swarms need a key-value store with no owner: a key's records live on the
`replication` peers whose ids are closest (XOR of SHA-256 hashes) to the key, any peer can find
them in a few round trips, and peers join, crash and lie.

What py-libp2p 0.8.1's kad-dht can and cannot do (read from `libp2p/kad_dht/`, `records/`):
- Validators *can* be plugged in: `NamespacedValidator({"ns": Validator})`, a `Validator` has
  `validate(key, value)` and `select(key, [values]) -> index`, with `strict_validation` to
  refuse unnamespaced keys. But a storing node *cannot merge*: on PUT_VALUE it keeps either the
  existing record or the new one (`select` over the two), so two owners storing subkeys of one
  key would overwrite each other. `get_value` answers from the local store without asking the
  network if it holds the key, keeps one "best" value across replicas (`select`), and pushes it
  back to the others ("entry correction"), again replacing rather than merging. Expiry is the
  storing node's (24 h from receipt, served up to 48 h), not the writer's. Its value store
  accepts up to 50,000 records of up to 1 MiB from anyone unless a strict validator is set.
- So we use kad-dht for its routing table and `find_peer` (`routing.py`: the key space, the
  lookup's bookkeeping, dead and suspect peers). Its value store is closed to everything but one
  namespace: a strict validator that refuses every PUT_VALUE outside `/meshtrain/`, where each
  peer's announcement is also published for other libp2p stacks to read (interop.py,
  `put_interop` / `get_interop`).
- STORE and GET are meshtrain RPCs (`dht/find`, `dht/store`), one protocol file: this one.

Design.
- **Lookup** (`_lookup`): iterative, like Kademlia's FIND_VALUE, driving a `routing.Lookup`.
  Seeds are the routing table's closest usable peers (plus connected peers while the table is
  small). Up to `alpha` `dht/find` queries are in flight; each reply carries the queried peer's
  closest known peers (with addresses) and, for a get, its live records for the key. The lookup
  ends when the `replication` closest peers not known to be dead have all answered, or at
  `lookup_timeout` with what it has. Queries run in the DHT's nursery, not the lookup's, so a
  straggler's query finishes in the background: a crashed peer (py-libp2p needs ~0.7 s to fail
  a dial to a closed port, `rpc_timeout` for a peer that vanished without closing its
  connection) costs a lookup ~0.1 s (`straggler_min..straggler_max`), not its timeout, and is
  still marked dead when its query fails. Every call's outcome goes to `Routing`.
- **Store**: sign, validate locally, look the key up, send the record to the `replication`
  closest peers that answered (ourselves included when we are among them). Each storing node
  validates and merges (`RecordStore`). Returns how many replicas accepted it.
- **Connections**: a query to a peer we are not connected to dials it; that connection is
  one-off (transport/one_off.py): hung up a moment after the lookup or store unless the node's
  policy keeps it (node/presence.py: a peer its plan wants), so lookups do not leave
  connections behind for the bound to close. Those kad's own PUT_VALUE and GET_VALUE open
  (`put_interop`, every 5 minutes) and py-libp2p's routing-table upkeep (a random lookup every
  10 minutes, a ping of up to 5 stale peers every 5) are not: the host cannot tell which of the
  connections opened meanwhile are theirs (counting every one closed a joiner's).
- **Get**: the union (merge) of our local entries and every valid record the lookup saw;
  records that fail validation are dropped and logged with the peer that sent them. Replicas
  among the closest that lacked an entry are repaired in the background (read repair), which
  heals replicas lost to churn without any client read-modify-write.

One DHT serves many swarms. Every node joins one *network* (`NETWORK`, "meshtrain"), whatever
swarm it trains in: a swarm's keys carry its id (`/meshtrain/<swarm>/peers`), and the swarm
index (`/meshtrain/swarms`, `swarm_index.py`) lists the swarms, so any node of any swarm is an
entry point to all of them. Records are signed for the network (`records.py`). A private swarm's
hosts (libp2p swarm key) reach only each other, so their DHT holds only their own records.

Wire (msgpack, through `meshtrain.transport.rpc`):
  dht/find   {"swarm", "target": bytes, "key": str|nil} -> {"peers": [[id, [addr]]], "records": [rec]}
  dht/store  {"swarm", "key", "records": [rec]}          -> {"results": [nil | reason]}
where `rec` is `Record.to_wire()` and "swarm" names the network (the field kept its name from
when each swarm had a DHT of its own). A request for another network gets `wrong-swarm`.

Failures. A peer that fails or lies costs a call at most `lookup_timeout` + `rpc_timeout`:
`get` returns what the reachable, honest replicas hold; `store` raises `DhtError` only if no
replica accepted the record (`InvalidRecord` if every one refused it). A request with a bad
target or key is `malformed`, one with more records than a key may hold `too_many`; a record
a storing node refuses gets its reason in `results`.

Not here: the routing table, which peers are dead or suspect, the lookup's bookkeeping and the
XOR metric (`routing.py`); what records mean (`records.py` validates, `discovery.py` announces
peers). mDNS.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import math
import time
from collections.abc import Iterable, Sequence
from contextlib import AsyncExitStack
from dataclasses import dataclass, field
from typing import Any

import multiaddr
import trio
from libp2p.kad_dht.kad_dht import DHTMode, KadDHT
from libp2p.records.utils import InvalidRecordType
from libp2p.records.validator import NamespacedValidator
from libp2p.tools.anyio_service import background_trio_service

from meshtrain.dht.interop import NAMESPACE as INTEROP_NAMESPACE
from meshtrain.dht.interop import InteropValidator, InvalidInteropRecord, PeerAnnouncement, open_record
from meshtrain.dht.records import (
    DhtError,
    InvalidRecord,
    Record,
    RecordLimits,
    RecordStore,
    Subkey,
    as_state,
    live,
    merge,
    plain_or_dict,
    validate,
)
from meshtrain.dht.routing import (
    KAD_PROTOCOL,
    Lookup,
    LookupResult,
    Routing,
    routing_key,
    xor_distance,
)
from meshtrain.errors import ConfigError
from meshtrain.lifecycle import Service
from meshtrain.log import get_logger, kv
from meshtrain.transport.framing import MalformedMessage
from meshtrain.transport.host import ConnectError, Host, parse_multiaddr, peer_id_of
from meshtrain.transport.identity import parse_peer_id
from meshtrain.transport.rpc import RemoteError, RpcError
from meshtrain.transport.validate import MALFORMED, WRONG_SWARM, require_map

__all__ = [
    "DEFAULT_ALPHA",
    "DEFAULT_BOOTSTRAP_TIMEOUT",
    "DEFAULT_DEAD_PEER_TTL",
    "DEFAULT_LOOKUP_TIMEOUT",
    "DEFAULT_PURGE_INTERVAL",
    "DEFAULT_REPLICATION",
    "DEFAULT_RPC_TIMEOUT",
    "DEFAULT_STRAGGLER_MAX",
    "DEFAULT_STRAGGLER_MIN",
    "FIND_RPC",
    "KAD_PROTOCOL",
    "NETWORK",
    "STORE_RPC",
    "BootstrapError",
    "Dht",
    "DhtConfig",
    "routing_key",
]

log = get_logger(__name__)

FIND_RPC = "dht/find"
STORE_RPC = "dht/store"

DEFAULT_REPLICATION = 5
DEFAULT_ALPHA = 5
DEFAULT_RPC_TIMEOUT = 2.0
DEFAULT_LOOKUP_TIMEOUT = 5.0
DEFAULT_BOOTSTRAP_TIMEOUT = 5.0
DEFAULT_STRAGGLER_MIN = 0.1
DEFAULT_STRAGGLER_MAX = 1.0
DEFAULT_DEAD_PEER_TTL = 30.0
DEFAULT_PURGE_INTERVAL = 30.0
MAX_REPLY_PEERS = 10
MAX_ADDRS_PER_PEER = 8
MAX_TARGET_BYTES = 512
RPC_OVERHEAD = 64 << 10  # room beside the records in a request or reply
NETWORK = "meshtrain"  # the one DHT every swarm's nodes join


class BootstrapError(DhtError):
    """None of the bootstrap addresses could be reached."""


@dataclass(frozen=True)
class DhtConfig:
    """How a node stores, looks up and serves records.

    replication: peers that hold each key (Kademlia's k for storage).
    alpha: queries in flight during one lookup.
    rpc_timeout: deadline of one query or store to one peer.
    lookup_timeout: deadline of a whole lookup; it returns what it found by then.
    bootstrap_timeout: deadline of dialling one bootstrap address.
    straggler_min, straggler_max: bounds of the patience with one query before the lookup also
        asks the next closest peer (4x the lookup's median answer time, within the bounds).
    dead_peer_ttl: how long a peer that failed a query is skipped.
    purge_interval: how often expired records are dropped from the local store.
    read_repair: after a get, push missing entries to the closest replicas that lacked them.
    refresh_after_bootstrap: run kad's routing-table refresh (random lookups per bucket) in
        the background after bootstrapping.
    limits: record validation and storage bounds (`RecordLimits`), the same on every node.
    """

    replication: int = DEFAULT_REPLICATION
    alpha: int = DEFAULT_ALPHA
    rpc_timeout: float = DEFAULT_RPC_TIMEOUT
    lookup_timeout: float = DEFAULT_LOOKUP_TIMEOUT
    bootstrap_timeout: float = DEFAULT_BOOTSTRAP_TIMEOUT
    straggler_min: float = DEFAULT_STRAGGLER_MIN
    straggler_max: float = DEFAULT_STRAGGLER_MAX
    dead_peer_ttl: float = DEFAULT_DEAD_PEER_TTL
    purge_interval: float = DEFAULT_PURGE_INTERVAL
    read_repair: bool = True
    refresh_after_bootstrap: bool = True
    limits: RecordLimits = field(default_factory=RecordLimits)

    def __post_init__(self) -> None:
        if self.replication < 1 or self.alpha < 1:
            raise ConfigError("replication and alpha must be at least 1")
        if min(self.rpc_timeout, self.lookup_timeout, self.bootstrap_timeout) <= 0:
            raise ConfigError("DHT timeouts must be positive")


@functools.lru_cache(maxsize=8192)
def _addr_str(addr: multiaddr.Multiaddr) -> str:
    """`str(multiaddr)`, cached (~90 us each, and a find reply lists up to 80); keyed by the
    address's bytes, which is what a Multiaddr hashes and compares by."""
    return str(addr)


@dataclass
class _FindReply:
    peers: list[tuple[str, list[str]]]
    records: list[Record]


class Dht(Service):
    """A node's part of the DHT. `async with Dht(host) as dht:`.

    host: the running `Host`; the DHT registers `dht/find` and `dht/store` on it and runs
        py-libp2p's KadDHT (server mode) for routing.
    network: records are signed for, and only accepted in, this network (`NETWORK`: the one all
        swarms share; tests give theirs a name of their own).
    config: `DhtConfig`.

    Contract: `store` returns the number of replicas that accepted the record and raises
    `DhtError` if none did; `get` never raises because peers failed or lied — it returns what
    the reachable, honest replicas hold (possibly nothing). Every call is bounded by
    `lookup_timeout` + `rpc_timeout`. Records come back validated and unexpired.
    """

    def __init__(self, host: Host, network: str = NETWORK, config: DhtConfig | None = None) -> None:
        if not network or not isinstance(network, str):
            raise ConfigError("the DHT's network must be a non-empty string")
        self.host = host
        self.network = network
        self.config = config or DhtConfig()
        self.local = RecordStore(network, self.config.limits)
        self.kad = KadDHT(
            host.libp2p,
            DHTMode.SERVER,
            # strict: a PUT_VALUE outside our namespace is refused, inside it must be a peer's
            # own signed announcement (interop.py)
            validator=NamespacedValidator({INTEROP_NAMESPACE: InteropValidator()}, strict_validation=True),
            validator_changed=True,
            strict_validation=True,
        )
        self.routing = Routing(host, self.kad, self.config.rpc_timeout, self.config.dead_peer_ttl)
        self._nursery: trio.Nursery | None = None
        self._repair_limit = trio.CapacityLimiter(8)
        self.stats = {"rejected_from_peers": 0, "repairs": 0}

    @property
    def peer_id(self) -> str:
        return self.host.peer_id

    # -- lifecycle ---------------------------------------------------------------------------

    async def _start(self, stack: AsyncExitStack) -> None:
        await stack.enter_async_context(background_trio_service(self.kad))
        self._nursery = await stack.enter_async_context(trio.open_nursery())
        limits = self.config.limits
        self.host.rpc.serve(FIND_RPC, self._serve_find, max_request=MAX_TARGET_BYTES + 1024)
        self.host.rpc.serve(STORE_RPC, self._serve_store, max_request=limits.max_key_bytes + RPC_OVERHEAD)
        stack.callback(self.host.on_connected(self.routing.on_connected))
        self._nursery.start_soon(self.routing.admit_connected_peers)
        self._nursery.start_soon(self._purge_loop)
        for peer in self.host.connected_peers():
            self.routing.on_connected(peer)

    def _require_open(self) -> trio.Nursery:
        if self._stack is None or self._nursery is None:
            raise DhtError("the DHT is not running (use `async with Dht(...)`)")
        return self._nursery

    # -- public API -------------------------------------------------------------------------

    async def bootstrap(self, addrs: Iterable[str]) -> int:
        """Dial the bootstrap addresses (in parallel; dead ones are skipped and logged), add
        the reachable ones to the routing table and look ourselves up to learn our neighbours.
        Returns how many were reachable; raises `BootstrapError` if addresses were given and
        none was, `ConfigError` for an address without `/p2p/<peer id>`. Our own address in
        the list is ignored, so every node of a swarm can be given the same list."""
        nursery = self._require_open()
        addrs = [a for a in addrs if peer_id_of(a) != self.peer_id]
        reached: list[str] = []

        async def dial(addr: str) -> None:
            try:
                peer = await self.host.connect(addr, timeout=self.config.bootstrap_timeout)
            except ConnectError as e:
                log.warning(kv("bootstrap peer unreachable, skipped", addr=addr, error=e))
                return
            reached.append(peer)
            await self.routing.admit(peer, [parse_multiaddr(addr)], wait_identify=False)

        async with trio.open_nursery() as dials:
            for addr in addrs:
                dials.start_soon(dial, addr)
        if addrs and not reached:
            raise BootstrapError(
                f"none of the {len(addrs)} bootstrap addresses answered; check them, or start "
                "this node without bootstrap peers to found a new swarm"
            )
        await self._lookup(parse_peer_id(self.peer_id).to_bytes(), key=None)
        if self.config.refresh_after_bootstrap:
            nursery.start_soon(self.routing.refresh)
        log.info(kv("dht bootstrapped", reached=len(reached), of=len(addrs), table=self.kad.routing_table.size()))
        return len(reached)

    async def store(self, key: str, value: Any, expiry: float, subkey: Subkey = None) -> int:
        """Sign `value` as ours and store it under `key` (and `subkey`) until `expiry` (unix
        seconds). Returns the number of replicas that accepted it. Raises `InvalidRecord` if the
        record is invalid here, `DhtError` if no replica accepted it."""
        record = Record.create(self.host.identity, self.network, key, value, expiry, subkey)
        return await self.store_record(record)

    async def store_record(self, record: Record) -> int:
        """Store an already signed record (ours or relayed) on the closest replicas."""
        self._require_open()
        validate(record, self.network, now=time.time(), limits=self.config.limits)
        found = await self._lookup(routing_key(record.key), key=None)
        holders = self._closest_with_self(routing_key(record.key), found.closest)
        accepted = 0
        reasons: list[str] = []

        async def store_at(peer: str) -> None:
            nonlocal accepted
            if peer == self.peer_id:
                try:
                    self.local.put(record, time.time())
                    accepted += 1
                except InvalidRecord as e:
                    reasons.append(e.reason)
                return
            results = await self._send_store(peer, record.key, [record])
            if results is None:
                return
            if results[0] is None:
                accepted += 1
            else:
                reasons.append(results[0])

        async with trio.open_nursery() as nursery:
            for peer in holders:
                nursery.start_soon(store_at, peer)
        if accepted == 0:
            if reasons:
                raise InvalidRecord(reasons[0], f"every replica refused the record ({reasons})")
            raise DhtError(f"no replica of {record.key!r} could be reached")
        return accepted

    async def get(self, key: str) -> Any:
        """The key's live, validated value: None if nothing is stored, the value for a plain
        key, `{subkey: value}` for a key with subkeys."""
        return plain_or_dict(await self.get_records(key))

    async def get_records(self, key: str) -> dict[Subkey, Record]:
        """The key's live, validated records by subkey (merged over every replica reached)."""
        nursery = self._require_open()
        found = await self._lookup(routing_key(key), key=key)
        now = time.time()
        state = live(merge(self.local.get(key, now), found.records), now)
        if self.config.read_repair and state:
            holders = self._closest_with_self(routing_key(key), found.closest)
            have_all = {(sk, r.signature) for sk, r in state.items()}
            for peer in holders:
                if peer == self.peer_id:
                    for rec in state.values():
                        self._put_quietly(rec, now)
                    continue
                held = found.seen.get(peer, set())
                missing = [state[sk] for sk, sig in have_all - held]
                if missing:
                    nursery.start_soon(self._repair, peer, key, missing)
        return state

    async def put_interop(self, key: str, value: bytes) -> None:
        """Publish `value` (interop.py `seal`) under `key` with kad's PUT_VALUE to the closest
        peers, for other libp2p stacks to read; bounded by `lookup_timeout` + `rpc_timeout`.
        Raises `DhtError` when it does not validate (kad's own refusal, raised before a send)."""
        self._require_open()
        try:
            with trio.move_on_after(self.config.lookup_timeout + self.config.rpc_timeout):
                await self.kad.put_value(key, value)
        except (InvalidRecordType, ValueError) as e:
            raise DhtError(f"kad refused the record for {key!r}: {e}") from None

    async def get_interop(self, key: str) -> PeerAnnouncement | None:
        """The newest valid announcement under `key` that kad's GET_VALUE finds (ours first);
        None if none is found within `lookup_timeout` + `rpc_timeout`."""
        self._require_open()
        value = None
        with trio.move_on_after(self.config.lookup_timeout + self.config.rpc_timeout):
            value = await self.kad.get_value(key)
        if value is None:
            return None
        try:
            return open_record(key, value)
        except InvalidInteropRecord:
            return None

    async def find_peer(self, peer_id: str) -> list[str]:
        """Addresses of `peer_id` from the peerstore or a kad lookup; [] if unknown."""
        self._require_open()
        with trio.move_on_after(self.config.lookup_timeout):
            info = await self.kad.find_peer(parse_peer_id(peer_id))
            if info is not None:
                return [str(a) for a in info.addrs]
        return []

    def routing_table_peers(self) -> list[str]:
        return sorted(p.to_base58() for p in self.kad.routing_table.get_peer_ids())

    # -- lookup -----------------------------------------------------------------------------

    def _seeds(self, target: bytes) -> list[str]:
        width = max(2 * self.config.replication, 20)
        peers = [p.to_base58() for p in self.kad.routing_table.find_local_closest_peers(target, width)]
        if len(peers) < self.config.replication:
            peers += self.host.connected_peers()
        return [p for p in dict.fromkeys(peers) if self.routing.usable(p)]

    def _closest_with_self(self, target: bytes, answered: Sequence[str]) -> list[str]:
        target_hash = hashlib.sha256(target).digest()
        peers = sorted({*answered, self.peer_id}, key=lambda p: xor_distance(target_hash, p))
        return peers[: self.config.replication]

    async def _lookup(self, target: bytes, key: str | None) -> LookupResult:
        cfg = self.config
        nursery = self._require_open()
        lookup = Lookup(target, self.peer_id, cfg.replication)
        for seed in self._seeds(target):
            lookup.add(seed)
        records: dict[Subkey, Record] = {}
        seen: dict[str, set[tuple[Subkey, bytes]]] = {}
        send, recv = trio.open_memory_channel[tuple[str, _FindReply | None]](math.inf)
        # Queries run in the DHT's nursery, not the lookup's: one still in flight when the
        # lookup ends (a straggler) finishes in the background, so a dead peer is still marked
        # dead after `rpc_timeout` and the next lookup does not wait for it again.
        with recv, trio.move_on_after(cfg.lookup_timeout):
            while True:
                while (
                    lookup.active() < cfg.alpha
                    and len(lookup.in_flight) < 3 * cfg.alpha
                    and (peer := lookup.next_peer()) is not None
                ):
                    lookup.started(peer, trio.current_time())
                    nursery.start_soon(self._query_find, peer, target, key, send)
                patience = lookup.patience(cfg.straggler_min, cfg.straggler_max)
                if not lookup.in_flight or lookup.done(trio.current_time(), patience):
                    break
                wake = lookup.next_straggler_at(patience)
                if lookup.top_answered():  # only the stragglers are left to wait for
                    wake = min(wake, lookup.give_up_at(patience))
                with trio.move_on_at(wake) as wait:
                    peer, reply = await recv.receive()
                if wait.cancelled_caught:
                    lookup.mark_stragglers(trio.current_time(), patience)
                    for p in lookup.stragglers:
                        self.routing.suspect[p] = time.monotonic() + cfg.rpc_timeout
                    continue
                lookup.finished(peer, reply is not None, trio.current_time())
                if reply is None:
                    continue
                for other, addrs in reply.peers:
                    if other != self.peer_id and self.routing.usable(other):
                        self.routing.learn_addrs(other, addrs)
                        lookup.add(other)
                if key is not None:
                    seen[peer] = {(r.subkey, r.signature) for r in reply.records}
                    records = merge(records, as_state(reply.records))
        return LookupResult(lookup.closest_answered(), records, seen)

    async def _query_find(self, peer: str, target: bytes, key: str | None, send: trio.MemorySendChannel) -> None:
        limits = self.config.limits
        reply: _FindReply | None = None
        started = time.monotonic()
        try:
            async with self.host.one_off.use(peer):  # a peer dialled for this is hung up after it
                raw = await self.host.rpc.call(
                    peer,
                    FIND_RPC,
                    {"swarm": self.network, "target": target, "key": key},
                    timeout=self.config.rpc_timeout,
                    max_response=limits.max_key_bytes + RPC_OVERHEAD,
                )
            reply = self._parse_find_reply(peer, key, raw)
        except RemoteError as e:
            log.info(kv("dht find refused", peer=peer, error=e))
        except (RpcError, MalformedMessage) as e:
            log.debug(kv("dht find failed", peer=peer, error=e))
            self.routing.failed(peer, started)
        if reply is not None:
            self.routing.answered(peer)
            self._admit_soon(peer)
        with contextlib.suppress(trio.BrokenResourceError):  # the lookup already ended
            send.send_nowait((peer, reply))

    def _parse_find_reply(self, peer: str, key: str | None, raw: Any) -> _FindReply:
        msg = require_map(raw, "peers", error=MalformedMessage)
        peers_raw, recs_raw = msg["peers"], msg.get("records") or []
        if not isinstance(peers_raw, list) or not isinstance(recs_raw, list):
            raise MalformedMessage("peers and records must be lists")
        peers: list[tuple[str, list[str]]] = []
        for item in peers_raw[:MAX_REPLY_PEERS]:
            parsed = _parse_peer(item)
            if parsed is not None:
                peers.append(parsed)
        records: list[Record] = []
        if key is not None:
            now = time.time()
            for obj in recs_raw[: self.config.limits.max_subkeys]:
                try:
                    rec = Record.from_wire(key, obj)
                    validate(rec, self.network, now=now, limits=self.config.limits)
                except InvalidRecord as e:
                    self.stats["rejected_from_peers"] += 1
                    log.warning(kv("dht peer sent an invalid record", peer=peer, key=key, reason=e.reason))
                    continue
                records.append(rec)
        return _FindReply(peers, records)

    # -- store / repair ---------------------------------------------------------------------

    async def _send_store(self, peer: str, key: str, records: list[Record]) -> list[str | None] | None:
        """`dht/store` to one peer: per-record results (None = accepted), or None if it failed."""
        started = time.monotonic()
        try:
            async with self.host.one_off.use(peer):
                raw = await self.host.rpc.call(
                    peer,
                    STORE_RPC,
                    {"swarm": self.network, "key": key, "records": [r.to_wire() for r in records]},
                    timeout=self.config.rpc_timeout,
                )
            results = require_map(raw, "results", error=MalformedMessage)["results"]
            if not isinstance(results, list) or len(results) != len(records):
                raise MalformedMessage("results must list one entry per record")
        except RemoteError as e:
            log.info(kv("dht store refused", peer=peer, key=key, error=e))
        except (RpcError, MalformedMessage) as e:
            log.debug(kv("dht store failed", peer=peer, key=key, error=e))
            self.routing.failed(peer, started)
        else:
            self.routing.answered(peer)
            return [r if isinstance(r, str) else None for r in results]
        return None

    async def _repair(self, peer: str, key: str, records: list[Record]) -> None:
        async with self._repair_limit:
            results = await self._send_store(peer, key, records)
        if results is not None:
            self.stats["repairs"] += sum(r is None for r in results)

    def _put_quietly(self, record: Record, now: float) -> None:
        try:
            self.local.put(record, now)
        except InvalidRecord as e:
            log.debug(kv("dht local repair refused", key=record.key, reason=e.reason))

    # -- RPC handlers -----------------------------------------------------------------------

    def _check_swarm(self, req: Any, *fields: str) -> dict[str, Any]:
        msg = require_map(req, "swarm", *fields)
        if msg["swarm"] != self.network:
            raise RemoteError(WRONG_SWARM, "this node serves another DHT network")
        return msg

    async def _serve_find(self, peer: str, req: Any) -> dict[str, Any]:
        msg = self._check_swarm(req, "target", "key")
        target, key = msg["target"], msg["key"]
        if not isinstance(target, bytes) or not 0 < len(target) <= MAX_TARGET_BYTES:
            raise RemoteError(MALFORMED, "target must be 1..512 bytes")
        if key is not None and not isinstance(key, str):
            raise RemoteError(MALFORMED, "key must be a string or nil")
        self._admit_soon(peer)
        peerstore = self.host.libp2p.get_peerstore()
        closest = []
        for pid in self.kad.routing_table.find_local_closest_peers(target, MAX_REPLY_PEERS + 2):
            p = pid.to_base58()
            if p in (peer, self.peer_id) or self.routing.is_dead(p):
                continue
            try:
                addrs = [_addr_str(a) for a in peerstore.addrs(pid)[:MAX_ADDRS_PER_PEER]]
            except Exception:  # no addresses known: not worth sending
                continue
            if addrs:
                closest.append([p, addrs])
            if len(closest) >= MAX_REPLY_PEERS:
                break
        records = []
        if key is not None:
            records = [r.to_wire() for r in self.local.get(key, time.time()).values()]
        return {"peers": closest, "records": records}

    async def _serve_store(self, peer: str, req: Any) -> dict[str, Any]:
        msg = self._check_swarm(req, "key", "records")
        key, recs = msg["key"], msg["records"]
        if not isinstance(key, str) or not isinstance(recs, list):
            raise RemoteError(MALFORMED, "key must be a string and records a list")
        if len(recs) > self.config.limits.max_subkeys:
            raise RemoteError("too_many", f"at most {self.config.limits.max_subkeys} records")
        self._admit_soon(peer)
        now = time.time()
        results: list[str | None] = []
        for obj in recs:
            try:
                self.local.put(Record.from_wire(key, obj), now)
                results.append(None)
            except InvalidRecord as e:
                log.info(kv("dht refused a record", peer=peer, key=key[:80], reason=e.reason))
                results.append(e.reason)
        return {"results": results}

    # -- routing table ---------------------------------------------------------------------

    def _admit_soon(self, peer: str) -> None:
        """A peer spoke our DHT protocol: add it to the routing table (in the background)."""
        if self._nursery is not None and not self.kad.routing_table.peer_in_table(parse_peer_id(peer)):
            self._nursery.start_soon(self.routing.admit, peer, None, False)

    async def _purge_loop(self) -> None:
        while True:
            await trio.sleep(self.config.purge_interval)
            dropped = self.local.purge(time.time())
            now = time.monotonic()
            for table in (self.routing.dead, self.routing.suspect):
                for peer in [p for p, t in table.items() if t < now]:
                    del table[peer]
            if dropped:
                log.debug(kv("dht purged expired records", count=dropped))


def _parse_peer(item: Any) -> tuple[str, list[str]] | None:
    """`[peer id, [addr, ...]]` from a find reply; None if the peer id is not one. Addresses
    that are not strings or name another peer are dropped (they would make us dial someone
    else); the rest are parsed only if we need them (`Routing.learn_addrs`)."""
    if not isinstance(item, list) or len(item) != 2:
        return None
    peer, addrs = item
    if not isinstance(peer, str) or not isinstance(addrs, list):
        return None
    try:
        parse_peer_id(peer)
    except Exception:
        return None
    suffix = "/p2p/" + peer
    out = [
        a
        for a in addrs[:MAX_ADDRS_PER_PEER]
        if isinstance(a, str) and a.startswith("/") and ("/p2p/" not in a or a.endswith(suffix))
    ]
    return peer, out
