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
  membership was behind);
- **deal with the missing peers** — the candidates that have not joined — by the rules of
  missing_peers.py (`MissingPeers`, which this coordinator composes): **end the round** when
  nobody else will come (they joined a later round here, report steps past it, or, asked where
  they are, are past it or in it at a coordinator we cannot reach: a majority that joined
  completes it at once, a minority is told it is `Late` and re-syncs), hand it over to where they
  are, or fix the group without peers found silent, left behind or away ("Silent peers" there);
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
(`CoordinatedRound.base`, coordinated_round.py): a member refuses for a while the transfers of an
attempt it abandoned, by tag (transport/tensor_inbox.py), and a tag names the attempt — numbered 0
again, a soak's reopened round had every transfer refused, each member excluded in turn (stop 66:
3.5 s without a round).

Groups that disagree. A grouped round's tag names the group (collective/groups.py: "f0~g1.2"),
computed from each peer's view of the round's roster (node/roster.py). Joins are announced ahead,
so every view agrees on them; departures are not: for a few seconds after peers leave, each
survivor may still count a different one of them, compute other groups and join the round under
another group's tag — at the same coordinator or another. Each of those rounds then waited for
peers that were in the round under a sibling tag: the hard deadline, 90 s by default, after which
everyone proceeded alone and re-synced (tests/test_grouped_daemons.py, three of six daemons
leaving). The probe (missing_peers.py `MissingPeers.probe`) finds them: a WHERE reply is about the
series (the tag without its group suffix) and names the tag the peer is in, and our own trainer's
is in `OwnRounds`. A missing peer in this round under another tag ends it with
`Late(regroup=True)`: everyone who joined computes its group again from its view now and joins anew
(allreduce.py, at most `MAX_REGROUPS` times); the round is forgotten here, so a join under its old
tag opens a fresh round, which probes again. Views converge within a heartbeat or two, so a
departure costs a round a probe interval (`PROBE_AFTER`) or two instead of the hard deadline. Two
peers whose groups agreed may form the round before that, under their tag; once our trainer ended
it, it is past for us, under no tag (own_rounds.py), and a peer still waiting here under another
tag is told the round has passed and re-syncs — not regrouped until `MAX_REGROUPS` runs out (CI). A
peer that predates `regroup` reads the reply as Late and proceeds alone, as it always did.

Members that come back. A member that left a round it thought silent while its join was in (the
rules for silent peers: missing_peers.py, "Silent peers") may come back to it (the coordinator was
only stopped): a second join from a member of the attempt under way counts as its leaving that
attempt (`_rejoined`), so the others retry without it at once.

Withdrawn joins. A member that stops waiting for our reply to its join (we left its round's
candidates, or went silent, for it: join_wait.py, member_round.py; or its exchange was cancelled)
tells us (`withdraw`, WITHDRAW_RPC). Before the group is fixed its join is dropped: it is elsewhere
now, and a group fixed with it would wait for data that never comes (a 30-minute soak's restarted
coordinator fixed a group with such a join, its own trainer away; the trainer, back, was told
"joined after the group was formed" for 27 s while the attempt waited out its deadline). The peer,
still a candidate, is then a missing one like any other (missing_peers.py: the probe finds where it
is). After, it is the member's leaving, as a second join is. A withdrawal can overtake its join (a
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
(protocol.py), moving data (data_phase.py), deciding attempts on time (attempt_outcomes.py), what
to do about the candidates that have not joined (missing_peers.py), the per-round record
(coordinated_round.py).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Sequence

import trio

