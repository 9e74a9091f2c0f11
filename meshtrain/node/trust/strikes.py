"""Strikes policy: which screening verdicts count, and which peers they exclude.

Problem. In a robust all-reduce each part's owner flags contributions far outside the group
(collective/data_phase.py: a norm over `spec.aggregation.screen_norm` x the median or under its inverse, a
cosine with the robust aggregate under `spec.aggregation.screen_alignment` x the group's median cosine). One
owner's flag proves nothing to anyone else, and an admitted stranger may file flags against
honest peers. There is no central validator: every honest peer must reach the same verdicts from
replicated state alone.

Design. `StrikeBook` (one per node, held by `PeerPresence`):
- **Filing.** After every committed robust round the collective hands us what we saw as an owner
  (`RoundScreening`, via `SwarmCollective.screening_listeners`): we remember the round's group
  and digest (`ROUND_LOG` rounds), and turn each flag into a signed strike in our record of the
  swarm's `strikes` CRDT (crdt/strikes.py: the evidence is the round, its group and digest, our
  part, the scores; an echo flag, collective/echoes.py, as an echo strike). Loss scoring's
  verdicts on the round's sampled peers arrive later, from a worker thread (node/trust/scoring.py,
  `on_scores`), and are filed the same way, as loss strikes; so are replay spot-checks'
  (node/trust/spot_check.py, `on_spot_checks`), as spot strikes. Those two measure a peer's update on
  *our* φ, so a flagged one is passed over while the peer's published φ digest differs from ours
  at the newest round both published (`other_lineage`): a lineage that parity (node/state/parity.py) is
  repairing, whose honest update would fail them all the same. That repair takes about a round,
  so a peer is passed over in at most `lineage_passes` rounds of a strikes window; past them its
  verdicts are filed (a peer that keeps taking part from another φ, or publishes digests other
  than its own, gains a delay, not a pass).
- **Re-checking.** Every peer checks every strike before counting it: the replica already
  verified the reporter's signature and the record's shape; here, the reporter must be admitted
  by the swarm's rule (its proof of work, carried in its strikes record, or the allowlist:
  `Admission.admits_reporter`), its scores must break the spec's thresholds (a strike without
  evidence counts for nothing; a loss strike's `gain` and `ref` must break `loss_flagged`, and
  the round's digest must have sampled the peer, `sampled_peers`; a spot strike's `match` and
  `ref` must break `spot_flagged`, and the digest must have sampled the peer for spot-checks), and
  if we were in that round ourselves its group and digest must be the ones we saw (a reporter
  cannot invent a group without the peers we saw).
- **Counting.** A round counts against a peer when half the other members of its group (at
  least `MIN_REPORTERS`, 2) struck it there, with the same group and digest (`quorum`): one
  reporter counts once per round, a lone admitted liar cannot strike anyone out, and an honest
  peer whose update one owner found odd by chance (one part poorly aligned) is not struck. A
  scaled, empty or random update is flagged by every honest owner. A peer struck in
  `spec.verification.strikes` distinct rounds within `spec.verification.strikes_window` consecutive rounds of the swarm
  (`excluded_at`; an adversary is struck in every round it takes part in, an honest peer's odd
  update only now and then, and chance strikes spread over a long run never add up) is
  **excluded**:
  `Admission.reason` refuses it, so it is no round candidate, no state donor or donor's client
  and no data-plane peer (`is_member`) on any honest peer, everywhere at once.
- **Persistence.** The strikes CRDT is replicated like membership (a restarted or late peer
  pulls it through anti-entropy), and we also keep it in `strikes.bin` in the data dir, reloaded
  (signatures re-checked by the replica) on start, so verdicts outlive a restart of the whole
  swarm.

Standing. `standing()` gives each flagged peer's counted rounds and whether it is excluded (the
status page, `swarm list`'s advert).

Not here: what it does not catch. Norm and direction screening see norms and directions only:
an update trained on other data, or replayed from an earlier round, points roughly the right way
and passes them. Replay screening (collective/echoes.py: echo strikes, re-checked against
`spec.aggregation.screen_echo`) catches an update that repeats an earlier round's, on every owner at once,
and tells its own limits; loss scoring (node/trust/scoring.py) catches those of the sampled peers
whose update does not lower the loss on their own assigned batches, and its own limits are told
there; replay spot-checks
(node/trust/spot_check.py) catch replayed, lazy and empty updates of sampled peers, and tell their own
limits. A peer that publishes φ digests other than ours delays its loss and spot strikes by
`lineage_passes` rounds (not norm, direction or echo ones; tests/test_adversary_swarm.py's
`replay-phi`). What would close that too is a round that takes only peers holding the same φ (a
digest of the φ each round's update was taken from, in the join, as PCCL checks shared state
before it reduces; with overlap and prepared joins "φ now" differs between honest peers, so it
needs that per-round digest threaded from the optimizer), which the collective does not have
yet. A majority of colluding admitted peers (half of a round's others) can strike
honest peers out. The window bounds chance verdicts,
it does not rule them out: an honest peer whose updates are often odd (dp's single-step gradients
of small batches: flagged in about 1 round in 5, which is why dp swarms screen nothing by
default, node/spec/swarm.py) can still be struck `spec.verification.strikes` times within a window; an
adversary that takes part in only one round in `strikes_window` is never excluded (the robust
rule still bounds what it does in those rounds). An exclusion lasts while the reporters' records
carry its strikes: each keeps its latest `MAX_STRIKES` (crdt/strikes.py), and a strikes window's
worth per peer (`_file`), so a reporter that
later files that many strikes about others drops the evidence, and the peer is admitted again. The flag rule itself:
collective/data_phase.py. The record format: crdt/strikes.py.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import trio

from meshtrain.collective.contract import RoundScreening, sampled_peers, screening_rule
from meshtrain.crdt.entries import CrdtError, decode_entries, encode_entries
from meshtrain.crdt.replica import ChangeEvent
from meshtrain.crdt.strikes import ECHO, LOSS, MAX_STRIKE_GROUP, SPOT, Strike
from meshtrain.crdt.swarm_view import CONFIG, MEMBERSHIP, STRIKES, SwarmView
from meshtrain.crdt.types import LWWRegister
from meshtrain.log import get_logger, kv
from meshtrain.node.spec.swarm import SwarmSpec

log = get_logger(__name__)

MIN_REPORTERS = 2  # a round counts against a peer with at least this many reporters (and half the others)
LINEAGE_PASSES = 3  # rounds per strikes window whose loss/spot verdicts on a peer on another φ are passed over
ROUND_LOG = 512  # rounds whose group and digest we remember (to check strikes about them)
STRIKES_FILE = "strikes.bin"
SAVE_DELAY = 1.0  # seconds: strike changes are written to disk at most this often
MAX_FILE_BYTES = 64 << 20


def quorum(group_size: int) -> int:
    """Reporters that make a round of `group_size` peers count against one of them: half the
    others (rounded up), at least `MIN_REPORTERS`."""
    return max(MIN_REPORTERS, -(-(group_size - 1) // 2))


def loss_flagged(gain: float, ref: float, spec: SwarmSpec) -> bool:
    """Loss scoring's rule (node/trust/scoring.py): an update whose relative loss drop on its own
    assigned batches (`gain`) falls short of `spec.verification.score_ratio` x the round aggregate's drop there
    (`ref`) by more than `spec.verification.score_floor` is suspect. A batch the aggregate did not lower by more
    than `score_floor` tells nothing: the round's updates do not fit it, so neither need the peer's
    (an honest peer's update raised such a batch's loss by 1.8 % where the aggregate raised it by
    0.7 %, and two owners flagged it)."""
    return (
        ref > spec.verification.score_floor
        and gain < spec.verification.score_ratio * ref - spec.verification.score_floor
    )


def spot_flagged(match: float, ref: float, spec: SwarmSpec) -> bool:
    """The replay spot-check's rule (node/trust/spot_check.py): an update whose cosine with the
    recomputation of its sender's first inner steps (`match`) falls below the round aggregate's
    cosine with it (`ref`) by more than `spec.verification.spot_check_margin` is suspect: an honest update
    matches its own batches at least about as well as the swarm's mean does."""
    return match < ref - spec.verification.spot_check_margin


