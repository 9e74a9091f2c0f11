"""The swarm's records: what each peer says about itself in the swarm's CRDTs, and their rules.

Problem. Every peer must hold the same view of the swarm — who is in it, how far each peer is, its
latest numbers, the strikes it raised, the run config — without a leader, and a hostile peer must
be able neither to speak for another nor to make some peers read a record that others reject.

Design. Five CRDTs, kept by a `Replica` (`swarm_specs` lists them, in the order the replica
merges them: config and membership first, as a `keep` gate reads them — swarm_view.py):

- **membership** — one signed record per peer (an `LWWRegister` read per owner: each owner's
  latest entry is its record, and only its key can sign it): heartbeat time, a lease (how long
  the heartbeat vouches for the peer), addresses, role, capabilities, connection type, and a
  `left` flag; `peer_info` reads it as a `PeerInfo`. A peer is *live* while it has not left and
  the reader's own monotonic clock says its latest record was written less than a lease ago
  (`Freshness`, below: no peer's wall clock is trusted for it).
- **progress** — per-peer record {step, samples, outer_round, and `phi`: the digests of the
  outer parameters φ after the peer's last few rounds, `[[round, digest], ...]`} (same per-owner
  register; `PeerProgress`). Every peer of a DiLoCo-family swarm must hold the same φ after the
  same round; the digests let each peer check that continuously (`node/state/parity.py`).
- **metrics** — per-peer record of a few latest numbers (loss, throughput, ...; `PeerMetrics`).
- **strikes** — per-reporter record (same per-owner register, signed by its reporter) of the
  contributions it flagged as an all-reduce part's owner, with the evidence (crdt/strikes.py has
  the format and rules; which strikes count is node policy, node/trust/strikes.py).
- **config** — an `LWWMap` that only the swarm owner's key may write; everyone else's entries are
  rejected on every peer (`CrdtSpec.writers`).

Liveness without wall clocks (`Freshness`). A heartbeat's timestamp comes from its writer's
clock, which may be minutes off ours (a home machine without NTP, a VM after a suspend): judged
by `timestamp + lease` against our clock (as before), a peer more than a lease behind or more
than 30 s ahead was never live for the others, and nothing said why. Instead each reader
dates every owner's latest record on its *own* monotonic clock, when it arrives:
- a record its owner handed us itself (gossip it published, an anti-entropy exchange with it,
  or our own write) is dated now: gossip brings it within a hop or two of its writing, and an
  owner answering an exchange is alive (its record is at most one heartbeat interval old);
- a newer record relayed by someone else (anti-entropy, a re-publish) is dated from the
  previous record we dated, by the difference of the two timestamps — both on the owner's clock,
  so its offset cancels — and never later than its arrival;
- the first record of an owner that reaches us relayed (we just started, recovered the swarm's
  state, or the owner is new) has nothing to be dated from but its timestamp against our wall
  clock: a peer whose clock is far behind looks stale until its next heartbeat reaches us from
  it (one heartbeat interval), one far ahead looks fresh for one lease at most;
- a record we already hold, or an older one, arriving again changes nothing: a heartbeat
  relayed late vouches for at most one lease after the record it replaced, never for ever.
- a pause of the reader's own (SIGSTOP, a suspended VM, a starved loop: `LoopPauses`, noticed
  as a gap in a loop that notes every `PULSE_S`) is left out of every age: no record could reach
  it meanwhile, and judged across the pause every peer would look gone the moment it resumes.
So liveness is a pure function of the arrivals a reader saw and its clock, the same rule on
every peer; two peers agree on who is live up to the time a heartbeat takes to spread, not
exactly (`SwarmView.membership_snapshot`). The same dating says how old a peer's progress is
(`SwarmView.age`: is it training *now*). Each peer's clock offset is measured by the node
(node/clock_offsets.py) and shown, never needed.

Why per-owner records rather than an LWWMap keyed by peer id: in a map anyone may write any key,
so a hostile peer could overwrite another's heartbeat; an owner's entry can only be signed by
that owner.

Wire. A record entry's body is `[timestamp_ms, record]` (the register's timestamp: for membership,
the heartbeat time), the record a msgpack map:

    membership: {"addrs": [str, ...], "role": str, "caps": {..., "in_from": int?, "life": int?}, "conn": str,
                 "lease": int ms, "left": bool}
    progress:   {"step": int, "samples": int, "round": int, "phi": [[round, digest], ...]?}
    metrics:    {name: number, ...}
    strikes:    {"strikes": [strike, ...], "caps": {...}} (crdt/strikes.py)

The roster round (`in_from`, a trainer's membership record). Grouped rounds are a pure function
of the round and the *roster*, the trainers (collective/groups.py); a trainer's record says from
which round id on it is in the roster, the round its grouping counts it from (`PeerInfo.in_from`;
node/roster.py picks it ahead, so that every peer holds the record before that round starts, and
says why). It travels in the capabilities map rather than as a key of its own: a peer that
predates it checks the record's keys exactly and would refuse a record with a new one, so two
versions could not share a swarm; a capability it stores, spreads and ignores. Written only when
it is not 0 (a record without it is in from round 0: a peer that predates it, a founder, any
trainer of an ungrouped swarm), so those records are exactly what they were.

A peer's life (`life`, every membership record of a node). When this life of the peer began, in
ms on its own clock (`PeerInfo.life_ms`): its other records dated before that were written in an
earlier life — both dates are on its clock, so a skewed clock does not matter. A restarted peer's
progress record from its last life reads as fresh for a few heartbeats more (it was rewritten
every heartbeat while it trained); read as "it trains", it made a restart that was still starting
or downloading a trainer beside whom another's round alone was a lineage of its own, and a round's
coordinator wait for it as for one about to join (node/presence.py `training_peers`). In the
capabilities map for the reason above; 0 (absent): not known, every record counts as this life's.

Failures. Record bodies are checked (`check_membership`, `check_progress`, `check_metrics`,
`check_strikes`: the same rules on every peer) before merging, so a malformed record is rejected
everywhere, never half-read: exactly the keys above (metric names are free), labels of at most
`MAX_LABEL_CHARS`, at most `MAX_ADDRS` addresses, `MAX_CAPABILITIES_BYTES` of capabilities,
`MAX_METRICS` metrics and `MAX_PHI_DIGESTS` φ digests (rounds strictly increasing), counts in
0..2**63-1 (a capabilities map's `in_from` and `life` too), a lease in `MIN_LEASE_MS`..`MAX_LEASE_MS`. A bad
record raises `CrdtError`.

Not here: writing, heartbeating and reading the records, admission and the replica's `keep` gate
(swarm_view.py, `SwarmView`); gossip, anti-entropy and merging (`gossip.py`, `anti_entropy.py`,
`replica.py`); what the config keys mean (node).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Any

from meshtrain.crdt.entries import CrdtError, SignedEntry
from meshtrain.crdt.replica import CrdtSpec
from meshtrain.crdt.strikes import check_strikes
from meshtrain.crdt.types import LWWMap, LWWRegister
from meshtrain.transport.framing import packb
from meshtrain.transport.validate import is_int, is_number

MEMBERSHIP = "membership"
PROGRESS = "progress"
METRICS = "metrics"
CONFIG = "config"
STRIKES = "strikes"

MIN_LEASE_MS, MAX_LEASE_MS = 100, 3_600_000
MAX_ADDRS = 16
MAX_ADDR_CHARS = 512
MAX_LABEL_CHARS = 64  # role, connection type, metric names
MAX_CAPABILITIES_BYTES = 4096
MAX_METRICS = 32
MAX_PHI_DIGESTS = 8  # φ digests a progress record carries (the last rounds)
MAX_DIGEST_BYTES = 64
INT64_MAX = (1 << 63) - 1
IN_FROM = "in_from"  # the membership capability that carries the round id a trainer is in the roster from
LIFE = "life"  # the membership capability that carries when this life of the peer began (ms, its clock)


@dataclass(frozen=True)
class PeerInfo:
    """A peer's latest membership record."""

    peer_id: str
    addrs: tuple[str, ...]
    role: str
    capabilities: dict[str, Any]
    connection: str
    last_heartbeat_ms: int  # on the peer's own clock: shown, not compared with ours (`Freshness`)
    lease_ms: int
    left: bool
    seq: int  # the record's entry seq: grows across the peer's restarts
    in_from: int = 0  # the round id from which it is in the roster (module docstring; 0: from the start)
    life_ms: int = 0  # when this life of the peer began, on its clock (module docstring; 0: not known)


