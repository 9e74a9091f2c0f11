"""Which outer optimizer a swarm spec names, built and checked the same way on every peer.

The spec's `outer.optimizer` is one of the built-in algorithms (`diloco`, `streaming`, `noloco`,
`sparseloco`, with their hyper-parameters in the spec; `dp`, synchronous data parallelism, the
baseline: an `OuterOptimizer` whose round is every inner step, optim/data_parallel.py) or `py:<module or file.py>:<Class>`, a
`meshtrain.OuterOptimizer` subclass of the swarm's own, whose source file's digest the signed
spec pins (`outer.optimizer_digest`, meshtrain/pyref.py).

Every optimizer, built-in or py:, is built with `Class.from_spec(model, inner, collective,
spec.outer)`: the spec's `outer` section (optim/spec_section.py), the fields an optimizer reads
(the built-in names' classes: `meshtrain.optim.BUILTIN_OPTIMIZERS`); `OuterOptimizer.from_spec`,
which a py: class that does not define its own inherits, is `Class(model, inner, collective,
H=outer.H)`.

Error feedback: a spec whose codec is topk gets it (`OuterOptimizer.feed_back`, β = the spec's
`error_decay`) unless it says `error_feedback = false` — top-k alone drops all but k of every
chunk's values each round, for good; with it they wait in this peer's residual and go out later
(SparseLoCo's accumulator, which that optimizer keeps itself). `build_outer` sets it on whatever
`from_spec` built, built-in or py:, that exchanges through topk (`OuterSection.topk_error_feedback`
says where: not noloco, whose exchange holds φ). A topk spec signed before the key existed lacks
it and runs without, as it did (meshtrain/spec_section.py).

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
from meshtrain.optim import BUILTIN_OPTIMIZERS, OuterOptimizer
from meshtrain.pyref import PyRef


def outer_class(spec: SwarmSpec) -> type[OuterOptimizer]:
    """The class the spec names (a py: class is imported)."""
    if spec.outer.optimizer in BUILTIN_OPTIMIZERS:
        return BUILTIN_OPTIMIZERS[spec.outer.optimizer]
    cls = PyRef.parse(spec.outer.optimizer).load()
    if not (isinstance(cls, type) and issubclass(cls, OuterOptimizer)):
        raise ConfigError(f"optimizer {spec.outer.optimizer}: not a subclass of meshtrain.OuterOptimizer")
    return cls


def build_outer(
    spec: SwarmSpec, model: torch.nn.Module, inner: torch.optim.Optimizer | None, collective: Collective
) -> OuterOptimizer:
    """The spec's outer optimizer over `model`, stepping `inner`."""
    cls = outer_class(spec)
    if spec.outer.optimizer in BUILTIN_OPTIMIZERS:
        outer = cls.from_spec(model, inner, collective, spec.outer)
    else:
        try:
            outer = cls.from_spec(model, inner, collective, spec.outer)
        except TypeError as e:
            raise ConfigError(
                f"optimizer {spec.outer.optimizer}: cannot build it ({e}); a py: optimizer takes "
                f"(model, inner, collective, H=...) or defines from_spec(model, inner, collective, outer)"
            ) from None
        check_matches(outer, spec)
    beta = spec.outer.topk_error_feedback
    if beta is not None and outer.codec == "topk" and outer.error_feedback is None:
        outer.error_feedback = beta  # the module docstring, "Error feedback"
    return outer


def check_matches(outer: OuterOptimizer, spec: SwarmSpec) -> None:
    """`outer` must be the spec's algorithm (or a subclass of it) with the spec's H."""
    cls = outer_class(spec)
    if not isinstance(outer, cls):
        raise ConfigError(
            f"the swarm's spec says {spec.outer.optimizer}, but this outer optimizer is a "
            f"{type(outer).__name__}: every peer must run the spec's outer optimizer"
        )
    if outer.H != spec.outer.H:
        raise ConfigError(f"the swarm's spec says H = {spec.outer.H}; this outer optimizer has H = {outer.H}")


def check_copy(spec: SwarmSpec) -> None:
    """A py: optimizer's source here must be the one the spec pins."""
    if spec.outer.optimizer in BUILTIN_OPTIMIZERS or not spec.outer.optimizer_digest:
        return
    mine = PyRef.parse(spec.outer.optimizer).source_digest()
    if mine != spec.outer.optimizer_digest:
        raise ConfigError(
            f"optimizer: your {spec.outer.optimizer} differs from the swarm's (source digest "
            f"{mine[:12]} here, {spec.outer.optimizer_digest[:12]} in the swarm's spec); get the "
            f"swarm's optimizer code"
        )
