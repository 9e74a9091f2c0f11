"""The all-reduce's control protocol: its RPCs, refusal codes, deadlines and typed messages.

The participant (allreduce.py, member_round.py) and the coordinator (coordinator.py) talk over
five RPCs; bulk data never goes through them (data_phase.py moves it over tensor streams). Every message is a
frozen dataclass here, with `to_wire()` giving the msgpack map that travels and one `parse` per
message that checks untrusted input and raises `Malformed` (which the RPC layer answers with
the code `malformed`). Nothing outside this file reads a wire map.

Wire (compatible with the first version, so mixed versions of this code interoperate):

    JOIN_RPC   {"key", "expected", "skipped", ["uplink"], ["taper"]}
                                                                -> a JoinReply:
               {"attempt": 0, "group": [...], ["shares": [...]], ["taper"]}
                                                                  Joined: you are in attempt 0
               {"moved": peer}                                    Moved: start again at `peer`
               {"late": true, "passed": bool, "elsewhere": peer, ["regroup": true]}
                                                                  Late: not in this round
    REPORT_RPC {"key", "attempt", "status", "digest", "suspects", "rejected", "evidence"}
                                                                -> the attempt's Outcome
    WATCH_RPC  {"key", "attempt"}                               -> the attempt's Outcome:
               {"commit": digest, "group", "holders", "resync", "unconfirmed", "rejected"}
               {"retry": attempt, "group", "excluded", ["shares"], ["taper"]}
               {"abort": why}
    WHERE_RPC  {"tag", "round"}                                 -> {"round", "coordinator", "finished", ["tag"]}
    WITHDRAW_RPC {"key"}                                        -> {}: our join of `key` no longer stands

Fields in [brackets] were added later and are optional both ways. So was WITHDRAW_RPC (a member
that stopped waiting for its join's reply says so: join_wait.py, coordinator.py "Withdrawn
joins"); a coordinator that predates it refuses the unknown protocol, and the join it holds
stays in its round, as it always did. `regroup` (a Late the
coordinator sends when the round's peers computed its groups differently, coordinator.py "Groups
that disagree") reads as a plain Late to a peer that predates it, which proceeds alone as it
always did; WHERE's `tag` is the tag (with its group suffix) of the round under way in the asked
tag's series (the reply is about the series, whatever group the peer is in). `uplink` (for
bandwidth-weighted parts) is the joiner's link rate in bytes/s, and `shares` (one non-negative
integer per member of `group`, shares.py) size the attempt's parts; without them every part is
equal. A coordinator sends shares only when every member sent an uplink — so every member
understands them — and a peer that ignores them (an old one) is then never in the group. Likewise `taper`
(added to bring the all-reduce to its link bound): in a join, how many shrinking last stripes per
part this peer can cut (flat.py `STRIPE_TAPER`); in a group, how many every member cuts this
attempt — sent only when every member's join offered a taper (the smallest offered), so a group
with an old peer cuts equal stripes, the old layout, and every member cuts alike.

A round key travels as the string `"{round_id}/{tag}/{coordinator}"` (peer ids hold no "/");
`RoundKey` is its parsed form. Refusals are typed RPC errors: `not-a-member` (the sender is not
a candidate of the round in our view of membership), `round-out-of-window` (the round is too
far behind ours: the joiner re-syncs) and `coordinator-behind` (the round is too far ahead of
ours: we are the one left behind — a coordinator stopped while the swarm went on — and the
joiner goes to the next candidate instead, as if we had gone; an older peer reads it as any
refusal and does the same), besides `malformed` and `unknown_attempt`.

Not here: what the coordinator decides (coordinator.py), how a peer takes part (allreduce.py, member_round.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from meshtrain.collective.shares import MAX_SHARE
from meshtrain.transport.validate import (
    Malformed,
    is_int,
    require_bytes,
    require_int,
    require_list,
    require_map,
    require_number,
    require_str,
)

JOIN_RPC, REPORT_RPC, WATCH_RPC = "allreduce/join", "allreduce/report", "allreduce/watch"
WHERE_RPC, WITHDRAW_RPC = "allreduce/where", "allreduce/withdraw"
NOT_A_MEMBER, OUT_OF_WINDOW = "not-a-member", "round-out-of-window"  # typed refusals (RPC codes)
COORDINATOR_BEHIND = "coordinator-behind"  # ... and the one that sends the joiner to the next candidate
UNKNOWN_ATTEMPT = "unknown_attempt"
JOIN_QUIET = 0.5  # after the join deadline, fix the group once no one joined for this long
WAIT_LOG_EVERY = 5.0  # a round still waiting after this long says (again) what it waits for
PROBE_AFTER = 2.0  # a coordinator still missing peers this long asks them where they are ...
PROBE_EVERY = 2.0  # ... and again this often
FAIL_GRACE = 1.0  # after the first failure report, wait this long for the others' accounts
MAX_KEY_CHARS = 1024  # a round key longer than this is refused
MAX_TAG_CHARS = MAX_KEY_CHARS  # ... and a tag in a WHERE reply (read as "unknown")
MAX_PEER_LIST = 4096  # lists of peer ids from a peer are cut to this many
MAX_TAPER = 8  # a stripe taper above this (last stripe 1/256 of a stripe) is malformed
MAX_UPLINK = 1e12  # bytes/s: a joiner's uplink above this (8 Tbit/s) is malformed

DONE, FAIL = "done", "fail"


@dataclass(frozen=True)
class AllReduceConfig:
    join_timeout: float = 30.0  # coordinator waits this long for the expected group to join ...
    hard_join_factor: float = 3.0  # ... or up to this many times longer while only a minority joined
    part_timeout: float = 20.0  # base deadline of each transfer ...
    min_bandwidth: float = 10e6  # ... plus its size at this many bytes/s
    report_timeout: float = 10.0  # after the first success report, wait this long for the rest
    max_attempts: int = 5
    liveness_interval: float = 0.25  # while collecting joins, the coordinator reviews membership this often
    robust: str = "none"  # "none" | "trimmed_mean" | "clipped_mean"
    trim: int = 0  # trimmed_mean: values dropped at each end; 0: a quarter of the contributors (at least 1)
    clip: float = 2.0
    owner_check: float = 10.0  # robust modes: a reduced part this much larger than ours is garbage
    # Screening (robust modes, 3+ contributors; aggregation.py `screen_contributions`): an owner flags a
    # contribution whose norm is over screen_norm x the part's median norm or under its inverse
    # (0: no screening), or whose cosine with the robust aggregate is below screen_alignment x the
    # contributions' median cosine (0: no direction rule).
    screen_norm: float = 0.0
    screen_alignment: float = 0.0
    # Replay screening (robust modes with screening; echoes.py): after a round commits an owner
    # flags a contribution whose cosine with a contribution or aggregate of its part in one of its
    # recent rounds is at least this (0: off).
    screen_echo: float = 0.0
    # Loss scoring (robust modes, contract.py `sampled_peers`): owners keep the contributions of
    # this many sampled peers to their part for the node to score (0: none kept).
    score_samples: int = 0
    round_window: int | None = None  # refuse joins for rounds further than this from ours (None: any)
    member_wait: float = 3.0  # how long a request from a peer not (yet) in membership waits for it
    # Pipelining (data_phase.py): parts move in stripes of at most this many input bytes, with
    # this many transfers in flight per peer and direction, so that the all-gather of a stripe
    # starts as soon as it is reduced and no transfer's handshake round trip idles a link.
    stripe_bytes: int = 2 << 20
    window: int = 2
    # ... and this many of a peer's reduce-scatter transfers in flight in all (to any owners) while
    # its uplink is unknown, so that a slow uplink finishes its stripes in turn and their
    # all-gather starts early; with the uplink known (configured or measured), as many stripes as
    # it sends in `scatter_horizon` seconds, from 2 to 16 (data_phase.py `scatter_slots`).
    scatter_window: int = 4
    scatter_horizon: float = 1.0
    # Bandwidth-weighted parts (shares.py): this peer's uplink in Mbit/s, sent with its joins so
    # the coordinator sizes the parts by the members' rates (0: measured from recent rounds).
    uplink_mbit: float = 0.0

    def __post_init__(self) -> None:
        if self.robust not in ("none", "trimmed_mean", "clipped_mean"):
            raise ValueError("robust must be none, trimmed_mean or clipped_mean")
        if self.screen_norm and self.screen_norm <= 1 or not 0 <= self.screen_alignment <= 1:
            raise ValueError("screen_norm must be 0 (off) or > 1, and screen_alignment in 0..1")
        if not 0 <= self.screen_echo <= 1:
            raise ValueError("screen_echo must be in 0..1 (0: off)")
        if self.trim < 0:
            raise ValueError("trim must be >= 0 (0: a quarter of the contributors)")
        if self.score_samples < 0:
            raise ValueError("score_samples must be >= 0")
        if self.stripe_bytes < 4096 or self.window < 1 or self.scatter_window < 1:
            raise ValueError("stripe_bytes must be >= 4096, window and scatter_window >= 1")
        if not self.scatter_horizon > 0:
            raise ValueError("scatter_horizon must be > 0 seconds")
        if not 0 <= self.uplink_mbit <= MAX_UPLINK * 8 / 1e6:
            raise ValueError("uplink_mbit must be 0 (measured) or a rate in Mbit/s")

    def transfer_deadline(self, numel: int) -> float:
        """The deadline of one transfer of up to `numel` fp32 elements."""
        return self.part_timeout + 4 * numel / self.min_bandwidth

    def round_deadline(self, numel: int) -> float:
        """A safety net over a whole round of `numel` elements: the longest its joins, attempts
        and reports can take by the per-step deadlines, and half a minute more."""
        per_attempt = 2 * self.transfer_deadline(numel) + self.report_timeout + FAIL_GRACE
        return self.join_timeout * self.hard_join_factor + self.max_attempts * per_attempt + 30


# -- the round key ------------------------------------------------------------------------------


@dataclass(frozen=True, order=True)
class RoundKey:
    """One round at one coordinator. `series` (tag, coordinator) without the round id tells a
    stale round from the swarm's current one."""

    round_id: int
    tag: str
    coordinator: str

    @property
    def wire(self) -> str:
        return f"{self.round_id}/{self.tag}/{self.coordinator}"

    @property
    def series(self) -> tuple[str, str]:
        return (self.tag, self.coordinator)

    def __str__(self) -> str:
        return self.wire

    @classmethod
    def parse(cls, value: Any, *, to: str) -> RoundKey:
        """A round key addressed to the coordinator `to` (us, on the serving side)."""
        if not isinstance(value, str) or len(value) > MAX_KEY_CHARS:
            raise Malformed("a round key is a str")
        head, _, rest = value.partition("/")
        tag, _, coordinator = rest.rpartition("/")
        if not head.isdigit() or len(head) > 18 or coordinator != to:
            raise Malformed("a round key is round/tag/coordinator, addressed to us")
        return cls(int(head), tag, coordinator)


