"""SkipPipe path scheduling: which peers each microbatch visits, and when.

The problem (Blagoev, Chen, Ersoy 2025, "SkipPipe: Partial and Reordered Pipelining Framework
for Training LLMs in Heterogeneous Networks", arXiv 2502.19913; reference code
`gensyn-ai/skippipe`, `schedulers/a_star_modified.py`, `schedulers/CBS.py`). A model is cut
into S stages; peers hold one stage each, several peers may replicate a stage. Stage 0 holds the
data, the embedding and the head/loss. A microbatch starts at its stage-0 peer (its *origin*),
visits peers of other stages and returns to the origin for the loss; the backward pass retraces
the path in reverse. SkipPipe lets a path *skip* a fixed number of stages (the model learns to
run with layers dropped) and *swap* the order of neighbouring stages, so a microbatch can avoid
slow peers and slow links. We choose every microbatch's path and a collision-free timetable.

Cost model (the reference's `communication_costs.py` / `a_star_modified.py`): forward on peer p
takes `forward_time[p]`; backward takes 1.5× that; the head/loss at the origin takes a quarter of
the origin's forward (the reference charges it once and no separate head backward — so do we);
moving activations (forward) or gradients (backward) from a to b costs
`latency + activation_bytes / bandwidth`. A peer computes one thing at a time.

Constraints, as the reference codes them (`validate` checks every one):
- a path starts at its origin, visits exactly L = (S − 1) − k peers of distinct non-zero stages,
  and returns to the origin; k = round(skip_ratio · (S − 1)) rounded half *up* (not Python's
  banker's rounding); stage 0 is never skipped; the last stage is not forced.
- a *swap* is a move to a stage below the furthest stage visited so far (the frontier); it goes
  back at most `max_swap_back` (1) stages, at most `max_swaps` (2) per path, or never with
  `allow_swaps=False`. A forward move goes at most `max_jump` (4) stages beyond the frontier.
- in-flight: a microbatch holds activation memory on a peer from the start of its forward there to
  the end of its backward there; at most `max_in_flight` (3) microbatches at once per peer.
- stage load: at most `max_stage_load` microbatches visit each non-zero stage per iteration, so
  the stages' replicas get balanced updates; the default is the balanced ceil(M·L / stages).
- no two visits overlap on one peer. When two microbatches want a peer at once, one waits — the
  scheduler picks paths so that little waiting is left.

Algorithm: prioritised time-aware A* with large-neighbourhood repair, instead of the reference's
conflict-based search (CBS). Three phases, all deterministic:
1. *First (collision-unaware) schedule*, the reference's starting point: each microbatch takes its
   fastest path as if alone (only the stage load is shared), then the fixed paths are timed
   against each other; `target_ratio` (0.88) × its makespan is the stop bound.
2. *Prioritised planning* (cooperative A*): microbatches in id order (round-robin over origins)
   each run an A* over partial paths (stages visited, current peer, time) against a reservation
   table holding the earlier microbatches' visits and in-flight intervals; a visit starts at the
   earliest gap where the peer is free and has memory. The heuristic — remaining hops at the
   cheapest link, the cheapest unvisited stages' compute, forward and backward — never
   overestimates, so each microbatch gets its best path given the ones before it. A stage-load
   look-ahead rejects a path that would leave the later microbatches no way to fit the bound.
3. *Repair*: in passes, each microbatch (earliest first) is removed and re-planned against all the
   others, kept only if it finishes earlier; earlier finishes free gaps that the next ones use.
   Stops when the makespan is ≤ the bound, a pass improves nothing, or the expansion budget is
   spent. The best of the phases' schedules is returned.
The budget counts A* node expansions, never wall-clock seconds, so the same input always gives the
same output (ties break on sorted peer ids and insertion order; no randomness). Measured: 12
peers, 6 stages, 24 microbatches in ~0.1–0.3 s on one core.

Alternatives rejected: the reference's CBS branches on every conflict (type 1 memory, type 2
stage load, type 3 collision) and re-runs A* for every microbatch per branch in a joblib pool — its
tree grows exponentially and it stops on thresholds tuned by hand; prioritised planning plus
repair is the standard cheap alternative in multi-agent path finding and reaches similar quality
here in milliseconds. An ILP/CP solver would be exact but is a heavy dependency and slow beyond a
few microbatches. Plain simulation with first-come-first-served peers and admission control for
memory can deadlock once swaps create cyclic waits; a reservation table cannot.

`full_pipeline_schedule` is the baseline: every microbatch visits every stage in order (no skips,
no swaps), with the same search, cost model, memory limit and collision rule — so the comparison
isolates the effect of skipping and swapping. Its replicas are chosen by the same search rather
than fixed pipeline columns, which makes it a strong baseline.

This module is pure: no I/O, no clocks, no global state. It does not place peers on stages (the
reference's genetic GCMA placement) and does not run anything; the runtime follows
`Schedule.peer_order()`.
"""

from __future__ import annotations

