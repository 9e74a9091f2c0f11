"""`SwarmView`: the swarm's membership, progress, metrics, strikes and run config, as one typed object.

Problem. A peer needs one object that says who is live, how far everyone is, who flagged whom
and what the run config is, agreed with every other peer, and that keeps its own records fresh
at a rate the swarm's gossip can carry. The swarm's records are CRDTs kept by a `Replica`
(swarm_records.py: their formats, the rules every peer applies, `PeerInfo`, `swarm_specs`); this
view is the service that writes, heartbeats and reads them.

Design. The view writes our own records — a membership heartbeat, progress, metrics, strikes, and
the config if we own the swarm (`set_config` by a non-owner raises `NotSwarmOwner` locally) — and
answers every question about everyone's. A clean `leave()` writes our membership record with
`left=True` and hands it to peers before the process exits, so others drop the peer at once
instead of when its lease runs out.

Admission. A swarm may refuse peers (a public swarm asks for a proof of work, or the owner's
allowlist, node/trust/admission.py): the view takes the rule as a filter (`admit`) and answers every
question about peers — who is live, their progress and metrics — from admitted records only. A
config change wakes `wait_live`, as it may admit a peer.

Whose records are stored at all (`keep`): strangers' identities are free, so with a `keep` rule
the view installs a gate on its replica (record_gate.py, its whole story) that refuses the
membership records that fail it and the member-only records (progress, metrics, strikes) of
owners without a membership record that passes it; `ignored_peers` names the latest refused.

Liveness does not trust wall clocks: the view dates every accepted membership, progress, metrics
and strikes record on our own monotonic clock as it arrives (`Freshness`, swarm_records.py: a
record its owner handed us is dated now; a relayed one is dated from the owner's previous
record on the owner's own clock), and a peer is live while its latest membership record is
younger than its lease and it has not left. A peer whose clock is minutes off is as live as any
other; `age(crdt, peer)` says how old a peer's record is by our clock (the node's "is it training
now"). Peers agree on who is live up to the time a heartbeat takes to spread, not to the
millisecond; a round's candidates already differed by connection (node/presence.py), and its
coordinator protocol settles them (collective/allreduce.py).

Heartbeat rate: every heartbeat is flooded to every peer, so the interval stretches as the swarm
grows (3 s up to 12 peers, 32 s at 256) and the lease with it (heartbeat_rate.py, its whole story).

Progress and metrics are rate-limited (own_reports.py, `OwnReports`, this peer's records and when
they are written): they go out with the next heartbeat, except an outer-round change and the
record a node writes as it starts training (`announce`: a restarted trainer's step, a heartbeat
late, let a group left behind train past it at 100 steps a second), which are written at once —
unless a progress record of ours went out less than `progress_gap()` ago (the interval's stretch
past `heartbeat_interval`: 0 up to 12 peers, 1 s at 16, 7.7 s at 64, 29 s at 256); then it is
written once the gap has passed. Every peer's round ends flood a record to every peer, so
unbounded, a swarm of N peers with rounds of T seconds sends each peer N/T records a second,
growing with N; bounded, each peer writes about one progress record per interval in a large
swarm, and what every peer receives follows the heartbeat rate (log N). The price is freshness
in large swarms with fast rounds: a peer's round and φ digests (node/state/parity.py) lag up to a gap
there, where rounds are grouped and parity is not judged anyway.

Wire: none of its own — the records of swarm_records.py, sent and merged by the replica.

Failures (besides a silent death and a revoked peer, above). A cancelled view stops without
leaving. After a restart, an entry of ours from the previous incarnation may beat what we wrote
since (or arrive before we wrote): we write our records again on top of it, our strikes from this
process joining the old record's.

Not here: the records' formats and checks (swarm_records.py), gossip, anti-entropy and merging
(`gossip.py`, `anti_entropy.py`, `replica.py`), choosing whom to connect to (transport, dht), and
what the config keys mean (node).
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Callable, Iterable, Mapping, Sequence
from contextlib import AsyncExitStack, asynccontextmanager
from typing import Any, cast

import trio

from meshtrain.crdt.entries import CrdtError, NotAWriter, SignedEntry, check_value
from meshtrain.crdt.heartbeat_rate import (
    DEFAULT_HEARTBEAT_INTERVAL,
    DEFAULT_MAX_HEARTBEAT_INTERVAL,
    DEFAULT_SWARM_HEARTBEAT_RATE,
    DEFAULT_TTL,
    heartbeat_interval_for,
    progress_gap_for,
)
from meshtrain.crdt.own_reports import OwnReports
from meshtrain.crdt.record_gate import MEMBER_RECORDS, RecordGate
from meshtrain.crdt.replica import ChangeEvent, CrdtSpec, Replica, ReplicaConfig
from meshtrain.crdt.strikes import MAX_STRIKES, Strike, StrikeRecord, record_of
from meshtrain.crdt.swarm_records import (
    CONFIG,
    IN_FROM,
    LIFE,
    MAX_ADDRS,
    MAX_CAPABILITIES_BYTES,
    MAX_LEASE_MS,
    MAX_PHI_DIGESTS,
    MEMBERSHIP,
    METRICS,
    MIN_LEASE_MS,
    PROGRESS,
    PULSE_S,
    STRIKES,
    Freshness,
    LoopPauses,
    PeerInfo,
    PeerMetrics,
    PeerProgress,
    peer_info,
    peer_progress,
    require_label,
    swarm_specs,
)
from meshtrain.crdt.types import LWWMap, now_ms
from meshtrain.lifecycle import Service
from meshtrain.log import get_logger, kv
from meshtrain.transport.framing import packb
from meshtrain.transport.host import Host

__all__ = [
    "CONFIG",
    "DEFAULT_LEAVE_TIMEOUT",
    "LIVE_RECHECK",
    "MAX_PHI_DIGESTS",
    "MEMBERSHIP",
    "METRICS",
    "NotSwarmOwner",
    "PROGRESS",
    "PeerInfo",
    "PeerMetrics",
    "PeerProgress",
    "STRIKES",
    "SwarmView",
    "open_swarm_view",
    "swarm_specs",
]

log = get_logger(__name__)

LIVE_RECHECK = 0.5  # seconds: wait_live looks again this often without a membership change

DEFAULT_LEAVE_TIMEOUT = 2.0
HAND_OUT_TIMEOUT = 1.0  # `hand_out`: how long a write that must be seen at once may hold its writer


class NotSwarmOwner(NotAWriter):
    """Only the swarm owner's key may change the run config."""


