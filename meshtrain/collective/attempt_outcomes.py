"""Deciding a round's attempts on time: the coordinator's side of an attempt once its group is
fixed.

The problem. attempt_rules.py says what an attempt's reports decide — `Commit`, `Retry` among the
survivors, `Abort` — as pure functions of the reports and the clock. Someone must call them at
the right moments: when the last report comes in, after a grace once the first failure came (one
failure breaks everyone's transfers, so innocent peers look guilty until the others are heard:
`FAIL_GRACE`), at the report deadline once the first success came (a killed member never
reports) — or as soon as every member yet to report is gone (its connection closed, or found
silent: a 30-minute soak's round waited out the 10 s deadline for a member killed just after its
data phase, the two others done) — and never while the attempt is held after a pause of our own,
when a member that took us for silent may have completed the round elsewhere.

The design. `AttemptOutcomes` takes the reports (`record`) and runs the timers in the
coordinator's nursery; each timer notes the coordinator's pulse before it decides (a pause of
ours holds the attempts it finds under way: coordinator.py, "Our own pauses"), and an attempt
decided or held meanwhile is left alone. A commit at the report deadline waits, with weighted
parts (shares.py), for members still connected as long again as the first reporter took (by
design they finish later: a slow peer still downloads the results) rather than leave them
`unconfirmed`. A retry is a new attempt of the same round among the survivors, its parts sized
by the coordinator (`RoundsKeeper.attempt_among`). After a pause of ours, a held attempt goes on
only if every other member says it stayed (own_pauses.py `gone_members`), else it is aborted.

Failures: none of its own — a member that never reports is dropped at the deadlines above; the
outcome reaches each member through its `watch` or `report` call (coordinator.py).

Not here: the rules themselves (attempt_rules.py), group formation and the pause check
(coordinator.py), the messages (protocol.py).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Sequence
from typing import Protocol

import trio

from meshtrain.collective.attempt_rules import Attempt, commit_of, next_group, whom_to_drop
from meshtrain.collective.own_pauses import OwnPauses
from meshtrain.collective.protocol import FAIL_GRACE, Abort, AllReduceConfig, Report, Retry, RoundKey
from meshtrain.log import get_logger, kv

log = get_logger(__name__)

POLL_S = 0.25  # a decision put off (a slow member heard first, a weighted part still working) is retried this often


class RoundsKeeper(Protocol):
    """What `AttemptOutcomes` needs of the coordinator that keeps the rounds."""

    def live(self, peer: str) -> bool:
        """Whether `peer` may still report: us, or connected and not found silent."""
        ...

    def start_soon(self, fn: Callable[..., Awaitable[object]], *args: object) -> None:
        """Run a timer in the coordinator's nursery."""
        ...

    def note_running(self) -> None:
        """The coordinator's pulse: a pause of ours just ended holds the attempts under way."""
        ...

    def attempts_of(self, key: RoundKey) -> list[Attempt]:
        """Round `key`'s attempts so far (the list itself: a retry appends to it)."""
        ...

    def attempt_among(self, key: RoundKey, group: Sequence[str]) -> Attempt:
        """A new attempt of round `key` among `group`, its parts sized for them."""
        ...

    def attempt_id(self, key: RoundKey, index: int) -> int:
        """The id of round `key`'s attempt at `index` of `attempts_of` (members name it so)."""
        ...

    def others_train(self, key: RoundKey, group: Sequence[str]) -> bool:
        """Whether candidates of round `key` outside `group` train now (a fresh progress record)."""
        ...


