"""A TEST HOOK: a node that lies, for scripts/bench/bench_adversarial.py and the verification tests.

Problem. Verifying work (screening, strikes: node/trust/strikes.py) is only believable if it is
measured against real lying peers — daemons on loopback that run the real stack and send bad
updates through the real all-reduce. Patching the code in each test would measure the patch.

Design. One environment variable, read in one place (`mode_from_env`, called once when a `Node`
is built): `MESHTRAIN_ADVERSARY=<mode>` makes that node an adversary. Its collective is wrapped
(`AdversarialCollective`) so that what it contributes to every all-reduce is, by mode:

    signflip10   the honest update x -10 (sign-flipped and scaled)
    noise        Gaussian noise with the update's norm
    zeros        zeros with full weight (a free rider that claims its share)
    replay       the update it sent in its first round, again every round
    replay-phi   replay, and it publishes φ digests other than its own (`publish_other_phi`), so
                 honest peers see it on another lineage and pass over its loss and spot-check
                 verdicts for as long as node/trust/strikes.py allows (`lineage_passes`)
    otherdata    honest, but its inner steps train on other data than assigned: each batch's
                 token order reversed (`other_data`)

The node calls two functions, both no-ops for an honest node (mode None): `wrap(mode,
collective)` when it builds its trainer's collective, and `arm(mode, trainer, view)` once the
trainer and the membership view exist (`otherdata`, `replay-phi`).

Everything else (membership, proof of work, rounds, state; with `replay-phi`, all but the φ
digests in its progress record) is the honest node's.

Not for users: there is no flag or config key for it, and a node logs a warning when it runs one.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import replace
from typing import Protocol

import torch

from meshtrain.collective.contract import Collective, ReduceResult, RoundRequest
from meshtrain.collective.forwarding import ForwardingCollective
from meshtrain.crdt.swarm_view import SwarmView
from meshtrain.errors import ConfigError
from meshtrain.log import get_logger, kv

log = get_logger(__name__)

ENV = "MESHTRAIN_ADVERSARY"
MODES = ("signflip10", "noise", "zeros", "replay", "replay-phi", "otherdata")


def mode_from_env() -> str | None:
    """The adversary mode this process runs (None: honest). The only reader of `ENV`."""
    mode = os.environ.get(ENV, "").strip()
    if not mode:
        return None
    if mode not in MODES:
        raise ConfigError(f"{ENV}={mode!r}: one of {', '.join(MODES)} (a test hook)")
    log.warning(kv("this node is an ADVERSARY (test hook)", mode=mode))
    return mode


def wrap(mode: str | None, collective: Collective) -> Collective:
    """The collective a node of `mode` trains through: `collective` itself when honest."""
    return collective if mode is None else AdversarialCollective(collective, mode)


class HasBatches(Protocol):
    def batch(self, step: int) -> tuple[torch.Tensor, torch.Tensor]: ...


def arm(mode: str | None, trainer: HasBatches, view: SwarmView | None) -> None:
    """The hooks outside the collective: `otherdata` swaps the trainer's batches, `replay-phi`
    makes `view` publish other φ digests. Nothing for an honest node or another mode."""
    if mode == "otherdata":
        trainer.batch = other_data(trainer.batch)  # type: ignore[method-assign,assignment]  # the hook replaces the method
    if mode == "replay-phi":
        assert view is not None  # the node's presence has been entered
        publish_other_phi(view)


class AdversarialCollective(ForwardingCollective):
    """`inner` with every all-reduce contribution replaced as `mode` says (module docstring);
    everything else is `inner`'s (collective/forwarding.py), SparseLoCo's gathered payloads too."""

    def __init__(self, inner: Collective, mode: str) -> None:
        self.inner, self.mode = inner, mode
        self._first: dict[str, dict[str, torch.Tensor]] = {}  # replay: per tag, the first update sent

    async def average_with(self, partner: str | None, request: RoundRequest) -> ReduceResult:
        return await super().average_with(partner, replace(request, tensors=self.corrupt(request.tensors, request.tag)))

    async def all_reduce(self, request: RoundRequest) -> ReduceResult:
        return await super().all_reduce(replace(request, tensors=self.corrupt(request.tensors, request.tag)))

    def corrupt(self, tensors: dict[str, torch.Tensor], tag: str) -> dict[str, torch.Tensor]:
        if self.mode == "signflip10":
            return {k: -10 * v for k, v in tensors.items()}
        if self.mode == "zeros":
            return {k: torch.zeros_like(v) for k, v in tensors.items()}
        if self.mode == "noise":
            norm = torch.sqrt(sum((v.float() ** 2).sum() for v in tensors.values()))
            noise = {k: torch.randn_like(v, dtype=torch.float32) for k, v in tensors.items()}
            scale = norm / torch.sqrt(sum((v**2).sum() for v in noise.values())).clamp_min(1e-30)
            return {k: (noise[k] * scale).to(v.dtype) for k, v in tensors.items()}
        if self.mode in ("replay", "replay-phi"):
            first = self._first.setdefault(tag, {k: v.detach().clone() for k, v in tensors.items()})
            return {k: first[k].clone() for k in tensors} if first.keys() == tensors.keys() else tensors
        return tensors  # otherdata: its update is honest about the wrong data


def other_data(
    batch: Callable[[int], tuple[torch.Tensor, torch.Tensor]],
) -> Callable[[int], tuple[torch.Tensor, torch.Tensor]]:
    """`batch(step)` on other data than assigned: the same rows with their token order reversed."""

    def reversed_batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
        x, y = batch(step)
        seq = torch.cat([x[:, :1], y], dim=1).flip(1)
        return seq[:, :-1].contiguous(), seq[:, 1:].contiguous()

    return reversed_batch


def publish_other_phi(view: SwarmView) -> None:
    """Make `view` publish φ digests other than ours: each digest's bits flipped in every progress
    record it writes. Our own parity check compares the true ones (node/state/run_state.py keeps them),
    so this node stays in step in its own eyes while every honest peer sees another lineage."""
    report = view.report_progress

    def lying(*, phi: list[tuple[int, bytes]] | None = None, **progress: int | None) -> None:
        other = None if phi is None else [(r, bytes(b ^ 0xFF for b in digest)) for r, digest in phi]
        report(phi=other, **progress)

    view.report_progress = lying  # type: ignore[method-assign]
