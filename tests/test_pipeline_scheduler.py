"""SkipPipe path scheduling (`meshtrain.pipeline.scheduler`): a pure function, tested on random
problems with hypothesis against an independent checker written here, and against the module's
own `validate` (which must also catch schedules we break on purpose).
"""

from __future__ import annotations

from dataclasses import replace

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from meshtrain.pipeline.scheduler import (
    BACKWARD_FACTOR,
    Link,
    PipelineProblem,
    ScheduleError,
    UnsatisfiableScheduleError,
    full_pipeline_schedule,
    skipped_stages_per_path,
    skippipe_schedule,
    validate,
)


@st.composite
def problems(draw) -> PipelineProblem:
    S = draw(st.integers(2, 5))
    placement: dict[str, int] = {}
    for s in range(S):
        for r in range(draw(st.integers(1, 3))):
            placement[f"p{s}.{r}"] = s
    peers = sorted(placement)
    fwd = {p: draw(st.floats(0.05, 2.0)) for p in peers}
    links = {
        (a, b): Link(latency=draw(st.floats(0.0, 0.2)), bandwidth=draw(st.floats(1e6, 1e9)))
        for i, a in enumerate(peers)
        for b in peers[i + 1 :]
    }
    return PipelineProblem(
        num_stages=S,
        placement=placement,
        forward_time=fwd,
        links=links,
        activation_bytes=draw(st.floats(0, 4e6)),
        microbatches=draw(st.integers(1, 8)),
        skip_ratio=draw(st.sampled_from([0.0, 0.25, 0.34, 0.5])),
        allow_swaps=draw(st.booleans()),
    )


def independent_check(schedule, problem: PipelineProblem) -> None:
    """The properties a runtime relies on, checked without the scheduler's own helpers."""
    k = skipped_stages_per_path(problem) if schedule.mode == "skippipe" else 0
    L = problem.num_stages - 1 - k
    assert sorted(p.microbatch for p in schedule.plans) == list(range(problem.microbatches))
    busy: dict[str, list[tuple[float, float]]] = {}
    for plan in schedule.plans:
        stages = [s for s, _ in plan.path[1:-1]]
        assert plan.path[0] == plan.path[-1] == (0, plan.origin)
        assert problem.placement[plan.origin] == 0
        assert len(stages) == len(set(stages)) == L and 0 not in stages
        assert all(problem.placement[q] == s for s, q in plan.path)
        if schedule.mode == "full" or not problem.allow_swaps:
            assert stages == sorted(stages)
        t = 0.0
        for v in plan.visits:  # causal: each visit starts after the previous one ends
            assert v.start >= t - 1e-9 and v.end > v.start
            t = v.end
            busy.setdefault(v.peer, []).append((v.start, v.end))
        back = [v for v in plan.visits if v.kind == "backward"]
        assert back[-1].peer == plan.origin
        assert back[-1].end - back[-1].start == pytest.approx(BACKWARD_FACTOR * problem.forward_time[plan.origin])
    for spans in busy.values():  # a peer computes one thing at a time
        spans.sort()
        assert all(b[0] >= a[1] - 1e-9 for a, b in zip(spans, spans[1:], strict=False))
    assert schedule.makespan == pytest.approx(max(p.completion for p in schedule.plans))


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(problems())
def test_random_problems_get_valid_deterministic_schedules(problem):
    try:
        sched = skippipe_schedule(problem, search_budget=3000)
    except UnsatisfiableScheduleError as e:
        assert any(w in str(e) for w in ("raise", "lower", "place"))  # says what to relax
        return
    assert validate(sched, problem) == []
    independent_check(sched, problem)
    assert skippipe_schedule(problem, search_budget=3000) == sched  # no clocks, no randomness
    full = full_pipeline_schedule(problem, search_budget=3000)
    assert validate(full, problem) == []
    independent_check(full, problem)


def _hetero() -> PipelineProblem:
    placement = {"d0": 0, "d1": 0, "a0": 1, "a1": 1, "b0": 2, "b1": 2, "c0": 3, "c1": 3, "e0": 4, "e1": 4}
    fwd = {p: (3.0 if p.endswith("1") and p[0] in "bc" else 1.0) for p in placement}  # two slow peers
    peers = sorted(placement)
    links = {(a, b): Link(0.05, 1e8) for i, a in enumerate(peers) for b in peers[i + 1 :]}
    return PipelineProblem(
        num_stages=5,
        placement=placement,
        forward_time=fwd,
        links=links,
        activation_bytes=1e6,
        microbatches=8,
        skip_ratio=0.25,
    )


def test_skipping_beats_the_full_pipeline_on_a_heterogeneous_swarm():
    problem = _hetero()
    sk, full = skippipe_schedule(problem), full_pipeline_schedule(problem)
    assert validate(sk, problem) == [] and validate(full, problem) == []
    # each path skips one of four stages, so it does 3/4 of the compute and can route around the
    # slow replicas: the iteration must end sooner than the full pipeline's.
    assert sk.makespan < full.makespan
    assert sk.stats.expansions > 0 and sk.stats.stopped


def test_validate_catches_broken_schedules():
    problem = _hetero()
    sched = skippipe_schedule(problem)
    plan = sched.plans[0]
    v0 = plan.visits[1]
    # a visit moved before its input arrives / onto another microbatch's time
    moved = replace(plan, visits=(plan.visits[0], replace(v0, start=0.0, end=v0.end - v0.start), *plan.visits[2:]))
    assert validate(replace(sched, plans=(moved, *sched.plans[1:])), problem)
    # a path that visits a stage twice
    twice = replace(plan, path=(plan.path[0], plan.path[1], plan.path[1], *plan.path[3:]))
    assert validate(replace(sched, plans=(twice, *sched.plans[1:])), problem)
    # a microbatch missing
    assert validate(replace(sched, plans=sched.plans[1:]), problem)


@pytest.mark.parametrize(
    "change,error,needle",
    [
        ({"placement": {"d0": 0, "a0": 1}, "num_stages": 3}, UnsatisfiableScheduleError, "stage 2 has no peer"),
        ({"forward_time": {}}, ScheduleError, "forward_time"),
        ({"links": {}}, ScheduleError, "no link"),
        ({"skip_ratio": 1.0}, ScheduleError, "skip_ratio"),
        ({"microbatches": 0}, ScheduleError, "microbatches"),
        ({"origins": ("a0",) * 8}, ScheduleError, "stage-0"),
    ],
)
def test_bad_problems_are_clear_errors(change, error, needle):
    with pytest.raises(error, match=needle):
        skippipe_schedule(replace(_hetero(), **change))
