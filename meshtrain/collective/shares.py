"""How much of the vector each member of an all-reduce owns, given the members' link rates.

The problem (links of different speeds): the data phase cuts the flat input into one part per member and each
owner reduces its part and sends it back to everyone (data_phase.py). With equal parts a slow
member owns 1/n of the vector, and its link carries (n − 1)/n·M more than it must, so a round
with 2 of 8 peers at 20 Mbit/s and 6 at 100 Mbit/s takes 70 s for 100 MB where 40 s (M / B_slow:
the slow peer must still upload its input and download the result) is possible.

The rule (`part_shares`): member i owning a fraction f_i of the M elements sends (1 − f_i)·M in
the reduce-scatter and (n − 1)·f_i·M in the all-gather, and receives as much, so over a link of
rate B_i its time is T_i = M·(1 + (n − 2)·f_i) / B_i. The round ends with the slowest member, so
we minimise max_i T_i subject to Σ f_i = 1 and 0 ≤ f_i ≤ `MAX_PART_FACTOR`/n: water-filling,
the small linear program hivemind's load balancing (`hivemind/averaging/load_balancing.py`)
hands to a solver. For a target time T every member owns what keeps it within T,
f_i(T) = clip((T·B_i − 1) / (n − 2), 0, cap); Σ f_i(T) grows with T, so bisection finds the T
where the parts add up to the vector. Members too slow to finish within T even owning nothing
own nothing (they are the bottleneck anyway, at M / B_i); a slower member never owns more than
a faster one. The cap is there because a rate is a member's claim: one that claims a huge rate
owns at most twice its equal part (what an owner could corrupt grows no further), and one that
claims a tiny rate only gives its part away.

Equal parts, the old layout, whenever the rule cannot help or cannot be trusted: a rate unknown
for any member (an old peer, or no measurement yet), rates within `NEAR_EQUAL` of each other
(measurement noise must not reshuffle a homogeneous swarm), or n ≤ 2 (each member then moves M
whatever the split).

Shares are integers, so that the bounds every member computes from them (flat.py
`part_bounds`) are exact integer arithmetic: the coordinator applies the rule once, on the rates
the members sent with their joins, and announces the shares with the group (protocol.py
`Joined`, `Retry`); members never apply the rule to their own view of the rates.

Where a member's rate comes from: its configured `uplink_mbit` (AllReduceConfig), else
`egress_rate`, measured on its own sends in its last all-reduce that moved enough data
(member_round.py measures it, `SwarmCollective` keeps it, and it goes with the next join). A
round with no measurement yet runs with equal parts.

Not here: the bounds themselves (flat.py), sending the rates and shares (protocol.py,
coordinator.py).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

SHARE_SCALE = 1 << 16  # shares are fractions of the vector × this
NEAR_EQUAL = 1.5  # rates within this factor: equal parts (equal links measured up to 1.22 apart)
MAX_SHARE = 1 << 32  # a share from the wire above this is malformed
MIN_MEASURED_BYTES = 16 << 20  # an attempt that sent less tells little about the link (latency)
MAX_PART_FACTOR = 2.0  # no member owns more than this × an equal part (a rate is only a claim)


def part_shares(rates: Sequence[float | None]) -> tuple[int, ...]:
    """Each member's share of the vector (in the order of `rates`, bytes/s per member), or ()
    for equal parts. See the module docstring for the rule and when it falls back to ()."""
    n = len(rates)
    if n <= 2 or any(r is None or not math.isfinite(r) or r <= 0 for r in rates):
        return ()
    known = [float(r) for r in rates]  # type: ignore[arg-type]  # None excluded above
    if max(known) <= NEAR_EQUAL * min(known):
        return ()
    cap = min(1.0, MAX_PART_FACTOR / n)

    def fractions(t: float) -> list[float]:
        return [min(cap, max(0.0, (t * b - 1) / (n - 2))) for b in known]

    lo, hi = 0.0, (1 + (n - 2) * cap) / min(known)  # at hi every member owns `cap`: n·cap ≥ 1
    for _ in range(100):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if sum(fractions(mid)) < 1 else (lo, mid)
    shares = tuple(round(f * SHARE_SCALE) for f in fractions(hi))
    return shares if sum(shares) > 0 else ()


def egress_rate(sends: Sequence[tuple[float, float, int]], quantile: float = 0.9) -> float | None:
    """A peer's uplink in bytes/s, measured from its own sends of one attempt, each
    (start, end, bytes); None when they are too few to tell (under `MIN_MEASURED_BYTES`).

    Not bytes ÷ the attempt's duration: a round lasts as long as its slowest member, so every
    member would measure the bottleneck. Each send is taken as flowing at its own average rate
    while it is in flight, the sends in flight at once add up, and the `quantile` of that sum
    over the time anything was in flight is the answer (a high one: a fast peer's sends to fast
    owners fill its link, however slowly its sends to a slow owner crawl meanwhile)."""
    if sum(n for _, _, n in sends) < MIN_MEASURED_BYTES:
        return None
    events: list[tuple[float, float]] = []
    for start, end, nbytes in sends:
        if end > start:
            events += [(start, nbytes / (end - start)), (end, -nbytes / (end - start))]
    events.sort()
    segments, rate = [], 0.0
    for (t, delta), (t_next, _) in zip(events, events[1:], strict=False):
        rate += delta
        if t_next > t and rate > 0:
            segments.append((rate, t_next - t))
    busy = sum(d for _, d in segments)
    if busy <= 0:
        return None
    acc = 0.0
    for rate, d in sorted(segments):
        acc += d
        if acc >= quantile * busy:
            return rate
    return max(segments)[0]