# -- requests -----------------------------------------------------------------------------------


@dataclass(frozen=True)
class JoinRequest:
    key: RoundKey
    expected: tuple[str, ...] = ()  # our candidates (informational: the coordinator uses its own view)
    skipped: tuple[str, ...] = ()  # lower ids we gave up on: never hand the round over to them
    uplink: float | None = None  # our link rate, bytes/s (None: unknown, or an old peer)
    taper: int | None = None  # the stripe taper we can cut up to (None: an old peer, none)

    def to_wire(self) -> dict[str, Any]:
        wire: dict[str, Any] = {"key": self.key.wire, "expected": list(self.expected), "skipped": list(self.skipped)}
        if self.uplink is not None:
            wire["uplink"] = self.uplink
        if self.taper is not None:
            wire["taper"] = self.taper
        return wire

    @classmethod
    def parse(cls, value: Any, *, to: str) -> JoinRequest:
        req = require_map(value, "key", what="join")
        key = RoundKey.parse(req["key"], to=to)
        skipped = req.get("skipped", [])
        if not isinstance(skipped, list) or not all(isinstance(p, str) for p in skipped):
            raise Malformed("bad join")
        uplink = req.get("uplink")
        if uplink is not None:
            uplink = float(require_number(uplink, "uplink", 0, MAX_UPLINK))
            if uplink <= 0:
                raise Malformed("uplink must be a positive rate in bytes/s")
        taper = None if req.get("taper") is None else parse_taper(req["taper"])  # None: an old peer
        return cls(key, (), tuple(skipped[:MAX_PEER_LIST]), uplink, taper)


