"""What a round's coordinator does about the candidates that have not joined it: wait for them, go
on without them, end the round, or hand it over to where they are.

The problem. A round's group is fixed once every expected candidate joined, or at the join
deadline with a majority in (coordinator.py). A candidate that has not joined may be on its way —
or stopped, cut off, left behind, fetching the swarm's state, past the round, or in it at another
coordinator or under another grouping of it. Waiting for such a peer costs every joiner up to the
hard join deadline (`hard_join_factor` × the join deadline, 90 s by default); going on without
one that is on its way leaves it "late" for the round, or a group of one beside it.

Nobody else will come. The round ends (`MissingPeers.nobody_else_coming`) when the missing peers
joined a later round here, report (in the swarm's replicated progress, `reported_step`) an inner
step past this round — a grouped swarm's peers run their rounds at other coordinators, so a late
join's snapshot mismatch left a coordinator waiting out its hard deadline for partners whose
group had formed elsewhere and moved on; our own trainer counts alike, when it re-synced past a
round we still coordinate or entered a later round of the series (`OwnRounds.past`,
own_rounds.py) — or, asked where they are (`WHERE_RPC`, after `PROBE_AFTER`: `probe`), are past
this round or in it at a coordinator we cannot reach. A majority that joined (counting joiners
still candidates) then completes the round at once; a minority is told it is `Late` (passed, or
elsewhere) and re-syncs. The coordinator reads the first two as it reviews a round collecting
joins (coordinator.py `_review`); the probe reads the answers (probe.py `Whereabouts`) and also
hands the round over to a lower-id coordinator that its missing peers are in (`Moved`), or has
everyone regroup when they are in it under another tag (coordinator.py, "Groups that disagree").

Silent peers (probe.py): a missing peer that leaves a probe unanswered while its heartbeats
stopped is silent; once every missing peer is silent (or past the round), two or more joined and
they are a majority of the peers not silent, the group is fixed without them (`without_silent`),
and the next rounds do so as soon as everyone else is in; a missing peer whose answer puts it
further behind than the round window (probe.py `Whereabouts`: stopped while the swarm went on; it must
re-sync first) counts as silent here. A lone joiner keeps waiting (unless every missing peer is
left behind: none of them can share the round later; and where others passed the round and the
rest are silent, the round is over for the swarm: the joiner is told so and re-syncs): a round of
one beside a stopped partner is a solo round (node/state/parity.py), and so is a group whose other
joiners left our candidates since (killed) while our own trainer, not silent, had not joined yet.
Our own trainer is waited for while it trains; once it does not (it is fetching a state) and has
kept the round waiting `OWN_TRAINER_WAIT`, it counts as away too (`_own_trainer_away`), and so
does, after the same wait, another missing peer fetching the swarm's state (it answers from no
round of this life and does not train, after rounds ended here: probe.py `Whereabouts`) — except
beside a lone joiner, whose state it may be fetching.

The design. `MissingPeers` keeps no state of its own: it reads the round (coordinated_round.py)
and what the coordinator hands it — the host (connections, the probe), the config (the round
window), our own trainer's rounds (own_rounds.py), the silent peers (probe.py `SilentPeers`),
`reported_step` — and acts through the coordinator (`JoinCollector`: fix the group, hand the
round over, regroup). The coordinator calls it from the timer of each round collecting joins
(coordinator.py `_fix_group_later`, `_review`); time is only read through `trio.current_time()`.

Not here: group formation, handing over and regrouping themselves (coordinator.py), asking a peer
where it is and telling a silent one apart (probe.py), the WHERE answer (own_rounds.py).
"""

from __future__ import annotations

from collections.abc import Callable, Collection
from typing import Protocol

import trio

from meshtrain.collective.coordinated_round import CoordinatedRound
from meshtrain.collective.own_rounds import OwnRounds
from meshtrain.collective.probe import SilentPeers, Whereabouts
from meshtrain.collective.protocol import AllReduceConfig, RoundKey
from meshtrain.log import get_logger, kv
from meshtrain.transport.host import Host

log = get_logger(__name__)

# Our own trainer, missing from a round it does not train for (fetching a state), is waited for
# this long before two or more joiners go on without it (`_own_trainer_away`).
OWN_TRAINER_WAIT = 5.0


