"""Replay screening: a contribution that repeats an earlier round's.

Problem. A peer that replays an old pseudo-gradient (its own, another peer's, or a round's
aggregate) does no work and still points roughly the right way, so norm and direction screening
(aggregation.py `screen_contributions`) pass it. Loss scoring (node/trust/scoring.py) catches it only
once the swarm has moved far enough from the round it was computed in, and only for the few
peers a round samples: in bench_adversarial.py's runs a replayer survived up to 6 rounds.

Design. The owner of a part already holds every contribution to it. Before it combines them it
compares each with what it kept of that part from its last `ECHO_ROUNDS` committed rounds of the
same tag (every contributor's contribution and the committed aggregate), and a contribution whose
cosine with any of them is at least the threshold (`AllReduceConfig.screen_echo`; the spec's
`screen_echo`, default 0.9999) is an *echo* (`EchoMemory.match`). It is dropped from the part's
combination, like a contribution with NaN in it (data_phase.py: named in the attempt's
`rejected`, so the round's outcome excludes its sender), so a replay never reaches the model, and
flagged (`PartSketch.flag`) once the round commits, when the round's sketch is kept
(`EchoMemory.remember`). Each owner drops it from its own part: together they drop it from all
of them.

Honest updates never come that close: consecutive rounds' updates share the inner optimizer's
momentum and the swarm's direction, and at small H they are alike (scripts/studies/echo_separation.py,
gpt-tiny, per part of 8, against every earlier round of 20, 3 seeds: the largest honest cosine
0.9987 at H = 2, 0.9964 at H = 3, 0.990 at H = 5, 0.945 at H = 10, 0.62 at H = 50; a replay's
1.0). The margin is thinnest at small H, and it narrows as a run goes on (0.9924 at H = 2 over 12
rounds): the threshold leaves a factor of 13 in 1 - cosine there. The codecs are deterministic, so a
replay decodes to the same values: its cosine is 1.0 whatever the codec. An earlier round that
most of this round's contributors (two or more) repeat on the shared coordinates is not judged:
there honest updates repeat too (coordinates no batch reaches, whose update is weight decay
alone, proportional to φ, and so nearly the same each round), and a replaying minority cannot
make the others repeat.

What is kept. Not the contributions — a sketch: the coordinates whose index in the flat input
(all the round's tensors flattened in order) is a multiple of `stride`, `echo_stride(numel)`, so
about `ECHO_SAMPLES` coordinates over the whole input whatever the group. Parts move between
rounds (a member joins or leaves, parts are weighted by bandwidth: shares.py), so two rounds'
sketches are compared on the coordinates both hold (`MIN_OVERLAP` at least). Memory per tag:
`ECHO_ROUNDS` x (contributors + 1) x this owner's share of `ECHO_SAMPLES` floats (8 rounds of 8
peers: 2.4 MB); cost per round: a few matrix products of that size.

Evidence. An echo flag (`ContributionFlag` with rule "echo") carries the cosine (`echo`), the
earlier round it matched (`earlier`), and the contribution's norm over the aggregate's and its
cosine with the aggregate on the sketch's coordinates (`norm_ratio`, `alignment`). The node turns
it into a signed strike like any screening flag (node/trust/strikes.py), counted only with half the
round's others agreeing: every owner sees a replay on its own part. Dropping needs no agreement:
an owner decides its own part's combination, and an honest owner's false echo (none measured)
would cost one part one contribution, as the trimmed mean's trim does.

Not caught here: a replay perturbed by noise of more than ~1.4 % of its norm (cosine under
0.9999), or blended with fresh work (which is then partly work); a replay of a round older than
`ECHO_ROUNDS` rounds that this owner did not see repeated since; in grouped rounds
(collective/groups.py) an owner sees a peer only in the rounds they share a group. Those are
left to loss scoring and spot-checks (node/trust/scoring.py, node/trust/spot_check.py). Two peers sending
the same contribution in one round are not flagged: which one copied cannot be told.
"""

from __future__ import annotations

import dataclasses
import math
from collections import OrderedDict, deque
from dataclasses import dataclass

import torch

from meshtrain.collective.contract import ContributionFlag

ECHO_ROUNDS = 8  # committed rounds per tag an owner remembers
ECHO_SAMPLES = 1 << 16  # coordinates sketched over a round's whole flat input
MIN_OVERLAP = 64  # coordinates two sketches must share to be compared
MAX_TAGS = 64  # tags remembered (streaming's fragments each have one), least recently used dropped
ECHO = "echo"  # the rule of an echo flag