def echo_flagged(echo: float, spec: SwarmSpec) -> bool:
    """Replay screening's rule (collective/echoes.py): a contribution whose cosine with a
    contribution or aggregate of an earlier round (`echo`) is at least `spec.aggregation.screen_echo` repeats
    it: honest updates of different rounds stayed below 0.9987 even at H = 2 (scripts/studies/echo_separation.py)."""
    return spec.aggregation.screen_echo > 0 and echo >= spec.aggregation.screen_echo


def lineage_passes(spec: SwarmSpec) -> int:
    """Distinct rounds within a strikes window in which a peer's flagged loss and spot verdicts are
    passed over because it holds another φ (`StrikeBook.other_lineage`): `LINEAGE_PASSES` (parity
    repairs an honest peer's lineage within about a round; a chaos soak saw three), but never so
    many that the window's other rounds cannot reach `spec.verification.strikes`, so a peer that always holds
    another φ can still be excluded."""
    if not spec.verification.strikes_window:
        return LINEAGE_PASSES
    return max(0, min(LINEAGE_PASSES, spec.verification.strikes_window - spec.verification.strikes))


def window_span(spec: SwarmSpec) -> int | None:
    """The most round ids (inner steps, H apart) that rounds within one strikes window lie apart;
    None without a window."""
    return (spec.verification.strikes_window - 1) * spec.outer.H if spec.verification.strikes_window else None


