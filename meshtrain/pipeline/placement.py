"""Stage placement: which stage each peer of a pipeline swarm holds, as a pure function of the
swarm's membership.

Problem. In a pipeline swarm every peer holds one of S stages (stage 0: embedding, head, loss and
the data — the microbatches' *origins*; stages 1..S-1: runs of blocks). Strangers join and leave
at any time, and there is no coordinator to hand out stages. Every peer must nevertheless arrive
at the same placement, every stage must keep a replica while there are enough peers, and a peer
should move as rarely as possible: a move costs a download of the new stage's weights.

Design. `place` is deterministic over what the CRDT membership says — each member's announced
stage (its membership record's capabilities) and its measured forward time — so peers that hold
the same membership compute the same placement without talking. Three rules, in order:
1. *Keep.* A peer that announces a stage in range keeps it.
2. *Join.* Peers without a stage, fastest first (announced forward seconds; unknown counts as
   slowest), then by id, each go to the stage furthest below its floor, else to the one least
   above it, then to the one with the fewest replicas; ties go to the stage with the least
   compute (Σ 1 / forward seconds of its replicas, unknown counted as `UNKNOWN_SPEED`), then to
   the lowest index. Floors: stage 0
   wants `origins` replicas (two by default: one origin's failure must not stop the data), as
   far as the peers beyond one per block stage allow; every other stage wants one.
3. *Refill.* While a stage is below its floor and another is above its own, the fastest peer
   (then the lowest id) of the most replicated stage above its floor (ties: the highest index)
   moves to it. With at least S peers every stage then has a replica: the floors sum to at most
   the number of peers, so a stage below its floor implies one above its own, and each move
   closes one unit of deficit.
4. *Even out fresh peers.* While a stage holds at least two replicas more than another and one
   of them is *fresh* (it announces step 0: it has trained nothing, so moving it costs nothing),
   its fastest fresh peer (then the lowest id) moves to the stage with the fewest replicas (ties:
   the least compute, then the lowest index); the most replicated such stage first (ties: the
   highest index). Peers that start together each place themselves before hearing of the
   others, and rule 1 would keep what they picked (six daemons started at once held 3/2/1 of
   three stages); this evens them out before anyone trained. A peer that has trained moves only
   by rule 3. Each move lowers Σ replicas², so the rule ends.

The assignment a peer computes for itself is announced in its membership record and shown on the
status page (node/stages/peer.py); the next computation takes it as that peer's stage (rule 1),
which is what keeps placements stable as peers come and go. Two peers that join at the same
moment, each before hearing of the other, may pick the same stage: rule 1 keeps both, and rule 3
repairs any stage left empty.

`announced` reads a member's pipeline role from its membership record's capabilities (stage,
forward time, steps, epoch keys), checked, so that a hostile record cannot make `place` raise.

Not here: moving the weights (a moved peer downloads its new stage from that stage's replicas),
and agreeing on *when* a placement takes effect (the node's epochs).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from meshtrain.errors import ConfigError
from meshtrain.transport.validate import is_int, is_number

DEFAULT_ORIGINS = 2  # stage-0 replicas wanted: one origin's failure must not stop the data
MAX_KEY_CHARS = 64  # an announced epoch key's length at most
UNKNOWN_SPEED = 1.0  # forward seconds assumed for a peer that announced none (for capacity only)


@dataclass(frozen=True)
class Member:
    """A pipeline peer as the membership announces it.

    peer_id: its id. stage: the stage it announces, or None (new, or announced none).
    forward_s: its measured forward seconds for one microbatch (lower is faster), or None.
    fresh: it has trained nothing (announces step 0), so rule 4 may move it for free.
    """

    peer_id: str
    stage: int | None = None
    forward_s: float | None = None
    fresh: bool = False


def floors(n_peers: int, num_stages: int, origins: int = DEFAULT_ORIGINS) -> list[int]:
    """The replicas each stage wants: stage 0 `origins` as far as the peers beyond one per block
    stage allow (at least 1), every block stage 1."""
    zero = max(1, min(origins, n_peers - (num_stages - 1)))
    return [zero] + [1] * (num_stages - 1)


def place(members: Iterable[Member], num_stages: int, *, origins: int = DEFAULT_ORIGINS) -> dict[str, int]:
    """peer id -> stage for every member (module docstring). Pure and deterministic: the order
    of `members` does not matter, only their contents."""
    if num_stages < 1:
        raise ConfigError(f"a pipeline needs at least one stage, got {num_stages}")
    if origins < 1:
        raise ConfigError(f"stage 0 needs at least one origin, got {origins}")
    by_id: dict[str, Member] = {}
    for m in sorted(members, key=lambda m: m.peer_id):  # sums below run in one order everywhere
        if m.peer_id in by_id:
            raise ConfigError(f"peer {m.peer_id} is listed twice")
        by_id[m.peer_id] = m
    S = num_stages
    floor = floors(len(by_id), S, origins)
    placement: dict[str, int] = {}
    for m in by_id.values():  # 1. keep
        if m.stage is not None and 0 <= m.stage < S:
            placement[m.peer_id] = m.stage
    count = [0] * S
    capacity = [0.0] * S
    for p, s in placement.items():
        count[s] += 1
        capacity[s] += _rate(by_id[p])
    joiners = sorted((m for m in by_id.values() if m.peer_id not in placement), key=_fastest_first)
    for m in joiners:  # 2. join
        s = min(range(S), key=lambda t: (-(floor[t] - count[t]), count[t], capacity[t], t))
        placement[m.peer_id] = s
        count[s] += 1
        capacity[s] += _rate(m)

    def move(mover: Member, frm: int, to: int) -> None:
        placement[mover.peer_id] = to
        count[frm] -= 1
        count[to] += 1
        capacity[frm] -= _rate(mover)
        capacity[to] += _rate(mover)

    while True:  # 3. refill
        short = [t for t in range(S) if count[t] < floor[t]]
        spare = [t for t in range(S) if count[t] > floor[t]]
        if not short or not spare:
            break
        frm = max(spare, key=lambda t: (count[t], t))
        move(min((by_id[p] for p, s in placement.items() if s == frm), key=_fastest_first), frm, short[0])
    while True:  # 4. even out fresh peers
        to = min(range(S), key=lambda t: (count[t], capacity[t], t))
        fresh = {t: [by_id[p] for p, s in placement.items() if s == t and by_id[p].fresh] for t in range(S)}
        over = [t for t in range(S) if fresh[t] and count[t] >= count[to] + 2 and count[t] > floor[t]]
        if not over:
            return placement
        frm = max(over, key=lambda t: (count[t], t))
        move(min(fresh[frm], key=_fastest_first), frm, to)


def stage_map(placement: Mapping[str, int], num_stages: int) -> list[list[str]]:
    """The sorted peer ids of each stage, by stage (empty lists for empty stages)."""
    out: list[list[str]] = [[] for _ in range(num_stages)]
    for p, s in sorted(placement.items()):
        if 0 <= s < num_stages:
            out[s].append(p)
    return out


def _rate(m: Member) -> float:
    return 1.0 / (m.forward_s if m.forward_s and m.forward_s > 0 else UNKNOWN_SPEED)


def _fastest_first(m: Member) -> tuple[float, str]:
    return (m.forward_s if m.forward_s is not None and m.forward_s > 0 else float("inf"), m.peer_id)


def announced(caps: Any, num_stages: int) -> dict[str, Any]:
    """What a peer's membership record announces about its pipeline role, checked: a stage in
    range, a positive finite forward time, a step, epoch keys. Anything else is left out (a
    hostile record cannot make placement raise)."""
    raw = caps.get("pipeline") if isinstance(caps, dict) else None
    if not isinstance(raw, dict):
        return {}
    out: dict[str, Any] = {}
    stage = raw.get("stage")
    if is_int(stage) and 0 <= stage < num_stages:
        out["stage"] = stage
    fwd = raw.get("fwd")
    if is_number(fwd) and math.isfinite(fwd) and 0 < fwd < 1e6:
        out["fwd"] = float(fwd)
    for key in ("step", "offer", "cut"):
        v = raw.get(key)
        if is_int(v) and 0 <= v < 1 << 62:
            out[key] = v
    for key in ("epoch", "ready"):
        v = raw.get(key)
        if isinstance(v, str) and len(v) <= MAX_KEY_CHARS:
            out[key] = v
    return out
