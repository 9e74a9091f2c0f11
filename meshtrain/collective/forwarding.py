"""`ForwardingCollective`: the base of every collective that wraps another, so that a wrapper has
every capability of the collective it wraps.

Problem. An outer optimizer asks its collective for more than the contract's two averages:
whether a round runs in groups smaller than the swarm (`GroupsRounds`: it then adds the consensus
term, optim/outer.py), whether a round's join can be sent ahead (`PreparesRounds`), whether the
collective wants to know the optimizer (`WatchesOptimizer`), and SparseLoCo needs every peer's
payload as sent (`GathersPayloads`). It asks the one way contract.py
gives, `isinstance(collective, Capability)` and then the capability's method. Between the
optimizer and the `SwarmCollective` that has those capabilities sit wrappers: `meshtrain.Swarm`
(node/user_loop.py, a loop you write), `LocalRanksCollective` (node/ranks/group.py, a multi-GPU
peer's ranks), `StageCollective` (pipeline/replica_sync.py, a stage's replica rounds) and
`AdversarialCollective` (node/trust/adversary.py, a test hook). Each re-declared the methods it knew of,
and a capability it did not declare was hidden: a grouped round through `meshtrain.Swarm` or a
multi-GPU peer skipped the consensus term, so the groups' φ drifted apart, and
SparseLoCo through any wrapper proceeded alone every round.

Design. A wrapper subclasses `ForwardingCollective` and says what it wraps: `inner`, an attribute,
or a property where the wrapped collective changes (the running node's, the current pipeline
epoch's), None where this peer has none (a multi-GPU peer's other ranks). The base has every
method of the contract and of every capability and hands each call to `inner` as it came, so a
wrapper overrides only what it changes: a tag prefix, the contribution, the in-machine reduce
around the exchange; one that changes the request hands on `dataclasses.replace(request, ...)`.
A capability `inner` lacks is answered as by a collective without it: the
round is not grouped, `prepare` and `unprepare` send nothing, `watch` looks at nothing, and
`all_gather` raises `CollectiveError`. A new
capability is added to contract.py and forwarded here once; every wrapper then has it.

Not here: what the capabilities mean (contract.py); collectives that wrap nothing (`SwarmCollective`,
`LocalCollective`), which implement the contract and the capabilities they have directly.
"""

from __future__ import annotations

from typing import Any

import torch

from meshtrain.collective.contract import (
    Collective,
    CollectiveError,
    GatherResult,
    GathersPayloads,
    GroupsRounds,
    PreparesRounds,
    ReduceResult,
    RoundRequest,
    WatchesOptimizer,
)


class ForwardingCollective:
    """Every call of the contract and its capabilities, handed to `inner` (module docstring). It
    names no Protocol as a base: the contract and the capabilities are runtime-checkable Protocols,
    met by structure (`isinstance` sees them all), and mypy checks the fit wherever a wrapper is
    passed as a `Collective`.

    inner: the wrapped collective — set it in `__init__`, or define it as a property; None where
        this peer has none (then the contract's own calls must be overridden).
    """

    inner: Collective | None

    def _wrapped(self) -> Collective:
        inner = self.inner
        if inner is None:
            raise CollectiveError(f"{type(self).__name__} wraps no collective on this peer")
        return inner

    @property
    def peer_id(self) -> str:
        return self._wrapped().peer_id

    def group(self, round_id: int) -> tuple[str, ...]:
        return self._wrapped().group(round_id)

    async def all_reduce(self, request: RoundRequest) -> ReduceResult:
        return await self._wrapped().all_reduce(request)

    async def average_with(self, partner: str | None, request: RoundRequest) -> ReduceResult:
        return await self._wrapped().average_with(partner, request)

    # -- capabilities: `inner`'s, or the answer of a collective without them ----------------------

    def round_is_grouped(self, round_id: int) -> bool:
        inner = self.inner
        return isinstance(inner, GroupsRounds) and inner.round_is_grouped(round_id)

    async def prepare(self, *, round_id: int, tag: str = "", within: float = 1.0) -> None:
        inner = self.inner
        if isinstance(inner, PreparesRounds):
            await inner.prepare(round_id=round_id, tag=tag, within=within)

    async def unprepare(self, *, round_id: int, tag: str = "") -> None:
        inner = self.inner
        if isinstance(inner, PreparesRounds):
            await inner.unprepare(round_id=round_id, tag=tag)

    def watch(self, optimizer: Any) -> None:
        inner = self.inner
        if isinstance(inner, WatchesOptimizer):
            inner.watch(optimizer)

    async def all_gather(
        self, payload: dict[str, torch.Tensor], *, round_id: int, tag: str = "", weight: float = 1.0
    ) -> GatherResult:
        inner = self.inner
        if not isinstance(inner, GathersPayloads):
            raise CollectiveError(f"{type(inner).__name__} cannot all-gather (no GathersPayloads capability)")
        return await inner.all_gather(payload, round_id=round_id, tag=tag, weight=weight)
