"""Grouped averaging for large swarms (Moshpit-style): which peers all-reduce together in a round.

The problem. A round that all-reduces across the whole swarm costs each peer 2(n−1)/n·M bytes —
flat in n — but everything else grows with n: a peer opens a data-plane session to each of the
n−1 others, the coordinator handles n joins and n reports, the round waits for the slowest of n,
and one failure retries the attempt for all n. hivemind's Moshpit averaging (Ryabinin et al.
2021, `hivemind/averaging/matchmaking.py` with its group keys) keeps every round small instead:
peers sit in a d-dimensional grid and, in each round, average only with the peers that share all
their coordinates but one; the dimension rotates, so in d rounds every peer's update reaches
every other (exactly the global mean on a full grid of equal weights).

The design: a pure function of (spec, round, roster), agreed without a leader (the roster of a
round, and why not the membership as each peer has heard it: "Failures" below).
- **Shape** (`grid_sides`). n peers, group size g: d = the fewest dimensions with g^d ≥ n, side
  k = the least integer with k^d ≥ n (so every group holds at most k ≤ g peers), and the top
  dimension (d−1) gets only as many layers as needed, ⌈n / k^(d−1)⌉. With n ≤ g it is one group:
  the whole swarm, today's round.
- **Positions.** Peers are ranked by blake2b(seed, epoch, snapshot digest, peer id) and the i-th
  fills cell i in mixed radix (dimension 0 the least significant). Only the top layer can be
  partial, and layer 0 is always full (k^(d−1) < n).
- **Rounds.** The round index is round_id // period (`period` = H, so every fragment of one
  outer round uses the same groups). Rounds come in *epochs*: the top dimension first, then
  d−2, …, 0, and — when the grid is not full — the top dimension once more. In a round on
  dimension j a group is the peers sharing every coordinate but j.
- **Mixing within an epoch** (the property tests check it for every n): from any peer a, the
  first round (top dimension) reaches the cell (0, a's lower coordinates), which exists because
  layer 0 is full; the rounds on d−2 … 0 then reach every cell of layer 0; the last round (top
  dimension again) reaches every cell. So every peer's update reaches every other within d + 1
  rounds, and within d on a full grid (n = k^d, where the epoch has d rounds). Exactly d for
  every n is impossible: a grid whose every pair mixes in d rounds is a product set, i.e. full.
- **Reshuffles.** The ranking is re-keyed every epoch, so a slow or faulty peer does not meet
  the same partners forever, and a roster change re-keys it at once (the snapshot digest).

Why this and not the alternatives.
- *Two-level* (groups all-reduce, then one leader per group all-reduces with the other leaders
  and hands the result back): the exact global mean every round, but the leaders are special —
  each moves about twice a member's bytes, their round adds a stage of latency, and a leader
  that dies stalls its whole group's result. Moshpit makes no peer special (every peer's cost is
  the same, a failure is one group's ordinary retry) and gives up exactness within a round for
  mixing within d + 1 rounds, which the outer optimizer's consensus term turns into agreement.
- *hivemind's matchmaking* (peers declare a key of grid bits in the DHT and form whatever group
  gathers under it in time; after a round each peer shifts in bits drawn from its group): no
  shared membership needed, but a DHT lookup per round and groups that depend on timing. Every
  meshtrain peer already holds the replicated membership, so the grid is computed, not found.

Failures. Membership is eventually consistent: a joiner's record reaches different peers seconds
apart, and with rounds well under a second, peers that computed a round's groups from their own
replicas disagreed for several rounds around every join (a coordinator held one round both as the
whole swarm and as a group, each with part of the peers), and a minority waited out its hard join
deadline at every disagreement. So the snapshot is not "the trainers this peer has heard of" but
the *roster of the round*: a trainer's membership record says from which round id it is in the
roster (`in_from`, crdt/swarm_records.py), and the roster of round r is the live trainers whose
`in_from` falls in r's group round or earlier (`in_roster`, `GroupPlan.roster`) — a function of the
round, not of when a record arrived. A joiner announces a round far enough ahead that its record
has reached every peer first, and takes part in no round before it (node/roster.py says how far,
and why in time rather than rounds). Peers that predate the field, and every trainer of an
ungrouped swarm, are in from round 0, as before. What stays unagreed is a departure: a peer that
dies drops out of the roster when its lease runs out on each peer (a clean leave when its record
arrives), so peers can compute a round from different rosters then; a peer that re-syncs keeps its
place (node/training_run.py), as leaving would regroup everyone. The all-reduce tolerates it as it
tolerates a late peer (its coordinator waits for the expected group until the join deadline, stops
waiting for peers that report steps past the round or answer that they are past it, and fixes it
with the majority that came; a peer that went elsewhere runs its round with whoever came to it), at
the cost of a slow round; every group then agrees again from the next consistent roster. Where
the disagreement put every survivor under another group's tag of the same round (each still
counting a different departed peer), nobody came to anyone: the coordinator's probe finds its
missing peers in the round under other tags and has everyone regroup from their views then
(coordinator.py, "Groups that disagree"). A peer
that dies inside a group is the collective's ordinary failure (survivors retry).

Who connects to whom. Because the groups are a pure function, a peer knows its partners of the
next round before it starts (`GroupPlan.partners`): presence dials them ahead and keeps only a
bounded set of connections (node/presence.py), not the full mesh a round never uses.

Not here: choosing a joiner's `in_from` and waiting for it (node/roster.py, node/state/download.py),
running a group's all-reduce (allreduce.py: `SwarmCollective` takes a `GroupPlan`), and
what a group's mean means for an outer optimizer (optim/outer.py, "Grouped rounds": replicas in
different groups hold different φ, so it adds a consensus term toward the group's mean φ, and the
node's parity check is off while rounds are grouped, node/state/parity.py).
"""