import heapq
import math
from bisect import bisect_right
from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Literal

from meshtrain.errors import MeshtrainError

BACKWARD_FACTOR = 1.5  # backward compute = 1.5 × forward (reference cost model)
HEAD_FACTOR = 0.25  # head/loss at the origin = forward / 4 (reference cost model)
DEFAULT_MAX_IN_FLIGHT = 3
DEFAULT_MAX_SWAPS = 2
DEFAULT_MAX_SWAP_BACK = 1
DEFAULT_MAX_JUMP = 4
DEFAULT_TARGET_RATIO = 0.88  # ALGORITHMS.md; the stored reference code reads 0.92
DEFAULT_SEARCH_BUDGET = 40_000  # A* node expansions over one call, construction excluded
_SEARCH_NODE_CAP = 5_000  # per A* call; past it a depth-first dive finds some path
_MAX_REPAIR_PASSES = 8

VisitKind = Literal["forward", "head", "backward"]
ScheduleMode = Literal["skippipe", "full"]


class ScheduleError(MeshtrainError):
    """The scheduling problem is malformed: a missing link, a negative time, a bad ratio."""


class UnsatisfiableScheduleError(ScheduleError):
    """The constraints admit no schedule: a stage with no peer, a stage-load bound too small for
    the microbatches, a skip count that leaves nothing to visit. The message says what to relax."""


@dataclass(frozen=True)
class Link:
    """A directed or symmetric network link. latency: seconds; bandwidth: bytes per second."""

    latency: float
    bandwidth: float


@dataclass(frozen=True)
class PipelineProblem:
    """One training iteration to schedule.

    num_stages: S, the number of model stages; stage 0 is embedding + head/loss and holds data.
    placement: peer id → the stage it holds (one stage per peer; a stage may have many peers).
    forward_time: peer id → seconds of forward compute for one microbatch of its stage.
    links: (a, b) → Link; looked up as (a, b), then (b, a). Needed for every pair of peers on
        different stages.
    activation_bytes: bytes of activations (and of their gradients) per microbatch per hop.
    microbatches: M, microbatches this iteration, each starting at a stage-0 peer.
    skip_ratio: fraction of the S − 1 non-zero stages each path skips (rounded half up).
    max_in_flight: microbatches whose activations a peer may hold at once (memory).
    max_stage_load: microbatches per non-zero stage per iteration; None = balanced default.
    allow_swaps, max_swaps, max_swap_back, max_jump: path shape rules (module docstring).
    origins: the origin of each microbatch; None = round-robin over sorted stage-0 peers.
    """

    num_stages: int
    placement: Mapping[str, int]
    forward_time: Mapping[str, float]
    links: Mapping[tuple[str, str], Link]
    activation_bytes: float
    microbatches: int
    skip_ratio: float = 0.0
    max_in_flight: int = DEFAULT_MAX_IN_FLIGHT
    max_stage_load: int | None = None
    allow_swaps: bool = True
    max_swaps: int = DEFAULT_MAX_SWAPS
    max_swap_back: int = DEFAULT_MAX_SWAP_BACK
    max_jump: int = DEFAULT_MAX_JUMP
    origins: tuple[str, ...] | None = None


@dataclass(frozen=True)
class Visit:
    """One stretch of compute: `microbatch` on `peer` (holding `stage`) from `start` to `end`."""

    microbatch: int
    peer: str
    stage: int
    kind: VisitKind
    start: float
    end: float


@dataclass(frozen=True)
class MicrobatchPlan:
    """A microbatch's path ((stage, peer) from its origin back to it) and its visits in time
    order: forward along the path, head at the origin, backward along the path reversed."""

    microbatch: int
    origin: str
    path: tuple[tuple[int, str], ...]
    visits: tuple[Visit, ...]

    @property
    def release(self) -> float:
        return self.visits[0].start

    @property
    def completion(self) -> float:
        return self.visits[-1].end


@dataclass(frozen=True)
class SearchStats:
    """How the search went. first_makespan: the collision-unaware start (phase 1);
    planned_makespan: after prioritised planning (phase 2); expansions: A* nodes expanded;
    repair_passes: phase-3 passes run; stopped: why the search ended."""

    first_makespan: float
    planned_makespan: float
    expansions: int
    repair_passes: int
    stopped: str


@dataclass(frozen=True)
class Schedule:
    """The plan for one iteration: one `MicrobatchPlan` per microbatch (by id) and the makespan."""

    mode: ScheduleMode
    plans: tuple[MicrobatchPlan, ...]
    makespan: float
    stats: SearchStats

    def peer_order(self) -> dict[str, tuple[tuple[int, VisitKind], ...]]:
        """peer → its visits in the order it must process them: (microbatch, kind)."""
        per_peer: dict[str, list[Visit]] = {}
        for plan in self.plans:
            for v in plan.visits:
                per_peer.setdefault(v.peer, []).append(v)
        return {
            peer: tuple((v.microbatch, v.kind) for v in sorted(vs, key=lambda v: (v.start, v.microbatch)))
            for peer, vs in sorted(per_peer.items())
        }


