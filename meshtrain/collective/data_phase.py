"""One attempt's data phase of the all-reduce: reduce-scatter, then all-gather.

Group of n, flattened input of M elements cut into n parts (flat.py `part_bounds`; part j belongs
to the j-th peer of the sorted group). **Reduce-scatter**: every peer sends part j (optionally
codec-encoded, with its weight) to its owner, which accumulates the contributions in fp32 in a
fixed (sorted) order — or combines them robustly (`reduce_contributions`). **All-gather**: each
owner encodes its reduced part once, decodes it back for itself, and sends the same bytes to
all. Every peer thus holds the owner's exact bits for every part, so results are bit-identical
by construction. Each peer moves 2(n−1)/n·M elements, the bandwidth-optimal amount (as
hivemind's butterfly and PCCL's ring); all transfers of a phase run concurrently.

With `codec="none"` parts travel as views of the flat input (no encode copy) and reduced parts
are received straight into their slice of the output (no decode, no concatenation).

Failures become `AttemptFailed` with the peers we suspect: a transfer that broke or missed its
size-scaled deadline, a peer whose connection dropped (the host's connection events wake us at
once), or garbage — a contribution with NaN/inf or of the wrong size is dropped and its sender
named in `stats.rejected`; a reduced part that does not decode, or (robust modes) is far outside
our own contribution's range, is proof against its owner (`evidence=True`).

`DataPhase` is one object per attempt: what the attempt needs is fixed at construction, and
`run` = connect, `reduce_scatter`, `all_gather`, under a liveness watch.

Not here: who is in the group and what happens after a failure (coordinator.py), the round's
control messages (protocol.py).
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
import trio

from meshtrain.collective.compression import CodecError, get_codec
from meshtrain.collective.contract import CollectiveError
from meshtrain.collective.flat import flatten_fp32, part_bounds, unflatten
from meshtrain.collective.protocol import AllReduceConfig, RoundKey
from meshtrain.log import get_logger, kv
from meshtrain.transport.host import Host
from meshtrain.transport.tensor_streams import TensorStreams, TransferError, payload_digest

log = get_logger(__name__)


class AttemptFailed(Exception):
    """This attempt cannot complete; carries the peers we suspect.

    `evidence` says we hold proof (their data was garbage, or we are accusing ourselves because
    we are leaving); without it the suspicion is a broken transfer, which may only be the echo of
    that peer abandoning the attempt because of someone else."""

    def __init__(self, suspects: set[str], why: str, evidence: bool = False) -> None:
        super().__init__(why)
        self.suspects = suspects
        self.evidence = evidence


@dataclass
class AttemptStats:
    """What one attempt moved and saw."""

    sent: int = 0
    received: int = 0
    zero_weight: set[str] = field(default_factory=set)  # contributed nothing (weight 0)
    rejected: dict[str, str] = field(default_factory=dict)  # peer -> why its data was thrown away
    digest: bytes | None = None  # of our result, once we have one


def exception_leaves(eg: BaseException) -> Iterator[BaseException]:
    """The non-group exceptions inside a (nested) exception group."""
    if isinstance(eg, BaseExceptionGroup):
        for e in eg.exceptions:
            yield from exception_leaves(e)
    else:
        yield eg


def reduce_contributions(
    contributions: dict[str, torch.Tensor], weights: dict[str, float], config: AllReduceConfig, rejected: dict[str, str]
) -> torch.Tensor:
    """Combine the contributions to one part (runs in a worker thread).

    Weighted mean in fp32 over the finite contributions in sorted peer order (the owner's result
    must not depend on arrival order); with `config.robust` and three or more contributors, a
    coordinate-wise trimmed mean (`trim` largest and smallest dropped) or a mean after clipping
    each contribution to the median norm × `clip`. Non-finite contributions are named in
    `rejected`."""
    peers = sorted(contributions)
    bad = [p for p in peers if not torch.isfinite(contributions[p]).all()]
    for p in bad:
        rejected[p] = "non-finite values"
    peers = [p for p in peers if p not in bad]
    robust = config.robust
    if robust == "none" or len(peers) < 3:
        total = sum(weights[p] for p in peers)
        acc = torch.zeros_like(contributions[peers[0]]) if peers else None
        if acc is None or total == 0:
            return torch.zeros_like(next(iter(contributions.values())))
        for p in peers:
            if weights[p]:
                acc.add_(contributions[p], alpha=weights[p])
        return acc.div_(total)
    peers = [p for p in peers if weights[p] > 0]
    stack = torch.stack([contributions[p] for p in peers])
    if robust == "clipped_mean":
        norms = stack.norm(dim=1)
        limit = norms.median() * config.clip
        scale = torch.clamp(limit / norms.clamp_min(1e-30), max=1.0)
        return (stack * scale[:, None]).mean(dim=0)
    k = min(config.trim, (len(peers) - 1) // 2)
    if k == 0:
        return stack.mean(dim=0)
    srt = stack.sort(dim=0).values
    return srt[k : len(peers) - k].mean(dim=0)


class DataPhase:
    """The data movement of one attempt.

    streams / host: the tensor data plane, and the host whose connection events tell us a peer
    dropped. config: deadlines and the robust mode. key / attempt: name the transfers (so stale
    data from another attempt is never mixed in). group: the attempt's members, sorted; `me` is
    in it. tensors / codec / weight: our input, how parts are encoded, our weight (0: we
    contribute nothing but still receive the result). `stats` fills in as the attempt runs."""

    def __init__(
        self,
        streams: TensorStreams,
        host: Host,
        config: AllReduceConfig,
        *,
        key: RoundKey,
        attempt: int,
        group: tuple[str, ...],
        me: str,
        tensors: dict[str, torch.Tensor],
        codec: str,
        weight: float,
    ) -> None:
        try:
            self.codec = get_codec(codec)
        except CodecError as e:
            raise CollectiveError(str(e)) from None
        self.streams, self.host, self.config = streams, host, config
        self.group, self.me, self.tensors, self.weight = group, me, tensors, weight
        self.index = group.index(me)
        self.others = [p for p in group if p != me]
        self.tag = f"ar/{key.wire}/{attempt}"
        self.lossless = codec == "none"
        self.flat = flatten_fp32(tensors)
        self.bounds = part_bounds(self.flat.numel(), len(group))
        self.lo, self.hi = self.bounds[self.index], self.bounds[self.index + 1]
        self.part_bytes = 4 * (self.hi - self.lo) + 64
        self.deadline = config.transfer_deadline(self.flat.numel())
        # The result is assembled in place: every owner's part lands in its slice of `out`.
        self.out = torch.empty(self.flat.numel())
        self.failed: set[str] = set()
        self.stats = AttemptStats()
        if weight == 0:
            self.stats.zero_weight.add(me)

    async def run(self) -> dict[str, torch.Tensor]:
        """The attempt's result, in the caller's names, shapes and dtypes; or `AttemptFailed`."""
        try:
            await self.connect_group()
            async with trio.open_nursery() as nursery:
                nursery.start_soon(self._watch_liveness, nursery.cancel_scope)
                reduced = await self.reduce_scatter()
                await self.all_gather(reduced)
                nursery.cancel_scope.cancel()
        except BaseExceptionGroup as eg:
            leaves = list(exception_leaves(eg))
            for e in leaves:
                if isinstance(e, CollectiveError):
                    raise e from None
            fails = [e for e in leaves if isinstance(e, AttemptFailed)]
            if fails and len(fails) == len(leaves):
                # Proof outweighs broken transfers, which may only echo others abandoning the attempt.
                fails = [f for f in fails if f.evidence] or fails
                raise AttemptFailed(
                    set().union(*(f.suspects for f in fails)), str(fails[0]), evidence=fails[0].evidence
                ) from None
            raise
        if self.failed:
            raise AttemptFailed(set(self.failed), "peers disconnected during the attempt")
        return unflatten(self.out, self.tensors, list(self.tensors))

    async def connect_group(self) -> None:
        """Open data-plane connections to the whole group first: setup is off the critical path,
        and an unreachable member is a suspect before any data moves."""

        async def one(peer: str) -> None:
            try:
                with trio.fail_after(self.config.part_timeout):
                    await self.streams.prepare(peer)
            except (TransferError, trio.TooSlowError) as e:
                self.failed.add(peer)
                log.info(kv("allreduce peer unreachable", peer=peer[-8:], error=repr(e)))

        async with trio.open_nursery() as nursery:
            for p in self.others:
                nursery.start_soon(one, p)
        if self.failed:
            raise AttemptFailed(set(self.failed), "group members unreachable")

    async def reduce_scatter(self) -> torch.Tensor:
        """Send our slice of every part to its owner; collect and reduce our own part."""
        contributions: dict[str, torch.Tensor] = {}
        weights: dict[str, float] = {}
        async with trio.open_nursery() as rs:
            for j, peer in enumerate(self.group):
                if peer != self.me:
                    piece = self.flat[self.bounds[j] : self.bounds[j + 1]]
                    rs.start_soon(self._send, peer, f"{self.tag}/rs/{j}", self._encode(piece), {"w": self.weight})
            for peer in self.others:
                rs.start_soon(self._collect, peer, contributions, weights)
        contributions[self.me] = self.flat[self.lo : self.hi]
        weights[self.me] = self.weight
        return await trio.to_thread.run_sync(
            reduce_contributions, contributions, weights, self.config, self.stats.rejected
        )

    async def _collect(self, peer: str, contributions: dict[str, torch.Tensor], weights: dict[str, float]) -> None:
        got = await self._receive(peer, f"{self.tag}/rs/{self.index}")
        w = got.meta.get("w")
        try:
            if not isinstance(w, int | float) or not math.isfinite(w) or w < 0:
                raise CodecError("bad weight")
            x = self.codec.decode(got.tensors, (self.hi - self.lo,), torch.float32)
        except CodecError as e:
            self.stats.rejected[peer] = f"garbage contribution: {e}"
            return
        if w == 0:
            self.stats.zero_weight.add(peer)
        contributions[peer] = x
        weights[peer] = float(w)

    async def all_gather(self, reduced: torch.Tensor) -> None:
        """Send our reduced part, exactly as encoded once, to all; fetch every other part."""
        mine = self._encode(reduced)
        self.out[self.lo : self.hi] = (
            reduced if self.lossless else self.codec.decode(mine, (self.hi - self.lo,), torch.float32)
        )
        # Hashed once, off the event loop, rather than once per receiver while sending.
        mine_digest = await trio.to_thread.run_sync(payload_digest, mine) if self.others else None
        async with trio.open_nursery() as ag:
            for peer in self.others:
                ag.start_soon(self._send, peer, f"{self.tag}/ag/{self.index}", mine, {}, mine_digest)
            for j, peer in enumerate(self.group):
                if peer != self.me:
                    ag.start_soon(self._fetch, j, peer)

    async def _fetch(self, j: int, peer: str) -> None:
        slot = self.out[self.bounds[j] : self.bounds[j + 1]]
        got = await self._receive(peer, f"{self.tag}/ag/{j}", {"values": slot} if self.lossless else None)
        try:
            if self.lossless:
                if not bool(torch.isfinite(slot).all()):
                    raise CodecError("non-finite values")
                part = slot
            else:
                part = self.codec.decode(got.tensors, (self.bounds[j + 1] - self.bounds[j],), torch.float32)
        except CodecError as e:
            raise AttemptFailed({peer}, f"garbage reduced part from {peer[-8:]}: {e}", evidence=True) from None
        if self.config.robust != "none" and part.numel():
            # Robust combination cannot exceed the contributions' range; we only know ours, so a
            # part vastly larger than our slice of it means its owner is lying (robust
            # aggregation alone protects contributions only).
            ours = float(self.flat[self.bounds[j] : self.bounds[j + 1]].abs().max())
            if float(part.abs().max()) > self.config.owner_check * max(ours, 1e-12):
                self.stats.rejected[peer] = "reduced part out of range"
                raise AttemptFailed({peer}, f"reduced part from {peer[-8:]} out of range", evidence=True)
        if not self.lossless:
            slot.copy_(part)

    def _encode(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
        if self.lossless:
            return {"values": x}
        try:
            return self.codec.encode(x)
        except CodecError as e:  # our own input is not finite: we cannot take part
            raise CollectiveError(f"cannot encode our input: {e}") from None

    async def _send(self, peer: str, subtag: str, parts: dict, meta: dict, digest: bytes | None = None) -> None:
        try:
            rep = await self.streams.send(peer, subtag, parts, meta=meta, digest=digest, timeout=self.deadline)
            self.stats.sent += rep.nbytes
        except TransferError as e:
            self.failed.add(peer)
            raise AttemptFailed({peer}, f"send to {peer[-8:]}: {e}") from None

    async def _receive(self, peer: str, subtag: str, into: dict | None = None) -> Any:
        try:
            got = await self.streams.receive(
                peer, subtag, timeout=self.deadline, into=into, max_bytes=2 * self.part_bytes + (1 << 20)
            )
            self.stats.received += got.nbytes
            return got
        except TransferError as e:
            self.failed.add(peer)
            raise AttemptFailed({peer}, f"receive from {peer[-8:]}: {e}") from None

    async def _watch_liveness(self, scope: trio.CancelScope) -> None:
        """Cancel the attempt as soon as a peer we depend on drops its connection."""
        gone = await self.host.wait_disconnected(self.others)
        self.failed.update(gone)
        scope.cancel()
