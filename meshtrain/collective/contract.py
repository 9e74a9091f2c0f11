"""The interface between outer optimizers and the network: `Collective`.

Outer optimizers never touch transport directly. They ask a `Collective` to average a dict of
tensors, either among a group (all-reduce: DiLoCo, Streaming DiLoCo) or with one partner (NoLoCo),
and get back the result together with *who actually contributed*, because on a public swarm any
peer may vanish mid-round and the optimizer must know the denominator it averaged over.

Contract every implementation keeps (the fault-tolerant network one in `allreduce.py`, and
`LocalCollective` for simulated workers in one process):
- the returned tensors are the mean over `contributors` (in float32 accumulation, then cast to
  the input dtype), bit-identical on every contributor (`digest` lets callers check);
- a peer that fails or misses the deadline is dropped from `contributors`; the call returns the
  survivors' result rather than raising, unless this peer itself could not take part;
- calls are identified by `round_id` (plus an optional `tag`, e.g. a fragment index), so stale
  messages from an earlier round are never mixed into a later one.

The request. A call says what it wants in one `RoundRequest` (the tensors, the round, its tag,
the codec, our weight): `all_reduce(request)`, `average_with(partner, request)`. The request
checks its fields once, when it is built (`ValueError` naming the field), so no implementation
re-checks them; a wrapper that changes one thing (a tag prefix, the contribution) hands on
`dataclasses.replace(request, ...)`, which checks again. `average_with` takes the same request
plus the partner, rather than a request type of its own: its fields are the all-reduce's (NoLoCo
asks for one or the other with the same request), less the weight, which a pair's unweighted
mean does not use. `GathersPayloads.all_gather` keeps its keywords: its payload travels as sent,
so a request's codec would be a field it could only refuse.

Capabilities. What some collectives do beyond the contract is a runtime-checkable Protocol of
its own, below: `GroupsRounds` (a round may run in groups smaller than the swarm),
`PreparesRounds` (a round's join may be sent ahead), `WatchesOptimizer` (the collective wants to
know the optimizer built over it), `GathersPayloads` (every peer's payload to every peer, as
sent: SparseLoCo's sparse exchange). There is one way to ask: `isinstance(collective, GroupsRounds)
and collective.round_is_grouped(round_id)`; a collective without a capability answers as its
Protocol's docstring says (not grouped; nothing prepared; nothing watched; no gather). A collective that
wraps another (`meshtrain.Swarm`, a multi-GPU peer's local ranks, a pipeline stage's) subclasses
`ForwardingCollective` (forwarding.py), which has every capability and answers with the wrapped
collective's, so no wrapper can hide one: one that did made grouped rounds skip their consensus
term.

Screening (against peers that send scaled, flipped, random or replayed updates). In a robust
all-reduce each part's owner sees every contribution to its part; it flags those whose norm is far
outside the group's or whose direction disagrees with the robust aggregate (`ContributionFlag`,
aggregation.py `screen_contributions`), and after the round commits those that repeat an earlier
round's contribution or aggregate (echoes.py). The flags this peer raised as an owner come back in
`ReduceResult.screening` (a `RoundScreening`: the round, its group, the committed digest), for the
node to turn into signed strikes (node/trust/strikes.py). The wire does not change: owners already
know who contributed.

Samples for loss scoring (against peers that lie about the work behind their updates). With
`AllReduceConfig.score_samples` = k, every owner also keeps, for the round's *sampled* peers, their
contribution to its part and hands it on in `RoundScreening.samples`, with the slice of the flat
input its part is (`part`) and the committed aggregate of that slice: the node scores them by loss
(node/trust/scoring.py). The sample is `sampled_peers(group, digest, k)`: a ranking of the group by
a hash of the committed digest, so it is the same on every owner, checkable by anyone who holds a
strike's group and digest, and unknown to a sender before every contribution of the round was
combined. The collective stays model-agnostic: it keeps tensors and says where they are; what they
mean is the node's.
"""

from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

import torch

from meshtrain.collective.compression import CODECS
from meshtrain.errors import MeshtrainError
from meshtrain.transport.validate import is_int, is_number


class CollectiveError(MeshtrainError):
    """This peer could not take part in the collective at all (not: a partner failed)."""


@dataclass(frozen=True)
class ContributionFlag:
    """A contribution the owner of `part` found suspect: its norm over the median norm of the part's
    contributions (`norm_ratio`), its `alignment` (its cosine with the robust aggregate over the
    group's median cosine: about 1 for an honest update, about 0 for noise, below 0 for a flipped
    one), and which rule it broke ("norm" | "direction" | "echo"). An echo (echoes.py: it repeats
    an earlier round's contribution or aggregate) carries its cosine with it (`echo`) and that
    round (`earlier`); its norm ratio and alignment are against the aggregate."""

    peer: str
    part: int
    norm_ratio: float
    alignment: float
    rule: str
    echo: float = 0.0
    earlier: int = 0


