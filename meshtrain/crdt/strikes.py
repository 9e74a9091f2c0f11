"""Strikes: the signed, replicated verdicts of screening, as CRDT records.

Problem. In a public swarm a peer may send a scaled, flipped, random or empty update. The owner of
each all-reduce part sees every contribution to it and flags the ones far outside the group
(collective/data_phase.py); a flag seen by one peer must become a verdict every honest peer can
check and count alike, with no central validator.

Design. Each reporter writes one record (`SwarmView`'s `strikes` CRDT: a per-owner
`LWWRegister`), `{"strikes": [strike, ...], "caps": {...}}`, signed with its own key, so a strike always names
its reporter truthfully. A strike is the evidence of one flag:

    {"round": int, "tag": str, "peer": flagged peer id, "group": [sorted peer ids of the round],
     "digest": the round's committed result digest, "part": the reporter's index in the group,
     "norm": norm / median norm, "align": cosine with the robust aggregate / the median cosine}

A *loss* strike (node/trust/scoring.py) has the same keys plus

    "rule": "loss", "gain": the flagged contribution's relative loss drop on its sender's own
     assigned batches, "ref": the round aggregate's drop on them (both over the loss at φ; how
     many batches is the spec's `score_batches`, not recorded: the re-check does not need it)

and its "norm" / "align" are the contribution's norm over the aggregate's and its cosine with it.
A *spot* strike (node/trust/spot_check.py) has the keys of a screening strike plus

    "rule": "spot", "match": the flagged contribution's cosine with the reporter's recomputation
     of its sender's first inner steps, "ref": the round aggregate's cosine with that recomputation

with "norm" / "align" against the aggregate, as a loss strike's. An *echo* strike (replay
screening: collective/echoes.py) has the keys of a screening strike plus

    "rule": "echo", "echo": the flagged contribution's cosine with a contribution or aggregate of
     the reporter's part in an earlier round, "earlier": that round (below "round")

with "norm" / "align" against the aggregate. A record without "rule" is a screening strike (the
form before loss scoring, still read); "rule" is "screen", "loss", "spot" or "echo"; "gain" is
present exactly when it is "loss", "match" exactly when it is "spot", "ref" with either, and
"echo" and "earlier" exactly when it is "echo".

The record also carries the reporter's membership capabilities (`caps`: its proof of work), so
a peer can check the reporter's admission from the record alone. `check_strikes` holds the
structural rules (the same on every replica, so a malformed record is
rejected everywhere): at most `MAX_STRIKES` strikes (the reporter's latest), a group of 3..
`MAX_STRIKE_GROUP` sorted distinct ids holding both the reporter and the flagged peer (not the
same), the part the reporter's own, finite scores, one strike per (round, peer) (a loss, spot
or screening strike of one round count as one: the peer was flagged there).

Not here: whether a strike counts and when a peer is excluded (node/trust/strikes.py: the reporter
admitted, the scores past the spec's thresholds, the round as we saw it, half the round's others,
`spec.verification.strikes` rounds), and how flags are found (collective/data_phase.py).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from meshtrain.crdt.entries import CrdtError, SignedEntry
from meshtrain.transport.validate import is_int, is_number

# A record must fit one CRDT entry (48 KiB): 16 strikes with groups of 48 peer ids take ~44 KiB.
MAX_STRIKES = 16  # strikes a reporter's record carries
MAX_STRIKE_GROUP = 48  # peer ids in a strike's group (a larger round's owner files no strikes)
MAX_PEER_CHARS = 64
MAX_TAG_CHARS = 64
MAX_DIGEST_BYTES = 64
INT64_MAX = (1 << 63) - 1
# A strike's rule: screening (norm, direction), loss scoring, a replay spot-check, or an echo.
SCREEN, LOSS, SPOT, ECHO = "screen", "loss", "spot", "echo"
STRIKE_KEYS = frozenset({"round", "tag", "peer", "group", "digest", "part", "norm", "align"})
RULE_KEYS = {  # the keys a record of each rule has ("rule" may be left out of a screening strike)
    SCREEN: (STRIKE_KEYS, STRIKE_KEYS | {"rule"}),
    LOSS: (STRIKE_KEYS | {"rule", "gain", "ref"},),
    SPOT: (STRIKE_KEYS | {"rule", "match", "ref"},),
    ECHO: (STRIKE_KEYS | {"rule", "echo", "earlier"},),
}


def _round(value: Any) -> int:
    if not is_int(value) or not 0 <= value <= INT64_MAX:
        raise CrdtError("a strike's round is an int in 0..2**63-1")
    return value


def _tag(value: Any) -> str:
    if not isinstance(value, str) or len(value) > MAX_TAG_CHARS:
        raise CrdtError(f"a strike's tag is a str of at most {MAX_TAG_CHARS} characters")
    return value


@dataclass(frozen=True)
class Strike:
    """A contribution flagged by `reporter`, the owner of part `part` of round (`round_id`, `tag`)
    whose sorted `group` committed `digest`: `peer`'s norm over the median (`norm_ratio`) and its
    `alignment` (collective/contract.py `ContributionFlag`). A loss strike (`rule` LOSS) also
    carries `gain` and `ref`: the contribution's and the aggregate's relative loss drop on the
    flagged peer's assigned batches (node/trust/scoring.py), and its norm and alignment are against the
    aggregate. A spot strike (`rule` SPOT) carries `match` and `ref`: the contribution's and the
    aggregate's cosine with the reporter's recomputation of the peer's update (node/trust/spot_check.py),
    its norm and alignment against the aggregate. An echo strike (`rule` ECHO) carries `echo`,
    the contribution's cosine with the reporter's part of an `earlier` round (a replay,
    collective/echoes.py), its norm and alignment against the aggregate."""

    reporter: str
    round_id: int
    tag: str
    peer: str
    group: tuple[str, ...]
    digest: bytes
    part: int
    norm_ratio: float
    alignment: float
    rule: str = SCREEN
    gain: float = 0.0
    ref: float = 0.0
    match: float = 0.0
    echo: float = 0.0
    earlier: int = 0

    @property
    def round_key(self) -> tuple[int, str]:
        return (self.round_id, self.tag)

    def to_record(self) -> dict[str, Any]:
        rec: dict[str, Any] = {
            "round": self.round_id,
            "tag": self.tag,
            "peer": self.peer,
            "group": list(self.group),
            "digest": self.digest,
            "part": self.part,
            "norm": self.norm_ratio,
            "align": self.alignment,
        }
        if self.rule == LOSS:  # a screening strike keeps the form readers before loss scoring know
            rec.update(rule=LOSS, gain=self.gain, ref=self.ref)
        elif self.rule == SPOT:
            rec.update(rule=SPOT, match=self.match, ref=self.ref)
        elif self.rule == ECHO:
            rec.update(rule=ECHO, echo=self.echo, earlier=self.earlier)
        return rec

    @classmethod
    def from_record(cls, reporter: str, rec: Any) -> Strike:
        """A strike from its record, checked (`CrdtError` for anything malformed)."""
        rule = rec.get("rule", SCREEN) if isinstance(rec, dict) else None
        if not isinstance(rule, str) or rule not in RULE_KEYS or set(rec) not in RULE_KEYS[rule]:
            raise CrdtError(
                "a strike has exactly round, tag, peer, group, digest, part, norm, align "
                "(and rule: screen; loss with gain and ref; spot with match and ref; echo with echo and earlier)"
            )
        group = rec["group"]
        if not isinstance(group, list) or not 3 <= len(group) <= MAX_STRIKE_GROUP:
            raise CrdtError(f"a strike's group is a list of 3..{MAX_STRIKE_GROUP} peer ids")
        if not all(isinstance(p, str) and 0 < len(p) <= MAX_PEER_CHARS for p in group) or group != sorted(set(group)):
            raise CrdtError("a strike's group is sorted, distinct peer ids")
        digest, peer, part = rec["digest"], rec["peer"], rec["part"]
        if not isinstance(digest, bytes) or not 0 < len(digest) <= MAX_DIGEST_BYTES:
            raise CrdtError(f"a strike's digest is 1..{MAX_DIGEST_BYTES} bytes")
        if reporter not in group or peer not in group or peer == reporter:
            raise CrdtError("a strike's reporter and flagged peer are two members of its group")
        if not is_int(part) or part != group.index(reporter):
            raise CrdtError("a strike's part is its reporter's own (its index in the group)")
        for key in ("norm", "align", "gain", "ref", "match", "echo"):
            if key in rec and (not is_number(rec[key]) or not math.isfinite(rec[key])):
                raise CrdtError(f"a strike's {key} score is a finite number")
        round_id = _round(rec["round"])
        if rule == ECHO and not (is_int(rec["earlier"]) and 0 <= rec["earlier"] < round_id):
            raise CrdtError("an echo strike's earlier round is an int below its round")
        return cls(
            reporter,
            round_id,
            _tag(rec["tag"]),
            peer,
            tuple(group),
            digest,
            part,
            float(rec["norm"]),
            float(rec["align"]),
            rule,
            float(rec.get("gain", 0.0)),
            float(rec.get("ref", 0.0)),
            float(rec.get("match", 0.0)),
            float(rec.get("echo", 0.0)),
            int(rec.get("earlier", 0)),
        )


@dataclass(frozen=True)
class StrikeRecord:
    """One reporter's record: its strikes, and the capabilities of its membership record (its
    proof of work: whoever counts the strikes can check the reporter's admission from the record
    alone, after a restart that left no membership behind)."""

    reporter: str
    capabilities: dict[str, Any]
    strikes: tuple[Strike, ...]


def record_of(entry: SignedEntry) -> StrikeRecord:
    """The reporter's record in a strikes entry, checked (`CrdtError` for anything malformed)."""
    rec = entry.body[1] if isinstance(entry.body, list) and len(entry.body) == 2 else None
    if not isinstance(rec, dict) or set(rec) != {"strikes", "caps"}:
        raise CrdtError("a strikes entry's body is [timestamp, {strikes: [...], caps: {...}}]")
    items, caps = rec["strikes"], rec["caps"]
    if not isinstance(items, list) or len(items) > MAX_STRIKES:
        raise CrdtError(f"a strikes record holds at most {MAX_STRIKES} strikes")
    if not isinstance(caps, dict):
        raise CrdtError("a strikes record's caps is a map")
    strikes = tuple(Strike.from_record(entry.owner, item) for item in items)
    if len({(s.round_key, s.peer) for s in strikes}) != len(strikes):
        raise CrdtError("a reporter strikes a peer at most once per round")
    return StrikeRecord(entry.owner, dict(caps), strikes)


def check_strikes(entry: SignedEntry) -> None:
    record_of(entry)
