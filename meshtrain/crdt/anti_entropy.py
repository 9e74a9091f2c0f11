"""Anti-entropy: how a `Replica` repairs what gossip missed, pulling from one connected peer at a time.

The problem. Gossip is best effort: a peer that missed messages (it was partitioned, restarted,
or a gossip message was dropped) must catch up without a leader, and a restarted peer must get
its own earlier entries back before it writes.

Design.
- **Pull (repair path): anti-entropy** every `anti_entropy_interval` (±`anti_entropy_jitter`)
  with one random *currently connected* peer, and at once with every newly connected peer (a
  reconnection is when two peers most likely differ: a healed partition, a restart). The replica
  never dials: it checks the connection before each RPC, because py-libp2p's `new_stream`
  silently re-dials a peer from its address book, so a partition stays a partition until the
  transport reconnects. Two RPCs: `crdt/digest` sends a 16-byte fingerprint per CRDT and gets
  back the digest (owner -> (seq, signature prefix)) of only the CRDTs that differ — one
  small RPC when in sync. For a CRDT of `MIN_BUCKETED` entries or more it also sends the
  fingerprints of owner buckets (crdt/fingerprints.py), and the digest that comes back holds
  only the buckets that differ (a gossip round in flight touches a few owners): at 256 members
  and 2 changed, ~0.6 KB of bucket fingerprints and a ~1.2 KB reply instead of a 17 KB digest.
  Deltas and pulls then cover those buckets alone. `crdt/pull` then pushes what the peer lacks
  and pulls what we lack (`delta_since`) in batches of at most `max_rpc_entries_bytes` (512 KiB;
  RPC frames are capped at 1 MiB), repeating while the peer says `more`. Entries accepted through anti-entropy *are*
  re-gossiped: nobody flooded them on this side of a healed partition, and the first peer to
  pull them spreads them to its whole side in one gossip round instead of many exchanges.
- **Restarts.** A peer that restarts with the same identity but no state would restart its seqs
  at 1 and lose to its own older entries (`base.py`). `recover()` pulls the swarm's state from
  up to `recover_peers` connected peers before the caller writes; if an entry of ours arrives
  later anyway (we started alone and met the swarm afterwards), the `ChangeEvent` carries
  `own_superseded=True` so the writer can write again on top (`SwarmView` does).

Wire (`crdt/digest`, `crdt/pull`; requests at most `MAX_RPC_REQUEST`):
- `crdt/digest` {ns, fp: {crdt name: fingerprint}, fb?: {crdt name: [bucket fingerprint]}} ->
  {d: {crdt name: digest}, b?: {crdt name: [count, [bucket]]}} for the CRDTs whose fingerprints
  differ; a CRDT named in `b` has only those buckets in `d`.
- `crdt/pull` {ns, d: {crdt name: our digest}, p: {crdt name: entries we push}, b?: as above} ->
  {e: {crdt name: entries they lack}, more, rejected}; deltas of a CRDT in `b` cover its buckets.
  Peers that predate `fb`/`b` ignore them and answer with whole digests, as before.

Failures. A peer that does not answer, answers for another swarm, or answers malformed replies
costs one RPC timeout; one that does not serve us is skipped for `RETRY_AFTER` seconds if
another peer is connected. Requests are checked field by field and refused with a
`RemoteError` (`malformed`, `wrong-swarm`, `unavailable`); pushed entries go through the same
`merge_entries` as gossip.

Who owns what. `AntiEntropy` is a part that `Replica` builds and enters (a `Service`: its RPC
handlers and its two tasks, the periodic exchanges and the greeting of new connections). It owns
its bookkeeping of peers — who did not serve us, when each connected (`connected_since`, which
gossip reads) — and `recovered`; it reads the CRDTs, their cached fingerprints and merges into
them only through `FingerprintedCrdts`, which the replica is, and bumps the replica's `ae_*`
counters.

Not here: the entries' merge rules and the gate (`replica.py`), the push path (`gossip.py`),
`Replica.flush` (a gossip publish, then exchanges with a few peers).
"""

from __future__ import annotations

import functools
import math
import random
import time
from collections.abc import Callable, Mapping
from contextlib import AsyncExitStack
from typing import Any, Protocol

import trio

