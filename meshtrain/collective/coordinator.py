"""The all-reduce coordinator's state machine: group formation and each attempt's outcome.

One peer coordinates each round (the lowest id of the round's candidates that answers; see
allreduce.py for how peers find it). Its job, per round key:

- **collect joins** until every expected candidate joined, or the join deadline passed with a
  majority in (up to `hard_join_factor` × the deadline while only a minority joined), then fix
  the group of attempt 0 — and its parts' shares, from the rates the members joined with
  (shares.py; a retry's survivors get theirs from the same rates). The expected set is always
  our own `group(round_id)` view (a follow-up exchange's cut to the peers our own trainer
  entered it among: `OwnRounds.among`), refreshed while waiting and at every join — never a
  joiner's claim — so a peer that left is no longer waited for, and one that came into view since the round
  opened is. The group itself is fixed from those who joined *and* are still candidates: a peer
  excluded (by the swarm's strikes) or gone after its join came in — a join sent ahead of the
  round, prepared.py — is told it is `Late`, so an exclusion takes effect in the next group fixed;
- **hand the round over** (`Moved`) to a lower-id candidate once one is connected (our view of
  membership was behind), or **end it** when nobody else will come: the missing peers joined a
  later round here, report (in the swarm's replicated progress, `reported_step`) an inner step
  past this round — a grouped swarm's peers run their rounds at other coordinators, so a late
  join's snapshot mismatch left a coordinator waiting out its hard deadline for partners whose
  group had formed elsewhere and moved on; our own trainer counts alike, when it re-synced past a
  round we still coordinate or entered a later round of the series (`OwnRounds.past`,
  own_rounds.py) — or, asked where they are (`WHERE_RPC`, after
  `PROBE_AFTER`), are past this round or in it at a coordinator we cannot reach. A majority
  that joined (counting joiners still candidates) then completes the round at once; a minority
  is told it is `Late` (passed, or elsewhere) and re-syncs;
- **regroup a round its peers grouped differently** ("Groups that disagree", below);
- **decide each attempt** from the members' reports: `Commit` when everyone succeeded (the
  majority digest wins; a minority digest is told to re-sync), `Retry` among the survivors after
  a failure, `Abort` after `max_attempts` — the rules are attempt_rules.py's, the timers that
  apply them (the failure grace, the report deadline) attempt_outcomes.py's. An aborted round
  committed nothing here: its members proceed alone, re-sync to the state before it and join it
  again, and the first such join opens it afresh (a 30-minute soak's coordinator, its attempt
  aborted after its own pause, answered their joins "after the group was formed" for 19 s — each
  answer another re-sync to the same state).

Attempt ids. A round opened again after an abort numbers its attempts on from the old round's
(`_Round.base`): a member refuses for a while the transfers of an attempt it abandoned, by tag
(transport/tensor_inbox.py), and a tag names the attempt — numbered 0 again, a soak's reopened
round had every transfer refused, each member excluded in turn (stop 66: 3.5 s without a round).

Groups that disagree. A grouped round's tag names the group (collective/groups.py: "f0~g1.2"),
computed from each peer's view of the round's roster (node/roster.py). Joins are announced ahead,
so every view agrees on them; departures are not: for a few seconds after peers leave, each
survivor may still count a different one of them, compute other groups and join the round under
another group's tag — at the same coordinator or another. Each of those rounds then waited for
peers that were in the round under a sibling tag: the hard deadline, 90 s by default, after
which everyone proceeded alone and re-synced (tests/test_grouped_daemons.py, three of six
daemons leaving). The probe finds them: a WHERE reply is about the series (the tag without its
group suffix) and names the tag the peer is in, and our own trainer's is in `OwnRounds`. A
missing peer in this round under another tag ends it with `Late(regroup=True)`: everyone who
joined computes its group again from its view now and joins anew (allreduce.py, at most
`MAX_REGROUPS` times); the round is forgotten here, so a join under its old tag opens a fresh
round, which probes again. Views converge within a heartbeat or two, so a departure costs a
round a probe interval (`PROBE_AFTER`) or two instead of the hard deadline. Two peers whose
groups agreed may form the round before that, under their tag; once our trainer ended it, it is
past for us, under no tag (own_rounds.py), and a peer still waiting here under another tag is
told the round has passed and re-syncs — not regrouped until `MAX_REGROUPS` runs out (CI). A peer that
predates `regroup` reads the reply as Late and proceeds alone, as it always did.

Silent peers (probe.py): a missing peer that leaves a probe unanswered while its heartbeats
stopped is silent; once every missing peer is silent (or past the round), two or more joined and
they are a majority of the peers not silent, the group is fixed without them (`_without_silent`),
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
A member that left a round it thought silent while its join was in may come back to it (the
coordinator was only stopped): a second join from a member of the attempt under way counts as its
leaving that attempt (`_rejoined`), so the others retry without it at once.

Withdrawn joins. A member that stops waiting for our reply to its join (we left its round's
candidates, or went silent, for it: join_wait.py, allreduce.py; or its exchange was cancelled)
tells us (`withdraw`, WITHDRAW_RPC). Before the group is fixed its join is dropped: it is
elsewhere now, and a group fixed with it would wait for data that never comes (a 30-minute soak's
restarted coordinator fixed a group with such a join, its own trainer away; the trainer, back, was
told "joined after the group was formed" for 27 s while the attempt waited out its deadline). The
peer, still a candidate, is then a missing one like any other (the probe finds where it is).
After, it is the member's leaving, as a second join is. A withdrawal can overtake its join (a
join waits at the door for membership or a pause check first), so it is remembered for a while
(`WITHDRAWN_KEPT`), and a join of that key read before it is told it is late.

Our own pauses. A coordinator that was itself stopped (SIGSTOP, a suspended VM, a loop blocked
for seconds) was silent to its members, who may have completed the round without it since. After
such a pause (own_pauses.py tells it, and tells whether joins and members still stand): a round
still collecting joins with one from before it starts again (`Late(regroup=True)`), a join read
just after it is checked with its joiner, and an attempt under way is held until its members say
whether they stayed — it goes on if all did, else it is aborted.

The coordinator is driven by calls (`join`, `report`, `watch`, from the RPC handlers and from
its own participation) and by timers; the timers run in a nursery that the owner hands in with
`run` (the collective's, so their lifetime is the collective's). Time is only read through
`trio.current_time()`, so the state machine is tested with trio's `MockClock` without sleeping.

Not here: the RPC handlers and their authentication (allreduce.py), the message formats
(protocol.py), moving data (data_phase.py), deciding attempts on time (attempt_outcomes.py).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Collection, Sequence
from dataclasses import dataclass, field

import trio

from meshtrain.collective.attempt_outcomes import AttemptOutcomes
from meshtrain.collective.attempt_rules import Attempt
from meshtrain.collective.own_pauses import OwnPauses
from meshtrain.collective.own_rounds import OwnRounds
from meshtrain.collective.probe import SilentPeers, Whereabouts
from meshtrain.collective.protocol import (
    FAIL,
    JOIN_QUIET,
    NOT_A_MEMBER,
    PROBE_AFTER,
    PROBE_EVERY,
    UNKNOWN_ATTEMPT,
    WAIT_LOG_EVERY,
    Abort,
    AllReduceConfig,
    Joined,
    JoinReply,
    Late,
    Moved,
    Outcome,
    Report,
    RoundKey,
)
from meshtrain.crdt.swarm_records import PULSE_S
from meshtrain.log import get_logger, kv
from meshtrain.transport.host import Host
from meshtrain.transport.rpc import RemoteError

log = get_logger(__name__)

ROUNDS_KEPT = 16  # rounds remembered (older ones are forgotten)
# Our own trainer, missing from a round it does not train for (fetching a state), is waited for
# this long before two or more joiners go on without it (`_own_trainer_away`).
OWN_TRAINER_WAIT = 5.0
LATEST_KEPT = 4096  # (peer, series) -> latest round entries remembered
WITHDRAWN_KEPT = 1024  # (peer, key) -> withdrawal time entries remembered ("Withdrawn joins")


@dataclass
class _Round:
    key: RoundKey
    expected: frozenset[str]
    created: float
    moved: str | None = None  # handed over to this lower-id candidate before the group was fixed
    elsewhere: str | None = None  # the missing peers are in this round at a coordinator we cannot reach
    skipped: set[str] = field(default_factory=set)  # lower ids joiners gave up on (never hand over to them)
    passed: bool = False  # the missing peers already joined a later round: nobody else will come
    regroup: bool = False  # the missing peers are in this round under another grouping of it
    last_wait_log: float = 0.0
    joins: dict[str, float] = field(default_factory=dict)
    uplinks: dict[str, float | None] = field(default_factory=dict)  # each joiner's rate, bytes/s
    tapers: dict[str, int | None] = field(default_factory=dict)  # each joiner's offered stripe taper
    group_fixed: trio.Event = field(default_factory=trio.Event)
    attempts: list[Attempt] = field(default_factory=list)
    base: int = 0  # the id of its first attempt ("Attempt ids"); attempts[i] is attempt base + i

    @property
    def missing(self) -> frozenset[str]:
        return self.expected - set(self.joins)

    @property
    def aborted(self) -> bool:
        """Its last attempt was aborted: nobody committed the round here."""
        return (
            bool(self.attempts) and self.attempts[-1].decided.is_set() and isinstance(self.attempts[-1].outcome, Abort)
        )

    def ended_without_us(self) -> Late:
        return Late(self.passed, self.elsewhere, regroup=self.regroup)


class Coordinator:
    """State a coordinator keeps per round key.

    host: for connection state (`is_connected`) and the `WHERE_RPC` probe.
    config: deadlines and limits (`AllReduceConfig`).
    group: our own view of a round's candidates, `group(round_id)` → sorted ids, us included.
    reported_step: optional `(peer) -> int | None`, the inner step a peer last reported to the
        swarm (None: unknown); round ids are inner steps, so a missing peer reporting a step past
        a round is not coming to it.
    own: what our own trainer entered (own_rounds.py), kept by the collective it joins through.
    quiet: optional `(peer) -> bool`, whether a peer's heartbeats stopped reaching us (None: not
        known; an unanswered probe alone then makes a peer silent: "Silent peers").
    Call `await nursery.start(coordinator.run)` before `join` (timers run in that nursery)."""

    def __init__(
        self,
        host: Host,
        config: AllReduceConfig,
        group: Callable[[int], Sequence[str]],
        reported_step: Callable[[str], int | None] | None = None,
        own: OwnRounds | None = None,
        quiet: Callable[[str], bool] | None = None,
    ) -> None:
        self.host = host
        self.config = config
        self.group = group
        self.reported_step = reported_step
        self.own = own or OwnRounds()
        self.rounds: dict[RoundKey, _Round] = {}
        # (peer, series) -> the highest round id that peer joined here; a series is a key without
        # its round id (tag + coordinator), so it tells a stale round from the swarm's current one.
        self.latest: dict[tuple[str, tuple[str, str]], int] = {}
        self.withdrawn: dict[tuple[str, RoundKey], float] = {}  # (peer, key) -> when ("Withdrawn joins")
        self.silent = SilentPeers(quiet, self.start_soon)  # missing peers found silent (probe.py)
        self.pauses = OwnPauses(host)  # ours ("Our own pauses")
        self.outcomes = AttemptOutcomes(self, config, self.pauses)  # each attempt decided on time
        self._nursery: trio.Nursery | None = None

    @property
    def peer_id(self) -> str:
        return self.host.peer_id

    async def run(
        self,
        *,
        task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED,  # type: ignore[name-defined]  # trio-typing's stale stubs shadow trio's: no TaskStatus
    ) -> None:
        """Own the timers' nursery until cancelled."""
        async with trio.open_nursery() as nursery:
            self._nursery = nursery
            task_status.started()
            try:
                while True:  # our pulse: a gap in it is a pause of ours ("Our own pauses")
                    self.note_running()
                    await trio.sleep(PULSE_S)
            finally:
                self._nursery = None

    def start_soon(self, fn: Callable[..., Awaitable[object]], *args: object) -> None:
        if self._nursery is None:
            raise RuntimeError("the coordinator is not running: start `run` in a nursery first")
        self._nursery.start_soon(fn, *args)

    # -- group formation ---------------------------------------------------------------------

    def _round(self, key: RoundKey) -> _Round:
        r = self.rounds.get(key)
        if r is None:
            # The candidates come from our own view of membership, never from a joiner's message.
            r = _Round(key, self._candidates(key), trio.current_time())
            self.rounds[key] = r
            self.start_soon(self._fix_group_later, r)
            for old in list(self.rounds)[:-ROUNDS_KEPT]:
                del self.rounds[old]
        return r

    async def _fix_group_later(self, r: _Round) -> None:
        """Fix the group at the join deadline if a majority of the expected peers joined, else
        keep waiting up to the hard deadline: a lone early peer must not form a group of one and
        leave the majority, arriving a little later, "late" for the round."""
        cfg = self.config
        next_probe = r.created + PROBE_AFTER

        async def tick(dt: float) -> None:
            nonlocal next_probe
            with trio.move_on_after(dt):
                await r.group_fixed.wait()
            self.note_running()
            self._review(r)
            if not r.group_fixed.is_set() and trio.current_time() >= next_probe:
                await self._probe(r)
                next_probe = trio.current_time() + PROBE_EVERY

        with trio.move_on_after(cfg.join_timeout):
            while not r.group_fixed.is_set():
                await tick(cfg.liveness_interval)
        with trio.move_on_after(cfg.join_timeout * (cfg.hard_join_factor - 1)):
            while not r.group_fixed.is_set() and 2 * len(r.joins) <= len(r.expected):
                await tick(0.05)
            # Peers finishing the previous round arrive in a wave: once the majority is in, keep
            # the door open while joins are still arriving, so the tail of the wave is not "late".
            seen = -1
            while not r.group_fixed.is_set() and len(r.joins) != seen:
                seen = len(r.joins)
                await trio.sleep(JOIN_QUIET)
        self.note_running()
        self._fix_group(r)

    async def _probe(self, r: _Round) -> None:
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
            self._regroup(r, {me: ours})
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
            self._regroup(r, found.regrouped)
            return
        reachable = sorted(c for c in set(elsewhere.values()) if c not in r.skipped or c in answers)
        accounted = set(elsewhere) | passed >= r.missing - {me}
        if accounted and not elsewhere:
            self._nobody_else_coming(r, "the missing peers are past this round")
        elif reachable:
            self._hand_over(r, reachable[0], "the missing peers are in this round there")
        elif accounted:
            self._nobody_else_coming(
                r,
                "the missing peers are in this round at a coordinator we cannot reach",
                elsewhere=min(elsewhere.values()),
            )
        else:
            self._without_silent(r, passed, found.behind, found.fetching)

    def _without_silent(
        self,
        r: _Round,
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
        candidates = set(self._candidates(r.key)) | {self.peer_id}
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
            self._nobody_else_coming(r, "the others are past this round, the rest silent or away")
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
        self._fix_group(r)

    def _own_trainer_away(self, r: _Round) -> bool:
        """Whether our own trainer, missing from `r`, is not coming soon: it does not train now
        (no fresh progress record of this life: `reported_step` is None — it is fetching a state)
        and `r` has waited `OWN_TRAINER_WAIT` for it. Then it counts as away like a silent peer,
        so two or more joiners that are a majority go on without it (never a group of one:
        `_without_silent`). A 30-minute soak's restarted coordinator — the lowest id, so every
        round's — announced itself and then failed its download for 18 s (its donors disagreed),
        and the two trainers that had joined its round waited all that time."""
        if self.peer_id not in r.missing or self.reported_step is None:
            return False
        return self.reported_step(self.peer_id) is None and trio.current_time() - r.created >= OWN_TRAINER_WAIT

    def _nobody_else_coming(self, r: _Round, why: str, elsewhere: str | None = None) -> None:
        """The missing peers will not join: a majority that did completes the round now (a peer
        that cancelled and moved on must not void the round for the rest); a minority — a stale
        or cut-off coordinator, usually alone — ends it, and its members re-sync. Counted are the
        joins the group would take (still candidates: `_fix_group`): a 30-minute soak's
        coordinator counted a killed peer's join, fixed a group of itself alone and committed a
        round of one beside the missing peer's."""
        candidates = set(self._candidates(r.key)) | {self.peer_id}
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
            self._fix_group(r)
            return
        if elsewhere is None:
            r.passed = True
        else:
            r.elsewhere = elsewhere
        r.group_fixed.set()
        log.info(kv("allreduce round ends: nobody else will come", key=r.key, why=why, joined=len(r.joins)))

    def _review(self, r: _Round) -> None:
        """While collecting joins: follow membership (a peer that left — its connection closed, or
        its lease ran out — is no longer waited for), end a round nobody else will come to, or
        hand it over."""
        if r.group_fixed.is_set():
            return
        round_id = r.key.round_id
        self._refresh_expected(r)
        if r.expected <= set(r.joins):
            self._fix_group(r)
            return
        now = trio.current_time()
        if now - r.created >= WAIT_LOG_EVERY and now - r.last_wait_log >= WAIT_LOG_EVERY:
            r.last_wait_log = now
            log.warning(
                kv(
                    "outer round waiting for peers to join",
                    round=round_id,
                    tag=r.key.tag,
                    joined=len(r.joins),
                    expected=len(r.expected),
                    missing=",".join(p[-8:] for p in sorted(r.missing)),
                    waited_s=round(now - r.created, 1),
                )
            )
        missing = r.missing
        if missing and self.silent.marks:
            past = [
                p for p in missing if self.latest.get((p, r.key.series), -1) > round_id or self._reported_past(p, r.key)
            ]
            self._without_silent(r, past)
            if r.group_fixed.is_set():
                return
        if missing and all(self.latest.get((p, r.key.series), -1) > round_id for p in missing):
            self._nobody_else_coming(r, "the missing peers joined a later round here")
            return
        # Us too: our own trainer, re-synced past this round while we coordinated it, will not
        # join it either (our peers' joins would wait out the hard deadline for us).
        if missing and all(self._reported_past(p, r.key) for p in missing):
            self._nobody_else_coming(r, "the missing peers report steps past this round")
            return
        me = self.peer_id
        lower = [
            p for p in sorted(self._candidates(r.key)) if p < me and p not in r.skipped and self.host.is_connected(p)
        ]
        if lower:
            self._hand_over(r, lower[0], "a lower id is connected")

    def _reported_past(self, peer: str, key: RoundKey) -> bool:
        """Whether `peer` told the swarm it is at an inner step past round `key`: it ended that
        round elsewhere (its report comes a step after its join to a round, wherever). For our
        own trainer we know more: whether it entered a later round of the series (own_rounds.py)."""
        if peer == self.peer_id and self.own.past(key):
            return True
        step = self.reported_step(peer) if self.reported_step is not None else None
        return step is not None and step > key.round_id

    def _candidates(self, key: RoundKey) -> frozenset[str]:
        """Round `key`'s candidates in our view: `group`, cut to a follow-up's peers where our own
        trainer entered the round as one (`OwnRounds.among`)."""
        group = frozenset(self.group(key.round_id))
        among = self.own.among(key)
        return group if among is None else group & among

    def _refresh_expected(self, r: _Round) -> None:
        """The peers the round waits for: our view's candidates now, and whoever joined."""
        r.expected = self._candidates(r.key) | frozenset(r.joins)

    def _regroup(self, r: _Round, tags: dict[str, str]) -> None:
        """Missing peers are in this round under other tags (`tags`: peer -> its tag): they
        computed the round's groups from another roster. Everyone who joined here is told to
        compute their group again and join anew ("Groups that disagree"); a join under this key
        from now on opens a fresh round, which waits and probes again."""
        self._restart(
            r,
            "allreduce groups disagree; regrouping",
            joined=",".join(p[-8:] for p in sorted(r.joins)),
            elsewhere=",".join(f"{p[-8:]}:{t}" for p, t in sorted(tags.items())),
        )

    def _restart(self, r: _Round, why: str, **fields: object) -> None:
        """End round `r` for everyone who joined with `Late(regroup=True)`: each joins anew at
        once, and the round is forgotten here, so their joins open it afresh. Logs `why`."""
        r.regroup = True
        r.group_fixed.set()
        if self.rounds.get(r.key) is r:
            del self.rounds[r.key]
        log.info(kv(why, key=r.key, **fields))

    def _hand_over(self, r: _Round, to: str, why: str) -> None:
        """Everyone who joined here is told to start the round again at `to`."""
        r.moved = to
        r.group_fixed.set()
        if self.rounds.get(r.key) is r:
            del self.rounds[r.key]
        log.info(kv("allreduce coordinator handing over", key=r.key, to=to[-8:], why=why))

    def _fix_group(self, r: _Round) -> None:
        """Fix the round's group: those who joined and are candidates in our view now. A peer
        whose join came in (sent ahead of the round: prepared.py) and that has since left our
        candidates — excluded by the swarm's strikes, its lease or connection gone — is told it
        is late rather than taken in: a strike that landed while the next round was forming must
        not wait a round more to take effect."""
        if not r.group_fixed.is_set():
            candidates = set(self._candidates(r.key)) | {self.peer_id}
            group = tuple(sorted(p for p in r.joins if p in candidates))
            if left := sorted(set(r.joins) - candidates):
                log.info(
                    kv(
                        "allreduce group fixed without peers no longer candidates",
                        key=r.key,
                        left=",".join(p[-8:] for p in left),
                    )
                )
            r.attempts.append(Attempt.among(group, r.uplinks, r.tapers))
            r.group_fixed.set()
            log.debug(kv("allreduce group fixed", round=r.key.round_id, size=len(group), expected=len(r.expected)))

    async def join(
        self,
        peer: str,
        key: RoundKey,
        skipped: Sequence[str] = (),
        uplink: float | None = None,
        taper: int | None = None,
        read_at: float | None = None,
    ) -> JoinReply:
        """`peer` joins round `key`; `uplink`: its link rate in bytes/s (None: unknown); `taper`:
        the stripe taper it can cut up to (None: an older peer, none); `read_at`: when its request
        was read (a join read before its own withdrawal is late: "Withdrawn joins")."""
        self.note_running()
        if not await self.pauses.join_stands(peer, key):
            return Late(detailed=False)
        if read_at is not None and self.withdrawn.get((peer, key), float("-inf")) >= read_at:
            log.info(kv("allreduce join withdrawn before it was taken in", key=key, peer=peer[-8:]))
            return Late(detailed=False)
        r = self._round(key)
        if r.aborted:  # its members re-synced to the state before it and come back: a fresh round
            aborted = self.rounds.pop(key)
            r = self._round(key)
            r.base = aborted.base + len(aborted.attempts)
            log.info(kv("allreduce round opened again after its attempt was aborted", key=key, peer=peer[-8:]))
        r.skipped.update(skipped)
        self.silent.heard(peer)
        series = (peer, key.series)
        self.latest[series] = max(self.latest.get(series, -1), key.round_id)
        if len(self.latest) > LATEST_KEPT:  # bounded: forget the oldest entries
            for old in list(self.latest)[:1024]:
                del self.latest[old]
        if r.group_fixed.is_set():
            if not r.moved:
                self._rejoined(r, peer)
            return Moved(r.moved) if r.moved else r.ended_without_us()
        r.joins[peer] = trio.current_time()
        r.uplinks[peer] = uplink
        r.tapers[peer] = taper
        # Our view now, not the one the round was opened with: peers that were still starting
        # when an early joiner opened it (their trainer role or connection not yet here) are
        # expected too, or the last of the others to join would close the group without them.
        self._refresh_expected(r)
        if r.expected <= set(r.joins):
            self._fix_group(r)
        await r.group_fixed.wait()
        if r.moved:
            return Moved(r.moved)
        if r.passed or r.elsewhere or r.regroup:
            return r.ended_without_us()
        if peer not in r.attempts[0].group:
            return Late(detailed=False)
        first = r.attempts[0]
        return Joined(r.base, first.group, first.shares, first.taper)

    def note_running(self) -> None:
        """Our loop runs now. After a pause of ours ("Our own pauses"): every round still
        collecting joins with a join from before the pause starts again — those whose joiners
        still wait join it anew at once (`Late(regroup=True)`), and a joiner that left us for
        silent meanwhile is no longer counted in — and every attempt under way is held while its
        members are asked whether they stayed (attempt_outcomes.py `confirm_members`). Every path that may decide (a
        join or report handler, a timer) notes first."""
        now = trio.current_time()
        pause = self.pauses.note(now)
        if not pause:
            return
        began = now - pause
        for r in list(self.rounds.values()):
            if not r.group_fixed.is_set():
                stale = sorted(p for p, t in r.joins.items() if t < began)
                if stale:
                    self._restart(
                        r,
                        "allreduce round restarted: we were paused, and its joins from before may be stale",
                        paused_s=round(pause, 1),
                        stale=",".join(p[-8:] for p in stale),
                    )
            for i, a in enumerate(r.attempts):
                if a.decidable():
                    a.held = True
                    self.start_soon(self.outcomes.confirm_members, r.key, r.base + i, a, pause)

    def _rejoined(
        self, r: _Round, peer: str, why: str = "allreduce member joined again; leaving the attempt without it"
    ) -> None:
        """`peer`, a member of the attempt under way, joins the round again: it gave the round up
        unheard (it left us for silent while its join was in, and came back) and will send that
        attempt nothing. Count it as leaving — what its `leave` would have said — so the others
        retry without it now, not at the transfer deadline: a 30-minute soak saw two members
        wait 18 s in a data phase for such a peer, which heartbeat all along. A withdrawal that
        comes once the group is fixed says the same (`withdraw`)."""
        a = r.attempts[-1] if r.attempts else None
        if a is None or a.decided.is_set() or peer not in a.group or peer in a.reports:
            return
        log.info(kv(why, key=r.key, peer=peer[-8:]))
        self.outcomes.record(peer, Report(r.key, r.base + len(r.attempts) - 1, FAIL, None, (peer,), (), True), a)

    def withdraw(self, peer: str, key: RoundKey) -> None:
        """`peer` stopped waiting for our reply to its join of round `key` ("Withdrawn joins"):
        before the group is fixed its join is dropped; after, it leaves the attempt under way."""
        self.note_running()
        self.withdrawn[(peer, key)] = trio.current_time()
        if len(self.withdrawn) > WITHDRAWN_KEPT:  # bounded: forget the oldest entries
            for old in list(self.withdrawn)[: WITHDRAWN_KEPT // 4]:
                del self.withdrawn[old]
        r = self.rounds.get(key)  # a round handed over or restarted is no longer here
        if r is None:
            return
        if r.group_fixed.is_set():
            self._rejoined(r, peer, "allreduce member withdrew its join; leaving the attempt without it")
        elif r.joins.pop(peer, None) is not None:
            r.uplinks.pop(peer, None)
            r.tapers.pop(peer, None)
            log.info(kv("allreduce join withdrawn: the peer stopped waiting for us", key=key, peer=peer[-8:]))

    def joined(self, key: RoundKey) -> frozenset[str]:
        """The peers whose joins of round `key` are in here so far (read-only; for status and
        tests). Empty while the round is not open here: not opened yet, handed over, or forgotten."""
        r = self.rounds.get(key)
        return frozenset(r.joins) if r is not None else frozenset()

    def waiting_for(self) -> str | None:
        """What a round we joined as a participant waits for, in words, or None."""
        for r in list(self.rounds.values()):
            if not r.group_fixed.is_set() and self.peer_id in r.joins:
                missing = sorted(r.missing)
                try:
                    waited = f", {trio.current_time() - r.created:.0f} s"
                except RuntimeError:  # asked from outside trio (a status thread)
                    waited = ""
                return (
                    f"round {r.key.round_id} ({r.key.tag}): waiting for {len(missing)} of "
                    f"{len(r.expected)} peers to join ({', '.join(p[-8:] for p in missing[:8])}){waited}"
                )
        return None

    # -- attempts ----------------------------------------------------------------------------

    def _attempt(self, key: RoundKey, attempt: int) -> Attempt:
        r = self.rounds.get(key)
        if r is None or not r.group_fixed.is_set() or not 0 <= attempt - r.base < len(r.attempts):
            raise RemoteError(UNKNOWN_ATTEMPT, f"{key} attempt {attempt}")
        return r.attempts[attempt - r.base]

    def _member_attempt(self, peer: str, key: RoundKey, attempt: int) -> Attempt:
        a = self._attempt(key, attempt)
        if peer not in a.group:
            raise RemoteError(NOT_A_MEMBER, f"{peer[-8:]} is not in the group of {key} attempt {attempt}")
        return a

    async def watch(self, peer: str, key: RoundKey, attempt: int) -> Outcome:
        a = self._member_attempt(peer, key, attempt)
        await a.decided.wait()
        assert a.outcome is not None  # set before decided (our own invariant, not peer input)
        return a.outcome

    async def report(self, peer: str, rep: Report) -> Outcome:
        self.note_running()
        a = self._member_attempt(peer, rep.key, rep.attempt)
        self.outcomes.record(peer, rep, a)
        await a.decided.wait()
        assert a.outcome is not None  # set before decided
        return a.outcome

    def live(self, peer: str) -> bool:
        """Whether `peer` may still report: us, or connected and not found silent (probe.py)."""
        return peer == self.peer_id or (self.host.is_connected(peer) and peer not in self.silent.now())

    def attempts_of(self, key: RoundKey) -> list[Attempt]:
        """Round `key`'s attempts so far (the list itself: a retry appends to it)."""
        return self.rounds[key].attempts

    def attempt_id(self, key: RoundKey, index: int) -> int:
        """The id of round `key`'s attempt at `index` of `attempts_of` ("Attempt ids")."""
        return self.rounds[key].base + index

    def attempt_among(self, key: RoundKey, group: Sequence[str]) -> Attempt:
        """A new attempt of round `key` among `group` (`Attempt.among`)."""
        r = self.rounds[key]
        return Attempt.among(tuple(group), r.uplinks, r.tapers)

    def others_train(self, key: RoundKey, group: Sequence[str]) -> bool:
        """Whether candidates of round `key` outside `group` train now (a fresh progress record;
        unknown without `reported_step`: False). One fetching a state may be fetching ours."""
        reported = self.reported_step
        if reported is None:
            return False
        outside = set(self._candidates(key)) - set(group) - {self.peer_id}
        return any(reported(p) is not None for p in outside)
