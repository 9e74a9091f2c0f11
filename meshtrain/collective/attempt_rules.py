"""How a coordinator decides one attempt of a round from its members' reports.

The problem. Once a round's group is fixed (coordinator.py), its members move their parts in a
data phase (data_phase.py) — an *attempt* — and each reports how it went: done, with the digest
of the result it holds, or failed, naming the members it suspects (with proof when it received
garbage, and itself when it is leaving). The coordinator must reach one decision every member
learns: `Commit` (who holds the result, who must re-sync), `Retry` among the survivors, or
`Abort`. The reports are untrusted and partial: a killed peer never reports, one failure breaks
everyone's transfers so innocent peers are blamed too, and a liar may accuse an honest peer.

The design. `Attempt` keeps the group, the reports (taken once, cut to the group: a report
cannot name outsiders) and when the first report and the first failure came. The rules are pure
functions of it and of the clock, the same on every coordinator:
- `commit_of`: everyone reported (or the report deadline passed): the majority digest wins; a
  member holding another digest re-syncs, one that never reported is `unconfirmed`. No digest at
  all is no commit: the silent members are dropped instead.
- `whom_to_drop`: after a failure, who goes — a member that accused itself (it is leaving); one
  a majority of the provers blame (garbage data: one liar cannot evict an honest peer); one
  blamed that never reported (gone) — though one blamed by a minority and still connected gets
  until the report deadline (a busy CPU is slow to report: `None`, ask again); one a majority of
  all reporters blame that holds no proof itself (it stalls everyone). If nothing singles anyone
  out, everyone blamed goes, so a retry always makes progress.
- `next_group`: the survivors retry, unless none is left, the retry would be a round of one
  after another member left by itself (the leaver may complete the round elsewhere, and a round
  of one would publish a second φ for it: a 30-minute soak's parity violation at round 413), or
  would be a round of one while peers outside the group train (they are in the round at another
  coordinator, whose view had them when ours did not: a 30-minute soak's coordinator retried
  alone beside two restarted trainers that had committed the round among themselves — two φ,
  healed by the parity rule), the attempts ran out, or nobody was dropped (no progress): then
  `Abort`, and every member proceeds alone and withholds its φ. Where nobody else trains, a
  retry of one is the round's survivor, not a lineage of its own (the members dropped were told
  the round failed for them).

Not here: the timers that call these rules and the hold after a pause of ours
(attempt_outcomes.py), the messages (protocol.py).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

import trio

from meshtrain.collective.protocol import Abort, Commit, Outcome, Report
from meshtrain.collective.shares import part_shares


@dataclass
class Attempt:
    """One try of a round's data phase among `group`, and what its members reported."""

    group: tuple[str, ...]
    shares: tuple[int, ...] = ()  # the members' part sizes (shares.py; empty: equal parts)
    taper: int = 0  # how many of each part's last stripes shrink (flat.py `stripe_bounds`)
    started: float = field(default_factory=trio.current_time)
    reports: dict[str, Report] = field(default_factory=dict)
    outcome: Outcome | None = None
    decided: trio.Event = field(default_factory=trio.Event)
    first_report: float | None = None
    first_fail: float | None = None
    held: bool = False  # no decision while its members are asked whether they stayed (a pause of ours)

    @classmethod
    def among(
        cls, group: tuple[str, ...], uplinks: Mapping[str, float | None], tapers: Mapping[str, int | None]
    ) -> Attempt:
        """An attempt among `group`, its parts sized by the rates the members joined with
        (`uplinks`, shares.py) and its stripes tapered as far as every member can (`tapers`; 0 if
        one offered none: an older peer). Both travel with the group, so every member cuts the
        vector the same way. An empty group (every peer that joined left the candidates) tapers
        nothing; its joiners are told they are late (min() of nothing once ended the daemon)."""
        offered = [tapers.get(p) for p in group]
        taper = min((t for t in offered if t is not None), default=0) if None not in offered else 0
        return cls(group, part_shares([uplinks.get(p) for p in group]), taper)

    def decidable(self) -> bool:
        return not self.decided.is_set() and not self.held

    def take(self, peer: str, rep: Report) -> None:
        """Keep `peer`'s report, its suspects cut to the group."""
        self.reports[peer] = Report(
            rep.key,
            rep.attempt,
            rep.status,
            rep.digest,
            tuple(s for s in rep.suspects if s in self.group),
            tuple(rep.rejected),
            bool(rep.evidence),
        )

    @property
    def failed(self) -> bool:
        return any(rep.failed for rep in self.reports.values())

    @property
    def all_reported(self) -> bool:
        return set(self.reports) >= set(self.group)

    def describe_failures(self) -> str:
        """The failure reports, for the log: `reporter>suspect,suspect!` (`!`: with proof)."""
        return ";".join(
            f"{p[-8:]}>{','.join(x[-8:] for x in rep.suspects)}{'!' if rep.evidence else ''}"
            for p, rep in sorted(self.reports.items())
            if rep.failed
        )