from meshtrain.crdt.base import SignedCrdt
from meshtrain.crdt.entries import (
    Digest,
    MalformedCrdtData,
    SignedEntry,
    digest_from_wire,
    digest_to_wire,
)
from meshtrain.crdt.fingerprints import (
    BucketScope,
    bucket_count,
    parse_bucket_fingerprints,
    parse_bucket_scope,
    restrict,
)
from meshtrain.crdt.gossip import RETRY_AFTER, SPLIT_MARGIN, LocalCrdts, RateLimitedLog, split_batches
from meshtrain.lifecycle import Service
from meshtrain.log import get_logger, kv
from meshtrain.transport.host import Host
from meshtrain.transport.rpc import RemoteError, RpcError, RpcUnavailable
from meshtrain.transport.validate import MALFORMED, UNAVAILABLE, WRONG_SWARM, require_map

log = get_logger(__name__)

RPC_DIGEST = "crdt/digest"
RPC_PULL = "crdt/pull"
MAX_RPC_ENTRIES_BYTES = 512 << 10  # entries per anti-entropy request or reply (RPC cap: 1 MiB)
MAX_RPC_REQUEST = 1 << 20
DEFAULT_RECOVER_TIMEOUT = 5.0


class _NotConnected(RpcError):
    """The chosen anti-entropy partner is no longer connected (we do not dial)."""


def _beats(theirs: tuple[int, bytes], mine: SignedEntry | None) -> bool:
    seq, prefix = theirs
    return mine is None or (seq, prefix) > (mine.seq, mine.signature[: len(prefix)])


class FingerprintedCrdts(LocalCrdts, Protocol):
    """The replica's CRDTs as anti-entropy sees them: `LocalCrdts` and their cached fingerprints
    (`Replica` is one)."""

    def fingerprint(self, name: str) -> bytes: ...

    def bucket_fingerprints(self, name: str, count: int) -> list[bytes]: ...


class AntiEntropySettings(Protocol):
    """The settings anti-entropy reads (`ReplicaConfig` has them)."""

    @property
    def anti_entropy_interval(self) -> float: ...
    @property
    def anti_entropy_jitter(self) -> float: ...
    @property
    def rpc_timeout(self) -> float: ...
    @property
    def max_rpc_entries_bytes(self) -> int: ...
    @property
    def max_pull_rounds(self) -> int: ...
    @property
    def recover_peers(self) -> int: ...


class AntiEntropyCounters(Protocol):
    """The counters anti-entropy bumps (`ReplicaStats` has them)."""

    ae_exchanges: int
    ae_failed: int
    ae_rpcs_sent: int
    ae_rpcs_served: int
    ae_entries_pulled: int
    ae_entries_pushed: int