def skipped_stages_per_path(problem: PipelineProblem) -> int:
    """k = round(skip_ratio · (S − 1)), rounded half up: how many non-zero stages a path skips."""
    return math.floor(problem.skip_ratio * (problem.num_stages - 1) + 0.5)


def full_pipeline_problem(problem: PipelineProblem) -> PipelineProblem:
    """The GPipe-style baseline of `problem`: no skips, no swaps, every stage visited in order."""
    return replace(problem, skip_ratio=0.0, allow_swaps=False, max_stage_load=None)


def skippipe_schedule(
    problem: PipelineProblem, *, target_ratio: float = DEFAULT_TARGET_RATIO, search_budget: int = DEFAULT_SEARCH_BUDGET
) -> Schedule:
    """Paths and timetable for `problem` (module docstring). Stops repairing once the makespan is
    ≤ target_ratio × the collision-unaware makespan (0 = never stop early), when a pass improves
    nothing, or after `search_budget` A* expansions. Raises ScheduleError /
    UnsatisfiableScheduleError on bad or unsatisfiable input."""
    return _solve(compile_problem(problem), "skippipe", target_ratio, search_budget)


def full_pipeline_schedule(
    problem: PipelineProblem, *, target_ratio: float = DEFAULT_TARGET_RATIO, search_budget: int = DEFAULT_SEARCH_BUDGET
) -> Schedule:
    """The full-pipeline baseline on the same placement, cost model and rules (module docstring)."""
    return _solve(compile_problem(full_pipeline_problem(problem)), "full", target_ratio, search_budget)


# ---------------------------------------------------------------------------------------------
# Problem compilation and the path-shape rules


@dataclass(frozen=True)
class _Compiled:
    S: int
    L: int  # non-zero stages each path visits
    stage_of: dict[str, int]
    peers_by_stage: tuple[tuple[str, ...], ...]
    fwd: dict[str, float]
    edge: dict[tuple[str, str], float]
    origins: tuple[str, ...]
    bound: int
    limit: int
    allow_swaps: bool
    max_swaps: int
    max_swap_back: int
    max_jump: int
    e_min: float
    stage_min_fwd: tuple[float, ...]
    stages_by_speed: tuple[int, ...]  # non-zero stages, cheapest compute first
    reachable: tuple[int, ...]  # non-zero stages some valid path can visit
    finishable: frozenset[tuple[int, int, int]]  # (mask, frontier, swaps) that can still finish

    def step(self, frontier: int, swaps: int, s: int) -> tuple[int, int] | None:
        """(frontier, swaps) after moving to stage s, or None if the move breaks a shape rule."""
        if s < frontier:
            if not self.allow_swaps or swaps >= self.max_swaps or frontier - s > self.max_swap_back:
                return None
            return frontier, swaps + 1
        if s - frontier > self.max_jump:
            return None
        return s, swaps


def _bad_number(x: float, *, positive: bool) -> bool:
    return not isinstance(x, int | float) or not math.isfinite(x) or (x <= 0 if positive else x < 0)