def screening_rule(norm_ratio: float, alignment: float, screen_norm: float, screen_alignment: float) -> str | None:
    """Which screening rule a contribution with these scores breaks ("norm" | "direction"), or
    None: its norm ratio outside [1/`screen_norm`, `screen_norm`], else its alignment below
    `screen_alignment`. 0 turns a rule off (`screen_norm` 0: no screening at all). The owner's
    flag (data_phase.py) and every peer's re-check of a strike (node/trust/strikes.py) use this one rule."""
    if not screen_norm:
        return None
    if not 1 / screen_norm <= norm_ratio <= screen_norm:
        return "norm"
    if screen_alignment and alignment < screen_alignment:
        return "direction"
    return None


def sampled_peers(group: tuple[str, ...], digest: bytes, k: int) -> tuple[str, ...]:
    """The `k` peers of `group` whose contributions a round with committed `digest` scores by loss
    (all of them if k >= the group's size), sorted: the group ranked by blake2b(digest, peer id).
    The same on every peer; nobody can steer it without steering the round's aggregate."""
    if k <= 0:
        return ()
    ranked = sorted(group, key=lambda p: hashlib.blake2b(digest + b"/" + p.encode(), digest_size=16).digest())
    return tuple(sorted(ranked[:k]))


@dataclass(frozen=True)
class RoundScreening:
    """What this peer saw of one committed round as the owner of a part: the round, its group
    (sorted), the committed result digest, and the contributions it flagged (maybe none).

    With loss scoring (`score_samples`): `part`, the [start, stop) slice of the flat input (the
    round's tensors in their order, flattened) that this peer owns; `samples`, the contributions
    of the sampled peers (`sampled_peers`, not us) to that slice, fp32, as received; `aggregate`,
    the committed result's slice. Empty / None without scoring, or when we were not a holder of
    the committed result (our own contributions then were not the round's)."""

    round_id: int
    tag: str
    group: tuple[str, ...]
    digest: bytes
    flags: tuple[ContributionFlag, ...] = ()
    part: tuple[int, int] = (0, 0)
    samples: dict[str, torch.Tensor] = field(default_factory=dict, compare=False, repr=False)
    aggregate: torch.Tensor | None = field(default=None, compare=False, repr=False)


@dataclass(frozen=True, eq=False)
class RoundRequest:
    """What one call of a collective asks for (module docstring, "The request").

    tensors: our input, by name, on the host (CPU); the result has the same names, shapes and
        dtypes. Not copied: the caller must not change them while the call runs.
    round_id: the round, an int >= 0 that every peer of the round passes alike.
    tag: tells apart the exchanges of one round (a fragment, a stage, a consensus term); "" if one.
    codec: how the tensors travel, one of compression.py's `CODECS`.
    weight: our share of a weighted mean, finite and >= 0; 0 takes part and contributes nothing
        (a joiner's round). `average_with` does not use it: a pair's mean is unweighted.
    overlap: inner steps the caller trains on while this exchange runs (an outer optimizer's
        τ, `delay`): a peer that reports a step past `round_id + overlap` has ended the round,
        and `average_with` stops waiting for such a partner.
    among: empty, or the peers (us among them) this exchange runs among: a follow-up exchange
        of a round whose first exchange already fixed who took part (`ReduceResult.members`, the
        same on every member) — the grouped round's consensus term (optim/outer.py). Its
        expected group is the round's group cut to these peers, on the joiner's side and at a
        coordinator whose own trainer asked the same, so nobody waits for a peer that left the
        round's first exchange (it is re-syncing, or went on alone). `average_with` ignores it.

    The fields are checked here, once, when the request is built: `ValueError` naming the field.
    Compared by identity (the tensors have no equality that answers a bool).
    """

    tensors: dict[str, torch.Tensor]
    round_id: int
    tag: str = ""
    codec: str = "none"
    weight: float = 1.0
    overlap: int = 0
    among: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if not isinstance(self.tensors, dict) or not all(
            isinstance(k, str) and isinstance(v, torch.Tensor) for k, v in self.tensors.items()
        ):
            raise ValueError(
                f"RoundRequest.tensors must be a dict of name -> torch.Tensor, got {type(self.tensors).__name__}"
            )
        if off_host := next((k for k, v in self.tensors.items() if v.device.type != "cpu"), None):
            # Collectives move host memory (the data plane reads it as bytes): a device tensor
            # would fail deep in the codec with torch's TypeError; refused here, once, by name.
            raise ValueError(
                f"RoundRequest.tensors[{off_host!r}] is on {self.tensors[off_host].device}: a collective "
                "takes host (CPU) tensors; the hook that made it (an outer optimizer's pseudo_gradient "
                "or communicate) must return them on the host (.cpu())"
            )
        if not is_int(self.round_id) or self.round_id < 0:
            raise ValueError(f"RoundRequest.round_id must be an int >= 0, got {self.round_id!r}")
        if not isinstance(self.tag, str):
            raise ValueError(f"RoundRequest.tag must be a str, got {self.tag!r}")
        if self.codec not in CODECS:
            raise ValueError(f"RoundRequest.codec must be one of {', '.join(CODECS)}; got {self.codec!r}")
        if not is_number(self.weight) or not math.isfinite(self.weight) or self.weight < 0:
            raise ValueError(f"RoundRequest.weight must be finite and >= 0, got {self.weight!r}")
        if not is_int(self.overlap) or self.overlap < 0:
            raise ValueError(f"RoundRequest.overlap must be an int >= 0, got {self.overlap!r}")
        if not isinstance(self.among, tuple) or not all(isinstance(p, str) for p in self.among):
            raise ValueError(f"RoundRequest.among must be a tuple of peer ids, got {self.among!r}")