class AntiEntropy(Service):
    """The repair path of a `Replica`: exchanges with connected peers (client) and serves theirs.

    Parameters:
    - `host`: the running `Host`; its RPC layer carries `crdt/digest` and `crdt/pull` both ways,
      and its connections are the peers we exchange with (it never dials).
    - `namespace`: the swarm id every request names.
    - `local`: the CRDTs it compares, pushes from and merges into (`FingerprintedCrdts`).
    - `settings`, `stats`: the replica's config and counters (`AntiEntropySettings`,
      `AntiEntropyCounters`).
    - `before_tick()`: called before each periodic exchange (the replica opens gossip streams
      gossipsub missed there); must not block.

    Entering serves the RPCs and starts two tasks (the periodic exchanges, greeting new
    connections); leaving stops them, and the RPCs then answer `unavailable`. It also keeps when
    each peer connected while it ran (`connected_since`).
    """

    def __init__(
        self,
        host: Host,
        namespace: str,
        local: FingerprintedCrdts,
        settings: AntiEntropySettings,
        stats: AntiEntropyCounters,
        *,
        before_tick: Callable[[], None],
    ) -> None:
        self.host = host
        self.me = host.peer_id
        self.namespace = namespace
        self.local = local
        self.settings = settings
        self.stats = stats
        self.before_tick = before_tick
        self.recovered = trio.Event()  # set once `recover` completed an exchange
        self._unavailable: dict[str, float] = {}  # peers that do not serve crdt RPCs, and since when
        self._connected_since: dict[str, float] = {}  # peers that connected while we ran
        self._warn = RateLimitedLog()
        self._running = False
        self._nursery: trio.Nursery | None = None

    async def _start(self, stack: AsyncExitStack) -> None:
        self.host.rpc.serve(RPC_DIGEST, self._serve_digest, max_request=MAX_RPC_REQUEST)
        self.host.rpc.serve(RPC_PULL, self._serve_pull, max_request=MAX_RPC_REQUEST)
        self._nursery = await stack.enter_async_context(trio.open_nursery())
        self._nursery.start_soon(self._tick_loop)
        self._nursery.start_soon(self._watch_connections)
        self._running = True

    async def _stop(self) -> None:
        self._running = False

    def connected_since(self, peer: str) -> float | None:
        """When `peer` connected (`time.monotonic()`), if it did while we ran and still is."""
        return self._connected_since.get(peer)

    # --- anti-entropy: client -------------------------------------------------------------------

    def candidate_peers(self) -> list[str]:
        """Connected peers for anti-entropy; those that recently did not serve `crdt/*` for
        our swarm only if there is nobody else. (Not filtered by gossip subscription: a peer
        whose gossip stream failed to come up is exactly one anti-entropy must still reach.)"""
        connected = self.host.connected_peers()
        now = time.monotonic()
        serving = [p for p in connected if now - self._unavailable.get(p, -math.inf) >= RETRY_AFTER]
        return serving or connected

    async def exchange_with(self, peer: str, *, mark_unavailable: bool = True) -> bool:
        """One exchange with `peer`: compare fingerprints, then push and pull what differs.

        Returns True if the exchange completed (the peer answered well-formed replies).
        `mark_unavailable`: if the peer turns out not to serve us, skip it for a while.
        """
        crdts = self.local.crdts
        fps = {name: self.local.fingerprint(name) for name in crdts}
        by_bucket = {}
        for name, crdt in crdts.items():
            count = bucket_count(len(crdt))
            if count:
                by_bucket[name] = self.local.bucket_fingerprints(name, count)
        request: dict[str, Any] = {"ns": self.namespace, "fp": fps}
        if by_bucket:
            request["fb"] = by_bucket
        try:
            reply = await self._call(peer, RPC_DIGEST, request)
            theirs = _parse_digest_reply(reply, crdts)
            scopes = parse_bucket_scope(reply.get("b", {}), crdts)
        except (RpcError, MalformedCrdtData) as e:
            return self._failed(peer, e, mark_unavailable)
        push: dict[str, list[SignedEntry]] = {}
        want: set[str] = set()
        for name, digest in theirs.items():
            crdt = crdts[name]
            scope = scopes.get(name)  # their digest holds only the buckets that differ
            missing = [e for e in crdt.delta_since(digest) if scope is None or scope.covers(e.owner)]
            if missing:
                push[name] = missing
            if any(_beats(v, crdt.entry(owner)) for owner, v in digest.items()):
                want.add(name)
        for _ in range(self.settings.max_pull_rounds):
            if not push and not want:
                break
            chunk, push = _take(push, self.settings.max_rpc_entries_bytes - SPLIT_MARGIN)
            request = {
                "ns": self.namespace,
                "d": {n: digest_to_wire(_scoped(crdts[n].digest(), scopes.get(n))) for n in sorted(want)},
                "p": {n: crdts[n].encode_entries(es) for n, es in chunk.items()},
            }
            if any(n in scopes for n in want):
                request["b"] = {n: scopes[n].to_wire() for n in sorted(want) if n in scopes}
            try:
                reply = await self._call(peer, RPC_PULL, request)
                pulled, more = _parse_pull_reply(reply, crdts, self.settings.max_rpc_entries_bytes + (64 << 10))
            except (RpcError, MalformedCrdtData) as e:
                return self._failed(peer, e, mark_unavailable)
            self.stats.ae_entries_pushed += sum(len(es) for es in chunk.values())
            self.stats.ae_entries_pulled += sum(len(es) for es in pulled.values())
            self.local.merge_batches(pulled.items(), "anti-entropy", peer)
            if not more:
                want = set()
        self.stats.ae_exchanges += 1
        return True

    async def _call(self, peer: str, name: str, request: Any) -> Any:
        # py-libp2p's new_stream dials a peer it has no connection to; check first, so that
        # anti-entropy never re-opens a link that was closed (that would undo a partition).
        if not self.host.is_connected(peer):
            raise _NotConnected(f"{peer} is not connected")
        self.stats.ae_rpcs_sent += 1
        return await self.host.rpc.call(peer, name, request, timeout=self.settings.rpc_timeout)

    def _failed(self, peer: str, error: Exception, mark_unavailable: bool = True) -> bool:
        self.stats.ae_failed += 1
        not_serving = (isinstance(error, RpcUnavailable) and self.host.is_connected(peer)) or (
            isinstance(error, RemoteError) and error.code in (WRONG_SWARM, UNAVAILABLE)
        )
        if mark_unavailable and not_serving:  # prefer other peers for a while
            self._unavailable[peer] = time.monotonic()
            if len(self._unavailable) > 4096:
                self._unavailable.clear()
        if isinstance(error, MalformedCrdtData) or (isinstance(error, RemoteError) and error.code == "malformed"):
            self._warn.warning(f"ae:{peer}", kv("anti-entropy failed", peer=peer, error=error))
        else:
            log.debug(kv("anti-entropy failed", peer=peer, error=error))
        return False

    async def _tick_loop(self) -> None:
        settings = self.settings
        while True:
            jitter = random.uniform(1 - settings.anti_entropy_jitter, 1 + settings.anti_entropy_jitter)
            await trio.sleep(settings.anti_entropy_interval * jitter)
            self.before_tick()
            peers = self.candidate_peers()
            if peers:
                await self.exchange_with(random.choice(peers))

    def _peers_other_than(self, known: set[str]) -> bool:
        return set(self.host.connected_peers()) != known

    async def _watch_connections(self) -> None:
        """Greet every newly connected peer with an anti-entropy exchange right away.

        A (re)connection is when two peers are most likely to differ — a healed partition, a
        restarted or new peer — so waiting for the next random tick would only delay the
        repair. Of the two ends, the one with the smaller peer id starts the exchange (one
        exchange per connection, not two); the other's periodic ticks cover a failure.
        """
        known: set[str] = set(self.host.connected_peers())
        while True:
            await self.host.wait_until(functools.partial(self._peers_other_than, known))
            current = set(self.host.connected_peers())
            new = current - known
            known = current
            now = time.monotonic()
            for peer in new:
                self._connected_since[peer] = now
            for peer in [p for p in self._connected_since if p not in current]:
                del self._connected_since[peer]
            if not new or self._nursery is None:
                continue
            for peer in sorted(new):
                if self.me < peer:
                    self._nursery.start_soon(self._greet, peer)

    async def _greet(self, peer: str) -> None:
        await trio.sleep(0.05)  # the new connection's muxer may still be settling
        await self.exchange_with(peer, mark_unavailable=False)

    async def recover(self, timeout: float = DEFAULT_RECOVER_TIMEOUT) -> bool:
        """Pull the swarm's state — our own earlier entries included — before writing.

        Waits (up to `timeout`) for a connected peer, then runs anti-entropy with up to
        `recover_peers` of them. Returns True (and sets `recovered`) once one exchange completed;
        False if no peer answered in time (e.g. the first peer of a swarm).
        """
        with trio.move_on_after(timeout):
            while True:
                peers = self.candidate_peers()
                random.shuffle(peers)
                ok = False
                for peer in peers[: self.settings.recover_peers]:
                    ok = await self.exchange_with(peer) or ok
                if ok:
                    self.recovered.set()
                    return True
                await trio.sleep(0.1)
        return False

    # --- anti-entropy: server -------------------------------------------------------------------

    def _check_request(self, request: Any, *fields: str) -> dict[str, Any]:
        if not self._running:
            raise RemoteError(UNAVAILABLE, "replica is not running")
        request = require_map(request, "ns", *fields, what="anti-entropy request")
        if request["ns"] != self.namespace:
            raise RemoteError(WRONG_SWARM, f"this peer replicates swarm {self.namespace!r}")
        return request

    async def _serve_digest(self, peer: str, request: Any) -> Any:
        self.stats.ae_rpcs_served += 1
        request = self._check_request(request, "fp")
        crdts = self.local.crdts
        fps = request["fp"]
        if not isinstance(fps, dict) or len(fps) > 4 * len(crdts) + 16:
            raise RemoteError(MALFORMED, "fp must be a small map of CRDT name -> fingerprint")
        try:
            theirs = parse_bucket_fingerprints(request.get("fb", {}), crdts)
        except MalformedCrdtData as e:
            raise RemoteError(MALFORMED, str(e)) from None
        digests: dict[str, Any] = {}
        scopes: dict[str, list[Any]] = {}
        for name, crdt in crdts.items():
            if fps.get(name) == self.local.fingerprint(name):
                continue
            digest = crdt.digest()
            if name in theirs:  # only the buckets whose fingerprints differ
                count = len(theirs[name])
                mine = self.local.bucket_fingerprints(name, count)
                scope = BucketScope(count, frozenset(i for i in range(count) if mine[i] != theirs[name][i]))
                digest = _scoped(digest, scope)
                scopes[name] = scope.to_wire()
            digests[name] = digest_to_wire(digest)
        return {"d": digests, "b": scopes} if scopes else {"d": digests}

    async def _serve_pull(self, peer: str, request: Any) -> Any:
        self.stats.ae_rpcs_served += 1
        request = self._check_request(request, "d", "p")
        crdts = self.local.crdts
        digests, pushed = request["d"], request["p"]
        if not isinstance(digests, dict) or not isinstance(pushed, dict):
            raise RemoteError(MALFORMED, "d and p must be maps keyed by CRDT name")
        try:
            scopes = parse_bucket_scope(request.get("b", {}), crdts)
        except MalformedCrdtData as e:
            raise RemoteError(MALFORMED, str(e)) from None
        limit = self.settings.max_rpc_entries_bytes + (64 << 10)
        decoded: list[tuple[str, list[SignedEntry]]] = []
        for name, data in pushed.items():
            crdt = crdts.get(name) if isinstance(name, str) else None
            if crdt is None or not isinstance(data, bytes):
                raise RemoteError(MALFORMED, f"p: unknown CRDT {name!r:.60} or not bytes")
            try:
                decoded.append((name, crdt.decode_entries(data, max_size=limit)))
            except MalformedCrdtData as e:
                self._warn.warning(f"ae:{peer}", kv("undecodable pushed entries", peer=peer, error=e))
                raise RemoteError(MALFORMED, str(e)) from None
        rejected = self.local.merge_batches(decoded, "anti-entropy", peer)
        wanted: dict[str, list[SignedEntry]] = {}
        for name, wire in digests.items():
            crdt = crdts.get(name) if isinstance(name, str) else None
            if crdt is None:
                continue  # a CRDT we do not keep: nothing to send
            try:
                delta = crdt.delta_since(digest_from_wire(wire))
            except MalformedCrdtData as e:
                raise RemoteError(MALFORMED, f"d[{name!r}]: {e}") from None
            scope = scopes.get(name)  # their digest holds only these buckets: the rest is equal
            if scope is not None:
                delta = [e for e in delta if scope.covers(e.owner)]
            if delta:
                wanted[name] = delta
        chunk, rest = _take(wanted, self.settings.max_rpc_entries_bytes - SPLIT_MARGIN)
        return {
            "e": {n: crdts[n].encode_entries(es) for n, es in chunk.items()},
            "more": bool(rest),
            "rejected": rejected,
        }


