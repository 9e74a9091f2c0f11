"""Streaming DiLoCo (Douillard et al. 2025, "Streaming DiLoCo with overlapping communication").

DiLoCo syncs the whole model every H steps, so its peak bandwidth is a full model at once and
training stalls for the exchange. Streaming DiLoCo changes three things (docs/algorithms.md; torchft
`local_sgd.py` implements the same schedule):

1. **Fragments** (§2.1). The parameters are split into P fragments; fragment p syncs every H
   steps at offset p·H/P, so one fragment is in flight at a time and the peak traffic per sync is
   ~1/P of the model. The assignment is *strided* (fragment p = transformer blocks p, p+P, p+2P…),
   which the paper found better than contiguous; parameters outside the blocks (embeddings, final
   norm, head) join the fragment that is smallest so far, keeping the fragments balanced.
2. **Overlap** (§2.2). Fragment p's pseudo-gradient Δ[p] = φ[p] − θ[p] is sent at step s; inner
   training continues for τ steps; at s + τ the outer step on the averaged Δ[p] gives the new
   φ[p], which is merged: θ[p] ← α·θ[p] + (1−α)·φ[p] (α = 0.5 in the paper; α = 0 replaces the
   local fragment and loses the τ steps of local progress made meanwhile).
3. **Quantised exchange** (§2.3). Outer gradients travel as 4-bit values (FP4 E3M0 in the paper,
   `codec="fp4"`; `"int4"` also works) while every peer accumulates in fp32; FP4 matched FP32.

The outer optimizer is DiLoCo's (Nesterov SGD, lr 0.7, momentum 0.9) applied per fragment; its
state stays identical on every peer. Evaluate φ (`outer_weights()`), not a replica's θ.
Requirements, checked with a clear ValueError: H % P == 0 and 0 <= τ < H/P.

4. **Eager updates** (`eager=True`; Kale, Douillard et al. 2025, "Eager updates for overlapped
   communication and computation in DiLoCo", arXiv 2502.12996). Without them, the τ steps that run
   while fragment p's average is in flight start from the old θ[p], and the merge at s + τ
   blends in the new φ[p] late. With them, at the send step the peer applies a *tentative* outer
   step using its own pseudo-gradient as a stand-in for the average it does not have yet:
   φ̃[p] = OuterOpt(φ[p], Δ_local[p]) (the same arithmetic as the real step, state not committed),
   and trains on from θ[p] ← φ̃[p]. When the average arrives, the real step gives φ[p] and the
   stand-in is corrected exactly: θ[p] ← θ[p] + (φ[p] − φ̃[p]) — the local progress of the τ
   steps is kept and the local update is swapped for the swarm's (α is not used). The paper's
   eager rule, for an overlap of a whole round, mixes the local Δ_t with the *previous* round's
   average of the others, (1/M)·Δ_local,t + (1/M)·Σ_{j≠i} Δ_j,t−1; here the average arrives τ < H/P
   steps later within the same round, so no stale average is involved and the local Δ alone
   stands in. The paper's identities hold and are tested: with one peer, or with peers whose
   pseudo-gradients are equal, eager overlap is bit for bit the blocking round (τ = 0); in
   general, after the correction θ − φ equals exactly the local progress made during the τ steps.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import ClassVar, Self

import torch

from meshtrain.collective.contract import Collective
from meshtrain.optim.diloco import DiLoCo
from meshtrain.optim.outer import OuterSpec
from meshtrain.optim.schedule import RoundSchedule
from meshtrain.transport.validate import is_int

_BLOCK = re.compile(r"^(?P<prefix>.*?\.)?(?P<index>\d+)\.")


def strided_fragments(model: torch.nn.Module, P: int) -> list[list[str]]:
    """Split `model`'s trainable parameters into P fragments: fragment p holds blocks p, p+P, …
    Blocks come from `model.block_groups()` if the model has it (meshtrain's GPT), else from the
    first numbered container in the parameter names (`blocks.3.attn.w`, `layers.3.…`, `h.3.…`).
    Every other parameter goes to the fragment with the fewest elements so far (ties: lowest p),
    so peak bytes per sync stay near total/P."""
    if not is_int(P) or P < 1:
        raise ValueError(f"the number of fragments P must be an integer >= 1, got {P!r}")
    params = {n: p for n, p in model.named_parameters() if p.requires_grad}
    # getattr: typed by nn.Module.__getattr__, `model.block_groups` would be a tensor or a module
    block_groups = getattr(model, "block_groups", None)
    if block_groups is not None:
        blocks: list[list[str]] = [[n for n in group if n in params] for group in block_groups()]
    else:
        by_index: dict[int, list[str]] = {}
        prefix = None
        for n in params:
            m = _BLOCK.match(n)
            if m and (prefix is None or m.group("prefix") == prefix):
                prefix = m.group("prefix")
                by_index.setdefault(int(m.group("index")), []).append(n)
        blocks = [by_index[i] for i in sorted(by_index)]
    blocks = [b for b in blocks if b]
    if len(blocks) < P:
        raise ValueError(f"cannot make {P} strided fragments from {len(blocks)} blocks; use P <= {len(blocks)}")
    fragments: list[list[str]] = [[] for _ in range(P)]
    for i, block in enumerate(blocks):
        fragments[i % P].extend(block)
    in_blocks = {n for f in fragments for n in f}
    size = [sum(params[n].numel() for n in f) for f in fragments]
    for n, p in params.items():
        if n not in in_blocks:
            p_min = min(range(P), key=lambda j: (size[j], j))
            fragments[p_min].append(n)
            size[p_min] += p.numel()
    order = {n: i for i, n in enumerate(params)}
    return [sorted(f, key=order.__getitem__) for f in fragments]


class StreamingDiLoCo(DiLoCo):
    """model, inner, collective: see `OuterOptimizer`.
    H: inner steps between two syncs of the same fragment (paper: 100).
    fragments: P (strided fragments from `strided_fragments`) or an explicit partition of the
        parameter names.
    delay: τ, inner steps each exchange overlaps with (default 1; 0 blocks like DiLoCo).
    alpha: merge weight of the local fragment (default 0.5).
    codec: "fp4" by default (4-bit outer gradients); "int4", "none", … also accepted.
    lr, momentum, nesterov: the outer SGD, as DiLoCo.

    eager: eager updates (point 4 of the module docstring; needs delay >= 1).

    Training must run inside `async with outer:` when delay > 0 (the exchanges run in its nursery).
    """

    spec_keys: ClassVar[frozenset[str] | None] = frozenset(
        ("outer_lr", "outer_momentum", "codec", "fragments", "delay", "alpha", "eager")
    )

    @classmethod
    def check_spec(cls, spec: OuterSpec) -> None:
        RoundSchedule(spec.H, spec.fragments, spec.delay)  # its own rules, in its words
        if spec.eager and spec.delay < 1:
            raise ValueError("eager updates need delay >= 1")

    @classmethod
    def from_spec(
        cls, model: torch.nn.Module, inner: torch.optim.Optimizer | None, collective: Collective, spec: OuterSpec
    ) -> Self:
        return cls(
            model,
            inner,
            collective,
            H=spec.H,
            fragments=spec.fragments,
            delay=spec.delay,
            alpha=spec.alpha,
            codec=spec.codec if spec.codec != "none" else "fp4",  # the spec's codec default is none; §2.3's fp4
            lr=spec.outer_lr,
            momentum=spec.outer_momentum,
            eager=spec.eager,
        )

    def __init__(
        self,
        model: torch.nn.Module,
        inner: torch.optim.Optimizer | None,
        collective: Collective,
        *,
        H: int = 100,
        fragments: int | list[list[str]] = 2,
        delay: int = 1,
        alpha: float = 0.5,
        codec: str = "fp4",
        lr: float = 0.7,
        momentum: float = 0.9,
        nesterov: bool = True,
        eager: bool = False,
    ) -> None:
        if isinstance(fragments, int):
            RoundSchedule(H, fragments, delay)  # its rules, before the parameters are split
            fragments = strided_fragments(model, fragments)
        super().__init__(
            model,
            inner,
            collective,
            H=H,
            lr=lr,
            momentum=momentum,
            nesterov=nesterov,
            codec=codec,
            fragments=fragments,
            delay=delay,
            alpha=alpha,
        )
        if eager and delay < 1:
            raise ValueError("eager updates hide the delay of an overlapped exchange: they need delay >= 1")
        self.eager = bool(eager)
        self._tentative: dict[str, torch.Tensor] = {}  # φ̃ of the fragments in flight (eager)

    # -- eager updates (arXiv 2502.12996; module docstring, point 4) -----------------------------

    def pseudo_gradient(self, names: Sequence[str]) -> dict[str, torch.Tensor]:
        delta = super().pseudo_gradient(names)
        if self.eager:
            for n in names:
                phi_tilde = self.tentative_outer_step(n, delta[n])
                self._tentative[n] = phi_tilde
                self.params[n].copy_(phi_tilde)
        return delta

    def merge(self, names: Sequence[str]) -> None:
        if not self.eager:
            return super().merge(names)
        for n in names:
            phi_tilde = self._tentative.pop(n, None)
            p = self.params[n]
            if phi_tilde is None:  # not sent by us with eager (cannot happen in a run); plain merge
                p.copy_(self.outer_params[n])
            else:
                p.add_((self.outer_params[n] - phi_tilde).to(p.dtype))

    def tentative_outer_step(self, name: str, grad: torch.Tensor) -> torch.Tensor:
        """φ̃ = the outer SGD step on φ[name] with `grad`, computed as torch's single-tensor SGD
        does (same operations, so the same bits), leaving φ and the momentum untouched."""
        phi = self.outer_params[name]
        grad = grad.to(torch.float32)
        if self.momentum != 0:
            state = self.outer_optimizer.state.get(phi, {}) if self.outer_optimizer is not None else {}
            buf = state.get("momentum_buffer")
            buf = torch.clone(grad).detach() if buf is None else buf.clone().mul_(self.momentum).add_(grad)
            grad = grad.add(buf, alpha=self.momentum) if self.nesterov else buf
        return phi.clone().add_(grad, alpha=-self.lr)