class SwarmView(Service):
    """The swarm as this peer sees it: who is live, how far everyone is, and the run config.

    Parameters:
    - `replica`: a `Replica` built with `swarm_specs(swarm_owner)` (checked on entry).
    - `swarm_owner`: the peer id whose key alone may write the config.
    - `role`, `capabilities`, `connection`: what this peer announces in its membership record
      (`capabilities` is a small msgpack map, e.g. {"gpu": "A100", "vram_gib": 80}); so does the
      attribute `in_from`, the round id from which a trainer is in the roster (0 by default:
      swarm_records.py, "The roster round"), set like `role` and written with the next heartbeat,
      and the attribute `life_ms`, when this life of the peer began (swarm_records.py, "A peer's
      life"; 0 by default: not said), lowered with our clock if the clock is set back before it.
    - `addrs`: addresses to announce (default: the host's).
    - `heartbeat_interval`, `ttl`: the shortest heartbeat interval and the lease at that
      interval (seconds); both stretch as the swarm grows, up to `max_heartbeat_interval`, to
      keep the swarm at about `swarm_heartbeat_rate · max(1, log₁₆ N)` heartbeats per second
      (module docstring, `heartbeat_interval_for`).
    - `recover_timeout`: how long entering the view waits to pull the swarm's state (and our own
      earlier records, after a restart) before the first heartbeat.
    - `admit`: the swarm's admission rule, `(PeerInfo) -> bool` (node/trust/admission.py); a peer it
      refuses is left out of every answer — `peers`, `live_peers`, `wait_live`, `progress`,
      `metrics` — and listed by `ignored_peers`. None admits everyone. May be set later.
    - `keep`: whose records this peer stores at all, `(peer id, capabilities) -> bool` (module
      docstring: membership records that fail it, and progress, metrics and strikes records of
      owners without a membership record that passes it, are refused by the replica's gate). It
      must depend on replicated state only. None (default) stores every valid record.

    Use as `async with SwarmView(replica, owner) as view:`; leaving the block leaves the swarm
    cleanly (`leave()`) unless the peer already left. If the process dies instead, others drop it
    once its lease runs out.
    """

    def __init__(
        self,
        replica: Replica,
        swarm_owner: str,
        *,
        role: str = "trainer",
        capabilities: Mapping[str, Any] | None = None,
        connection: str = "direct",
        addrs: Iterable[str] | None = None,
        heartbeat_interval: float = DEFAULT_HEARTBEAT_INTERVAL,
        ttl: float = DEFAULT_TTL,
        max_heartbeat_interval: float = DEFAULT_MAX_HEARTBEAT_INTERVAL,
        swarm_heartbeat_rate: float = DEFAULT_SWARM_HEARTBEAT_RATE,
        recover_timeout: float = 5.0,
        admit: Callable[[PeerInfo], bool] | None = None,
        keep: Callable[[str, dict[str, Any]], bool] | None = None,
    ) -> None:
        if not 0 < heartbeat_interval < ttl or max_heartbeat_interval < heartbeat_interval:
            raise CrdtError("need 0 < heartbeat_interval < ttl and heartbeat_interval <= max_heartbeat_interval")
        if swarm_heartbeat_rate <= 0:
            raise CrdtError("swarm_heartbeat_rate must be positive")
        longest_lease_ms = ttl * max_heartbeat_interval / heartbeat_interval * 1000
        if ttl * 1000 < MIN_LEASE_MS or longest_lease_ms > MAX_LEASE_MS:
            raise CrdtError(f"leases must stay within {MIN_LEASE_MS}..{MAX_LEASE_MS} ms")
        self.replica = replica
        self.swarm_owner = swarm_owner
        self.me = replica.me
        self.role = require_label(role, "role")
        self.capabilities = dict(capabilities or {})
        check_value(self.capabilities, what="capabilities")
        if len(packb(self.capabilities)) > MAX_CAPABILITIES_BYTES:
            raise CrdtError(f"capabilities must encode to at most {MAX_CAPABILITIES_BYTES} bytes")
        self.connection = require_label(connection, "connection type")
        # The round id from which we are in the roster (swarm_records.py; node/roster.py sets it).
        self.in_from = 0
        # When this life of ours began, ms on our clock (swarm_records.py, "A peer's life"; 0: not said).
        self.life_ms = 0
        self._addrs = list(addrs) if addrs is not None else None
        self.heartbeat_interval = heartbeat_interval
        self.max_heartbeat_interval = max_heartbeat_interval
        self.swarm_heartbeat_rate = swarm_heartbeat_rate
        self.ttl = ttl
        self.recover_timeout = recover_timeout
        self.admit = admit
        self._gate = RecordGate(replica, keep) if keep is not None else None
        self._left = False
        # Ours: progress, metrics and strikes (the strikes record carries our capabilities as they are then).
        self.reports = OwnReports(replica, lambda: self.capabilities, self.progress_gap)
        self._rewrite = trio.Event()  # set when our records must be written again at once
        self._members_changed = trio.Event()  # set (and replaced) on every membership change
        self._check_replica()
        # When each owner's latest record was written, by our monotonic clock (liveness, `age`);
        # records held before we subscribed are dated as first seen, relayed.
        self._fresh = {name: Freshness() for name in (MEMBERSHIP, *sorted(MEMBER_RECORDS))}
        self._pauses = LoopPauses()  # ours: left out of every age (noted while the view runs)
        self.woke_at: float | None = None  # when our last pause ended (monotonic; None: none yet)
        self._pulsing = False
        for name, fresh in self._fresh.items():
            for entry in replica.crdt(name).entries():
                fresh.heard(entry, now=time.monotonic(), wall_now_ms=now_ms(), from_owner=entry.owner == self.me)
        replica.on_change(self._on_change)
        if self._gate is not None:
            self._gate.install()

    @property
    def swarm_id(self) -> str:
        return self.replica.namespace

    @property
    def is_owner(self) -> bool:
        return self.me == self.swarm_owner

    def _check_replica(self) -> None:
        for spec in swarm_specs(self.swarm_owner):
            try:
                have = self.replica.spec(spec.name)
            except CrdtError:
                raise CrdtError(f"the replica lacks CRDT {spec.name!r}: build it with swarm_specs(owner)") from None
            if have.type_tag != spec.type_tag or have.writers != spec.writers:
                raise CrdtError(
                    f"the replica's CRDT {spec.name!r} is not the one swarm_specs("
                    f"{self.swarm_owner!r}) describes (type or writers differ)"
                )

    # --- membership -----------------------------------------------------------------------------

    def heartbeat(self) -> SignedEntry | None:
        """Write our membership record now (and pending progress/metrics). None after `leave`."""
        if self._left:
            return None
        entry = self._write_membership(left=False)
        self.reports.beat()
        return entry

    def current_interval(self) -> float:
        """Seconds between our heartbeats now: longer in a bigger swarm (module docstring)."""
        return heartbeat_interval_for(
            self._live_count(), self.heartbeat_interval, self.swarm_heartbeat_rate, self.max_heartbeat_interval
        )

    def progress_gap(self) -> float:
        """The least seconds between two progress writes of ours (module docstring, "Progress")."""
        return progress_gap_for(
            self._live_count(),
            self.heartbeat_interval,
            swarm_heartbeat_rate=self.swarm_heartbeat_rate,
            max_heartbeat_interval=self.max_heartbeat_interval,
        )

    def _live_count(self) -> int:
        self._note_running()
        at = time.monotonic()
        return sum(1 for p in self.peers() if self._is_live(p, at))

    def _is_live(self, peer: PeerInfo, at: float) -> bool:
        age = self._fresh[MEMBERSHIP].age(peer.peer_id, at)
        return not peer.left and age is not None and age <= peer.lease_ms / 1000

    def age(self, crdt: str, peer_id: str, at: float | None = None) -> float | None:
        """Seconds since `peer_id` wrote its latest record of `crdt` (membership, progress,
        metrics, strikes), by our monotonic clock at `at` (`time.monotonic()`; default: now) —
        never by the peer's wall clock (module docstring, "Liveness"), and never counting a
        pause of our own (`LoopPauses`). None: no record of it."""
        self._note_running()
        return self._fresh[crdt].age(peer_id, time.monotonic() if at is None else at)

    def _note_running(self) -> None:
        """Our loop runs now; a pause of ours that just ended is left out of every age (only while
        the view runs: a view never entered has no loop of its own to pause)."""
        if not self._pulsing:
            return
        now = time.monotonic()
        pause = self._pauses.note(now)
        if pause:
            self.woke_at = now
            for fresh in self._fresh.values():
                fresh.pause(pause)
            log.info(
                kv(
                    "this process was paused; its peers' ages leave the pause out",
                    swarm=self.swarm_id,
                    seconds=round(pause, 1),
                )
            )

    @property
    def announced_addrs(self) -> list[str]:
        """The addresses our record names: those `set_connection` gave (a node behind NAT: its
        circuit addresses), else the host's."""
        return list(self._addrs if self._addrs is not None else self.replica.host.addrs)

    def _write_membership(self, *, left: bool) -> SignedEntry | None:
        lease_ms = round(self.current_interval() * self.ttl / self.heartbeat_interval * 1000)
        ts = now_ms()
        if ts < self.life_ms:  # our clock was set back: our next records must not predate this life
            self.life_ms = ts
        # The roster round and our life ride in the capabilities, and only when set (swarm_records.py).
        extra = {k: v for k, v in ((IN_FROM, self.in_from), (LIFE, self.life_ms)) if v}
        record = {
            "addrs": self.announced_addrs[:MAX_ADDRS],
            "role": self.role,
            "caps": {**self.capabilities, **extra} if extra else self.capabilities,
            "conn": self.connection,
            "lease": lease_ms,
            "left": left,
        }
        return self.replica.write(MEMBERSHIP, lambda c, me: c.set(me, record, timestamp=ts))

    def set_connection(self, connection: str, addrs: Iterable[str] | None = None) -> None:
        """Change what we announce about how we are reached — the connection type (e.g. "public",
        "relayed" once a private peer holds relay reservations) and, if given, the addresses
        (e.g. our circuit addresses) — and write our record at once (not at the next heartbeat)."""
        self.connection = require_label(connection, "connection type")
        if addrs is not None:
            self._addrs = list(addrs)
        self._rewrite.set()

    async def leave(self, timeout: float = DEFAULT_LEAVE_TIMEOUT) -> None:
        """Leave the swarm cleanly: write `left`, stop heartbeating, hand the record to peers."""
        if self._left:
            return
        self._left = self.reports.closed = True
        self._write_membership(left=True)
        with trio.CancelScope(shield=True):
            await self.replica.flush(timeout)
        log.info(kv("left swarm", swarm=self.swarm_id, peer=self.me))

    async def hand_out(self, timeout: float = HAND_OUT_TIMEOUT, peers: int = 2, first: Sequence[str] = ()) -> int:
        """Hand our records to up to `peers` connected peers now (a gossip publish and
        anti-entropy exchanges, side by side; they re-gossip what was new to them), those of
        `first` first — the peers whose view of us matters next —, for a write that must be seen
        before we go on: gossip to a peer connected a moment ago waits for the mesh to graft it,
        near a second on loopback. Returns how many peers confirmed within `timeout`."""
        if self._left:
            return 0
        return await self.replica.flush(timeout, peers, first)

    @property
    def has_left(self) -> bool:
        return self._left

    def peers(self) -> list[PeerInfo]:
        """Every admitted peer with a membership record, live or not, sorted by peer id."""
        admit = self.admit
        records = self._records()
        return records if admit is None else [p for p in records if admit(p)]

    def ignored_peers(self) -> list[PeerInfo]:
        """Peers with a membership record that the admission rule (`admit`) refuses, and the
        latest peers whose record `keep` refused (not stored), sorted by peer id."""
        admit = self.admit
        held = [] if admit is None else [p for p in self._records() if not admit(p)]
        ids = {p.peer_id for p in held}
        refused = [
            p
            for p in (self._gate.refused() if self._gate is not None else [])
            if p.peer_id not in ids and self.replica.crdt(MEMBERSHIP).entry(p.peer_id) is None
        ]
        return sorted([*held, *refused], key=lambda p: p.peer_id)

    def _admitted_ids(self) -> set[str] | None:
        """Ids of the admitted peers, or None when everyone is (no admission rule)."""
        return None if self.admit is None else {p.peer_id for p in self.peers()}

    def records(self) -> list[PeerInfo]:
        """Every membership record, admitted or not (for an admission rule that needs a peer's
        record: `admit` itself must not ask `peers()`)."""
        return self._records()

    def _records(self) -> list[PeerInfo]:
        return [peer_info(entry) for entry in self.replica.crdt(MEMBERSHIP).entries()]

    def live_peers(self, *, at: float | None = None) -> list[PeerInfo]:
        """Peers that have not left and whose latest membership record is younger than its
        lease at `at` (our `time.monotonic()`; default: now), sorted by peer id."""
        self._note_running()  # once per read, before any age: not once per peer
        when = time.monotonic() if at is None else at
        return [p for p in self.peers() if self._is_live(p, when)]

    def is_live(self, peer_id: str, *, at: float | None = None) -> bool:
        return any(p.peer_id == peer_id for p in self.live_peers(at=at))

    async def wait_live(self, peer_id: str, timeout: float) -> bool:
        """Whether `peer_id` has (or within `timeout` seconds gets) a live membership record: a
        peer that just joined may reach us before its record does. Woken by membership changes,
        rechecked every `LIVE_RECHECK` seconds (a lease can start covering "now" on its own)."""
        with trio.move_on_after(timeout):
            while not self.is_live(peer_id):
                changed = self._members_changed
                with trio.move_on_after(LIVE_RECHECK):
                    await changed.wait()
            return True
        return False

    def membership_snapshot(self, *, at: float | None = None) -> list[str]:
        """Sorted ids of the live peers at `at` (our `time.monotonic()`; default: now). Peers
        that heard the same heartbeats agree on it, up to the time a heartbeat takes to spread."""
        return [p.peer_id for p in self.live_peers(at=at)]

    # --- progress and metrics -------------------------------------------------------------------

    @property
    def progress_live(self) -> bool:
        """While True, our progress record is written at every heartbeat even without news: a
        trainer held in a round (waiting for a peer to join) trains all the same, and a joiner
        that reads a stale record as "not training" finds no donor while we wait for it."""
        return self.reports.live

    @progress_live.setter
    def progress_live(self, live: bool) -> None:
        self.reports.live = live

    def report_progress(
        self,
        *,
        step: int | None = None,
        samples: int | None = None,
        outer_round: int | None = None,
        phi: list[tuple[int, bytes]] | None = None,
        announce: bool = False,
    ) -> None:
        """Record our progress; it goes out with the next heartbeat, at once if the outer round
        or the φ digests changed or `announce` says so (we start training: peers must see our
        step now, not a heartbeat later) — or, within `progress_gap()` of our last progress
        write, once that gap has passed (own_reports.py). `phi`: (round, digest) of our last
        rounds, oldest first."""
        self.reports.progress(step=step, samples=samples, outer_round=outer_round, phi=phi, announce=announce)

    def report_metrics(self, values: Mapping[str, float]) -> None:
        """Record our latest metrics (merged into the previous ones); sent with the next heartbeat."""
        self.reports.metrics(values)

    def progress(self) -> dict[str, PeerProgress]:
        """peer id -> its latest progress record (admitted peers only)."""
        admitted = self._admitted_ids()
        return {
            e.owner: peer_progress(e)
            for e in self.replica.crdt(PROGRESS).entries()
            if admitted is None or e.owner in admitted
        }

    def life_of(self, peer_id: str) -> int:
        """When `peer_id`'s life began, ms on its clock, as its latest membership record says (0:
        not said, or no record): a record of it dated before that is from an earlier life."""
        entry = self.replica.crdt(MEMBERSHIP).entry(peer_id)
        return 0 if entry is None else peer_info(entry).life_ms

    def progress_of(self, peer_id: str) -> PeerProgress | None:
        """`peer_id`'s latest progress record if it is admitted (`progress()` for one peer: a
        coordinator asks this for each missing peer at every review, so not O(members) each)."""
        entry = self.replica.crdt(PROGRESS).entry(peer_id)
        if entry is None:
            return None
        if self.admit is not None:
            member = self.replica.crdt(MEMBERSHIP).entry(peer_id)
            if member is None or not self.admit(peer_info(member)):
                return None
        return peer_progress(entry)

    def outer_round(self) -> int | None:
        """The highest outer round any peer has reported (None before any report)."""
        rounds = [p.outer_round for p in self.progress().values()]
        return max(rounds) if rounds else None

    def total_samples(self) -> int:
        return sum(p.samples for p in self.progress().values())

    def metrics(self) -> dict[str, PeerMetrics]:
        """peer id -> its latest metrics (admitted peers only)."""
        admitted = self._admitted_ids()
        return {
            e.owner: PeerMetrics(e.owner, dict(e.body[1]), e.body[0])
            for e in self.replica.crdt(METRICS).entries()
            if admitted is None or e.owner in admitted
        }

    # --- strikes --------------------------------------------------------------------------------

    def report_strikes(self, strikes: Iterable[Strike], *, per_peer: int = MAX_STRIKES) -> None:
        """Add strikes we raised (as a part's owner) to our signed record, written at once. The
        record keeps each peer's latest `per_peer` strikes (node/trust/strikes.py passes a strikes
        window's worth: older ones count toward no exclusion), and the latest `MAX_STRIKES` in all."""
        self.reports.strikes(strikes, per_peer=per_peer)

    def strike_records(self) -> list[StrikeRecord]:
        """Every reporter's record, as replicated (unverified: node/trust/strikes.py decides what counts)."""
        return [record_of(e) for e in self.replica.crdt(STRIKES).entries()]

    # --- config ---------------------------------------------------------------------------------

    def config(self) -> dict[str, Any]:
        """The run config as the swarm owner last wrote it."""
        return cast(LWWMap, self.replica.crdt(CONFIG)).value()

    def config_get(self, key: str, default: Any = None) -> Any:
        """One key of the run config (cheap: no copy of the whole map)."""
        return cast(LWWMap, self.replica.crdt(CONFIG)).get(key, default)

    def set_config(self, values: Mapping[str, Any] | None = None, **more: Any) -> SignedEntry:
        """Set config keys (owner only): `view.set_config(lr=0.7)` or `set_config({"lr": 0.7})`."""
        updates = {**(values or {}), **more}
        if not updates:
            raise CrdtError("set_config needs at least one key")
        self._require_owner()

        def mutate(crdt: Any, me: Any) -> SignedEntry | None:
            entry = None
            for key in sorted(updates):
                entry = crdt.set(me, key, updates[key])
            return entry

        return _written(self.replica.write(CONFIG, mutate))

    def _require_owner(self) -> None:
        if not self.is_owner:
            raise NotSwarmOwner(
                f"peer {self.me} is not the owner of swarm {self.swarm_id!r} ({self.swarm_owner}); "
                "only the owner's key can change the run config"
            )

    # --- lifecycle ------------------------------------------------------------------------------

    def _on_change(self, event: ChangeEvent) -> None:
        fresh = self._fresh.get(event.crdt)
        if fresh is not None:
            now, wall = time.monotonic(), now_ms()
            for entry in event.entries:
                # Handed over by its writer (gossip's publisher, the exchange's partner, us): dated now.
                fresh.heard(entry, now=now, wall_now_ms=wall, from_owner=entry.owner == event.peer)
        if event.crdt in (MEMBERSHIP, CONFIG):  # the config may admit a peer (node/trust/admission.py)
            changed, self._members_changed = self._members_changed, trio.Event()
            changed.set()
        # An entry of ours from a previous incarnation beat what we wrote since restarting (or
        # arrived before we wrote): write our records again on top of it.
        if event.own_superseded and (event.crdt == MEMBERSHIP or self.reports.superseded(event.crdt)):
            self._rewrite.set()

    async def _pulse_loop(self) -> None:
        """Note that our loop runs, every `PULSE_S` (`LoopPauses`: a gap is a pause of ours)."""
        self._pulsing = True
        try:
            while True:
                self._note_running()
                await trio.sleep(PULSE_S)
        finally:
            self._pulsing = False

    async def _heartbeat_loop(self) -> None:
        while not self._left:
            with trio.move_on_after(self.current_interval()):
                await self._rewrite.wait()
            self._rewrite = trio.Event()
            self.heartbeat()

    async def _start(self, stack: AsyncExitStack) -> None:
        await self.replica.recover(self.recover_timeout)
        self.heartbeat()
        self._nursery = self.reports.nursery = await stack.enter_async_context(trio.open_nursery())
        self._nursery.start_soon(self._heartbeat_loop)
        self._nursery.start_soon(self._pulse_loop)

    async def __aexit__(self, *exc: object) -> bool | None:
        """Leave on a clean exit and on an error (`leave` is shielded and bounded by its
        timeout): the others stop waiting for us at once instead of when our lease runs out. A
        cancelled view just stops (its owner is being torn down, or wants a silent peer); a killed
        process leaves no tombstone either — its closed connections tell the others. A daemon
        shutting down on a signal calls `leave()` itself first."""
        try:
            if self._stack is not None and not self._left and not isinstance(exc[1], trio.Cancelled):
                await self.leave()
        except BaseException:
            await super().__aexit__(*exc)
            raise
        return await super().__aexit__(*exc)


def _written(entry: SignedEntry | None) -> SignedEntry:
    if entry is None:  # LWWMap set/delete always write; a None here is a bug, not peer input
        raise CrdtError("config write produced no entry")
    return entry


@asynccontextmanager
async def open_swarm_view(
    host: Host,
    swarm_id: str,
    swarm_owner: str,
    *,
    replica_config: ReplicaConfig | None = None,
    extra_specs: Iterable[CrdtSpec] = (),
    **view_options: Any,
) -> AsyncIterator[SwarmView]:
    """A `Replica` with the swarm's CRDTs (plus `extra_specs`) and a `SwarmView` over it."""
    specs = [*swarm_specs(swarm_owner), *extra_specs]
    async with (
        Replica(host, swarm_id, specs, config=replica_config) as replica,
        SwarmView(replica, swarm_owner, **view_options) as view,
    ):
        yield view