@dataclass(frozen=True)
class ReduceResult:
    """What a collective call produced."""

    tensors: dict[str, torch.Tensor]
    contributors: tuple[str, ...]  # peer ids whose input is in the mean, sorted
    digest: bytes  # blake3 of the result, equal on all contributors
    bytes_sent: int = 0
    bytes_received: int = 0
    excluded: dict[str, str] = field(default_factory=dict)  # peer id -> why it was dropped
    screening: RoundScreening | None = None  # robust all-reduces: what we flagged as a part's owner
    # Everyone whose round this was, sorted: the contributors, those excluded, and those who took
    # part with weight 0 (a joiner entering mid-exchange). Empty: not told (read `contributors`).
    members: tuple[str, ...] = ()


@dataclass(frozen=True)
class GatherResult:
    """What a sparse all-gather (`GathersPayloads`) produced: the same on every peer that took part."""

    payloads: dict[str, dict[str, torch.Tensor]]  # peer -> its payload, for every included peer
    weights: dict[str, float]  # peer -> the weight it announced
    contributors: tuple[str, ...]  # included peers with weight > 0, sorted
    bytes_sent: int = 0
    bytes_received: int = 0
    excluded: dict[str, str] = field(default_factory=dict)


@runtime_checkable
class Collective(Protocol):
    """Averaging among peers. Implementations are trio-async."""

    @property
    def peer_id(self) -> str: ...

    async def all_reduce(self, request: RoundRequest) -> ReduceResult:
        """Weighted mean of `request.tensors` over the round's group; `weight` 0 contributes nothing."""
        ...

    async def average_with(self, partner: str | None, request: RoundRequest) -> ReduceResult:
        """Mean of `request.tensors` with one partner's (unweighted); if the partner is None or
        gone, the result is our own input."""
        ...

    def group(self, round_id: int) -> tuple[str, ...]:
        """The peers (sorted ids, us included) expected in this round, from the membership snapshot."""
        ...


@runtime_checkable
class WatchesOptimizer(Protocol):
    """A collective that wants to know the outer optimizer built over it (`meshtrain.Swarm`: it
    checks the optimizer against the swarm's spec, and runs the swarm's side of your own loop
    from the optimizer's step hook). `OuterOptimizer.__init__` calls `watch(self)` last; a
    collective without this capability is not told."""

    def watch(self, optimizer: Any) -> None: ...


@runtime_checkable
class GroupsRounds(Protocol):
    """A collective whose rounds may run in groups smaller than the swarm (`SwarmCollective` with
    a `GroupPlan`, collective/groups.py). In such a round the mean is the group's, and peers of
    different groups hold different state: an outer optimizer then adds a consensus term
    (optim/outer.py, "Grouped rounds"). Every member of a group answers alike from the same
    membership snapshot. A collective without this capability runs every round as one group."""

    def round_is_grouped(self, round_id: int) -> bool: ...


@runtime_checkable
class PreparesRounds(Protocol):
    """A collective that can send a round's join before the round's data is ready
    (`SwarmCollective`: prepared.py). `prepare` sends the round's join in the background and
    returns at once; the `all_reduce` of that round, due in about `within` seconds, then starts
    without a join round trip. `unprepare` says a prepared round will not run
    (training ended): its join is withdrawn now. One never run nor unprepared is withdrawn after a
    while, so the others are not held up either way. Without this capability every round sends
    its join when its `all_reduce` starts."""

    async def prepare(self, *, round_id: int, tag: str = "", within: float = 1.0) -> None: ...

    async def unprepare(self, *, round_id: int, tag: str = "") -> None: ...


@runtime_checkable
class GathersPayloads(Protocol):
    """A collective that hands every member of a round every member's payload exactly as it was
    sent, all agreeing on whose count (SparseLoCo's exchange: sparse_gather.py, whose `all_gather`
    asks for this): `SwarmCollective` over its data plane, `LocalCollective` in one process. Without
    this capability a sparse all-gather raises `CollectiveError`."""

    async def all_gather(
        self, payload: dict[str, torch.Tensor], *, round_id: int, tag: str = "", weight: float = 1.0
    ) -> GatherResult: ...