@dataclass(frozen=True)
class Report:
    """A member's account of one attempt: `done` with its result's digest, or `fail` with the
    peers it suspects. `evidence`: it holds proof against them (garbage data, or it accuses
    itself because it is leaving); `rejected`: senders of contributions it threw away."""

    key: RoundKey
    attempt: int
    status: str  # DONE | FAIL
    digest: bytes | None
    suspects: tuple[str, ...] = ()
    rejected: tuple[str, ...] = ()
    evidence: bool = False

    @property
    def failed(self) -> bool:
        return self.status == FAIL

    def to_wire(self) -> dict[str, Any]:
        return {
            "key": self.key.wire,
            "attempt": self.attempt,
            "status": self.status,
            "digest": self.digest,
            "suspects": list(self.suspects),
            "rejected": list(self.rejected),
            "evidence": self.evidence,
        }

    @classmethod
    def parse(cls, value: Any, *, to: str) -> Report:
        req = require_map(
            value, "key", "attempt", "status", "digest", "suspects", "rejected", "evidence", what="report"
        )
        if (
            req["status"] not in (DONE, FAIL)
            or not is_int(req["attempt"])
            or not isinstance(req["suspects"], list)
            or not isinstance(req["rejected"], list)
            or not isinstance(req["evidence"], bool)
            or not (req["digest"] is None or isinstance(req["digest"], bytes))
        ):
            raise Malformed("bad report")
        return cls(
            RoundKey.parse(req["key"], to=to),
            req["attempt"],
            req["status"],
            req["digest"],
            tuple(str(s) for s in req["suspects"][:MAX_PEER_LIST]),
            tuple(str(s) for s in req["rejected"][:MAX_PEER_LIST]),
            req["evidence"],
        )


