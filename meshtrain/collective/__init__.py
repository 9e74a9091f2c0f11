"""collective layer of meshtrain (see docs/architecture.md): averaging among peers.

Below `optim/` and `pipeline/`, above `transport/`. Outer optimizers and pipeline replicas ask a
`Collective` to average tensors and learn who contributed; this layer is every implementation of
that contract and what they share.

Public API:
- `Collective` / `ReduceResult` / `CollectiveError` — the contract (contract.py).
- `ForwardingCollective` — the base of a collective that wraps another, with every capability
  of the wrapped one (forwarding.py).
- `SwarmCollective` / `AllReduceConfig` — the fault-tolerant all-reduce over a running host
  (allreduce.py: the participant; member_round.py: its side of a round; coordinator.py: the
  per-round state machine; data_phase.py: reduce-scatter and all-gather; protocol.py: its
  messages).
- `GroupPlan` / `round_groups` — grouped rounds for large swarms (groups.py: Moshpit-style
  groups from the membership snapshot; `SwarmCollective(grouping=...)` runs each group's round).
- `average_pair` — averaging with one partner (pairwise.py, NoLoCo's gossip step).
- `LocalSwarm` / `LocalCollective` — simulated peers in one process (local.py).
- `get_codec` / `CODECS` — compression of what is exchanged (compression.py).
- `flatten_fp32`, `unflatten`, `part_bounds`, `result_digest` — the flat layout and the digest
  every implementation agrees on (flat.py).
"""

from meshtrain.collective.allreduce import AllReduceConfig, SwarmCollective
from meshtrain.collective.compression import CODECS, get_codec
from meshtrain.collective.contract import Collective, CollectiveError, ReduceResult
from meshtrain.collective.flat import flatten_fp32, part_bounds, result_digest, unflatten
from meshtrain.collective.forwarding import ForwardingCollective
from meshtrain.collective.groups import GroupPlan, round_groups
from meshtrain.collective.local import LocalCollective, LocalSwarm
from meshtrain.collective.pairwise import average_pair

__all__ = [
    "CODECS",
    "AllReduceConfig",
    "Collective",
    "CollectiveError",
    "ForwardingCollective",
    "GroupPlan",
    "LocalCollective",
    "LocalSwarm",
    "ReduceResult",
    "SwarmCollective",
    "average_pair",
    "flatten_fp32",
    "get_codec",
    "part_bounds",
    "result_digest",
    "round_groups",
    "unflatten",
]
