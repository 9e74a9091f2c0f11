"""DiLoCo (Douillard et al. 2023, "DiLoCo: Distributed Low-Communication Training of LMs").

Every peer runs H inner steps (AdamW in the paper: lr 4e-4, wd 0.1, betas (0.9, 0.95)); then
(docs/algorithms.md, DiLoCo):

    Δ_i = φ − θ_i                        pseudo-gradient (outer minus local parameters)
    Δ   = mean_i Δ_i                      all-reduce through the Collective (optional codec)
    b  ← μ·b + Δ                          torch SGD(nesterov=True) with grad = Δ:
    φ  ← φ − lr·(Δ + μ·b)                 lr 0.7, μ 0.9 by default
    θ_i ← φ

We use torch's `SGD` on φ rather than rewriting it (as OpenDiLoCo does), so `nesterov=False`
gives heavy-ball (the rule NoLoCo's reference code calls DiLoCo: b ← μ·b + Δ; φ ← φ − lr·b) and
momentum 0 gives plain outer SGD (lr 1: FedAvg). The outer state (φ and the momentum buffers) is
identical on every peer because every peer applies the same bit-identical Δ (the collective's
contract); it is part of `state_dict` for checkpoints and late joiners. A round that loses a peer
averages over the survivors (the collective does that); a joiner contributes weight 0 for its
first H steps, and at least `JOIN_WARMUP_STEPS` (`OuterOptimizer.join`). The inner optimizer's state persists across rounds and is
never averaged.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import ClassVar, Self

import torch

from meshtrain.collective.contract import Collective
from meshtrain.optim.outer import OuterOptimizer, OuterSpec


class DiLoCo(OuterOptimizer):
    """model, inner, collective: see `OuterOptimizer`.
    H: inner steps per round (paper: 500; 50–125 also run).
    lr, momentum, nesterov: the outer SGD (defaults 0.7, 0.9, True — docs/algorithms.md).
    codec: compression of the pseudo-gradient all-reduce ("none"; "fp16" was lossless in
        OpenDiLoCo; "fp4"/"int4" for 8× fewer bytes).
    fragments, delay, alpha: Streaming DiLoCo's schedule (`StreamingDiLoCo` sets them).
    """

    spec_keys: ClassVar[frozenset[str] | None] = frozenset(("outer_lr", "outer_momentum", "codec"))

    dense_all_reduce = True  # the mean of every peer's Δ: a robust rule can combine them

    @classmethod
    def from_spec(
        cls, model: torch.nn.Module, inner: torch.optim.Optimizer | None, collective: Collective, spec: OuterSpec
    ) -> Self:
        return cls(model, inner, collective, H=spec.H, lr=spec.outer_lr, momentum=spec.outer_momentum, codec=spec.codec)

    def __init__(
        self,
        model: torch.nn.Module,
        inner: torch.optim.Optimizer | None,
        collective: Collective,
        *,
        H: int = 500,
        lr: float = 0.7,
        momentum: float = 0.9,
        nesterov: bool = True,
        codec: str = "none",
        fragments: Sequence[Sequence[str]] | None = None,
        delay: int = 0,
        alpha: float = 0.0,
    ) -> None:
        if not lr > 0 or not 0 <= momentum < 1:
            raise ValueError(f"outer lr must be > 0 and momentum in [0, 1), got {lr}, {momentum}")
        super().__init__(model, inner, collective, H=H, codec=codec, fragments=fragments, delay=delay, alpha=alpha)
        self.lr, self.momentum, self.nesterov = lr, momentum, nesterov and momentum > 0

    def build_outer_optimizer(self, params: list[torch.Tensor]) -> torch.optim.Optimizer:
        # foreach=False: one code path, so the outer step is the same bits on every peer whatever
        # torch picks for its fast path on a given machine.
        return torch.optim.SGD(params, lr=self.lr, momentum=self.momentum, nesterov=self.nesterov, foreach=False)
