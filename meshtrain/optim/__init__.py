"""optim layer of meshtrain (see shared/ARCHITECTURE.md): outer optimizers, collectives, codecs.

Public API:
- `OuterOptimizer` — base class of low-communication outer optimizers (hooks, schedule, state,
  threading bridge); `DiLoCo`, `StreamingDiLoCo`, `NoLoCo`, `SparseLoCo` are subclasses; `DataParallel` is the
  synchronous baseline.
- `Collective` / `ReduceResult` — the interface to the network; `SwarmCollective` over a running
  host, `LocalSwarm` / `LocalCollective` for simulated peers in one process.
- `get_codec` / `CODECS` — compression of what is exchanged.
"""

from meshtrain.optim.allreduce import AllReduceConfig, SwarmCollective
from meshtrain.optim.collective import Collective, CollectiveError, ReduceResult
from meshtrain.optim.compression import CODECS, get_codec
from meshtrain.optim.diloco import DiLoCo
from meshtrain.optim.local import LocalCollective, LocalSwarm
from meshtrain.optim.noloco import NoLoCo, noloco_groups, noloco_partner
from meshtrain.optim.outer import DataParallel, OuterOptimizer, OuterStateError, RoundReport
from meshtrain.optim.sparseloco import SparseLoCo
from meshtrain.optim.streaming import StreamingDiLoCo, strided_fragments

__all__ = [
    "CODECS",
    "AllReduceConfig",
    "Collective",
    "CollectiveError",
    "DataParallel",
    "DiLoCo",
    "LocalCollective",
    "LocalSwarm",
    "NoLoCo",
    "OuterOptimizer",
    "OuterStateError",
    "ReduceResult",
    "RoundReport",
    "SparseLoCo",
    "StreamingDiLoCo",
    "SwarmCollective",
    "get_codec",
    "noloco_groups",
    "noloco_partner",
    "strided_fragments",
]
