"""Which outer optimizer a swarm spec names, built and checked the same way on every peer.

The spec's `optimizer` is one of the built-in algorithms (`diloco`, `streaming`, `noloco`,
`sparseloco`, with their hyper-parameters in the spec; `dp`, synchronous data parallelism, the
baseline: an `OuterOptimizer` whose round is every inner step, optim/data_parallel.py) or `py:<module or file.py>:<Class>`, a
`meshtrain.OuterOptimizer` subclass of the swarm's own, whose source file's digest the signed
spec pins (`optimizer_digest`, meshtrain/pyref.py).

A py: class is built with `Class.from_spec(model, inner, collective, spec)` when it defines that
classmethod (to read more of the spec), else `Class(model, inner, collective, H=spec.H)`.

Every peer runs the spec's optimizer, whoever builds it: the daemon's trainer, a
`Node(outer_factory=...)` hook (it may instrument the algorithm — a subclass — but not swap it),
or your own loop's optimizer over a `meshtrain.Swarm`. `check_matches` refuses anything else at
once with a one-line `ConfigError`: a spec that says `diloco` while a peer runs another rule
was possible before, and split the swarm silently. `check_copy` refuses a peer whose copy of a
py: optimizer's source differs from the one the spec pins.

Not here: the algorithms (optim/), loading user code (meshtrain/pyref.py).
"""

from __future__ import annotations

import torch

from meshtrain.collective import Collective
from meshtrain.errors import ConfigError
from meshtrain.node.spec.swarm import SwarmSpec
from meshtrain.optim import DataParallel, DiLoCo, NoLoCo, OuterOptimizer, SparseLoCo, StreamingDiLoCo
from meshtrain.pyref import PyRef

BUILTIN: dict[str, type[OuterOptimizer]] = {
    "diloco": DiLoCo,
    "streaming": StreamingDiLoCo,
    "noloco": NoLoCo,
    "sparseloco": SparseLoCo,
    "dp": DataParallel,
}


def outer_class(spec: SwarmSpec) -> type[OuterOptimizer]:
    """The class the spec names (a py: class is imported)."""
    if spec.optimizer in BUILTIN:
        return BUILTIN[spec.optimizer]
    cls = PyRef.parse(spec.optimizer).load()
    if not (isinstance(cls, type) and issubclass(cls, OuterOptimizer)):
        raise ConfigError(f"optimizer {spec.optimizer}: not a subclass of meshtrain.OuterOptimizer")
    return cls


def build_outer(
    spec: SwarmSpec, model: torch.nn.Module, inner: torch.optim.Optimizer | None, collective: Collective
) -> OuterOptimizer:
    """The spec's outer optimizer over `model`, stepping `inner`."""
    s = spec
    if s.optimizer == "diloco":
        return DiLoCo(model, inner, collective, H=s.H, lr=s.outer_lr, momentum=s.outer_momentum, codec=s.codec)
    if s.optimizer == "streaming":
        return StreamingDiLoCo(
            model,
            inner,
            collective,
            H=s.H,
            fragments=s.fragments,
            delay=s.delay,
            alpha=s.alpha,
            codec=s.codec if s.codec != "none" else "fp4",
            lr=s.outer_lr,
            momentum=s.outer_momentum,
            eager=s.eager,
        )
    if s.optimizer == "sparseloco":
        return SparseLoCo(
            model, inner, collective, H=s.H, lr=s.outer_lr, beta=s.error_decay, chunk=s.sparse_chunk, k=s.sparse_k
        )
    if s.optimizer == "noloco":
        return NoLoCo(model, inner, collective, H=s.H, codec=s.codec)
    if s.optimizer == "dp":
        if inner is None:  # FSDP: the trainer steps the sharded inner optimizer itself
            raise ConfigError(
                "optimizer dp steps the inner optimizer with the averaged gradient, which FSDP shards; "
                "run this peer with --sharding ddp"
            )
        # The trainer clips each peer's gradient before the step; the mean is then within the clip.
        return DataParallel(model, inner, collective, codec=s.codec)
    cls = outer_class(spec)
    from_spec = getattr(cls, "from_spec", None)
    try:
        outer = (
            from_spec(model, inner, collective, spec) if callable(from_spec) else cls(model, inner, collective, H=s.H)
        )
    except TypeError as e:
        raise ConfigError(
            f"optimizer {s.optimizer}: cannot build it ({e}); a py: optimizer takes "
            f"(model, inner, collective, H=...) or defines from_spec(model, inner, collective, spec)"
        ) from None
    check_matches(outer, spec)
    return outer


def check_matches(outer: OuterOptimizer, spec: SwarmSpec) -> None:
    """`outer` must be the spec's algorithm (or a subclass of it) with the spec's H."""
    cls = outer_class(spec)
    if not isinstance(outer, cls):
        raise ConfigError(
            f"the swarm's spec says {spec.optimizer}, but this outer optimizer is a "
            f"{type(outer).__name__}: every peer must run the spec's outer optimizer"
        )
    if outer.H != spec.H:
        raise ConfigError(f"the swarm's spec says H = {spec.H}; this outer optimizer has H = {outer.H}")


def check_copy(spec: SwarmSpec) -> None:
    """A py: optimizer's source here must be the one the spec pins."""
    if spec.optimizer in BUILTIN or not spec.optimizer_digest:
        return
    mine = PyRef.parse(spec.optimizer).source_digest()
    if mine != spec.optimizer_digest:
        raise ConfigError(
            f"optimizer: your {spec.optimizer} differs from the swarm's (source digest "
            f"{mine[:12]} here, {spec.optimizer_digest[:12]} in the swarm's spec); get the "
            f"swarm's optimizer code"
        )