@dataclass(frozen=True)
class WatchRequest:
    key: RoundKey
    attempt: int

    def to_wire(self) -> dict[str, Any]:
        return {"key": self.key.wire, "attempt": self.attempt}

    @classmethod
    def parse(cls, value: Any, *, to: str) -> WatchRequest:
        req = require_map(value, "key", "attempt", what="watch")
        if not is_int(req["attempt"]):
            raise Malformed("bad watch")
        return cls(RoundKey.parse(req["key"], to=to), req["attempt"])


@dataclass(frozen=True)
class Withdrawal:
    """Our join of round `key` no longer stands: we stopped waiting for its reply."""

    key: RoundKey

    def to_wire(self) -> dict[str, Any]:
        return {"key": self.key.wire}

    @classmethod
    def parse(cls, value: Any, *, to: str) -> Withdrawal:
        return cls(RoundKey.parse(require_map(value, "key", what="withdrawal")["key"], to=to))


@dataclass(frozen=True)
class WhereRequest:
    tag: str
    round_id: int

    def to_wire(self) -> dict[str, Any]:
        return {"tag": self.tag, "round": self.round_id}

    @classmethod
    def parse(cls, value: Any) -> WhereRequest:
        req = require_map(value, "tag", "round", what="where")
        if not isinstance(req["tag"], str) or not is_int(req["round"]):
            raise Malformed("bad where")
        return cls(req["tag"], req["round"])


@dataclass(frozen=True)
class WhereReply:
    """Where a peer is in a tag's series of rounds (the tag without its group suffix): the round
    under way (-1: none), its coordinator and its tag (None: an older peer, which answers for the
    exact tag asked), and the last round it finished (-1: none)."""

    round_id: int
    coordinator: str | None
    finished: int
    tag: str | None = None

    def to_wire(self) -> dict[str, Any]:
        wire: dict[str, Any] = {"round": self.round_id, "coordinator": self.coordinator, "finished": self.finished}
        if self.tag is not None:
            wire["tag"] = self.tag
        return wire

    @classmethod
    def parse(cls, value: Any) -> WhereReply:
        """Lenient, as the prober always was: a field of the wrong type reads as "unknown"."""
        rep = require_map(value, what="where reply")
        at, coordinator, finished, tag = rep.get("round"), rep.get("coordinator"), rep.get("finished"), rep.get("tag")
        return cls(
            at if is_int(at) else -1,
            coordinator if isinstance(coordinator, str) else None,
            finished if is_int(finished) else -1,
            tag if isinstance(tag, str) and len(tag) <= MAX_TAG_CHARS else None,
        )


# -- replies to a join --------------------------------------------------------------------------


@dataclass(frozen=True)
class Joined:
    """We are in the round: its attempt `attempt` runs among `group`, member i owning a part
    sized by `shares[i]` (empty: equal parts), each part's last `taper` stripes shrinking."""

    attempt: int
    group: tuple[str, ...]
    shares: tuple[int, ...] = ()
    taper: int = 0

    def to_wire(self) -> dict[str, Any]:
        return with_layout({"attempt": self.attempt, "group": list(self.group)}, self.shares, self.taper)


@dataclass(frozen=True)
class Moved:
    """The coordinator handed the round over to the lower-id candidate `to`."""

    to: str

    def to_wire(self) -> dict[str, Any]:
        return {"moved": self.to}


@dataclass(frozen=True)
class Late:
    """We are not in this round: the group was fixed without us; `passed`: the others are past
    it; `elsewhere`: they are in it at a coordinator this one cannot reach; `regroup`: the
    round's peers computed its groups differently (their views of the roster differed), so
    compute our group again and join anew (coordinator.py, "Groups that disagree")."""

    passed: bool = False
    elsewhere: str | None = None
    detailed: bool = True  # the first version's plain `{"late": true}` had no detail
    regroup: bool = False

    def to_wire(self) -> dict[str, Any]:
        if not self.detailed:
            return {"late": True}
        wire: dict[str, Any] = {"late": True, "passed": self.passed, "elsewhere": self.elsewhere}
        if self.regroup:
            wire["regroup"] = True
        return wire


