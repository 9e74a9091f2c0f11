"""Replay screening: a contribution that repeats an earlier round's (issue 21, items 4a and 5).

Problem. A peer that replays an old pseudo-gradient (its own, another peer's, or a round's
aggregate) does no work and still points roughly the right way, so norm and direction screening
(data_phase.py `screen_contributions`) pass it. Loss scoring (node/scoring.py) catches it only
once the swarm has moved far enough from the round it was computed in, and only for the few
peers a round samples: in bench_adversarial.py's runs a replayer survived up to 6 rounds.

Design. The owner of a part already holds every contribution to it. After a round commits it
compares each contribution with what it held of that part in its last `ECHO_ROUNDS` committed
rounds of the same tag (every contributor's and the committed aggregate), and flags one whose
cosine with any of them is at least the threshold (`AllReduceConfig.screen_echo`; the spec's
`screen_echo`, default 0.9999). Honest updates never come that close: consecutive rounds' updates
share the inner optimizer's momentum and the swarm's direction, and at small H they are alike
(scripts/echo_separation.py, gpt-tiny, per part of 8: the largest honest cosine with any earlier
update or aggregate 0.994 at H = 2, 0.996 at H = 3, 0.98 at H = 5, 0.62 at H = 50; a replay's
1.0). The codecs are deterministic, so a replay decodes to the same values: its cosine is 1.0
whatever the codec. Where the round's own aggregate repeats an earlier round on the shared
coordinates, that round is not compared: there honest updates repeat too (coordinates no batch
reaches, whose update is weight decay alone, proportional to φ, and so nearly the same each
round), as a replay with an honest majority never makes the aggregate do.

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
it into a signed strike like any screening flag (node/strikes.py), counted only with half the
round's others agreeing: every owner sees a replay on its own part.

Not caught here: a replay perturbed by noise of more than ~1.4 % of its norm (cosine under
0.9999), or blended with fresh work (which is then partly work); a replay of a round older than
`ECHO_ROUNDS` rounds that this owner did not see repeated since; in grouped rounds
(collective/groups.py) an owner sees a peer only in the rounds they share a group. Those are
left to loss scoring and spot-checks (node/scoring.py, node/spot_check.py). Two peers sending
the same contribution in one round are not flagged: which one copied cannot be told.
"""

from __future__ import annotations

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
class PartSketch:
    """What an owner keeps of one committed round's part [a, b): the sampled coordinates from
    `first` (a multiple of `stride`, the first in the part) on, each contributor's values there
    (`rows`, fp32) and the committed aggregate's."""

    round_id: int
    first: int
    stride: int
    rows: dict[str, torch.Tensor]
    aggregate: torch.Tensor

    @classmethod
    def of(
        cls,
        round_id: int,
        part: tuple[int, int],
        numel: int,
        contributions: dict[str, torch.Tensor],
        aggregate: torch.Tensor,
    ) -> PartSketch:
        """The sketch of part `part` of a flat input of `numel` coordinates, from the part's
        contributions (each the part's slice, b - a values) and its aggregate."""
        a, _ = part
        stride = echo_stride(numel)
        first = -(-a // stride) * stride
        pick = slice(first - a, None, stride)
        rows = {p: x[pick].float().clone() for p, x in contributions.items()}
        return cls(round_id, first, stride, rows, aggregate[pick].float().clone())

    @property
    def count(self) -> int:
        return len(self.aggregate)

    @property
    def last(self) -> int:
        """The index of the last sampled coordinate (first - stride: none)."""
        return self.first + (self.count - 1) * self.stride

    def window(self, first: int, last: int) -> slice:
        """The positions of coordinates first..last (multiples of stride, inclusive) in the rows."""
        return slice((first - self.first) // self.stride, (last - self.first) // self.stride + 1)


def unit_rows(rows: torch.Tensor) -> torch.Tensor:
    """`rows` scaled to unit norm (all-zero rows stay zero)."""
    return rows / rows.norm(dim=1, keepdim=True).clamp_min(1e-30)


class EchoMemory:
    """One owner's memory of its parts' recent rounds, per tag, and the echo check (module
    docstring). threshold: the cosine at which a contribution repeats an earlier one (0: off)."""

    def __init__(self, threshold: float, rounds: int = ECHO_ROUNDS) -> None:
        self.threshold, self.rounds = threshold, rounds
        self._kept: OrderedDict[str, deque[PartSketch]] = OrderedDict()

    def check(self, tag: str, sketch: PartSketch, part: int) -> list[ContributionFlag]:
        """Flags for the contributions of `sketch`'s round that repeat a contribution or aggregate
        of an earlier round of `tag` (round id below it) on coordinates both hold, as the owner of
        part `part`; then the sketch is remembered."""
        earlier = [s for s in self._kept.get(tag, ()) if s.round_id < sketch.round_id and s.stride == sketch.stride]
        flags = self._compare(sketch, earlier, part) if self.threshold > 0 else []
        kept = self._kept.setdefault(tag, deque(maxlen=self.rounds))
        self._kept.move_to_end(tag)
        if sketch.count:
            kept.append(sketch)
        while len(self._kept) > MAX_TAGS:
            self._kept.popitem(last=False)
        return flags

    def _compare(self, sketch: PartSketch, earlier: list[PartSketch], part: int) -> list[ContributionFlag]:
        peers = [p for p in sorted(sketch.rows) if float(sketch.rows[p].norm()) > 0]
        if not peers or not earlier:
            return []
        best: dict[str, tuple[float, int]] = {}
        for old in earlier:
            lo, hi = max(sketch.first, old.first), min(sketch.last, old.last)
            if hi < lo or (hi - lo) // sketch.stride + 1 < MIN_OVERLAP:
                continue
            now_w, old_w = sketch.window(lo, hi), old.window(lo, hi)
            before = unit_rows(torch.stack([*(r[old_w] for r in old.rows.values()), old.aggregate[old_w]]))
            if float((unit_rows(sketch.aggregate[now_w][None]) @ before.T).max()) >= self.threshold:
                continue  # the round's own aggregate repeats that round there: honest updates do too
            current = unit_rows(torch.stack([sketch.rows[p][now_w] for p in peers]))
            cosines, _ = (current @ before.T).max(dim=1)
            for p, c in zip(peers, cosines.tolist(), strict=True):
                if c >= self.threshold and c > best.get(p, (-2.0, 0))[0]:
                    best[p] = (c, old.round_id)
        if not best:
            return []
        agg = sketch.aggregate
        agg_norm = float(agg.norm())
        flags = []
        for p, (cosine, round_id) in sorted(best.items()):
            row = sketch.rows[p]
            norm_ratio = float(row.norm()) / agg_norm if agg_norm > 0 else 0.0
            alignment = float(row @ agg) / (float(row.norm()) * agg_norm) if agg_norm > 0 else 0.0
            flags.append(
                ContributionFlag(
                    p,
                    part,
                    round(norm_ratio, 6) if math.isfinite(norm_ratio) else 0.0,
                    round(alignment, 6) if math.isfinite(alignment) else 0.0,
                    ECHO,
                    echo=round(min(cosine, 1.0), 6),
                    earlier=round_id,
                )
            )
        return flags