from __future__ import annotations

import functools
import hashlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

AUTO_WHOLE_SWARM = 32  # group_size 0: the whole swarm is one group up to this many peers ...
AUTO_GROUP_SIZE = 16  # ... and groups of at most this many above (d = 2 covers 256 peers, d = 3 4096)
GROUP_TAG = "~g"  # a grouped round's tag: "<tag>~g<dimension>.<group index>"


def effective_group_size(n: int, group_size: int) -> int:
    """The g that `group_size` means for a swarm of n peers (0: automatic; n or more: one group)."""
    if group_size < 0 or group_size == 1:
        raise ValueError(f"group_size must be 0 (automatic) or at least 2, got {group_size}")
    if group_size == 0:
        return max(n, 1) if n <= AUTO_WHOLE_SWARM else AUTO_GROUP_SIZE
    return group_size


def grid_sides(n: int, g: int) -> tuple[int, ...]:
    """The grid for n peers in groups of at most g: sides of dimensions 0 … d−1 (module docstring)."""
    if n <= g:
        return (max(n, 1),)
    d = 1
    while g**d < n:
        d += 1
    k = 2
    while k**d < n:
        k += 1
    lower = k ** (d - 1)
    return (k,) * (d - 1) + (-(-n // lower),)


def epoch_length(n: int, sides: Sequence[int]) -> int:
    """Rounds per epoch: d on a full grid, d + 1 when the top layer is partial."""
    full = 1
    for s in sides:
        full *= s
    return len(sides) + (full != n)


def round_dimension(step: int, d: int) -> int:
    """The dimension averaged in the `step`-th round of an epoch: d−1, d−2, …, 0, then d−1."""
    return (d - 1 - step) % d


def _rank_key(seed: int, epoch: int, snapshot: bytes, peer: str) -> bytes:
    h = hashlib.blake2b(digest_size=16)
    h.update(f"{seed}/{epoch}/".encode())
    h.update(snapshot)
    h.update(peer.encode())
    return h.digest()


def _coordinates(index: int, sides: Sequence[int]) -> tuple[int, ...]:
    out = []
    for s in sides:
        out.append(index % s)
        index //= s
    return tuple(out)


def in_roster(in_from: int, round_id: int, period: int = 1) -> bool:
    """Whether a trainer in from round id `in_from` is in the roster of round `round_id`: from
    `in_from`'s group round on (the round ids of one group round, `period` apart, share one
    grouping, so a value inside a group round counts from that group round's start)."""
    return in_from // period <= round_id // period


@dataclass(frozen=True)
class RoundGroups:
    """One round's partition of the membership. `groups` are sorted tuples of peer ids, ordered by
    their lowest id; `dimension` the grid dimension averaged; `sides` the grid."""

    round_index: int
    dimension: int
    sides: tuple[int, ...]
    groups: tuple[tuple[str, ...], ...]

    @property
    def whole_swarm(self) -> bool:
        return len(self.groups) <= 1

    def index_of(self, peer: str) -> int:
        for i, grp in enumerate(self.groups):
            if peer in grp:
                return i
        raise KeyError(peer)


def round_groups(members: Sequence[str], round_index: int, group_size: int, seed: int = 0) -> RoundGroups:
    """The groups of round `round_index` among `members` (any order, duplicates ignored): the same
    on every peer that passes the same members, round and spec (module docstring)."""
    return _round_groups(tuple(sorted(set(members))), round_index, group_size, seed)


@functools.lru_cache(maxsize=256)
def _round_groups(peers: tuple[str, ...], round_index: int, group_size: int, seed: int) -> RoundGroups:
    """`round_groups` of sorted, distinct `peers`, cached: presence computes the partners of three
    rounds for every member whose wish it weighs (node/connections.py), from the same roster."""
    n = len(peers)
    sides = grid_sides(n, effective_group_size(n, group_size))
    d = len(sides)
    if d == 1:
        return RoundGroups(round_index, 0, sides, (peers,) if peers else ())
    epoch, step = divmod(round_index, epoch_length(n, sides))
    dim = round_dimension(step, d)
    snapshot = hashlib.blake2b("\n".join(peers).encode(), digest_size=16).digest()
    ranked = sorted(peers, key=lambda p: _rank_key(seed, epoch, snapshot, p))
    by_line: dict[tuple[int, ...], list[str]] = {}
    for i, p in enumerate(ranked):
        c = _coordinates(i, sides)
        by_line.setdefault(c[:dim] + c[dim + 1 :], []).append(p)
    groups = sorted(tuple(sorted(g)) for g in by_line.values())
    return RoundGroups(round_index, dim, sides, tuple(groups))


@dataclass(frozen=True)
class GroupPlan:
    """How a swarm groups its rounds: the spec's `group_size` (0: automatic), its `seed`, and the
    round ids per round (`period`, the spec's H: every fragment of an outer round uses the same
    groups)."""

    group_size: int = 0
    seed: int = 0
    period: int = 1

    def __post_init__(self) -> None:
        effective_group_size(1, self.group_size)  # validates
        if self.period < 1:
            raise ValueError(f"period must be >= 1, got {self.period}")

    def splits(self, n: int) -> bool:
        """Whether a round of n peers runs in groups smaller than the swarm."""
        return n > effective_group_size(n, self.group_size)

    def roster(self, in_from: Mapping[str, int], round_id: int) -> list[str]:
        """The roster of round `round_id`, sorted: the trainers of `in_from` (peer id -> the round
        id it is in from, module docstring "Failures") that are in by then."""
        return sorted(p for p, r in in_from.items() if in_roster(r, round_id, self.period))

    def groups(self, members: Sequence[str], round_id: int) -> RoundGroups:
        return round_groups(members, round_id // self.period, self.group_size, self.seed)

    def partners(self, members: Sequence[str], round_id: int, peer: str) -> tuple[str, ...]:
        """The peers `peer` all-reduces with in round `round_id` (its group without it), computed
        from `members` with `peer` among them, as the collective computes them: what presence
        dials ahead of a round (node/presence.py)."""
        groups = self.groups([*members, peer], round_id)
        return tuple(p for p in groups.groups[groups.index_of(peer)] if p != peer)

    def tag(self, tag: str, groups: RoundGroups, peer: str) -> str:
        """The all-reduce tag of `peer`'s group: `tag` itself when the round is the whole swarm."""
        if groups.whole_swarm:
            return tag
        return f"{tag}{GROUP_TAG}{groups.dimension}.{groups.index_of(peer)}"