JoinReply = Joined | Moved | Late


def with_layout(wire: dict[str, Any], shares: tuple[int, ...], taper: int) -> dict[str, Any]:
    """`wire` with the attempt's layout: `shares` when there are shares, `taper` when there is one
    (equal parts and equal stripes: the old wire form)."""
    if shares:
        wire["shares"] = list(shares)
    if taper:
        wire["taper"] = taper
    return wire


def parse_taper(value: Any) -> int:
    """An attempt's stripe taper from the wire: absent (an old coordinator, or none) is 0."""
    return 0 if value is None else require_int(value, "taper", 0, MAX_TAPER)


def parse_shares(value: Any, members: int) -> tuple[int, ...]:
    """The shares of a group of `members` from the wire: absent (an old coordinator, or equal
    parts) is (); else one integer in 0..MAX_SHARE per member, not all 0."""
    if value is None:
        return ()
    items = require_list(value, "shares", length=members)
    shares = tuple(require_int(s, "share", 0, MAX_SHARE) for s in items)
    if shares and not any(shares):
        raise Malformed("shares must not all be 0")
    return shares


def parse_join_reply(value: Any) -> JoinReply:
    rep = require_map(value, what="join reply")
    if "moved" in rep:
        return Moved(require_str(rep["moved"], "moved"))
    if rep.get("late"):
        elsewhere = rep.get("elsewhere")
        return Late(
            bool(rep.get("passed")),
            elsewhere if isinstance(elsewhere, str) else None,
            regroup=rep.get("regroup") is True,
        )
    attempt = require_int(rep.get("attempt"), "attempt", 0)
    group = tuple(str(p) for p in require_list(rep.get("group"), "group", max_len=MAX_PEER_LIST))
    return Joined(attempt, group, parse_shares(rep.get("shares"), len(group)), parse_taper(rep.get("taper")))


# -- an attempt's outcome -----------------------------------------------------------------------


@dataclass(frozen=True)
class Commit:
    """The attempt succeeded: `digest` is the result; `holders` have it, `resync` must fetch it
    from a holder (their digest differed), `unconfirmed` never reported (they fetch it too);
    `rejected`: members whose contributions someone threw away."""

    digest: bytes
    group: tuple[str, ...]
    holders: tuple[str, ...]
    resync: tuple[str, ...] = ()
    unconfirmed: tuple[str, ...] = ()
    rejected: tuple[str, ...] = ()

    def to_wire(self) -> dict[str, Any]:
        return {
            "commit": self.digest,
            "group": list(self.group),
            "holders": list(self.holders),
            "resync": list(self.resync),
            "unconfirmed": list(self.unconfirmed),
            "rejected": list(self.rejected),
        }


@dataclass(frozen=True)
class Retry:
    """Run attempt `attempt` among `group` (parts sized by `shares`, stripes tapered by `taper`,
    as in `Joined`); `excluded` were dropped from this one."""

    attempt: int
    group: tuple[str, ...]
    excluded: tuple[str, ...] = ()
    shares: tuple[int, ...] = ()
    taper: int = 0

    def to_wire(self) -> dict[str, Any]:
        wire = {"retry": self.attempt, "group": list(self.group), "excluded": list(self.excluded)}
        return with_layout(wire, self.shares, self.taper)


@dataclass(frozen=True)
class Abort:
    why: str

    def to_wire(self) -> dict[str, Any]:
        return {"abort": self.why}


Outcome = Commit | Retry | Abort


def _peers(value: Any, what: str) -> tuple[str, ...]:
    return tuple(str(p) for p in require_list(value, what, max_len=MAX_PEER_LIST))


def parse_outcome(value: Any) -> Outcome:
    rep = require_map(value, what="outcome")
    if "retry" in rep:
        group = _peers(rep.get("group"), "group")
        return Retry(
            require_int(rep["retry"], "retry", 0),
            group,
            _peers(rep.get("excluded", []), "excluded"),
            parse_shares(rep.get("shares"), len(group)),
            parse_taper(rep.get("taper")),
        )
    if "commit" in rep:
        return Commit(
            require_bytes(rep["commit"], "commit", max_len=64),
            _peers(rep.get("group"), "group"),
            _peers(rep.get("holders"), "holders"),
            _peers(rep.get("resync"), "resync"),
            _peers(rep.get("unconfirmed"), "unconfirmed"),
            _peers(rep.get("rejected"), "rejected"),
        )
    return Abort(str(rep.get("abort", "aborted"))[:200])
