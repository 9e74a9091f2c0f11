"""`DataParallel`: synchronous data parallelism over a `Collective`, the upper baseline.

Every inner step all-reduces the gradients before the inner optimizer steps, so every peer applies
the same averaged gradient to the same parameters with the same optimizer state: the replicas
stay bit-identical, as in DDP — what the low-communication outer optimizers (outer.py) are
measured against, and the spec's `optimizer = "dp"`.

Design. It is an `OuterOptimizer` with H = 1 whose round is the inner step, so the node, the
trainer, `meshtrain.Swarm`, parity, checkpoints and late joiners treat it like any other:

    pseudo_gradient   this peer's gradients (host fp32 copies), not φ − θ
    communicate       the base all-reduce (the swarm's aggregation rule and codec apply)
    apply             p.grad ← the mean, optional clip, then the inner optimizer's step
    merge             φ ← θ (φ is the swarm's parameters after the step, what parity hashes)

`step()` does *not* step the inner optimizer first (the base class does): the inner step is the
round's update. The trainer's clipping of the local gradients before `step()` stays as it is;
`clip` clips the averaged gradient as well (the library's baseline uses it).

State. The inner optimizer's state (AdamW's moments) is the swarm's state here, identical on
every peer, so `state_dict(inner=False)` — what a late joiner downloads — carries it, and
`load_state_dict`/`join` always restore it: a joiner continues bit-identically and contributes
from its first step. φ equals θ after every step; checkpoints, `export` and evaluation read φ.

Failures. A peer that cannot take part in a step's all-reduce (`CollectiveError`) steps on its
own gradient, logs it and sets `needs_resync` (the base class's rule): its replica now differs,
and the node downloads the swarm's state. Replicas are bit-identical across peers whose inner
step computes the same bits (the same device type and torch build): the update runs on the
model's device, not on the host.

Cost. Every step is a round: the gradients travel (2(n−1)/n of the model per peer, or its codec's
share), the node hashes φ and publishes the state to joiners after it (parity), the price of a
baseline that syncs every step.

Not here: outer momentum, fragments, overlap (a baseline needs none of them); FSDP (the trainer
steps a sharded inner optimizer itself: `inner` must be given).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from copy import deepcopy
from typing import Any, ClassVar, Self

import torch

from meshtrain.collective.contract import Collective, ReduceResult
from meshtrain.errors import ConfigError
from meshtrain.optim.outer import OuterOptimizer, OuterSpec, OuterStateError, RoundReport
from meshtrain.optim.outer_state import OptimizerLayout


class DataParallel(OuterOptimizer):
    """Synchronous data parallelism: gradients are all-reduced every step before the inner step,
    so every peer applies the same averaged gradient.

    model, collective: see `OuterOptimizer`. inner: the optimizer that applies the averaged
    gradient (required). codec: compression of the gradient all-reduce. clip: clip the averaged
    gradient to this norm (None: no clipping here). H: 1 (accepted so that code building any
    outer optimizer from a spec may pass it; a round is one step).
    """

    spec_keys: ClassVar[frozenset[str] | None] = frozenset(("codec",))

    # A spec's H is 1 (gradients are all-reduced every step; the spec's check refuses another H).
    # Its screening is off unless the spec sets `screen_norm`: a single step's gradient of a small
    # batch is too noisy to judge (an honest peer's odd batch has a cosine of about 0 with the
    # others' and 2-4x their norm: flagged in about 1 round in 5 by both other owners at batch 4,
    # and excluded within 30 steps).
    spec_defaults: ClassVar[Mapping[str, Any]] = {"H": 1, "screen_norm": 0.0}
    unpaced_reason: ClassVar[str | None] = "every step is a round: a skipped step would be a round without the peer"
    ungrouped_reason: ClassVar[str | None] = "its replicas must stay identical every step"
    join_warmup_steps = 0  # a joiner downloads the inner state too: it contributes from its first step
    dense_all_reduce = True  # the mean of every peer's gradient: a robust rule can combine them

    @classmethod
    def check_spec(cls, spec: OuterSpec) -> None:
        if spec.H != 1:
            raise ValueError(f"dp all-reduces gradients every step; H must be 1, not {spec.H}")

    @classmethod
    def from_spec(
        cls, model: torch.nn.Module, inner: torch.optim.Optimizer | None, collective: Collective, spec: OuterSpec
    ) -> Self:
        if inner is None:  # FSDP: the trainer steps the sharded inner optimizer itself
            raise ConfigError(
                "optimizer dp steps the inner optimizer with the averaged gradient, which FSDP shards; "
                "run this peer with --sharding ddp"
            )
        # The trainer clips each peer's gradient before the step; the mean is then within the clip.
        return cls(model, inner, collective, codec=spec.codec)

    def __init__(
        self,
        model: torch.nn.Module,
        inner: torch.optim.Optimizer,
        collective: Collective,
        *,
        codec: str = "none",
        clip: float | None = None,
        H: int = 1,
    ) -> None:
        if inner is None:
            raise ValueError("DataParallel steps the inner optimizer with the averaged gradient: pass it")
        if H != 1:
            raise ValueError(f"DataParallel all-reduces every step: H is 1, got {H!r}")
        super().__init__(model, inner, collective, H=1, codec=codec)
        self.clip = clip

    def pseudo_gradient(self, names: Sequence[str]) -> dict[str, torch.Tensor]:
        """This peer's gradients (zeros for a parameter without one), as host fp32 copies."""
        out = {}
        for n in names:
            p = self.params[n]
            g = p.grad.detach() if p.grad is not None else torch.zeros_like(p)
            out[n] = g.to("cpu", torch.float32, copy=True)
        return out

    def apply(self, result: ReduceResult, names: Sequence[str]) -> None:
        """The inner step with the averaged gradient."""
        for n in names:
            p = self.params[n]
            p.grad = result.tensors[n].to(p.device, p.dtype, copy=True)  # the result may be shared
        if self.clip is not None:
            torch.nn.utils.clip_grad_norm_([self.params[n] for n in names], self.clip)
        assert self.inner is not None  # checked in __init__
        self.inner.step()

    def merge(self, names: Sequence[str]) -> None:
        """φ ← θ: the swarm's parameters after the step."""
        for n in names:
            self.outer_params[n].copy_(self.params[n].detach())

    # -- the training loop: the round is the inner step ----------------------------------------

    def step(self) -> list[RoundReport]:
        for hook in self.step_hooks:
            hook(self)
        return self._bridge.run_from_thread(self.exchanges.advance())

    async def astep(self) -> list[RoundReport]:
        return await self._bridge.run_async(self.exchanges.advance())

    # -- state: the inner optimizer's is the swarm's ------------------------------------------

    def state_dict(self, *, inner: bool = True, copy: bool = True) -> dict[str, Any]:
        state = super().state_dict(inner=False, copy=copy)
        assert self.inner is not None
        state["inner"] = deepcopy(self.inner.state_dict()) if copy else self.inner.state_dict()
        return state

    def load_state_dict(self, state: dict[str, Any], *, inner: bool = True) -> None:
        if not isinstance(state, dict) or "inner" not in state:
            raise OuterStateError("a DataParallel state carries the inner optimizer's state; this one has none")
        assert self.inner is not None  # checked in __init__
        # the swarm's, from a donor: checked whole before any of it loads (optim/outer_state.py)
        OptimizerLayout.of(self.inner).check(state["inner"], "state's inner optimizer")
        super().load_state_dict(state, inner=True)