def commit_of(a: Attempt) -> Commit | None:
    """The commit of `a`'s done reports, the majority digest winning; None when no report
    carries a digest (a done report without one, which `Report.parse` allows, is no vote)."""
    done = {p: rep for p, rep in a.reports.items() if not rep.failed}
    counts: dict[bytes, int] = {}
    for rep in done.values():
        if rep.digest is not None:
            counts[rep.digest] = counts.get(rep.digest, 0) + 1
    if not counts:
        return None
    best = max(counts.items(), key=lambda kv_: (kv_[1], kv_[0]))[0]
    return Commit(
        digest=best,
        group=a.group,
        holders=tuple(sorted(p for p, rep in done.items() if rep.digest == best)),
        resync=tuple(sorted(p for p, rep in done.items() if rep.digest != best)),
        unconfirmed=tuple(sorted(set(a.group) - set(a.reports))),
        rejected=tuple(sorted({x for rep in done.values() for x in rep.rejected if x in a.group})),
    )


def whom_to_drop(a: Attempt, *, live: Callable[[str], bool], now: float, report_timeout: float) -> set[str] | None:
    """The members to drop after `a`'s failure reports so far, or None while a blamed member that
    is `live` (still connected) and blamed by a minority has not reported and the report deadline
    (from the first failure) has not passed: hear it first. Never empty when anyone was blamed."""
    fails = {p: rep for p, rep in a.reports.items() if rep.failed}
    blamed: dict[str, set[str]] = {}
    proof: dict[str, set[str]] = {}
    for p, rep in fails.items():
        for s in rep.suspects:
            blamed.setdefault(s, set()).add(p)
            if rep.evidence:
                proof.setdefault(s, set()).add(p)
    provers = {p for p, rep in fails.items() if rep.evidence}
    silent = {s for s in blamed if s not in a.reports}
    # A peer that a minority blames and that has not reported yet but is still connected is
    # probably just slow to report (a busy CPU): hear it before dropping it, up to the report
    # deadline. A killed peer is disconnected, and a staller is blamed by the majority.
    slow = {s for s in silent if 2 * len(blamed[s]) <= len(a.reports) and s not in proof and live(s)}
    if slow and a.first_fail is not None and now - a.first_fail < report_timeout:
        return None
    drop = {s for s, who in proof.items() if s in who or 2 * len(who) > len(provers)}
    drop |= silent
    # Majority blame, except against a peer that holds proof: abandoning the attempt on
    # evidence breaks everyone's transfers to it, so the others' blame is only the echo.
    drop |= {s for s, who in blamed.items() if 2 * len(who) > len(a.reports) and s not in provers}
    return drop or set(blamed)


def next_group(
    a: Attempt, suspects: set[str], attempts: int, max_attempts: int, others_train: bool = False
) -> tuple[str, ...] | Abort:
    """The group of the retry after dropping `suspects` from `a` (the round's `attempts`-th), or
    the `Abort` that ends the round instead. `others_train`: whether peers of the round's
    candidates outside `a`'s group train now (the coordinator's view)."""
    survivors = tuple(p for p in a.group if p not in suspects)
    left = [p for p in suspects if (rep := a.reports.get(p)) is not None and rep.failed and p in rep.suspects]
    if not survivors:
        return Abort("no member left")
    if len(survivors) == 1 < len(a.group) and left:
        return Abort(f"{','.join(sorted(p[-8:] for p in left))} left the round; a round of one is not the swarm's")
    if len(survivors) == 1 < len(a.group) and others_train:
        return Abort("a round of one beside peers that train outside it is not the swarm's")
    if attempts >= max_attempts or len(survivors) == len(a.group):
        return Abort("too many failed attempts" if suspects else "no progress")
    return survivors