@dataclass(frozen=True)
class PeerProgress:
    peer_id: str
    step: int
    samples: int
    outer_round: int
    updated_ms: int  # on the peer's clock (`SwarmView.age` says how old it is on ours)
    phi: tuple[tuple[int, bytes], ...] = ()  # (outer round, φ digest) after the last rounds

    def phi_at(self, outer_round: int) -> bytes | None:
        """The φ digest this peer published for `outer_round`, if it still carries it."""
        return next((d for r, d in self.phi if r == outer_round), None)


@dataclass(frozen=True)
class PeerMetrics:
    peer_id: str
    values: dict[str, float]
    updated_ms: int

    def rate(self, name: str) -> float | None:
        """Metric `name` if it is a rate this peer reported (a finite number above 0), else None."""
        value = self.values.get(name)
        return float(value) if is_number(value) and math.isfinite(value) and value > 0 else None


@dataclass(frozen=True)
class Heard:
    """The latest record of one owner we hold: its seq, its timestamp (the owner's clock, ms) and
    when it was written as our monotonic clock dates it (`Freshness`)."""

    seq: int
    stamp_ms: int
    written_at: float


class Freshness:
    """How old each owner's latest record of one CRDT is, on the reader's monotonic clock
    (module docstring, "Liveness without wall clocks"). A pure state machine: the caller passes
    every accepted entry (`heard`) with the times, and asks `age`.
    """

    def __init__(self) -> None:
        self._heard: dict[str, Heard] = {}

    def heard(self, entry: SignedEntry, *, now: float, wall_now_ms: int, from_owner: bool) -> None:
        """An entry of this CRDT was accepted at our monotonic `now` (`wall_now_ms`: our wall
        clock then); `from_owner`: its owner handed it to us (gossip, an exchange, our write)."""
        held = self._heard.get(entry.owner)
        if held is not None and entry.seq <= held.seq:
            return  # a record we hold (or an older one) relayed again: no news of its owner
        stamp = entry.body[0]
        if from_owner:
            written = now
        elif held is not None:  # both timestamps on the owner's clock: its offset cancels
            written = min(now, max(held.written_at, held.written_at + (stamp - held.stamp_ms) / 1000))
        else:  # first sight, relayed: only our wall clock to date it by; never in the future
            written = now - max(0.0, (wall_now_ms - stamp) / 1000)
        self._heard[entry.owner] = Heard(entry.seq, stamp, written)

    def age(self, owner: str, now: float) -> float | None:
        """Seconds since `owner`'s latest record was written, by our clock (None: none heard)."""
        held = self._heard.get(owner)
        return None if held is None else now - held.written_at

    def pause(self, seconds: float) -> None:
        """Our own process did not run for `seconds` (`LoopPauses`): no record could reach us
        meanwhile, so that time says nothing of anyone — every age leaves it out."""
        self._heard = {o: replace(h, written_at=h.written_at + seconds) for o, h in self._heard.items()}


