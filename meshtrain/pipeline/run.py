"""What the peers of one pipeline run agree on: the `PipelineRun` (its name, scheduling problem,
mode, microbatch shape and activation codec), from which every peer computes the same schedule of
an iteration, with or without the peers agreed dead.

Why a module of its own: the runtime (`runtime.py`) and its parts (`iteration.py`,
`rerouting.py`) all read the run; here it depends on none of them.

Not here: the wire protocol and the runtime (`runtime.py`), the search for a schedule
(`scheduler.py`).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Literal

from meshtrain.errors import MeshtrainError
from meshtrain.pipeline.hop_codec import ACTIVATION_CODECS
from meshtrain.pipeline.scheduler import (
    PipelineProblem,
    Schedule,
    ScheduleError,
    full_pipeline_schedule,
    skippipe_schedule,
)

MAX_RUN_CHARS = 64

Mode = Literal["skippipe", "full"]


class PipelineError(MeshtrainError):
    """The pipeline cannot run: a stage with no live peer, peers that never connected."""


@dataclass(frozen=True)
class PipelineRun:
    """Everything the peers of one pipeline run must agree on (they compute the same schedule).

    run: a name for the run, part of every message and tag (≤ 64 chars), so runs never mix.
    problem: the scheduling problem (placement, compute times, links, microbatches, skip ratio).
    mode: "skippipe" (skips and swaps) or "full" (every stage in order: the baseline).
    microbatch_size, context: the shape of a microbatch's token ids, [microbatch_size, context].
    activation_codec: how every activation and gradient hop is encoded (`hop_codec.py`: "none",
        the default, or one of `ACTIVATION_CODECS`).
    """

    run: str
    problem: PipelineProblem
    mode: Mode
    microbatch_size: int
    context: int
    activation_codec: str = "none"

    def __post_init__(self) -> None:
        if not isinstance(self.run, str) or not 0 < len(self.run) <= MAX_RUN_CHARS:
            raise PipelineError(f"run name must be 1..{MAX_RUN_CHARS} characters")
        if self.mode not in ("skippipe", "full"):
            raise PipelineError(f"mode must be 'skippipe' or 'full', got {self.mode!r}")
        if self.activation_codec not in ACTIVATION_CODECS:
            raise PipelineError(
                f"activation_codec must be one of {', '.join(ACTIVATION_CODECS)}, got {self.activation_codec!r}"
            )

    def schedule(self, dead: frozenset[str] = frozenset()) -> Schedule:
        """The schedule of an iteration, without the peers in `dead`."""
        problem = self.problem
        if dead:
            placement = {p: s for p, s in problem.placement.items() if p not in dead}
            problem = replace(
                problem,
                placement=placement,
                origins=None,
                forward_time={p: t for p, t in problem.forward_time.items() if p in placement},
            )
        try:
            if self.mode == "full":
                return full_pipeline_schedule(problem)
            return skippipe_schedule(problem)
        except ScheduleError as e:
            raise PipelineError(f"cannot schedule run {self.run} without {sorted(dead)}: {e}") from None


__all__ = ["MAX_RUN_CHARS", "Mode", "PipelineError", "PipelineRun"]
