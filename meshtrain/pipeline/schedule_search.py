"""The search behind SkipPipe path scheduling: each microbatch's path and a collision-free timetable.

The problem, the cost model and the constraints are told in scheduler.py, whose entry points
(`skippipe_schedule`, `full_pipeline_schedule`) and `validate` call `compile_problem` and `solve`
here; the types it builds are in schedule_types.py.

Compilation: `compile_problem` validates a `PipelineProblem` and precomputes its path-shape rules
(which stage may follow which under the swap and jump limits, which partial stage sequences can
still be completed, which stages some path can reach) and the balanced stage-load bound. The
runtime re-routes around dead peers with the same rules (`CompiledProblem.step`).

Algorithm: prioritised time-aware A* with large-neighbourhood repair, instead of the reference's
conflict-based search (CBS). Three phases, all deterministic (`solve`):
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

Pure: no I/O, no clocks, no global state. Not here: the public entry points, their defaults and
`validate` (scheduler.py); the problem and schedule types (schedule_types.py).
"""

from __future__ import annotations

import heapq
import math
from bisect import bisect_right
from dataclasses import dataclass, replace

from meshtrain.pipeline.schedule_types import (
    BACKWARD_FACTOR,
    HEAD_FACTOR,
    MicrobatchPlan,
    PipelineProblem,
    Schedule,
    ScheduleError,
    ScheduleMode,
    SearchStats,
    UnsatisfiableScheduleError,
    Visit,
    VisitKind,
    skipped_stages_per_path,
)

_SEARCH_NODE_CAP = 5_000  # per A* call; past it a depth-first dive finds some path
_MAX_REPAIR_PASSES = 8

# ---------------------------------------------------------------------------------------------
# Problem compilation and the path-shape rules


@dataclass(frozen=True)
class CompiledProblem:
    """A validated `PipelineProblem` with its path-shape rules precomputed (`compile_problem`)."""

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


def compile_problem(problem: PipelineProblem) -> CompiledProblem:
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

    shape = CompiledProblem(
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


def _explore_shapes(c: CompiledProblem) -> tuple[frozenset[tuple[int, int, int]], tuple[int, ...]]:
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
    def __init__(self, c: CompiledProblem) -> None:
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
    def __init__(self, c: CompiledProblem) -> None:
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


def solve(c: CompiledProblem, mode: ScheduleMode, target_ratio: float, search_budget: int) -> Schedule:
    """The three phases (module docstring) on a compiled problem; `mode` labels the result.
    Raises ScheduleError on a bad target_ratio or search_budget, UnsatisfiableScheduleError when
    a microbatch finds no path."""
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


def _to_plan(c: CompiledProblem, mb: int, route: _Route) -> MicrobatchPlan:
    origin = c.origins[mb]
    path = ((0, origin),) + tuple((c.stage_of[q], q) for q in route.middle) + ((0, origin),)
    visits = tuple(Visit(mb, p, s, k, a, b) for p, s, k, a, b in route.timeline)
    return MicrobatchPlan(mb, origin, path, visits)