def excluded_at(rounds: list[int], spec: SwarmSpec) -> int | None:
    """The round at which the rounds counted against a peer (round ids, sorted) exclude it: the
    first whose latest `spec.verification.strikes` counted rounds lie within `spec.verification.strikes_window` consecutive
    rounds of the swarm (round ids are inner steps, H apart). None: they do not (yet)."""
    limit, span = spec.verification.strikes, window_span(spec)
    if not limit or len(rounds) < limit:
        return None
    for i in range(limit - 1, len(rounds)):
        if span is None or rounds[i] - rounds[i - limit + 1] <= span:
            return rounds[i]
    return None


@dataclass(frozen=True)
class LossScore:
    """Loss scoring's measurement of one sampled peer's contribution to our part
    (node/trust/scoring.py): its relative loss drop on the peer's own assigned batches (`gain`), the
    round aggregate's drop on the same batches (`ref`), its norm over the aggregate's
    (`norm_ratio`) and its cosine with the aggregate (`alignment`)."""

    peer: str
    gain: float
    ref: float
    norm_ratio: float
    alignment: float


@dataclass(frozen=True)
class SpotCheck:
    """A replay spot-check of one sampled peer's contribution to our part (node/trust/spot_check.py):
    its cosine with our recomputation of the peer's first inner steps (`match`), the round
    aggregate's cosine with it (`ref`), its norm over the aggregate's (`norm_ratio`) and its
    cosine with the aggregate (`alignment`)."""

    peer: str
    match: float
    ref: float
    norm_ratio: float
    alignment: float


@dataclass(frozen=True)
class Standing:
    """A peer's record: the rounds counted against it, whether that excludes it, and in how many
    of those rounds loss scoring's strikes (node/trust/scoring.py), spot-checks' strikes
    (node/trust/spot_check.py) and replay screening's (collective/echoes.py) were among the counted
    reporters'."""

    peer: str
    rounds: int
    excluded: bool
    by_loss: int = 0
    by_spot: int = 0
    by_echo: int = 0


