"""Low-communication replica sync: a stage's replicas agree every H iterations, not every one.

Problem. SkipPipe's runtime all-reduces each stage's gradients among that stage's replicas every
iteration (`PipelineRuntime(sync_gradients=True)`): synchronous data parallelism per stage, fine
on a LAN, but over the internet it sends a stage's worth of gradients per iteration. NoLoCo
(Kolehmainen et al. 2025, arXiv 2506.10911) evaluates the other combination — random pipeline
routing with replicas that meet only every H inner steps through an outer optimizer — and that is
what this module gives a pipeline peer.

Design. `StageOuterSync` wraps one peer's `StageReplica` in an outer optimizer of the optim layer,
unchanged: DiLoCo (Nesterov outer step on the averaged pseudo-gradient; every replica of a stage
ends a round with bit-identical weights and outer state, the collective's contract) or NoLoCo
(pairwise gossip with one random replica of the stage; replicas differ by design). The outer
optimizer sees the stage's parameters only: every other parameter of the replica's (full, locally
built) model is frozen (`requires_grad = False`), so φ, Δ and the exchanged bytes are one stage's.
The runtime runs with `sync_gradients=False` (each replica steps AdamW on its own microbatches'
mean gradient); after each iteration the node calls `after_iteration()`, the outer optimizer's
`astep()` — a counter, except every H iterations, when the stage's replicas run their round.

Rounds are the stage's own: the collective is the runtime's (`PipelineRuntime.collective`, whose
group is the stage's live replicas, `replica_group`), reached through `StageCollective`, which
prefixes every tag with the stage (`s<index>/outer/`), so the rounds of different stages never
meet, and round ids are the iteration count, which every peer of the swarm shares. The runtime is
rebuilt when the placement changes (a new epoch); the optimizer survives it: `StageCollective`
asks for the current runtime's collective at every call, and hands it every other call and
capability as it came (collective/forwarding.py).

Failures are the outer optimizer's: a replica that dies mid-round is dropped by the collective,
and a peer that could not take part proceeds alone and sets `needs_resync`.

Not here: which peers hold which stage (placement.py), downloading a stage's state (node/).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from typing import Literal

import torch

from meshtrain.collective.contract import Collective, GatherResult, ReduceResult, RoundRequest
from meshtrain.collective.forwarding import ForwardingCollective
from meshtrain.errors import ConfigError
from meshtrain.optim import DiLoCo, NoLoCo, OuterOptimizer
from meshtrain.optim.outer import RoundReport
from meshtrain.pipeline.stages import StageReplica

OuterKind = Literal["diloco", "noloco"]


class StageCollective(ForwardingCollective):
    """The collective of one stage's replica rounds: `current()` (the running runtime's
    collective), with every tag prefixed by `prefix` so each stage's rounds are its own; the rest
    is the runtime collective's, capabilities too (collective/forwarding.py)."""

    def __init__(self, current: Callable[[], Collective], prefix: str) -> None:
        self.current = current
        self.prefix = prefix

    @property
    def inner(self) -> Collective:  # type: ignore[override]  # read where the call is made
        return self.current()

    async def all_reduce(self, request: RoundRequest) -> ReduceResult:
        return await super().all_reduce(replace(request, tag=self.prefix + request.tag))

    async def average_with(self, partner: str | None, request: RoundRequest) -> ReduceResult:
        return await super().average_with(partner, replace(request, tag=self.prefix + request.tag))

    async def all_gather(
        self, payload: dict[str, torch.Tensor], *, round_id: int, tag: str = "", weight: float = 1.0
    ) -> GatherResult:
        return await super().all_gather(payload, round_id=round_id, tag=self.prefix + tag, weight=weight)

    async def prepare(self, *, round_id: int, tag: str = "", within: float = 1.0) -> None:
        await super().prepare(round_id=round_id, tag=self.prefix + tag, within=within)

    async def unprepare(self, *, round_id: int, tag: str = "") -> None:
        await super().unprepare(round_id=round_id, tag=self.prefix + tag)

    def watch(self, optimizer: object) -> None:
        """Nothing: the optimizer outlives the epochs' runtimes, and may be built while none runs
        (node/stages/peer.py takes its stage before the epoch starts)."""


class StageOuterSync:
    """DiLoCo or NoLoCo over one stage's replicas (module docstring).

    replica: this peer's stage (its model's other parameters are frozen here).
    current: returns the collective of the running pipeline runtime.
    kind: "diloco" or "noloco". H: iterations per round. lr, momentum: the outer step (DiLoCo:
        0.7, 0.9; NoLoCo's β and μ default to 0.7 and 0.5 when `momentum` is None). codec: what
        the exchange is compressed with.

    Use inside trio: `async with sync.outer:` around the iterations, `await sync.after_iteration()`
    after each; `outer.state_dict()` / `load_state_dict` checkpoint it.
    """

    def __init__(
        self,
        replica: StageReplica,
        current: Callable[[], Collective],
        kind: OuterKind,
        *,
        H: int,
        lr: float = 0.7,
        momentum: float | None = None,
        codec: str = "none",
    ) -> None:
        mine = set(replica.names)
        for name, p in replica.model.named_parameters():
            p.requires_grad_(name in mine)
        self.replica = replica
        self.collective = StageCollective(current, f"s{replica.index}/outer/")
        self.outer: OuterOptimizer
        if kind == "diloco":
            mu = 0.9 if momentum is None else momentum
            self.outer = DiLoCo(replica.model, None, self.collective, H=H, lr=lr, momentum=mu, codec=codec)
        elif kind == "noloco":
            mu = 0.5 if momentum is None else momentum
            self.outer = NoLoCo(replica.model, None, self.collective, H=H, lr=lr, momentum=mu, codec=codec)
        else:
            raise ConfigError(f"replica sync must be diloco or noloco, got {kind!r}")

    @property
    def iterations(self) -> int:
        return self.outer.inner_steps

    async def after_iteration(self) -> list[RoundReport]:
        """One iteration done (the replica stepped its optimizer): count it; every H, the round."""
        return await self.outer.astep()