class JoinCollector(Protocol):
    """What `MissingPeers` needs of the coordinator collecting a round's joins."""

    def candidates(self, key: RoundKey) -> frozenset[str]:
        """Round `key`'s candidates in our view."""
        ...

    def fix_group(self, r: CoordinatedRound) -> None:
        """Fix the round's group: those who joined and are candidates in our view now."""
        ...

    def hand_over(self, r: CoordinatedRound, to: str, why: str) -> None:
        """Everyone who joined here is told to start the round again at `to`."""
        ...

    def regroup(self, r: CoordinatedRound, tags: dict[str, str]) -> None:
        """Missing peers are in this round under other tags (`tags`: peer -> its tag): everyone
        who joined here computes its group again and joins anew."""
        ...


class MissingPeers:
    """The coordinator's policy for a round's candidates that have not joined ("Nobody else will
    come", "Silent peers").

    coordinator: fixes the group, hands the round over, regroups (`JoinCollector`).
    host: for connection state (`is_connected`), the `WHERE_RPC` probe and our own id.
    config: the round window (`AllReduceConfig.round_window`).
    own: what our own trainer entered (own_rounds.py).
    silent: the missing peers found silent (probe.py).
    reported_step: optional `(peer) -> int | None`, the inner step a peer last reported to the
        swarm (None: unknown; for ourselves: our trainer does not train now)."""

    def __init__(
        self,
        coordinator: JoinCollector,
        host: Host,
        config: AllReduceConfig,
        own: OwnRounds,
        silent: SilentPeers,
        reported_step: Callable[[str], int | None] | None = None,
    ) -> None:
        self.coordinator = coordinator
        self.host = host
        self.config = config
        self.own = own
        self.silent = silent
        self.reported_step = reported_step

    @property
    def peer_id(self) -> str:
        return self.host.peer_id

    async def probe(self, r: CoordinatedRound) -> None:
        """Ask the missing candidates we are connected to where they are in this round's series.

        Our view of who coordinates can differ from theirs without a newcomer: a dropped
        connection to the lowest id hides it from our membership while the others still follow
        it, and we would wait out the hard join deadline (3 × join_timeout) alone. A missing peer
        already past this round counts as passed; one in this round at a lower-id coordinator
        makes us hand the round over there — or, if our joiners already failed to reach that
        coordinator (`skipped`) and it does not answer us either, end the round at once: the
        swarm's round is one we cannot join. A skipped coordinator that answers our probe is back
        (a killed peer restarts with its id): a 30-minute soak saw two coordinators of one round
        wait 10 s for each other's joiners, the higher one because its joiners had found the lower
        one dead a few seconds before it restarted."""
        me, round_id = self.peer_id, r.key.round_id
        ours = self.own.entered_as(r.key) if me in r.missing else None
        if ours is not None and ours != r.key.tag:
            self.coordinator.regroup(r, {me: ours})
            return
        if not r.missing - {me}:
            return  # only we have not joined yet (a slow start): our own join completes the group
        missing = sorted(p for p in r.missing if p != me and self.host.is_connected(p))
        answers = await self.silent.ask_all(self.host, missing, r.key.tag, round_id)
        if r.group_fixed.is_set():
            return
        reported = self.reported_step
        found = Whereabouts.of(
            answers,
            r.key,
            me,
            self.config.round_window,
            trains=None if reported is None else (lambda p: reported(p) is not None),
            rounds_ended=self.own.where(r.key.tag).finished >= 0,
            waited=trio.current_time() - r.created >= OWN_TRAINER_WAIT,
        )
        elsewhere, passed = found.elsewhere, found.passed
        if found.regrouped:
            self.coordinator.regroup(r, found.regrouped)
            return
        reachable = sorted(c for c in set(elsewhere.values()) if c not in r.skipped or c in answers)
        accounted = set(elsewhere) | passed >= r.missing - {me}
        if accounted and not elsewhere:
            self.nobody_else_coming(r, "the missing peers are past this round")
        elif reachable:
            self.coordinator.hand_over(r, reachable[0], "the missing peers are in this round there")
        elif accounted:
            self.nobody_else_coming(
                r,
                "the missing peers are in this round at a coordinator we cannot reach",
                elsewhere=min(elsewhere.values()),
            )
        else:
            self.without_silent(r, passed, found.behind, found.fetching)

    def without_silent(
        self,
        r: CoordinatedRound,
        passed: Collection[str] = (),
        behind: Collection[str] = (),
        fetching: Collection[str] = (),
    ) -> None:
        """Fix the group without the missing peers once every one of them is silent (or past the
        round), two or more peers joined and they are a majority of the peers not silent: a
        stopped peer's membership stays live until its lease runs out (12 s), and the round would
        wait for it that long. A lone joiner keeps waiting (a group of one beside a stopped
        partner is a round alone that the partner may share later). Counted are the joins that
        the group would take (still candidates), and our own trainer is waited for until it is
        away (`_own_trainer_away`): it is not silent, and a 30-minute soak saw a coordinator whose
        trainer was re-syncing fix a group of one — the one other joiner left beside a dead peer's
        join — a solo round. A missing peer
        `behind` (its answer puts it further behind than our round window: probe.py `Whereabouts`;
        or behind us and not training) counts
        as a silent one: it must re-sync before it can join, and a 3-daemon run's two peers
        waited the join deadline (30 s) for their woken coordinator, 11 rounds behind. Beside
        partners that are all behind, a lone joiner fixes its group of one too: they cannot share
        the round later, and CI saw the front peer of a swarm, coming back to a group left 100
        rounds behind (refused as `coordinator-behind`, it coordinated its round itself), wait
        out the hard join deadline (90 s) for them while they waited for its state. A missing peer
        `fetching` the swarm's state (probe.py `Whereabouts`) counts as away too, but never leaves a lone
        joiner a group of one: it joins the swarm at the state it fetches, which may be ours."""
        away = (
            self.silent.now() | set(behind) | set(fetching) | ({self.peer_id} if self._own_trainer_away(r) else set())
        )
        missing = r.missing
        if not missing <= away | set(passed) or not missing & away:
            return  # our own trainer is not silent: while it trains and has not joined, it is waited for
        candidates = set(self.coordinator.candidates(r.key)) | {self.peer_id}
        joined = [p for p in r.joins if p in candidates]
        # A partner left behind cannot share this round later (it re-syncs first, to our state):
        # beside only such partners, a lone joiner is not waited for either.
        fewest = 1 if missing <= set(behind) | set(passed) else 2
        if len(joined) < fewest and missing & set(passed):
            # Others passed the round, the rest are silent or away: the swarm has this round, and
            # a lone joiner waiting for a silent partner would wait for a round nobody else can
            # share — it re-syncs (a 30-minute soak's restart, entered at a round the two others
            # had just completed, waited 11 s for a third, SIGSTOPped, at the round both others'
            # next round waited at).
            self.nobody_else_coming(r, "the others are past this round, the rest silent or away")
            return
        if len(joined) < fewest or 2 * len(joined) <= len(r.expected - away):
            return
        log.info(
            kv(
                "allreduce fixing the group without silent peers",
                key=r.key,
                silent=",".join(sorted(p[-8:] for p in missing & away if p not in behind and p not in fetching)),
                behind=",".join(sorted(p[-8:] for p in missing & set(behind))),
                fetching=",".join(sorted(p[-8:] for p in missing & set(fetching))),
                joined=len(joined),
                expected=len(r.expected),
            )
        )
        self.coordinator.fix_group(r)

    def _own_trainer_away(self, r: CoordinatedRound) -> bool:
        """Whether our own trainer, missing from `r`, is not coming soon: it does not train now
        (no fresh progress record of this life: `reported_step` is None — it is fetching a state)
        and `r` has waited `OWN_TRAINER_WAIT` for it. Then it counts as away like a silent peer,
        so two or more joiners that are a majority go on without it (never a group of one:
        `without_silent`). A 30-minute soak's restarted coordinator — the lowest id, so every
        round's — announced itself and then failed its download for 18 s (its donors disagreed),
        and the two trainers that had joined its round waited all that time."""
        if self.peer_id not in r.missing or self.reported_step is None:
            return False
        return self.reported_step(self.peer_id) is None and trio.current_time() - r.created >= OWN_TRAINER_WAIT

    def nobody_else_coming(self, r: CoordinatedRound, why: str, elsewhere: str | None = None) -> None:
        """The missing peers will not join: a majority that did completes the round now (a peer
        that cancelled and moved on must not void the round for the rest); a minority — a stale
        or cut-off coordinator, usually alone — ends it, and its members re-sync. Counted are the
        joins the group would take (still candidates: coordinator.py `fix_group`): a 30-minute
        soak's coordinator counted a killed peer's join, fixed a group of itself alone and
        committed a round of one beside the missing peer's."""
        candidates = set(self.coordinator.candidates(r.key)) | {self.peer_id}
        joined = [p for p in r.joins if p in candidates]
        if 2 * len(joined) > len(r.expected):
            log.info(
                kv(
                    "allreduce fixing the group without the missing peers",
                    key=r.key,
                    why=why,
                    joined=len(joined),
                    expected=len(r.expected),
                )
            )
            self.coordinator.fix_group(r)
            return
        if elsewhere is None:
            r.passed = True
        else:
            r.elsewhere = elsewhere
        r.group_fixed.set()
        log.info(kv("allreduce round ends: nobody else will come", key=r.key, why=why, joined=len(r.joins)))
