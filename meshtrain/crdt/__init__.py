"""crdt layer of meshtrain (see docs/architecture.md).

Pure signed CRDT types (`types`, built on `base` and `entries`), the `Replica` that keeps a
swarm's CRDTs in sync over gossipsub (`gossip`) and anti-entropy RPCs (`anti_entropy`), and the
`SwarmView` that reads the swarm's membership, progress, metrics and config out of them (their
records' formats and checks: `swarm_records`).
"""

from meshtrain.crdt.base import SignedCrdt
from meshtrain.crdt.entries import (
    CrdtError,
    MalformedCrdtData,
    MergeOutcome,
    NotAWriter,
    RejectedEntries,
    Rejection,
    SignatureCache,
    SignedEntry,
)
from meshtrain.crdt.gossip import gossip_topic
from meshtrain.crdt.replica import (
    ChangeEvent,
    CrdtSpec,
    EntryTooLarge,
    Replica,
    ReplicaConfig,
    ReplicaStats,
)
from meshtrain.crdt.strikes import Strike
from meshtrain.crdt.swarm_view import (
    NotSwarmOwner,
    PeerInfo,
    PeerMetrics,
    PeerProgress,
    SwarmView,
    open_swarm_view,
    swarm_specs,
)
from meshtrain.crdt.types import (
    CRDT_TYPES,
    GCounter,
    LWWMap,
    LWWRegister,
    MaxRegister,
    ORSet,
    PNCounter,
)

__all__ = [
    "CRDT_TYPES",
    "ChangeEvent",
    "CrdtError",
    "CrdtSpec",
    "EntryTooLarge",
    "GCounter",
    "LWWMap",
    "LWWRegister",
    "MalformedCrdtData",
    "MaxRegister",
    "MergeOutcome",
    "NotAWriter",
    "NotSwarmOwner",
    "ORSet",
    "PNCounter",
    "PeerInfo",
    "PeerMetrics",
    "PeerProgress",
    "RejectedEntries",
    "Rejection",
    "Replica",
    "ReplicaConfig",
    "ReplicaStats",
    "SignatureCache",
    "SignedCrdt",
    "SignedEntry",
    "Strike",
    "SwarmView",
    "gossip_topic",
    "open_swarm_view",
    "swarm_specs",
]
