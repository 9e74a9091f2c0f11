"""meshtrain: many machines train one PyTorch model together, peer to peer.

The public API is small (docs/guide.md, "Python API"):

- `Node`, `NodeConfig`, `SwarmSpec`, `SignedSpec` — run a peer of a swarm from Python;
  `Node.run()` returns a `NodeResult`.
- `Swarm` — the network for a training loop you write yourself (`DiLoCo(model, inner, swarm)`).
- `OuterOptimizer` — the base class for your own outer optimizer; `DiLoCo`, `StreamingDiLoCo`,
  `NoLoCo`, `SparseLoCo` are built on it, and so is `DataParallel` (the synchronous baseline).
- `Collective`, `ReduceResult` — what an outer optimizer talks to.
- `SwarmOptimizer` — the swarm as a torch optimizer around yours (plain PyTorch, Accelerate, LR
  schedulers); `meshtrain.integrations.hf.MeshtrainCallback` makes a `transformers.Trainer` a peer.

Everything else lives in the layer subpackages `transport`, `dht`, `crdt`, `collective`, `optim`,
`pipeline`, `node` and `integrations` (docs/architecture.md). Names are imported on first use, so `import
meshtrain` (and `meshtrain --version`) stays fast.
"""

from __future__ import annotations

import importlib
from typing import Any

__version__ = "0.1.0"

_EXPORTS = {
    "Node": "meshtrain.node.daemon",
    "NodeResult": "meshtrain.node.training_run",
    "Swarm": "meshtrain.node.user_loop",
    "NodeConfig": "meshtrain.node.spec.config",
    "SwarmSpec": "meshtrain.node.spec.swarm",
    "SignedSpec": "meshtrain.node.spec.signed",
    "OuterOptimizer": "meshtrain.optim.outer",
    "DiLoCo": "meshtrain.optim.diloco",
    "StreamingDiLoCo": "meshtrain.optim.streaming",
    "NoLoCo": "meshtrain.optim.noloco",
    "SparseLoCo": "meshtrain.optim.sparseloco",
    "DataParallel": "meshtrain.optim.data_parallel",
    "Collective": "meshtrain.collective.contract",
    "ReduceResult": "meshtrain.collective.contract",
    "SwarmOptimizer": "meshtrain.integrations.optimizer",
}

__all__ = ["__version__", *_EXPORTS]


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'meshtrain' has no attribute {name!r}")