def _scoped(digest: Digest, scope: BucketScope | None) -> Digest:
    return digest if scope is None else restrict(digest, scope.buckets, scope.count)


def _take(
    batches: Mapping[str, list[SignedEntry]], budget: int
) -> tuple[dict[str, list[SignedEntry]], dict[str, list[SignedEntry]]]:
    """The first chunk of `split_batches` and everything else."""
    chunks = split_batches(batches, budget)
    if not chunks:
        return {}, {}
    first = chunks[0]
    rest: dict[str, list[SignedEntry]] = {}
    for chunk in chunks[1:]:
        for name, entries in chunk.items():
            rest.setdefault(name, []).extend(entries)
    return first, rest


def _parse_digest_reply(reply: Any, crdts: Mapping[str, SignedCrdt]) -> dict[str, Digest]:
    if not isinstance(reply, dict) or not isinstance(reply.get("d"), dict):
        raise MalformedCrdtData("a digest reply is {'d': {crdt name: digest}}")
    return {
        name: digest_from_wire(wire) for name, wire in reply["d"].items() if isinstance(name, str) and name in crdts
    }


def _parse_pull_reply(
    reply: Any, crdts: Mapping[str, SignedCrdt], max_size: int
) -> tuple[dict[str, list[SignedEntry]], bool]:
    if not isinstance(reply, dict) or not isinstance(reply.get("e"), dict):
        raise MalformedCrdtData("a pull reply is {'e': {crdt name: entries}, 'more': bool}")
    more = reply.get("more", False)
    if not isinstance(more, bool):
        raise MalformedCrdtData("'more' must be a bool")
    out: dict[str, list[SignedEntry]] = {}
    for name, data in reply["e"].items():
        if not isinstance(name, str) or name not in crdts or not isinstance(data, bytes):
            raise MalformedCrdtData(f"pull reply for unknown CRDT {name!r:.60} or not bytes")
        out[name] = crdts[name].decode_entries(data, max_size=max_size)
    return out, more


__all__ = [
    "DEFAULT_RECOVER_TIMEOUT",
    "MAX_RPC_ENTRIES_BYTES",
    "MAX_RPC_REQUEST",
    "RPC_DIGEST",
    "RPC_PULL",
    "AntiEntropy",
    "AntiEntropyCounters",
    "AntiEntropySettings",
    "FingerprintedCrdts",
]
