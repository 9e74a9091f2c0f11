"""The vocabulary of SkipPipe path scheduling: the problem, the answer, the errors, the cost factors.

`PipelineProblem` (with its `Link`s) is one training iteration to schedule; a `Schedule` (one
`MicrobatchPlan` of `Visit`s per microbatch, plus `SearchStats`) is the answer; `ScheduleError` and
`UnsatisfiableScheduleError` say why there is none. What the fields mean — the cost model, the
path-shape rules, the memory and stage-load limits — is told once, in scheduler.py's docstring.

Why a module of its own: the public entry points and `validate` (scheduler.py) call the search
(schedule_search.py), and the search builds these types; with them here, below both, neither of
the two imports the other back. Import them from `meshtrain.pipeline.scheduler`, which re-exports
every public name of this module.

Pure data: no search, no I/O. Not here: the entry points and `validate` (scheduler.py), the
search (schedule_search.py).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Literal

from meshtrain.errors import MeshtrainError

BACKWARD_FACTOR = 1.5  # backward compute = 1.5 × forward (reference cost model)
HEAD_FACTOR = 0.25  # head/loss at the origin = forward / 4 (reference cost model)
DEFAULT_MAX_IN_FLIGHT = 3
DEFAULT_MAX_SWAPS = 2
DEFAULT_MAX_SWAP_BACK = 1
DEFAULT_MAX_JUMP = 4

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
    allow_swaps, max_swaps, max_swap_back, max_jump: path shape rules (scheduler.py's docstring).
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
    """How the search went (its phases: schedule_search.py). first_makespan: the collision-unaware
    start (phase 1); planned_makespan: after prioritised planning (phase 2); expansions: A* nodes
    expanded; repair_passes: phase-3 passes run; stopped: why the search ended."""

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
