"""`LocalSwarm`: k simulated peers in one trio run, each with a `LocalCollective` that keeps the
network collective's contract (contract.py).

Why: the update rules of outer optimizers are tested, and algorithms are compared quickly, without
sockets — while exercising the same code paths the swarm runs (weights, codecs, contributors,
peers that leave mid-round, partners that are gone). `SwarmCollective` is the real thing.

Semantics, mirroring `SwarmCollective` / `average_pair`:
- `all_reduce`: a round (round_id, tag) completes when every live member of the swarm has called
  in, or `timeout` seconds after the first arrival (the missing are excluded, as a join deadline
  would). The input is flattened, each contribution passed through the codec, the weighted mean
  accumulated in fp32 in sorted peer-id order, and the mean passed through the codec once more
  (the all-gather's encoding) — so every member gets bit-identical tensors. A member arriving after
  its round completed gets `CollectiveError` (late), like a peer that joins after the group formed.
- `average_with`: both peers' codec-decoded inputs are averaged in peer-id order; if the partner
  is None, dead, never arrives within `timeout`, or already gave up, the result is our own input
  with `contributors == (self,)`.
- `kill(peer)`: the peer is gone — rounds stop waiting for it, its own calls raise
  `CollectiveError`. `add()` makes a new member (a late joiner).
- Byte counts are what the network implementation would move for the same inputs (reduce-scatter
  plus all-gather: 2·(n−1)/n of the encoded size; pairwise: the encoded size each way).

Not simulated: latency, bandwidth, partial failures inside a round's data phase.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import trio

from meshtrain.collective.compression import Codec, get_codec
from meshtrain.collective.contract import CollectiveError, GatherResult, ReduceResult, RoundRequest
from meshtrain.collective.flat import flatten_fp32, part_bounds, result_digest


@dataclass
class _Round:
    expected: frozenset[str]
    codec: Codec
    arrivals: dict[str, tuple[dict[str, torch.Tensor], float]] = field(default_factory=dict)
    done: trio.Event = field(default_factory=trio.Event)
    result: ReduceResult | None = None
    excluded: dict[str, str] = field(default_factory=dict)


@dataclass
class _Pair:
    arrivals: dict[str, dict[str, torch.Tensor]] = field(default_factory=dict)
    done: trio.Event = field(default_factory=trio.Event)
    abandoned: bool = False


class LocalSwarm:
    """size: the initial members ("peer-0000", "peer-0001", …).
    timeout: seconds a round waits for missing members after the first arrival (None: forever —
        fine when every member is known to call in)."""

    def __init__(self, size: int, *, timeout: float | None = 30.0) -> None:
        if size < 1:
            raise ValueError("a swarm needs at least one member")
        self.timeout = timeout
        self.members: list[str] = []
        self.alive: set[str] = set()
        self._rounds: dict[tuple[int, str], _Round] = {}
        self._pairs: dict[tuple[int, str, frozenset[str]], _Pair] = {}
        for _ in range(size):
            self.add()

    def add(self) -> LocalCollective:
        peer = f"peer-{len(self.members):04d}"
        self.members.append(peer)
        self.alive.add(peer)
        return LocalCollective(self, peer)

    def member(self, i: int) -> LocalCollective:
        return LocalCollective(self, self.members[i])

    def kill(self, peer: str) -> None:
        self.alive.discard(peer)
        for r in self._rounds.values():
            if not r.done.is_set():
                self._maybe_complete(r)
        for key, pair in self._pairs.items():
            if peer in key[2] and not pair.done.is_set():
                pair.abandoned = True
                pair.done.set()

    # -- all-reduce -----------------------------------------------------------------------------

    def _maybe_complete(self, r: _Round, *, deadline_passed: bool = False) -> None:
        waiting = (r.expected & self.alive) - set(r.arrivals)
        if r.done.is_set() or (waiting and not deadline_passed):
            return
        for p in sorted(r.expected - set(r.arrivals)):
            r.excluded[p] = "gone" if p not in self.alive else "missed the deadline"
        order = sorted(p for p in r.arrivals if p in self.alive)
        first = next(iter(r.arrivals.values()))[0]
        flat_len = sum(t.numel() for t in first.values())
        total = sum(r.arrivals[p][1] for p in order)
        acc = torch.zeros(flat_len)
        for p in order:
            flat, w = r.arrivals[p]
            if w:
                acc.add_(flatten_fp32(flat), alpha=w)
        if total:
            acc.div_(total)
        codec = r.codec
        mean = codec.decode(codec.encode(acc), acc.shape, torch.float32)
        out, pos = {}, 0
        for name, like in first.items():
            out[name] = mean[pos : pos + like.numel()].view(like.shape).to(like.dtype)
            pos += like.numel()
        contributors = tuple(p for p in order if r.arrivals[p][1] > 0)
        r.result = ReduceResult(out, contributors, result_digest(out), 0, 0, dict(r.excluded))
        r.done.set()

    async def _all_reduce(self, me: str, request: RoundRequest) -> ReduceResult:
        tensors, weight = request.tensors, request.weight
        key = (request.round_id, request.tag)
        c = get_codec(request.codec)
        r = self._rounds.get(key)
        if r is None:
            r = self._rounds[key] = _Round(frozenset(self.alive), c)
            for old in list(self._rounds)[:-64]:
                del self._rounds[old]
        if r.done.is_set() or me not in r.expected:
            raise CollectiveError(f"round {key}: joined after the group was formed; wait for the next round")
        r.arrivals[me] = ({k: c.decode(c.encode(v), v.shape, torch.float32) for k, v in tensors.items()}, weight)
        self._maybe_complete(r)
        with trio.move_on_after(self.timeout if self.timeout is not None else float("inf")):
            await r.done.wait()
        self._maybe_complete(r, deadline_passed=True)
        if me not in self.alive:
            raise CollectiveError(f"{me} left the swarm")
        assert r.result is not None  # completed above
        members = sorted(p for p in r.arrivals if p in self.alive)
        sent = _allreduce_bytes(c, sum(t.numel() for t in tensors.values()), len(members), members.index(me))
        return ReduceResult(
            {k: v.clone() for k, v in r.result.tensors.items()},
            r.result.contributors,
            r.result.digest,
            sent,
            sent,
            dict(r.result.excluded),
        )

    # -- sparse all-gather (SparseLoCo's exchange; the network version is sparse_gather.py) ------

    async def _all_gather(
        self, me: str, payload: dict[str, torch.Tensor], round_id: int, tag: str, weight: float
    ) -> GatherResult:
        """Every live member's payload, exactly; the round completes as an all-reduce's does."""
        key = (round_id, "gather/" + tag)
        r = self._rounds.get(key)
        if r is None:
            r = self._rounds[key] = _Round(frozenset(self.alive), get_codec("none"))
            for old in list(self._rounds)[:-64]:
                del self._rounds[old]
        if r.done.is_set() or me not in r.expected:
            raise CollectiveError(f"round {key}: joined after the group was formed; wait for the next round")
        r.arrivals[me] = ({k: v.clone() for k, v in payload.items()}, weight)

        def waiting() -> frozenset[str]:
            return (r.expected & self.alive) - set(r.arrivals)

        if not waiting():
            r.done.set()
        with trio.move_on_after(self.timeout if self.timeout is not None else float("inf")):
            await r.done.wait()
        r.done.set()
        if me not in self.alive:
            raise CollectiveError(f"{me} left the swarm")
        order = sorted(p for p in r.arrivals if p in self.alive)
        excluded = {p: "gone" if p not in self.alive else "missed the deadline" for p in r.expected - set(order)}
        nbytes = {p: sum(t.numel() * t.element_size() for t in r.arrivals[p][0].values()) for p in order}
        return GatherResult(
            {p: {k: v.clone() for k, v in r.arrivals[p][0].items()} for p in order},
            {p: r.arrivals[p][1] for p in order},
            tuple(p for p in order if r.arrivals[p][1] > 0),
            (len(order) - 1) * nbytes[me],
            sum(b for p, b in nbytes.items() if p != me),
            excluded,
        )

    # -- pairwise -------------------------------------------------------------------------------

    async def _average_with(self, me: str, partner: str | None, request: RoundRequest) -> ReduceResult:
        tensors, round_id, tag = request.tensors, request.round_id, request.tag
        if me not in self.alive:
            raise CollectiveError(f"{me} left the swarm")
        alone = ReduceResult(tensors, (me,), result_digest(tensors), 0, 0, {})
        if partner is None or partner == me:
            return alone
        key = (round_id, tag, frozenset((me, partner)))
        pair = self._pairs.setdefault(key, _Pair())
        for old in list(self._pairs)[:-256]:
            del self._pairs[old]
        if pair.abandoned or partner not in self.alive:
            return ReduceResult(tensors, (me,), alone.digest, 0, 0, {partner: "partner gone"})
        c = get_codec(request.codec)
        pair.arrivals[me] = {k: c.decode(c.encode(v), v.shape, torch.float32) for k, v in tensors.items()}
        if partner in pair.arrivals:
            pair.done.set()
        with trio.move_on_after(self.timeout if self.timeout is not None else float("inf")):
            await pair.done.wait()
        if partner not in pair.arrivals:
            pair.abandoned = True
            pair.done.set()
            return ReduceResult(tensors, (me,), alone.digest, 0, 0, {partner: "partner did not answer"})
        lo, hi = sorted((me, partner))
        a, b = pair.arrivals[lo], pair.arrivals[hi]
        out = {k: ((a[k] + b[k]) / 2).to(tensors[k].dtype) for k in tensors}
        sent = sum(c.encoded_nbytes(v.numel()) for v in tensors.values())
        return ReduceResult(out, (lo, hi), result_digest(out), sent, sent, {})


class LocalCollective:
    """One member's view of a `LocalSwarm`; implements `Collective`."""

    def __init__(self, swarm: LocalSwarm, peer_id: str) -> None:
        self.swarm = swarm
        self._id = peer_id

    @property
    def peer_id(self) -> str:
        return self._id

    def group(self, round_id: int) -> tuple[str, ...]:
        return tuple(sorted(self.swarm.alive | {self._id}))

    async def all_reduce(self, request: RoundRequest) -> ReduceResult:
        return await self.swarm._all_reduce(self._id, request)

    async def all_gather(
        self, payload: dict[str, torch.Tensor], *, round_id: int, tag: str = "", weight: float = 1.0
    ) -> GatherResult:
        """Every member's `payload` as sent (`GathersPayloads`, sparse_gather.py's contract)."""
        return await self.swarm._all_gather(self._id, payload, round_id, tag, weight)

    async def average_with(self, partner: str | None, request: RoundRequest) -> ReduceResult:
        return await self.swarm._average_with(self._id, partner, request)


def _allreduce_bytes(codec: Codec, numel: int, n: int, me: int) -> int:
    """Bytes one member sends in a reduce-scatter + all-gather over n members (the network's)."""
    if n <= 1:
        return 0
    bounds = part_bounds(numel, n)
    sizes = [codec.encoded_nbytes(bounds[j + 1] - bounds[j]) for j in range(n)]
    return sum(s for j, s in enumerate(sizes) if j != me) + (n - 1) * sizes[me]