PULSE_S = 0.5  # a reader's loop notes that it runs this often (`LoopPauses`) ...
PAUSE_S = 3.0  # ... and a gap longer than this between two notes was a pause of ours


class LoopPauses:
    """The reader's own pauses: a gap in the notes of a loop that notes every `PULSE_S` (a
    SIGSTOP, a suspended VM, a starved or blocked event loop). Records reach us only while we
    run, so ages judged across a pause of ours would declare every peer gone the moment we
    resume, before the records buffered meanwhile are read: a soak's peer, stopped 13 s inside
    a round it coordinated, resumed to find every other trainer's lease run out, formed the
    round as a group of one and committed it alone — a second φ (docs/benchmarks.md, "Chaos
    soak"). `Freshness.pause` then leaves the pause out of every age; a peer that died while
    we were stopped still runs out its lease, from where it stood when we stopped.
    A pure state machine: the caller passes its monotonic clock at every note."""

    def __init__(self) -> None:
        self._last: float | None = None
        self.paused_s = 0.0  # the pauses noticed, in all

    def note(self, now: float) -> float:
        """Our loop runs at `now`: the seconds of a pause that ended since the last note (0: none)."""
        last, self._last = self._last, max(now, self._last or now)
        if last is None or now - last <= PAUSE_S:
            return 0.0
        pause = now - last - PULSE_S
        self.paused_s += pause
        return pause


# --- record rules (the same on every peer: a malformed record is rejected everywhere) ------------


def _record(entry: SignedEntry) -> Any:
    body = entry.body
    if not isinstance(body, list) or len(body) != 2:
        raise CrdtError("a record entry's body is [timestamp, record]")
    if not isinstance(body[1], dict):
        raise CrdtError("a record must be a map")
    return body[1]


def require_label(value: Any, what: str) -> str:
    """`value` if it is a label (role, connection type, metric name); else `CrdtError`."""
    if not isinstance(value, str) or len(value) > MAX_LABEL_CHARS:
        raise CrdtError(f"{what} must be a str of at most {MAX_LABEL_CHARS} characters")
    return value


def require_count(value: Any, what: str) -> int:
    """`value` if it is a count (step, samples, round) in 0..2**63-1; else `CrdtError`."""
    if not is_int(value) or not 0 <= value <= INT64_MAX:
        raise CrdtError(f"{what} must be an int in 0..2**63-1")
    return value


