"""optim layer of meshtrain (see docs/architecture.md): the outer-optimizer math.

Outer optimizers talk to the network only through a `Collective` (meshtrain.collective, the layer
below); this package holds the update rules.

Public API:
- `OuterOptimizer` — base class of low-communication outer optimizers (hooks, schedule, state,
  threading bridge); `DiLoCo`, `StreamingDiLoCo`, `NoLoCo`, `SparseLoCo` are subclasses.
- `DataParallel` — the synchronous baseline (data_parallel.py): an `OuterOptimizer` whose round is
  every inner step (gradients all-reduced, then the inner step); the spec's `optimizer = "dp"`.
- `BUILTIN_OPTIMIZERS` — the spec's names of the built-in optimizers and their classes: the one
  place a name is looked up (node/spec/ builds each with its `from_spec` and checks a spec with
  what the class declares; `OuterOptimizer`'s docstring lists those attributes).
"""

from collections.abc import Mapping
from types import MappingProxyType

from meshtrain.optim.data_parallel import DataParallel
from meshtrain.optim.diloco import DiLoCo
from meshtrain.optim.noloco import NoLoCo, noloco_groups, noloco_partner
from meshtrain.optim.outer import OuterOptimizer, OuterSpec, OuterStateError, RoundReport
from meshtrain.optim.sparseloco import SparseLoCo
from meshtrain.optim.streaming import StreamingDiLoCo, strided_fragments

BUILTIN_OPTIMIZERS: Mapping[str, type[OuterOptimizer]] = MappingProxyType(
    {
        "diloco": DiLoCo,
        "streaming": StreamingDiLoCo,
        "noloco": NoLoCo,
        "sparseloco": SparseLoCo,
        "dp": DataParallel,  # synchronous data parallelism, the baseline
    }
)

__all__ = [
    "BUILTIN_OPTIMIZERS",
    "DataParallel",
    "DiLoCo",
    "NoLoCo",
    "OuterOptimizer",
    "OuterSpec",
    "OuterStateError",
    "RoundReport",
    "SparseLoCo",
    "StreamingDiLoCo",
    "noloco_groups",
    "noloco_partner",
    "strided_fragments",
]
