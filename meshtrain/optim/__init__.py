"""optim layer of meshtrain (see docs/architecture.md): the outer-optimizer math.

Outer optimizers talk to the network only through a `Collective` (meshtrain.collective, the layer
below); this package holds the update rules.

Public API:
- `OuterOptimizer` — base class of low-communication outer optimizers (hooks, schedule, state,
  threading bridge); `DiLoCo`, `StreamingDiLoCo`, `NoLoCo`, `SparseLoCo` are subclasses.
- `DataParallel` — the synchronous baseline (data_parallel.py): an `OuterOptimizer` whose round is
  every inner step (gradients all-reduced, then the inner step); the spec's `optimizer = "dp"`.
"""

from meshtrain.optim.data_parallel import DataParallel
from meshtrain.optim.diloco import DiLoCo
from meshtrain.optim.noloco import NoLoCo, noloco_groups, noloco_partner
from meshtrain.optim.outer import OuterOptimizer, OuterStateError, RoundReport
from meshtrain.optim.sparseloco import SparseLoCo
from meshtrain.optim.streaming import StreamingDiLoCo, strided_fragments

__all__ = [
    "DataParallel",
    "DiLoCo",
    "NoLoCo",
    "OuterOptimizer",
    "OuterStateError",
    "RoundReport",
    "SparseLoCo",
    "StreamingDiLoCo",
    "noloco_groups",
    "noloco_partner",
    "strided_fragments",
]