def compile_problem(problem: PipelineProblem) -> _Compiled:
    """Validate `problem` and precompute its path-shape rules (which stage may follow which,
    swaps, jumps). The scheduler searches with it; the runtime re-routes with the same rules."""
    S = problem.num_stages
    if not isinstance(S, int) or S < 2:
        raise ScheduleError(f"num_stages must be an integer ≥ 2, got {S!r}")
    stage_of = dict(sorted(problem.placement.items()))
    by_stage: list[list[str]] = [[] for _ in range(S)]
    for peer, s in stage_of.items():
        if not isinstance(s, int) or not 0 <= s < S:
            raise ScheduleError(f"peer {peer!r} is placed on stage {s!r}, outside 0..{S - 1}")
        by_stage[s].append(peer)
    for s, peers in enumerate(by_stage):
        if not peers:
            raise UnsatisfiableScheduleError(f"stage {s} has no peer; place at least one peer on every stage")
    fwd: dict[str, float] = {}
    for peer in stage_of:
        t = problem.forward_time.get(peer)
        if t is None or _bad_number(t, positive=True):
            raise ScheduleError(f"forward_time of peer {peer!r} must be a positive number, got {t!r}")
        fwd[peer] = float(t)
    if _bad_number(problem.activation_bytes, positive=False):
        raise ScheduleError(f"activation_bytes must be ≥ 0, got {problem.activation_bytes!r}")
    edge: dict[tuple[str, str], float] = {}
    for a in stage_of:
        for b in stage_of:
            if stage_of[a] == stage_of[b]:
                continue  # never adjacent on a path
            link = problem.links.get((a, b)) or problem.links.get((b, a))
            if link is None:
                raise ScheduleError(f"no link between {a!r} and {b!r}; give latency and bandwidth for it")
            if _bad_number(link.latency, positive=False) or _bad_number(link.bandwidth, positive=True):
                raise ScheduleError(f"link {a!r}–{b!r} needs latency ≥ 0 and bandwidth > 0, got {link!r}")
            edge[a, b] = link.latency + problem.activation_bytes / link.bandwidth
    M = problem.microbatches
    if not isinstance(M, int) or M < 1:
        raise ScheduleError(f"microbatches must be an integer ≥ 1, got {M!r}")
    if _bad_number(problem.skip_ratio, positive=False) or problem.skip_ratio >= 1:
        raise ScheduleError(f"skip_ratio must be in [0, 1), got {problem.skip_ratio!r}")
    L = (S - 1) - skipped_stages_per_path(problem)
    if L < 1:
        raise UnsatisfiableScheduleError(
            f"skip_ratio {problem.skip_ratio} skips all {S - 1} non-zero stages; lower skip_ratio "
            "or place the model on more stages"
        )
    for name in ("max_in_flight", "max_jump"):
        v = getattr(problem, name)
        if not isinstance(v, int) or v < 1:
            raise ScheduleError(f"{name} must be an integer ≥ 1, got {v!r}")
    for name in ("max_swaps", "max_swap_back"):
        v = getattr(problem, name)
        if not isinstance(v, int) or v < 0:
            raise ScheduleError(f"{name} must be an integer ≥ 0, got {v!r}")
    stage0 = tuple(by_stage[0])
    if problem.origins is None:
        origins = tuple(stage0[i % len(stage0)] for i in range(M))
    else:
        origins = tuple(problem.origins)
        if len(origins) != M:
            raise ScheduleError(f"origins has {len(origins)} entries for {M} microbatches")
        for o in origins:
            if stage_of.get(o) != 0:
                raise ScheduleError(f"origin {o!r} is not a stage-0 peer; only they hold data")

    shape = _Compiled(
        S=S,
        L=L,
        stage_of=stage_of,
        peers_by_stage=tuple(tuple(p) for p in by_stage),
        fwd=fwd,
        edge=edge,
        origins=origins,
        bound=M,
        limit=problem.max_in_flight,
        allow_swaps=problem.allow_swaps,
        max_swaps=problem.max_swaps,
        max_swap_back=problem.max_swap_back,
        max_jump=problem.max_jump,
        e_min=min(edge.values()),
        stage_min_fwd=tuple(min(fwd[p] for p in by_stage[s]) for s in range(S)),
        stages_by_speed=tuple(sorted(range(1, S), key=lambda s: (min(fwd[p] for p in by_stage[s]), s))),
        reachable=(),
        finishable=frozenset(),
    )
    finishable, reachable = _explore_shapes(shape)
    if (0, 0, 0) not in finishable:
        raise UnsatisfiableScheduleError(
            f"no path visits {L} of {S - 1} stages with jumps ≤ {shape.max_jump}; raise max_jump or skip fewer stages"
        )
    n_reach = len(reachable)
    bound = problem.max_stage_load
    if bound is None:
        bound = -(-M * L // n_reach)
    elif not isinstance(bound, int) or bound < 1:
        raise ScheduleError(f"max_stage_load must be an integer ≥ 1, got {bound!r}")
    if sum(min(bound, M) for _ in reachable) < M * L:
        raise UnsatisfiableScheduleError(
            f"{M} microbatches × {L} stages cannot fit max_stage_load {bound} on the {n_reach} "
            f"reachable stages; raise max_stage_load to ≥ {-(-M * L // n_reach)}"
        )
    return replace(shape, bound=bound, reachable=reachable, finishable=finishable)


def _explore_shapes(c: _Compiled) -> tuple[frozenset[tuple[int, int, int]], tuple[int, ...]]:
    """Which partial stage sequences (visited mask, frontier, swaps) can still be completed to L
    stages under the shape rules, and which stages appear on some complete sequence."""
    memo: dict[tuple[int, int, int], bool] = {}
    reachable: set[int] = set()

    def can_finish(mask: int, frontier: int, swaps: int) -> bool:
        key = (mask, frontier, swaps)
        if key in memo:
            return memo[key]
        ok = bin(mask).count("1") == c.L
        if not ok:
            for s in range(1, c.S):
                if mask >> s & 1:
                    continue
                nxt = c.step(frontier, swaps, s)
                if nxt is not None and can_finish(mask | 1 << s, *nxt):
                    ok = True
                    reachable.add(s)
        memo[key] = ok
        return ok

    can_finish(0, 0, 0)
    return frozenset(k for k, v in memo.items() if v), tuple(sorted(reachable))


# ---------------------------------------------------------------------------------------------
# Reservation table


class _PeerTable:
    """A peer's reserved compute (sorted, disjoint) and its microbatches' in-flight intervals."""

    __slots__ = ("starts", "ends", "owners", "mem")

    def __init__(self) -> None:
        self.starts: list[float] = []
        self.ends: list[float] = []
        self.owners: list[int] = []
        self.mem: list[tuple[float, float, int]] = []

    def fit(self, arrival: float, duration: float) -> float:
        """Earliest start ≥ arrival of a `duration`-long gap in the reserved compute."""
        starts, ends = self.starts, self.ends
        i = bisect_right(ends, arrival)
        t = arrival
        while i < len(starts):
            if starts[i] >= t + duration:
                return t
            if ends[i] > t:
                t = ends[i]
            i += 1
        return t

    def peak(self, s: float, e: float) -> int:
        """The most in-flight intervals overlapping at once inside [s, e)."""
        hits = [(a, b) for a, b, _ in self.mem if a < e and b > s]
        if len(hits) < 2:
            return len(hits)
        events = sorted([(max(a, s), 1) for a, _ in hits] + [(b, -1) for _, b in hits])
        # (time, -1) sorts before (time, +1): touching intervals do not overlap
        best = cur = 0
        for _, d in events:
            cur += d
            best = max(best, cur)
        return best

    def fit_with_memory(self, arrival: float, duration: float, limit: int) -> float:
        """Earliest start where the compute is free and fewer than `limit` microbatches hold
        memory throughout the visit (waiting for one of them to finish if needed)."""
        t = self.fit(arrival, duration)
        while self.peak(t, t + duration) >= limit:
            t = self.fit(min(b for a, b, _ in self.mem if a < t + duration and b > t), duration)
        return t

    def add(self, mb: int, start: float, end: float) -> None:
        i = bisect_right(self.starts, start)
        self.starts.insert(i, start)
        self.ends.insert(i, end)
        self.owners.insert(i, mb)

    def remove(self, mb: int) -> None:
        keep = [i for i, o in enumerate(self.owners) if o != mb]
        self.starts = [self.starts[i] for i in keep]
        self.ends = [self.ends[i] for i in keep]
        self.owners = [self.owners[i] for i in keep]
        self.mem = [m for m in self.mem if m[2] != mb]


# A timeline is ((peer, stage, kind, start, end), ...) in time order.
_Timeline = tuple[tuple[str, int, VisitKind, float, float], ...]


@dataclass(frozen=True)
class _Route:
    middle: tuple[str, ...]
    timeline: _Timeline

    @property
    def completion(self) -> float:
        return self.timeline[-1][4]


class _Tables:
    def __init__(self, c: _Compiled) -> None:
        self.c = c
        self.peer = {p: _PeerTable() for p in c.stage_of}
        self.load = [0] * c.S
        self.routes: dict[int, _Route] = {}

    def commit(self, mb: int, route: _Route) -> None:
        held: dict[str, list[float]] = {}
        for peer, _, _, s, e in route.timeline:
            self.peer[peer].add(mb, s, e)
            span = held.setdefault(peer, [s, e])
            span[0], span[1] = min(span[0], s), max(span[1], e)
        for peer, (s, e) in held.items():
            self.peer[peer].mem.append((s, e, mb))
        for q in route.middle:
            self.load[self.c.stage_of[q]] += 1
        self.routes[mb] = route

    def withdraw(self, mb: int) -> _Route:
        route = self.routes.pop(mb)
        for peer in {p for p, *_ in route.timeline}:
            self.peer[peer].remove(mb)
        for q in route.middle:
            self.load[self.c.stage_of[q]] -= 1
        return route

    def makespan(self) -> float:
        return max(r.completion for r in self.routes.values())

    def next_event_after(self, t: float) -> float | None:
        later = [e for pt in self.peer.values() for e in pt.ends if e > t]
        return min(later) if later else None


# ---------------------------------------------------------------------------------------------
# Time-aware A* for one microbatch


@dataclass(frozen=True)
class _Node:
    t: float  # end of the forward at `cur`
    cur: str
    middle: tuple[str, ...]
    fwd: tuple[tuple[float, float], ...]  # forward (start, end): origin, then the middle peers
    mask: int  # non-zero stages visited
    frontier: int
    swaps: int
    edge_sum: float  # forward link time so far (paid again by the backward)
    middle_fwd_sum: float  # forward compute of the middle peers so far


class _Planner:
    def __init__(self, c: _Compiled) -> None:
        self.c = c
        self.expansions = 0

    def _lower_bound(self, n: _Node, origin: str, load: list[int]) -> float | None:
        """Admissible estimate of the completion time through `n`, None if it cannot finish."""
        c = self.c
        r = c.L - len(n.middle)
        if r == 0:
            unknown = c.edge[n.cur, origin]
            rest_f = 0.0
        else:
            unknown = (r + 1) * c.e_min
            rest_f, need = 0.0, r
            for s in c.stages_by_speed:
                if not n.mask >> s & 1 and load[s] < c.bound:
                    rest_f += c.stage_min_fwd[s]
                    need -= 1
                    if need == 0:
                        break
            if need:
                return None
        fo = c.fwd[origin]
        return (
            n.t
            + 2 * unknown
            + n.edge_sum
            + (1 + BACKWARD_FACTOR) * rest_f
            + BACKWARD_FACTOR * n.middle_fwd_sum
            + (HEAD_FACTOR + BACKWARD_FACTOR) * fo
        )

    def _children(self, n: _Node, origin: str, tables: _Tables) -> list[tuple[float, _Node]]:
        c = self.c
        out = []
        for s in range(1, c.S):
            if n.mask >> s & 1 or tables.load[s] >= c.bound:
                continue
            nxt = c.step(n.frontier, n.swaps, s)
            if nxt is None or (n.mask | 1 << s, *nxt) not in c.finishable:
                continue
            for q in c.peers_by_stage[s]:
                e = c.edge[n.cur, q]
                f = c.fwd[q]
                start = tables.peer[q].fit_with_memory(n.t + e, f, c.limit)
                child = _Node(
                    start + f,
                    q,
                    n.middle + (q,),
                    n.fwd + ((start, start + f),),
                    n.mask | 1 << s,
                    nxt[0],
                    nxt[1],
                    n.edge_sum + e,
                    n.middle_fwd_sum + f,
                )
                lb = self._lower_bound(child, origin, tables.load)
                if lb is not None:
                    out.append((lb, child))
        return out

    def _close(self, n: _Node, origin: str, tables: _Tables, later: int) -> _Route | str:
        """Time the head and the backward of a complete forward path; check memory over the
        whole in-flight intervals and the stage-load look-ahead. A reason string on failure."""
        c = self.c
        if later:
            # the `later` microbatches still to plan must each find L stages under the bound
            cap = list(tables.load)
            for q in n.middle:
                cap[c.stage_of[q]] += 1
            if sum(min(c.bound - cap[s], later) for s in c.reachable) < later * c.L:
                return "load"
        tl: list[tuple[str, int, VisitKind, float, float]] = [(origin, 0, "forward", *n.fwd[0])]
        tl += [(q, c.stage_of[q], "forward", *se) for q, se in zip(n.middle, n.fwd[1:], strict=True)]
        fo = c.fwd[origin]
        t = n.t + c.edge[n.cur, origin]
        s = tables.peer[origin].fit(t, HEAD_FACTOR * fo)
        t = s + HEAD_FACTOR * fo
        tl.append((origin, 0, "head", s, t))
        prev = origin
        for q in reversed(n.middle):
            d = BACKWARD_FACTOR * c.fwd[q]
            s = tables.peer[q].fit(t + c.edge[prev, q], d)
            t = s + d
            tl.append((q, c.stage_of[q], "backward", s, t))
            prev = q
        d = BACKWARD_FACTOR * fo
        s = tables.peer[origin].fit(t + c.edge[prev, origin], d)
        tl.append((origin, 0, "backward", s, s + d))
        spans = [(origin, n.fwd[0][0], s + d)]
        spans += [(q, n.fwd[i + 1][0], tl[-2 - i][4]) for i, q in enumerate(n.middle)]
        for peer, a, b in spans:
            if tables.peer[peer].peak(a, b) >= c.limit:
                return "memory"
        return _Route(n.middle, tuple(tl))

    def plan(
        self, mb: int, tables: _Tables, later: int, not_before: float = 0.0, fixed: tuple[str, ...] | None = None
    ) -> _Route:
        """Best route for `mb` against `tables` (or the timing of the `fixed` middle peers),
        starting no earlier than `not_before`; delays the start when memory is full throughout."""
        while True:
            route, memory_blocked = self._search(mb, tables, later, not_before, fixed)
            if route is not None:
                return route
            nxt = tables.next_event_after(not_before) if memory_blocked else None
            if nxt is None:
                raise UnsatisfiableScheduleError(
                    f"microbatch {mb} finds no path under the stage-load bound {self.c.bound}; "
                    "raise max_stage_load or skip fewer stages"
                )
            not_before = nxt

    def _search(
        self, mb: int, tables: _Tables, later: int, not_before: float, fixed: tuple[str, ...] | None
    ) -> tuple[_Route | None, bool]:
        c = self.c
        origin = c.origins[mb]
        fo = c.fwd[origin]
        start = tables.peer[origin].fit_with_memory(not_before, fo, c.limit)
        root = _Node(start + fo, origin, (), ((start, start + fo),), 0, 0, 0, 0.0, 0.0)
        lb = self._lower_bound(root, origin, tables.load)
        if lb is None:
            return None, False
        heap: list[tuple[float, int, int, _Node | _Route]] = [(lb, 0, 0, root)]
        seq = 1
        memory_blocked = False
        expanded = 0
        while heap:
            _, _, _, item = heapq.heappop(heap)
            if isinstance(item, _Route):
                return item, memory_blocked
            if len(item.middle) == c.L:
                closed = self._close(item, origin, tables, later)
                if isinstance(closed, _Route):
                    heapq.heappush(heap, (closed.completion, -c.L - 1, seq, closed))
                    seq += 1
                else:
                    memory_blocked |= closed == "memory"
                continue
            if expanded >= _SEARCH_NODE_CAP:
                heap.append((0.0, 0, 0, item))
                return self._dive(heap, origin, tables, later, memory_blocked)
            expanded += 1
            self.expansions += 1
            for lb, child in self._children(item, origin, tables):
                if fixed is not None and child.middle != fixed[: len(child.middle)]:
                    continue
                heapq.heappush(heap, (lb, -len(child.middle), seq, child))
                seq += 1
        return None, memory_blocked

    def _dive(
        self, heap: list, origin: str, tables: _Tables, later: int, memory_blocked: bool
    ) -> tuple[_Route | None, bool]:
        """Past the node cap: depth-first, cheapest child first, from the open nodes in order —
        the first complete route wins. Keeps big problems bounded at some cost in quality."""
        best = min((it for it in heap if isinstance(it[3], _Route)), default=None)
        if best is not None:
            return best[3], memory_blocked
        stack = [it[3] for it in sorted(heap, key=lambda it: it[:3], reverse=True)]
        while stack:
            n = stack.pop()
            if len(n.middle) == self.c.L:
                closed = self._close(n, origin, tables, later)
                if isinstance(closed, _Route):
                    return closed, memory_blocked
                memory_blocked |= closed == "memory"
                continue
            self.expansions += 1
            kids = self._children(n, origin, tables)
            stack += [k for _, k in sorted(kids, key=lambda it: it[0], reverse=True)]
        return None, memory_blocked


# ---------------------------------------------------------------------------------------------
# The three phases


def _solve(c: _Compiled, mode: ScheduleMode, target_ratio: float, search_budget: int) -> Schedule:
    if _bad_number(target_ratio, positive=False) or not isinstance(search_budget, int) or search_budget < 0:
        raise ScheduleError("target_ratio must be ≥ 0 and search_budget an integer ≥ 0")
    planner = _Planner(c)
    M = len(c.origins)

    # Phase 1: each microbatch's best path as if alone (stage load shared), then timed together.
    alone = _Tables(c)
    paths = []
    for mb in range(M):
        route = planner.plan(mb, _TablesView(alone), later=M - 1 - mb)
        alone.commit(mb, route)
        paths.append(route.middle)
    first = _Tables(c)
    for mb in range(M):
        first.commit(mb, planner.plan(mb, first, later=0, fixed=paths[mb]))
    first_makespan = first.makespan()

    # Phase 2: prioritised planning against the reservation table.
    tables = _Tables(c)
    for mb in range(M):
        tables.commit(mb, planner.plan(mb, tables, later=M - 1 - mb))
    planned_makespan = tables.makespan()

    # Phase 3: re-plan one microbatch at a time against all the others.
    target = target_ratio * first_makespan
    budget_end = planner.expansions + search_budget
    passes, stopped = 0, "no improvement"
    while True:
        if tables.makespan() <= target:
            stopped = "within target"
            break
        if passes >= _MAX_REPAIR_PASSES:
            stopped = "pass limit"
            break
        passes += 1
        improved = False
        order = sorted(range(M), key=lambda m: (tables.routes[m].timeline[0][3], m))
        for mb in order:
            if planner.expansions >= budget_end:
                break
            old = tables.withdraw(mb)
            new = planner.plan(mb, tables, later=0)
            if new.completion < old.completion:
                tables.commit(mb, new)
                improved = True
            else:
                tables.commit(mb, old)
        if planner.expansions >= budget_end:
            stopped = "budget"
            break
        if not improved:
            break

    best = tables if tables.makespan() <= first_makespan else first
    plans = tuple(_to_plan(c, mb, best.routes[mb]) for mb in range(M))
    stats = SearchStats(first_makespan, planned_makespan, planner.expansions, passes, stopped)
    return Schedule(mode, plans, best.makespan(), stats)


class _TablesView(_Tables):
    """Empty reservations but the shared stage load: a microbatch planned as if alone."""

    def __init__(self, shared: _Tables) -> None:  # noqa: D107 — no work beyond wiring
        self.c = shared.c
        self.peer = {p: _PeerTable() for p in shared.c.stage_of}
        self.load = shared.load
        self.routes = {}


def _to_plan(c: _Compiled, mb: int, route: _Route) -> MicrobatchPlan:
    origin = c.origins[mb]
    path = ((0, origin),) + tuple((c.stage_of[q], q) for q in route.middle) + ((0, origin),)
    visits = tuple(Visit(mb, p, s, k, a, b) for p, s, k, a, b in route.timeline)
    return MicrobatchPlan(mb, origin, path, visits)


# ---------------------------------------------------------------------------------------------
# Validation


def validate(schedule: Schedule, problem: PipelineProblem) -> list[str]:
    """Every constraint of the module docstring checked on `schedule`; the violations, [] if none.
    A "full" schedule is checked against `full_pipeline_problem(problem)`."""
    if schedule.mode == "full":
        problem = full_pipeline_problem(problem)
    try:
        c = compile_problem(problem)
    except ScheduleError as e:
        return [f"problem: {e}"]
    out: list[str] = []
    M = len(c.origins)
    ids = [p.microbatch for p in schedule.plans]
    if sorted(ids) != list(range(M)):
        out.append(f"microbatch ids {sorted(ids)} are not exactly 0..{M - 1}")
    scale = max(1.0, abs(schedule.makespan))
    tol = 1e-9 * scale
    load = [0] * c.S
    per_peer: dict[str, list[Visit]] = {}
    for plan in schedule.plans:
        mb = plan.microbatch
        where = f"microbatch {mb}"
        if 0 <= mb < M and plan.origin != c.origins[mb]:
            out.append(f"{where}: origin {plan.origin!r}, expected {c.origins[mb]!r}")
        path = plan.path
        if len(path) < 2 or path[0] != (0, plan.origin) or path[-1] != (0, plan.origin):
            out.append(f"{where}: path must start and end at (0, {plan.origin!r}), got {path!r}")
            continue
        middle = path[1:-1]
        stages = [s for s, _ in middle]
        for s, q in middle:
            if c.stage_of.get(q) != s:
                out.append(f"{where}: peer {q!r} does not hold stage {s}")
        if 0 in stages:
            out.append(f"{where}: stage 0 visited mid-path")
        if len(set(stages)) != len(stages):
            out.append(f"{where}: a stage is visited twice: {stages}")
        if len(set(stages) - {0}) != c.L:
            out.append(f"{where}: skips {c.S - 1 - len(set(stages) - {0})} stages, must skip exactly {c.S - 1 - c.L}")
        frontier, swaps = 0, 0
        for s in stages:
            nxt = c.step(frontier, swaps, s)
            if nxt is None:
                out.append(
                    f"{where}: move to stage {s} from frontier {frontier} after {swaps} "
                    "swaps breaks the swap/jump rules"
                )
                break
            frontier, swaps = nxt
        for s in set(stages) - {0}:
            load[s] += 1
        # the visits must be the path's forward, head and reversed backward, timed by the cost model
        peers = [plan.origin] + [q for _, q in middle]
        expect: list[tuple[str, VisitKind, float]] = [(q, "forward", c.fwd.get(q, math.nan)) for q in peers]
        expect.append((plan.origin, "head", HEAD_FACTOR * c.fwd[plan.origin]))
        expect += [(q, "backward", BACKWARD_FACTOR * c.fwd.get(q, math.nan)) for q in reversed(peers[1:])]
        expect.append((plan.origin, "backward", BACKWARD_FACTOR * c.fwd[plan.origin]))
        got = [(v.peer, v.kind) for v in plan.visits]
        if got != [(q, k) for q, k, _ in expect]:
            out.append(f"{where}: visits {got} do not follow the path forward, head, backward")
            continue
        prev: Visit | None = None
        for v, (_, _, dur) in zip(plan.visits, expect, strict=True):
            if v.microbatch != mb or v.stage != c.stage_of.get(v.peer):
                out.append(f"{where}: visit {v} is mislabelled")
            if v.start < -tol or not abs((v.end - v.start) - dur) <= tol:
                out.append(f"{where}: {v.kind} on {v.peer!r} lasts {v.end - v.start}, expected {dur}")
            if prev is not None:
                hop = c.edge.get((prev.peer, v.peer), 0.0)
                if v.start < prev.end + hop - tol:
                    out.append(
                        f"{where}: {v.kind} on {v.peer!r} starts at {v.start} before its input "
                        f"arrives at {prev.end + hop}"
                    )
            prev = v
            per_peer.setdefault(v.peer, []).append(v)
    for s in range(1, c.S):
        if load[s] > c.bound:
            out.append(f"stage {s} gets {load[s]} microbatches, above the bound {c.bound}")
    for peer, visits in sorted(per_peer.items()):
        visits.sort(key=lambda v: (v.start, v.end, v.microbatch))
        for a, b in zip(visits, visits[1:], strict=False):
            if b.start < a.end - tol:
                out.append(
                    f"peer {peer!r}: microbatch {a.microbatch} ({a.kind}) and {b.microbatch} "
                    f"({b.kind}) overlap at {b.start}"
                )
        spans: dict[int, list[float]] = {}
        for v in visits:
            span = spans.setdefault(v.microbatch, [v.start, v.end])
            span[0], span[1] = min(span[0], v.start), max(span[1], v.end)
        events = sorted([(e - tol, -1) for _, e in spans.values()] + [(s, 1) for s, _ in spans.values()])
        cur = peak = 0
        for _, d in events:
            cur += d
            peak = max(peak, cur)
        if peak > c.limit:
            out.append(f"peer {peer!r} holds {peak} microbatches in flight, above the limit {c.limit}")
    ends = [p.completion for p in schedule.plans if p.visits]
    if ends and abs(max(ends) - schedule.makespan) > tol:
        out.append(f"makespan {schedule.makespan} is not the last completion {max(ends)}")
    return out
