"""A trainer's entry into the roster: the round from which every peer counts it in grouped rounds.

The problem. Grouped rounds are a pure function of (seed, round, roster) (collective/groups.py),
so every peer must compute a round from the same roster. Taken as "the trainers in my replica of
the membership", it was not: a joiner's record reached different peers seconds apart, rounds of a
small model last well under a second, and for several rounds around every join peers computed
different groups — a coordinator held one round both as the whole swarm and as a group, each with
part of the peers, and the minority waited out its hard join deadline (3 × the join timeout) at
every disagreement (tests/test_grouped_daemons.py, before this).

The design: the roster is a function of the round. A trainer's membership record carries the
round id from which it is in the roster (`in_from`, crdt/swarm_records.py); the roster of round r
is the live trainers whose `in_from` falls in r's group round or earlier (`in_roster`,
collective/groups.py). A joiner picks its `in_from` ahead of the swarm's round by a *lead*, far
enough that its record has reached every peer before that round starts (`entry_round`):
- The lead is a time, not a number of rounds: what it covers is the record's spread — gossip at
  once, and when a message is missed, the next heartbeat or an anti-entropy exchange — which
  takes the same seconds whether rounds take 20 ms or 20 minutes. So it is `LEAD_BEATS`
  heartbeat intervals of the swarm (6 s in a small swarm, stretching as heartbeats do in a large
  one), converted to rounds with the swarm's observed pace (`StepPace`: the swarm's furthest
  step, watched for up to `PACE_WINDOW_S`), in `MIN_LEAD_ROUNDS`..`MAX_LEAD_ROUNDS`. A fixed
  count of rounds would be milliseconds where rounds are fast and hours where they are slow.
  Rounds longer than the watch leave only a lower bound (the watch's length); the step rate
  the training peers report (`reported_round_seconds`) then bounds them better — a benchmark of
  25 s rounds counted a 6.5 s lead as 7 rounds from a 2 s watch, and its joiner waited 3 minutes.
- Until its round the joiner takes part in none: it waits, announced, and once the swarm reaches
  the round before its own takes the normal join path (node/state/download.py `download`,
  `OuterOptimizer.join`) with that round's state, so its first exchange is its round — entering a
  step before it if the swarm is in it already, waiting for the joiner. No second join protocol.
- Only where it matters: when the swarm's rounds run in groups once the joiner is in, counting
  every live member (joiners still syncing too: they are trainers soon) — `GroupPlan.splits`.
  An ungrouped swarm (the default `group_size` 0 up to 32 peers) has one group, the candidates,
  whoever counts whom; its joiner is in from round 0 and waits for nothing, as before.

Why not the alternatives. *Counting a joiner from the round its record arrived*: that is the
arrival time again, different on every peer. *A round agreed through the round's coordinator*:
grouped rounds have one coordinator per group, chosen from the groups — the very thing to agree
on. *A leader that admits joiners*: a node the swarm cannot lose, which meshtrain has none of.

Failures. A pace misjudged costs the joiner waiting time, never agreement: the round is
announced, whatever it is. The pace before a join overstates the pace after it — a peer alone
runs rounds without the network, ~20 ms each for a tiny model, and the joiners slow it — so the
lead is at most `MAX_LEAD_ROUNDS` rounds: converted unbounded, a joiner of a swarm of one waited
270 rounds, 80 s once the others had joined (tests/test_grouped_daemons.py). The price is a
shorter lead in time where rounds are faster than lead / `MAX_LEAD_ROUNDS` (0.19 s in a small
swarm); there a record that spreads late costs a slow round, as a departure does. A joiner
whose download lands after its round started misses it: its group waits for it as for a late
peer (the coordinator stops waiting once the joiner's progress reports a step past the round),
a slow round, and every later round agrees. The roster's departures are not announced: a peer
that dies drops out when its lease runs out on each peer, a clean leave when its record
arrives; the collective tolerates those as slow rounds (collective/groups.py, "Failures"). A
trainer that re-syncs keeps its place (its role stays "trainer": node/training_run.py) and
rejoins at the swarm's next round; meanwhile its group waits for it as for a late peer. Peers
that predate `in_from` count every trainer from round 0: mixed with them, a join is disagreed on
as before, until its round.

Not here: the record's field and its checks (crdt/swarm_records.py), the roster's rule and the
groups (collective/groups.py), announcing and reading it (node/presence.py `enter_roster`,
`roster`), the join itself (node/state/download.py).
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass, field

LEAD_BEATS = 2  # the lead: this many of the swarm's heartbeat intervals (module docstring)
MIN_LEAD_ROUNDS = 2  # ... and never fewer rounds than this
MAX_LEAD_ROUNDS = 32  # ... nor more (module docstring, "Failures": the pace before a join overstates it)
PACE_WINDOW_S = 2.0  # how long a joiner watches the swarm's step for its pace, at most
PACE_CHANGES = 3  # ... or until it saw the step change this many times
PACE_POLL_S = 0.05  # how often it looks
PACE_SAMPLES = 16  # a pace keeps this many of the newest changes


def lead_rounds(
    lead_s: float, round_s: float, min_rounds: int = MIN_LEAD_ROUNDS, max_rounds: int = MAX_LEAD_ROUNDS
) -> int:
    """Group rounds that cover `lead_s` seconds at `round_s` seconds a round, in
    `min_rounds`..`max_rounds` (`max_rounds` when the pace says nothing: rounds of no time)."""
    if not round_s > 0 or lead_s / round_s >= max_rounds:  # NaN and rounds of ~no time included
        return max_rounds
    return max(min_rounds, math.ceil(lead_s / round_s))


def reported_round_seconds(steps_per_s: Iterable[float], period: int) -> float | None:
    """Seconds per group round (`period` inner steps) at the median of the step rates the
    training peers report (their `steps_per_s` metric, node/trainer.py: how fast a step counter
    moves while it does not wait on a round), or None with no usable rate. Rounds' waits are not
    in it, so it reads rounds short: more lead rounds, never fewer, like a watch's lower bound."""
    rates = sorted(r for r in steps_per_s if math.isfinite(r) and r > 0)
    if not rates:
        return None
    return period / rates[(len(rates) - 1) // 2]


def entry_round(swarm_step: int, period: int, rounds_ahead: int) -> int:
    """The round id a joiner is in from: the start of the group round `rounds_ahead` rounds after
    the one the swarm runs next (the swarm is at inner step `swarm_step`; `period` round ids make
    a group round). The swarm runs `rounds_ahead` rounds without the joiner first."""
    return (swarm_step // period + 1 + rounds_ahead) * period


@dataclass
class StepPace:
    """The swarm's pace, from its furthest step watched over time (a pure state machine: the
    caller passes each reading with its time). Progress records go out when a peer's round changes,
    so the step is seen to move about once a round."""

    # (time, step) where it changed: the newest `PACE_SAMPLES`, so a pace watched for days (the
    # connection bound's, node/bound.py) follows the swarm's recent rounds in bounded memory
    samples: deque[tuple[float, int]] = field(default_factory=lambda: deque(maxlen=PACE_SAMPLES))

    def saw(self, now: float, step: int | None) -> None:
        if step is not None and (not self.samples or step > self.samples[-1][1]):
            self.samples.append((now, step))

    @property
    def changes(self) -> int:
        """How often the step was seen to move (the first reading is no change)."""
        return max(0, len(self.samples) - 1)

    def round_seconds(self, watched_s: float, period: int) -> float:
        """Seconds per group round (`period` inner steps), after watching for `watched_s` seconds:
        measured from the first change to the last when the step changed at least twice; else a
        lower bound — rounds shorter than half the watch would have moved it twice, shorter than
        the watch once — which counts more lead rounds, never fewer."""
        if self.changes >= 2:
            (t0, s0), (t1, s1) = self.samples[1], self.samples[-1]
            return (t1 - t0) * period / (s1 - s0)
        return watched_s / (self.changes + 1)