class StrikeBook:
    """The swarm's verdicts as this peer counts them.

    view: the swarm view (its `strikes` CRDT). spec: the thresholds (`screen_norm`,
    `screen_alignment`, `strikes`). admitted: whether a reporter (peer id, the capabilities its
    strikes record carries) passes the swarm's admission rule, strikes aside
    (`Admission.admits_reporter`). data_dir: where
    `strikes.bin` lives (None: nothing kept on disk)."""

    def __init__(
        self,
        view: SwarmView,
        spec: SwarmSpec,
        *,
        admitted: Callable[[str, dict[str, Any]], bool],
        data_dir: Path | None = None,
    ) -> None:
        self.view, self.spec, self.admitted = view, spec, admitted
        self.me = view.me
        self.path = data_dir / STRIKES_FILE if data_dir is not None else None
        self._rounds: OrderedDict[tuple[int, str], tuple[tuple[str, ...], bytes]] = OrderedDict()
        self._standing: dict[str, Standing] | None = None  # None: recount at the next question
        self._changed = trio.Event()
        self._announced: set[str] = set()  # peers whose exclusion we logged
        self._other_phi: OrderedDict[str, set[int]] = OrderedDict()  # per peer: screened rounds it held another φ in
        self.passed_over = 0  # flagged loss/spot verdicts passed over because the peer held another φ ...
        self.filed_other_phi = 0  # ... and filed although it did, past its passes
        view.replica.on_change(self._on_change)

    # -- filing ------------------------------------------------------------------------------

    def on_round(self, screening: RoundScreening) -> None:
        """A `SwarmCollective.screening_listeners` callback: remember the round, file our flags."""
        key = (screening.round_id, screening.tag)
        self._rounds[key] = (screening.group, screening.digest)
        self._rounds.move_to_end(key)
        while len(self._rounds) > ROUND_LOG:
            self._rounds.popitem(last=False)
        self._standing = None
        self._note_lineages(screening)
        if not screening.flags or len(screening.group) > MAX_STRIKE_GROUP or self.view.has_left:
            return
        strikes = [
            Strike(
                self.me,
                screening.round_id,
                screening.tag,
                f.peer,
                screening.group,
                screening.digest,
                f.part,
                f.norm_ratio,
                f.alignment,
                **({"rule": ECHO, "echo": f.echo, "earlier": f.earlier} if f.rule == ECHO else {}),
            )
            for f in screening.flags
        ]
        for s in strikes:
            scores = {"echo": s.echo, "earlier": s.earlier} if s.rule == ECHO else {}
            log.warning(
                kv(
                    "flagged a contribution",
                    round=s.round_id,
                    peer=s.peer[-12:],
                    norm=s.norm_ratio,
                    align=s.alignment,
                    rule=s.rule,
                    **scores,
                )
            )
        self._file(strikes)

    def on_scores(self, screening: RoundScreening, scores: list[LossScore]) -> None:
        """Loss scoring's verdicts on the sampled peers of a round we screened (node/trust/scoring.py):
        a signed loss strike for each score that breaks the spec's rule, unless screening already
        flagged that peer there (one strike per round and peer)."""
        flagged = [
            (sc.peer, sc.norm_ratio, sc.alignment, {"gain": sc.gain, "ref": sc.ref})
            for sc in scores
            if loss_flagged(sc.gain, sc.ref, self.spec)
        ]
        self._strike_sampled(screening, LOSS, flagged, "flagged a contribution by loss")

    def on_spot_checks(self, screening: RoundScreening, checks: list[SpotCheck]) -> None:
        """Replay spot-checks' verdicts on the sampled peers of a round we screened
        (node/trust/spot_check.py): a signed spot strike for each check that breaks the spec's rule,
        unless screening already flagged that peer there."""
        flagged = [
            (c.peer, c.norm_ratio, c.alignment, {"match": c.match, "ref": c.ref})
            for c in checks
            if spot_flagged(c.match, c.ref, self.spec)
        ]
        self._strike_sampled(screening, SPOT, flagged, "flagged a contribution by spot-check")

    def _strike_sampled(
        self,
        screening: RoundScreening,
        rule: str,
        flagged: list[tuple[str, float, float, dict[str, float]]],
        event: str,
    ) -> None:
        """File a `rule` strike for each (peer, norm ratio, alignment, scores) that broke its rule
        in a round we screened, except peers screening flagged there already."""
        if len(screening.group) > MAX_STRIKE_GROUP or self.view.has_left:
            return
        screened = {f.peer for f in screening.flags}
        part = screening.group.index(self.me)
        strikes = []
        for peer, norm_ratio, alignment, scores in flagged:
            if peer in screened:
                continue
            if self.other_lineage(peer):
                if self._within_passes(peer, screening.round_id):
                    self.passed_over += 1
                    log.info(kv(f"{event}: not filed, it holds another φ", round=screening.round_id, peer=peer[-12:]))
                    continue
                self.filed_other_phi += 1
                log.warning(
                    kv(
                        "holds another φ than ours past its passes: verdict filed",
                        round=screening.round_id,
                        peer=peer[-12:],
                    )
                )
            strikes.append(
                Strike(
                    self.me,
                    screening.round_id,
                    screening.tag,
                    peer,
                    screening.group,
                    screening.digest,
                    part,
                    norm_ratio,
                    alignment,
                    rule,
                    **scores,
                )
            )
            log.warning(kv(event, round=screening.round_id, peer=peer[-12:], **scores))
        self._standing = None
        self._file(strikes)

    def other_lineage(self, peer: str) -> bool:
        """`peer` published a φ digest (node/state/parity.py) that differs from ours at the newest
        round both of us published: it trains from another state than ours. Its update was
        computed from that state, so measuring it on ours (loss scoring, a spot-check's replay)
        judges the difference of states, not the peer — an honest peer on a lineage that parity
        is repairing fails both (a chaos soak struck the swarm's creator out that way, three
        rounds before its parity check re-synced it, and then no peer served it the state)."""
        progress = self.view.progress()
        mine, theirs = progress.get(self.me), progress.get(peer)
        if mine is None or theirs is None:
            return False
        ours = dict(mine.phi)
        newest = max((r for r, _ in theirs.phi if r in ours), default=None)
        return newest is not None and theirs.phi_at(newest) != ours[newest]

    def _note_lineages(self, screening: RoundScreening) -> None:
        """Remember the round's members that held another φ than ours as we screened it. Every
        honest owner screens every member, so all of them note the same rounds and pass over the
        same ones (`_within_passes`): passes counted per reporter from its own flagged verdicts
        would fall in different rounds on different reporters, and no round would reach a quorum.
        (They agree once the peer's progress record has reached them all: in a test swarm of
        0.5 s rounds, owners began noting a liar up to 3 rounds apart.)"""
        if len(screening.group) > MAX_STRIKE_GROUP:
            return  # no strikes are filed about such a round
        span = window_span(self.spec)
        passes = lineage_passes(self.spec)
        for peer in screening.group:
            if peer == self.me or not self.other_lineage(peer):
                continue
            rounds = self._other_phi.pop(peer, set()) | {screening.round_id}
            if span is not None:  # only a window's rounds before a verdict's round count (a late
                rounds = {r for r in rounds if r >= screening.round_id - 2 * span}  # verdict's too)
            else:  # no window: its first rounds decide, for the whole run
                rounds = set(sorted(rounds)[: passes + 1])
            self._other_phi[peer] = rounds
            while len(self._other_phi) > ROUND_LOG:
                self._other_phi.popitem(last=False)

    def _within_passes(self, peer: str, round_id: int) -> bool:
        """Whether `peer`, which holds another φ, held one in fewer than `lineage_passes` screened
        rounds before `round_id` within the strikes window: then its verdict there is passed over.
        Past them it keeps taking part in rounds from another φ than ours, which an honest peer
        re-syncs from within about a round, and the verdict is filed."""
        span = window_span(self.spec)
        before = [r for r in self._other_phi.get(peer, ()) if r < round_id and (span is None or r >= round_id - span)]
        return len(before) < lineage_passes(self.spec)

    def _file(self, strikes: list[Strike]) -> None:
        if not strikes:
            return
        try:
            # A window's worth per peer: the latest `strikes` alone could drop the ones whose
            # rounds reached a quorum when other reporters filed in other rounds, and undo an
            # exclusion (a test saw it).
            self.view.report_strikes(
                strikes, per_peer=max(self.spec.verification.strikes, self.spec.verification.strikes_window, 1)
            )
        except CrdtError as e:  # our own record would be refused: say so, do not stop training
            log.warning(kv("strikes not filed", error=str(e)))

    # -- re-checking and counting -------------------------------------------------------------

    def why_not_counted(self, strike: Strike, reporter_admitted: bool) -> str | None:
        """Why this peer does not count `strike` (None: it counts), its reporter admitted or not."""
        if not reporter_admitted:
            return "reporter not admitted"
        if not self.spec.aggregation.screen_norm or self.spec.aggregation.rule == "mean":
            return "this swarm does not screen"
        if strike.rule == LOSS:
            if not self.spec.verification.score_samples:
                return "this swarm does not score by loss"
            if not loss_flagged(strike.gain, strike.ref, self.spec):
                return "no evidence: the loss scores break no threshold"
            if strike.peer not in sampled_peers(strike.group, strike.digest, self.spec.verification.score_samples):
                return "the round's digest did not sample that peer for loss scoring"
        elif strike.rule == SPOT:
            if not self.spec.verification.spot_check_steps:
                return "this swarm does not spot-check"
            if not spot_flagged(strike.match, strike.ref, self.spec):
                return "no evidence: the spot-check's cosines break no threshold"
            if strike.peer not in sampled_peers(strike.group, strike.digest, self.spec.verification.spot_check_samples):
                return "the round's digest did not sample that peer for spot-checks"
        elif strike.rule == ECHO:
            if not self.spec.aggregation.screen_echo:
                return "this swarm does not screen for replays"
            if not echo_flagged(strike.echo, self.spec):
                return "no evidence: the echo's cosine breaks no threshold"
        elif (
            screening_rule(
                strike.norm_ratio,
                strike.alignment,
                self.spec.aggregation.screen_norm,
                self.spec.aggregation.screen_alignment,
            )
            is None
        ):
            return "no evidence: the scores break no threshold"
        seen = self._rounds.get(strike.round_key)
        if seen is not None and seen != (strike.group, strike.digest):
            return "not the round we saw (group or digest differs)"
        return None

    def standing(self) -> dict[str, Standing]:
        """Every peer with a counted round against it (cached until the strikes or membership change)."""
        if self._standing is None:
            self._standing = self._count()
        return self._standing

    def excluded(self, peer: str) -> bool:
        s = self.standing().get(peer)
        return s is not None and s.excluded

    def _count(self) -> dict[str, Standing]:
        reporters: dict[tuple[str, tuple[int, str], tuple[str, ...], bytes], set[str]] = {}
        by_rule: dict[str, set[tuple[str, tuple[int, str]]]] = {LOSS: set(), SPOT: set(), ECHO: set()}
        for record in self.view.strike_records():
            admitted = self.admitted(record.reporter, record.capabilities)
            for strike in record.strikes:
                if self.why_not_counted(strike, admitted) is None:
                    key = (strike.peer, strike.round_key, strike.group, strike.digest)
                    reporters.setdefault(key, set()).add(strike.reporter)
                    if strike.rule in by_rule:
                        by_rule[strike.rule].add((strike.peer, strike.round_key))
        counted: dict[str, list[tuple[int, str]]] = {}
        for (peer, key, group, _), who in reporters.items():
            if len(who) >= quorum(len(group)) and key not in counted.get(peer, []):
                counted.setdefault(peer, []).append(key)
        standing = {}
        for p, keys in counted.items():
            at = excluded_at(sorted(r for r, _ in keys), self.spec)
            by_loss, by_spot, by_echo = (sum((p, k) in by_rule[rule] for k in keys) for rule in (LOSS, SPOT, ECHO))
            standing[p] = Standing(p, len(keys), at is not None, by_loss, by_spot, by_echo)
            if at is not None and p not in self._announced:  # once per peer (bench_adversarial reads it)
                self._announced.add(p)
                log.warning(kv("peer excluded by strikes", peer=p, rounds=len(keys), at_round=at))
        return standing

    def _on_change(self, event: ChangeEvent) -> None:
        if event.crdt in (STRIKES, MEMBERSHIP, CONFIG):  # a config change may admit a reporter
            self._standing = None
        if event.crdt == STRIKES:
            self._changed.set()

    # -- persistence -------------------------------------------------------------------------

    def load(self) -> int:
        """Merge the strikes kept in `strikes.bin` (each entry's signature checked again by the
        replica, as any peer's); how many entries were taken."""
        if self.path is None or not self.path.exists():
            return 0
        try:
            _, entries = decode_entries(
                self.path.read_bytes(), expected_type=LWWRegister.type_tag, max_size=MAX_FILE_BYTES
            )
        except (OSError, CrdtError) as e:
            log.warning(kv("kept strikes unreadable; starting from the swarm's", path=str(self.path), error=str(e)))
            return 0
        # As if pulled from a peer: the replica checks them, and re-gossips what the others lack.
        outcome = self.view.replica.merge_entries(STRIKES, entries, "anti-entropy", None)
        return len(outcome.accepted)

    def save(self) -> None:
        if self.path is None:
            return
        from meshtrain.durable import write_atomic

        entries = self.view.replica.crdt(STRIKES).entries()
        self.path.parent.mkdir(parents=True, exist_ok=True)
        write_atomic(self.path, encode_entries(LWWRegister.type_tag, entries))

    async def keep_saved(self) -> None:
        """Write `strikes.bin` after every change (at most every `SAVE_DELAY` seconds)."""
        while True:
            await self._changed.wait()
            self._changed = trio.Event()
            await trio.to_thread.run_sync(self.save)
            await trio.sleep(SAVE_DELAY)