class AttemptOutcomes:
    """Decides the attempts of one coordinator's rounds from their members' reports, on time
    (module docstring)."""

    def __init__(self, keeper: RoundsKeeper, config: AllReduceConfig, pauses: OwnPauses) -> None:
        self.keeper, self.config, self.pauses = keeper, config, pauses

    def record(self, peer: str, rep: Report, a: Attempt) -> None:
        """Take `peer`'s report of attempt `a`, and decide once all are in, or set the timer."""
        if a.decided.is_set():
            return
        a.take(peer, rep)
        if a.all_reported:
            self._decide_failure(rep.key, a) if a.failed else self._conclude(rep.key, a)
        elif rep.failed and a.first_fail is None:
            # One failure cancels everyone's attempt, and the transfers it breaks make
            # innocent peers look guilty: hear the others before choosing whom to drop.
            a.first_fail = trio.current_time()
            self.keeper.start_soon(self._decide_later, rep.key, a, FAIL_GRACE, self._decide_failure)
        elif a.first_report is None and not a.failed:
            a.first_report = trio.current_time()
            self.keeper.start_soon(self._await_reports, rep.key, a)

    def decide_if_due(self, key: RoundKey, a: Attempt) -> None:
        """Decide `a` now if its reports or deadlines would have while it was held."""
        now = trio.current_time()
        if a.all_reported:
            self._decide_failure(key, a) if a.failed else self._conclude(key, a)
        elif a.first_fail is not None and now >= a.first_fail + FAIL_GRACE:
            self._decide_failure(key, a)
        elif a.first_report is not None and not a.failed and now >= a.first_report + self.config.report_timeout:
            self._conclude_when_due(key, a)

    async def confirm_members(self, key: RoundKey, i: int, a: Attempt, pause: float) -> None:
        """After a pause of ours, attempt `i` of round `key` (held meanwhile: no report decides
        it) goes on only if every other member says it stayed (own_pauses.py `gone_members`);
        otherwise it is aborted — one that took us for silent may complete the round at the
        next candidate, and a commit here would be a second φ for the round."""
        gone = await self.pauses.gone_members(key, a.group)
        a.held = False
        if a.decided.is_set():
            return
        if gone:
            a.outcome = Abort(f"the coordinator was paused {pause:.0f} s; {len(gone)} member(s) went on without it")
            a.decided.set()
            log.info(
                kv(
                    "allreduce attempt aborted: we were paused",
                    key=key,
                    attempt=i,
                    paused_s=round(pause, 1),
                    gone=",".join(p[-8:] for p in gone),
                )
            )
            return
        log.info(kv("allreduce attempt kept across our pause", key=key, attempt=i, paused_s=round(pause, 1)))
        self.decide_if_due(key, a)

    async def _decide_later(
        self, key: RoundKey, a: Attempt, delay: float, decide: Callable[[RoundKey, Attempt], None]
    ) -> None:
        await trio.sleep(delay)
        self.keeper.note_running()
        if a.decidable() and not (decide != self._decide_failure and a.first_fail is not None):
            decide(key, a)

    async def _await_reports(self, key: RoundKey, a: Attempt) -> None:
        """After the first success report: conclude at the report deadline, or as soon as every
        member yet to report is gone (not `live`: it cannot report any more)."""
        assert a.first_report is not None  # set by `record` before this starts
        deadline = a.first_report + self.config.report_timeout
        while trio.current_time() < deadline:
            await trio.sleep(min(POLL_S, max(deadline - trio.current_time(), 0.0)))
            self.keeper.note_running()
            if not a.decidable() or a.first_fail is not None:
                return  # decided, held after a pause of ours, or a failure decides it
            missing = [p for p in a.group if p not in a.reports]
            if missing and not any(self.keeper.live(p) for p in missing):
                log.info(
                    kv(
                        "allreduce committing without members gone before reporting",
                        key=key,
                        gone=",".join(p[-8:] for p in missing),
                    )
                )
                self._conclude(key, a)
                return
        if a.decidable() and a.first_fail is None:
            self._conclude_when_due(key, a)

    def _conclude_when_due(self, key: RoundKey, a: Attempt) -> None:
        """Commit at the report deadline — but with weighted parts (`a.shares`) members finish at
        different times by design (a slow peer still downloads the results after the fast ones
        are done), so members still connected get as long again as the first reporter took,
        rather than being left `unconfirmed` to fetch the whole result again over a slow link."""
        now, first = trio.current_time(), a.first_report or 0.0
        working = [p for p in a.group if p not in a.reports and self.keeper.live(p)]
        if a.shares and working and now < first + max(self.config.report_timeout, first - a.started):
            self.keeper.start_soon(self._decide_later, key, a, POLL_S, self._conclude_when_due)
            return
        self._conclude(key, a)

    def _decide_failure(self, key: RoundKey, a: Attempt) -> None:
        """Drop whom the failure reports so far single out (attempt_rules.py `whom_to_drop`) and
        retry, or hear a slow member first."""
        if not a.decidable():
            return
        drop = whom_to_drop(
            a, live=self.keeper.live, now=trio.current_time(), report_timeout=self.config.report_timeout
        )
        if drop is None:
            self.keeper.start_soon(self._decide_later, key, a, POLL_S, self._decide_failure)
            return
        log.info(
            kv(
                "allreduce attempt failed",
                key=key,
                drop=",".join(sorted(x[-8:] for x in drop)),
                reports=a.describe_failures(),
            )
        )
        self._retry(key, a, drop)

    def _retry(self, key: RoundKey, a: Attempt, suspects: set[str]) -> None:
        """Retry without `suspects`, or abort (attempt_rules.py `next_group`)."""
        if not a.decidable():
            return
        attempts = self.keeper.attempts_of(key)
        others_train = self.keeper.others_train(key, a.group)
        group = next_group(a, suspects, len(attempts), self.config.max_attempts, others_train)
        if isinstance(group, Abort):
            a.outcome = group
        else:
            nxt = self.keeper.attempt_among(key, group)
            attempts.append(nxt)
            a.outcome = Retry(
                self.keeper.attempt_id(key, len(attempts) - 1), group, tuple(sorted(suspects)), nxt.shares, nxt.taper
            )
        a.decided.set()

    def _conclude(self, key: RoundKey, a: Attempt) -> None:
        """Commit the majority digest (attempt_rules.py `commit_of`); with no digest at all,
        retry without the members that never reported."""
        if not a.decidable():
            return
        commit = commit_of(a)
        if commit is None:
            return self._retry(key, a, set(a.group) - set(a.reports))
        a.outcome = commit
        a.decided.set()