def check_membership(entry: SignedEntry) -> None:
    rec = _record(entry)
    if set(rec) != {"addrs", "role", "caps", "conn", "lease", "left"}:
        raise CrdtError("a membership record has exactly addrs, role, caps, conn, lease, left")
    lease = rec["lease"]
    if not is_int(lease):
        raise CrdtError("lease must be an int (milliseconds)")
    if not MIN_LEASE_MS <= lease <= MAX_LEASE_MS:
        raise CrdtError(f"lease must be in {MIN_LEASE_MS}..{MAX_LEASE_MS} ms")
    addrs = rec["addrs"]
    if not isinstance(addrs, list) or len(addrs) > MAX_ADDRS:
        raise CrdtError(f"addrs must be a list of at most {MAX_ADDRS}")
    for a in addrs:
        if not isinstance(a, str) or len(a) > MAX_ADDR_CHARS:
            raise CrdtError(f"an address must be a str of at most {MAX_ADDR_CHARS} characters")
    require_label(rec["role"], "role")
    require_label(rec["conn"], "connection type")
    if not isinstance(rec["caps"], dict) or len(packb(rec["caps"])) > MAX_CAPABILITIES_BYTES:
        raise CrdtError(f"caps must be a map of at most {MAX_CAPABILITIES_BYTES} encoded bytes")
    for key in (IN_FROM, LIFE):
        if key in rec["caps"]:
            require_count(rec["caps"][key], key)
    if not isinstance(rec["left"], bool):
        raise CrdtError("left must be a bool")


def check_progress(entry: SignedEntry) -> None:
    rec = _record(entry)
    if not {"step", "samples", "round"} <= set(rec) <= {"step", "samples", "round", "phi"}:
        raise CrdtError("a progress record has step, samples, round and optionally phi")
    for key in ("step", "samples", "round"):
        require_count(rec[key], key)
    phi_digests(rec.get("phi", []))


def phi_digests(value: Any) -> tuple[tuple[int, bytes], ...]:
    """`[[round, digest], ...]`, at most MAX_PHI_DIGESTS, rounds strictly increasing."""
    if not isinstance(value, list | tuple) or len(value) > MAX_PHI_DIGESTS:
        raise CrdtError(f"phi must be a list of at most {MAX_PHI_DIGESTS} [round, digest] pairs")
    out: list[tuple[int, bytes]] = []
    for pair in value:
        if not isinstance(pair, list | tuple) or len(pair) != 2:
            raise CrdtError("a phi entry is [round, digest]")
        rnd = require_count(pair[0], "phi round")
        digest = pair[1]
        if not isinstance(digest, bytes) or not 0 < len(digest) <= MAX_DIGEST_BYTES:
            raise CrdtError(f"a phi digest is 1..{MAX_DIGEST_BYTES} bytes")
        if out and rnd <= out[-1][0]:
            raise CrdtError("phi rounds must be strictly increasing")
        out.append((rnd, digest))
    return tuple(out)


def check_metrics(entry: SignedEntry) -> None:
    require_metrics(_record(entry))


def require_metrics(rec: Mapping[str, Any]) -> None:
    """A metrics record's rule, for ours as we write it and anyone's as it arrives: at most
    `MAX_METRICS` numbers under label names."""
    if len(rec) > MAX_METRICS:
        raise CrdtError(f"at most {MAX_METRICS} metrics per peer")
    for key, value in rec.items():
        require_label(key, "a metric name")
        if not is_number(value):
            raise CrdtError(f"metric {key!r} must be a number")


def swarm_specs(swarm_owner: str) -> list[CrdtSpec]:
    """The CRDTs a `SwarmView` needs; pass them (plus any of your own) to its `Replica`. In the
    order the replica merges them: config and membership first, as the `keep` gate reads them."""
    return [
        CrdtSpec(CONFIG, LWWMap.type_tag, writers=frozenset({swarm_owner})),
        CrdtSpec(MEMBERSHIP, LWWRegister.type_tag, check=check_membership),
        CrdtSpec(PROGRESS, LWWRegister.type_tag, check=check_progress),
        CrdtSpec(METRICS, LWWRegister.type_tag, check=check_metrics),
        CrdtSpec(STRIKES, LWWRegister.type_tag, check=check_strikes),
    ]


def peer_info(entry: SignedEntry) -> PeerInfo:
    """The `PeerInfo` of a membership entry (one that passed `check_membership`)."""
    ts, rec = entry.body
    caps = dict(rec["caps"])
    return PeerInfo(
        peer_id=entry.owner,
        addrs=tuple(rec["addrs"]),
        role=rec["role"],
        capabilities=caps,
        connection=rec["conn"],
        last_heartbeat_ms=ts,
        lease_ms=rec["lease"],
        left=rec["left"],
        seq=entry.seq,
        in_from=caps.pop(IN_FROM, 0),
        life_ms=caps.pop(LIFE, 0),
    )


def peer_progress(entry: SignedEntry) -> PeerProgress:
    """The `PeerProgress` of a progress entry (one that passed its check)."""
    stamp_ms, body = entry.body
    return PeerProgress(
        entry.owner, body["step"], body["samples"], body["round"], stamp_ms, phi_digests(body.get("phi", []))
    )