def echo_stride(numel: int) -> int:
    """Every `echo_stride(numel)`-th coordinate of a flat input of `numel` is sketched."""
    return max(1, numel // ECHO_SAMPLES)


@dataclass(frozen=True)
class Echo:
    """A contribution that repeats `earlier` round's contribution or aggregate: its cosine with it."""

    peer: str
    cosine: float
    earlier: int


@dataclass(frozen=True)
class PartSketch:
    """What an owner keeps of one round's part [`start`, b): the sampled coordinates from `first`
    (a multiple of `stride`, the first in the part) on, each contributor's values there (`rows`,
    fp32) and, once the part is combined, the aggregate's (None before)."""

    round_id: int
    start: int
    first: int
    stride: int
    rows: dict[str, torch.Tensor]
    aggregate: torch.Tensor | None = None

    @classmethod
    def of(cls, round_id: int, part: tuple[int, int], numel: int, contributions: dict[str, torch.Tensor]) -> PartSketch:
        """The sketch of part `part` of a flat input of `numel` coordinates, from the part's
        contributions (each the part's slice, b - a values)."""
        a, _ = part
        stride = echo_stride(numel)
        first = -(-a // stride) * stride
        rows = {p: x[first - a :: stride].float().clone() for p, x in contributions.items()}
        return cls(round_id, a, first, stride, rows)

    def with_aggregate(self, aggregate: torch.Tensor) -> PartSketch:
        """This sketch with the part's combined value (the part's slice)."""
        return dataclasses.replace(self, aggregate=aggregate[self.first - self.start :: self.stride].float().clone())

    @property
    def count(self) -> int:
        return len(next(iter(self.rows.values()))) if self.rows else 0

    @property
    def last(self) -> int:
        """The index of the last sampled coordinate (first - stride: none)."""
        return self.first + (self.count - 1) * self.stride

    def window(self, first: int, last: int) -> slice:
        """The positions of coordinates first..last (multiples of stride, inclusive) in the rows."""
        return slice((first - self.first) // self.stride, (last - self.first) // self.stride + 1)

    def flag(self, echo: Echo, part: int) -> ContributionFlag:
        """The screening flag of `echo` as the owner of part `part`, its norm ratio and alignment
        against this sketch's aggregate."""
        row, agg = self.rows[echo.peer], self.aggregate
        row_norm, agg_norm = float(row.norm()), float(agg.norm()) if agg is not None else 0.0
        norm_ratio = row_norm / agg_norm if agg_norm > 0 else 0.0
        alignment = 0.0
        if agg is not None and agg_norm > 0 and row_norm > 0:
            alignment = float(row @ agg) / (row_norm * agg_norm)
        return ContributionFlag(
            echo.peer,
            part,
            round(norm_ratio, 6) if math.isfinite(norm_ratio) else 0.0,
            round(alignment, 6) if math.isfinite(alignment) else 0.0,
            ECHO,
            echo=round(min(echo.cosine, 1.0), 6),
            earlier=echo.earlier,
        )


def unit_rows(rows: torch.Tensor) -> torch.Tensor:
    """`rows` scaled to unit norm (all-zero rows stay zero)."""
    return rows.div(rows.norm(dim=1, keepdim=True).clamp_min(1e-30))


class EchoMemory:
    """One owner's memory of its parts' recent committed rounds, per tag, and the echo check
    (module docstring). threshold: the cosine at which a contribution repeats an earlier one (0:
    off)."""

    def __init__(self, threshold: float, rounds: int = ECHO_ROUNDS) -> None:
        self.threshold, self.rounds = threshold, rounds
        self._kept: OrderedDict[str, deque[PartSketch]] = OrderedDict()

    def match(self, tag: str, sketch: PartSketch) -> list[Echo]:
        """The contributions of `sketch`'s round that repeat a contribution or aggregate of an
        earlier committed round of `tag` (round id below it) on the coordinates both hold, by
        peer. An earlier round that most of this round's contributors (two or more) repeat is not
        judged: where honest updates repeat too, a repeat is no evidence."""
        if self.threshold <= 0:
            return []
        earlier = [s for s in self._kept.get(tag, ()) if s.round_id < sketch.round_id and s.stride == sketch.stride]
        peers = [p for p in sorted(sketch.rows) if float(sketch.rows[p].norm()) > 0]
        best: dict[str, tuple[float, int]] = {}
        for old in earlier if peers else ():
            lo, hi = max(sketch.first, old.first), min(sketch.last, old.last)
            if hi < lo or (hi - lo) // sketch.stride + 1 < MIN_OVERLAP:
                continue
            now_w, old_w = sketch.window(lo, hi), old.window(lo, hi)
            before = [r[old_w] for r in old.rows.values()]
            if old.aggregate is not None:
                before.append(old.aggregate[old_w])
            current = unit_rows(torch.stack([sketch.rows[p][now_w] for p in peers]))
            cosines = (current @ unit_rows(torch.stack(before)).T).max(dim=1).values.tolist()
            repeats = [(p, c) for p, c in zip(peers, cosines, strict=True) if c >= self.threshold]
            if len(repeats) >= 2 and 2 * len(repeats) > len(peers):
                continue  # most of the round repeats that round here (weight decay alone): no evidence
            for p, c in repeats:
                if c > best.get(p, (-2.0, 0))[0]:
                    best[p] = (c, old.round_id)
        return [Echo(p, c, r) for p, (c, r) in sorted(best.items())]

    def remember(self, tag: str, sketch: PartSketch) -> None:
        """Keep a committed round's sketch (with its aggregate) for the rounds after it."""
        kept = self._kept.setdefault(tag, deque(maxlen=self.rounds))
        self._kept.move_to_end(tag)
        if sketch.count:
            kept.append(sketch)
        while len(self._kept) > MAX_TAGS:
            self._kept.popitem(last=False)