from meshtrain.collective.attempt_outcomes import AttemptOutcomes
from meshtrain.collective.attempt_rules import Attempt
from meshtrain.collective.coordinated_round import CoordinatedRound
from meshtrain.collective.missing_peers import MissingPeers
from meshtrain.collective.own_pauses import OwnPauses
from meshtrain.collective.own_rounds import OwnRounds
from meshtrain.collective.probe import SilentPeers
from meshtrain.collective.protocol import (
    FAIL,
    JOIN_QUIET,
    NOT_A_MEMBER,
    PROBE_AFTER,
    PROBE_EVERY,
    UNKNOWN_ATTEMPT,
    WAIT_LOG_EVERY,
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
LATEST_KEPT = 4096  # (peer, series) -> latest round entries remembered
WITHDRAWN_KEPT = 1024  # (peer, key) -> withdrawal time entries remembered ("Withdrawn joins")


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
        known; an unanswered probe alone then makes a peer silent: missing_peers.py, "Silent
        peers").
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
        self.rounds: dict[RoundKey, CoordinatedRound] = {}
        # (peer, series) -> the highest round id that peer joined here; a series is a key without
        # its round id (tag + coordinator), so it tells a stale round from the swarm's current one.
        self.latest: dict[tuple[str, tuple[str, str]], int] = {}
        self.withdrawn: dict[tuple[str, RoundKey], float] = {}  # (peer, key) -> when ("Withdrawn joins")
        self.silent = SilentPeers(quiet, self.start_soon)  # missing peers found silent (probe.py)
        # what we do about candidates that have not joined (missing_peers.py)
        self.missing_peers = MissingPeers(self, host, config, self.own, self.silent, reported_step)
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

    def _round(self, key: RoundKey) -> CoordinatedRound:
        r = self.rounds.get(key)
        if r is None:
            # The candidates come from our own view of membership, never from a joiner's message.
            r = CoordinatedRound(key, self.candidates(key), trio.current_time())
            self.rounds[key] = r
            self.start_soon(self._fix_group_later, r)
            for old in list(self.rounds)[:-ROUNDS_KEPT]:
                del self.rounds[old]
        return r

    async def _fix_group_later(self, r: CoordinatedRound) -> None:
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
                await self.missing_peers.probe(r)
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
        self.fix_group(r)

    def _review(self, r: CoordinatedRound) -> None:
        """While collecting joins: follow membership (a peer that left — its connection closed, or
        its lease ran out — is no longer waited for), end a round nobody else will come to, or
        hand it over."""
        if r.group_fixed.is_set():
            return
        round_id = r.key.round_id
        self._refresh_expected(r)
        if r.expected <= set(r.joins):
            self.fix_group(r)
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
            self.missing_peers.without_silent(r, past)
            if r.group_fixed.is_set():
                return
        if missing and all(self.latest.get((p, r.key.series), -1) > round_id for p in missing):
            self.missing_peers.nobody_else_coming(r, "the missing peers joined a later round here")
            return
        # Us too: our own trainer, re-synced past this round while we coordinated it, will not
        # join it either (our peers' joins would wait out the hard deadline for us).
        if missing and all(self._reported_past(p, r.key) for p in missing):
            self.missing_peers.nobody_else_coming(r, "the missing peers report steps past this round")
            return
        me = self.peer_id
        lower = [
            p for p in sorted(self.candidates(r.key)) if p < me and p not in r.skipped and self.host.is_connected(p)
        ]
        if lower:
            self.hand_over(r, lower[0], "a lower id is connected")

    def _reported_past(self, peer: str, key: RoundKey) -> bool:
        """Whether `peer` told the swarm it is at an inner step past round `key`: it ended that
        round elsewhere (its report comes a step after its join to a round, wherever). For our
        own trainer we know more: whether it entered a later round of the series (own_rounds.py)."""
        if peer == self.peer_id and self.own.past(key):
            return True
        step = self.reported_step(peer) if self.reported_step is not None else None
        return step is not None and step > key.round_id

    def candidates(self, key: RoundKey) -> frozenset[str]:
        """Round `key`'s candidates in our view: `group`, cut to a follow-up's peers where our own
        trainer entered the round as one (`OwnRounds.among`)."""
        group = frozenset(self.group(key.round_id))
        among = self.own.among(key)
        return group if among is None else group & among

    def _refresh_expected(self, r: CoordinatedRound) -> None:
        """The peers the round waits for: our view's candidates now, and whoever joined."""
        r.expected = self.candidates(r.key) | frozenset(r.joins)

    def regroup(self, r: CoordinatedRound, tags: dict[str, str]) -> None:
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

    def _restart(self, r: CoordinatedRound, why: str, **fields: object) -> None:
        """End round `r` for everyone who joined with `Late(regroup=True)`: each joins anew at
        once, and the round is forgotten here, so their joins open it afresh. Logs `why`."""
        r.regroup = True
        r.group_fixed.set()
        if self.rounds.get(r.key) is r:
            del self.rounds[r.key]
        log.info(kv(why, key=r.key, **fields))

    def hand_over(self, r: CoordinatedRound, to: str, why: str) -> None:
        """Everyone who joined here is told to start the round again at `to`."""
        r.moved = to
        r.group_fixed.set()
        if self.rounds.get(r.key) is r:
            del self.rounds[r.key]
        log.info(kv("allreduce coordinator handing over", key=r.key, to=to[-8:], why=why))

    def fix_group(self, r: CoordinatedRound) -> None:
        """Fix the round's group: those who joined and are candidates in our view now. A peer
        whose join came in (sent ahead of the round: prepared.py) and that has since left our
        candidates — excluded by the swarm's strikes, its lease or connection gone — is told it
        is late rather than taken in: a strike that landed while the next round was forming must
        not wait a round more to take effect."""
        if not r.group_fixed.is_set():
            candidates = set(self.candidates(r.key)) | {self.peer_id}
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
            self.fix_group(r)
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
        self, r: CoordinatedRound, peer: str, why: str = "allreduce member joined again; leaving the attempt without it"
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
        outside = set(self.candidates(key)) - set(group) - {self.peer_id}
        return any(reported(p) is not None for p in outside)
