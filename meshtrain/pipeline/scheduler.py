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

`skippipe_schedule` solves it; the search — prioritised time-aware A* with repair, deterministic,
its budget counted in A* expansions — is told and coded in schedule_search.py.

`full_pipeline_schedule` is the baseline: every microbatch visits every stage in order (no skips,
no swaps), with the same search, cost model, memory limit and collision rule — so the comparison
isolates the effect of skipping and swapping. Its replicas are chosen by the same search rather
than fixed pipeline columns, which makes it a strong baseline.

The problem and schedule types live in schedule_types.py (below both this module and the search,
so neither imports the other back). They are re-exported here, as is `compile_problem` (the
path-shape rules, which the runtime re-routes with): import every name from this module.

This module is pure: no I/O, no clocks, no global state. It does not place peers on stages (the
reference's genetic GCMA placement) and does not run anything; the runtime follows
`Schedule.peer_order()`. Not here: the search (schedule_search.py).
"""

from __future__ import annotations

import math
from dataclasses import replace

from meshtrain.pipeline.schedule_search import compile_problem, solve
from meshtrain.pipeline.schedule_types import (
    BACKWARD_FACTOR,
    DEFAULT_MAX_IN_FLIGHT,
    DEFAULT_MAX_JUMP,
    DEFAULT_MAX_SWAP_BACK,
    DEFAULT_MAX_SWAPS,
    HEAD_FACTOR,
    Link,
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

__all__ = [
    "BACKWARD_FACTOR",
    "DEFAULT_MAX_IN_FLIGHT",
    "DEFAULT_MAX_JUMP",
    "DEFAULT_MAX_SWAPS",
    "DEFAULT_MAX_SWAP_BACK",
    "DEFAULT_SEARCH_BUDGET",
    "DEFAULT_TARGET_RATIO",
    "HEAD_FACTOR",
    "Link",
    "MicrobatchPlan",
    "PipelineProblem",
    "Schedule",
    "ScheduleError",
    "ScheduleMode",
    "SearchStats",
    "UnsatisfiableScheduleError",
    "Visit",
    "VisitKind",
    "compile_problem",
    "full_pipeline_problem",
    "full_pipeline_schedule",
    "skipped_stages_per_path",
    "skippipe_schedule",
    "validate",
]

DEFAULT_TARGET_RATIO = 0.88  # docs/algorithms.md; the stored reference code reads 0.92
DEFAULT_SEARCH_BUDGET = 40_000  # A* node expansions over one call, construction excluded


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
    return solve(compile_problem(problem), "skippipe", target_ratio, search_budget)


def full_pipeline_schedule(
    problem: PipelineProblem, *, target_ratio: float = DEFAULT_TARGET_RATIO, search_budget: int = DEFAULT_SEARCH_BUDGET
) -> Schedule:
    """The full-pipeline baseline on the same placement, cost model and rules (module docstring)."""
    return solve(compile_problem(full_pipeline_problem(problem)), "full", target_ratio, search_budget)


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
