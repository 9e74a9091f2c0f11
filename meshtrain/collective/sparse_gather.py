"""Sparse all-gather: every peer of a round receives every peer's sparse payload exactly as it was
encoded, and all agree on whose payloads count.

The problem. SparseLoCo's peers each send a few percent of their pseudo-gradient as (indices,
2-bit values) — `sparse_codec.py`. An all-reduce cannot carry that: its reduce-scatter sums on the
way, and the sum of N sparse contributions has up to N times as many indices, which the all-gather
half would have to re-encode (lossy) or send densely. So the payloads travel as they are.

Design. (1) Exchange: each peer sends its payload, unchanged, to every other member of the round's
group (`collective.group(round_id)`) over the tensor data plane and receives theirs, all
concurrently, each transfer with a deadline scaled to its size. A payload that does not arrive in
time, or arrives malformed (other keys, dtypes or lengths than ours: every peer's layout follows
from the model's shapes alone), is missing. (2) Agreement: who is in the sum must be the same on
every peer, or the φs diverge. Rather than a second protocol, we reuse the fault-tolerant
all-reduce (its coordinator, attempts and digest check) on a tiny vector: for each member j, "I
hold j's payload" (0/1) and a 10-bit fragment h of the payload's blake3 digest and h². The
all-reduce's mean is bit-identical on every contributor, so every peer applies the same rule to the
same numbers: j counts iff every contributor holds it (mean of the indicator is exactly 1) and
all hold the same bytes (mean(h²) = mean(h)², i.e. no spread — small integers, exact in fp32). A
peer that vanished mid-gather is then out for everyone, or in for everyone if all survivors got
its payload first. The same check on a hash of the group itself catches peers whose membership
views differ (the round fails for all of them: `CollectiveError`, they proceed alone and re-sync).
(3) Summing is the caller's: every peer holds the same payloads and sums them in sorted peer
order, so the results are bit-identical by construction.

Bytes, per peer and round, for a model of M values at density d with 14-bit entries (1.75 bytes
per kept value) among N peers: the all-gather sends (N−1)·1.75·d·M; a dense fp32 all-reduce of the
densified sum sends 2·(N−1)/N·4·M. The gather is cheaper while N < 8/(1.75·d): 292 peers at
d = 1.56%. A "reduce of the union" (sparse reduce-scatter, then all-gather of the union) sends
(N−1)/N of the payload plus (N−1)·(union share), the union being up to N·d dense with wider values,
so it is never cheaper than the plain gather below that N either. `SparseLoCo` therefore gathers
and switches to the dense all-reduce of the decoded updates above the break-even point (its
`aggregation` option; its per-index mean needs a second dense vector, the "sent" mask, which
doubles the break-even N to ~584). The agreement all-reduce adds 3·N + 2 floats — noise. At our
benchmark's 4 peers and 208,704 values: 19.8 KB per peer and round against 1.25 MB, 63× fewer.

Where it runs. `all_gather(collective, ...)` asks the collective, which must `GathersPayloads`
(contract.py): `SwarmCollective.all_gather` is `gather_over_streams` below, over its data plane;
`LocalCollective` simulates it; a wrapper forwards it (forwarding.py).

Failures. A missing payload costs its deadline once (the transfers run concurrently), and the
agreement all-reduce keeps the all-reduce's guarantees: a dead peer is dropped from it, a peer that
is itself cut off gets `CollectiveError`. A peer of our group that ended this round without us —
its view of the round's members left us out (we had just joined or restarted), or it moved on
while we were slow — neither claims our payload nor sends its own, and our transfers with it
would wait out their deadline (20 s and more, seen in CI after a restart). So a transfer still
open after `PROBE_AFTER` asks that peer where it is in the agreement's series
(`SwarmCollective.where`, the WHERE RPC a coordinator asks its missing peers), every
`PROBE_EVERY`, and gives up on it once it agrees on this round or a later one (its exchange is
over: a restarted peer met its old self's partner already in the agreement, which waited for the
restarted peer's join while that peer waited for a payload) or ended it: its payload is missing,
as for a dead peer. Not here: what the payloads mean, summing them.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import blake3
import torch
import trio

from meshtrain.collective.contract import Collective, CollectiveError, GatherResult, GathersPayloads, RoundRequest
from meshtrain.collective.protocol import PROBE_AFTER, PROBE_EVERY, WhereReply
from meshtrain.log import get_logger, kv

log = get_logger(__name__)

HASH_BITS = 10  # of each payload digest compared through the agreement all-reduce (exact in fp32)


async def all_gather(
    collective: Collective, payload: dict[str, torch.Tensor], *, round_id: int, tag: str = "", weight: float = 1.0
) -> GatherResult:
    """Every member's `payload` (a flat dict of 1-D tensors with the same layout on every peer),
    through a collective that `GathersPayloads` (contract.py); `CollectiveError` from one that
    does not."""
    if not math.isfinite(weight) or weight < 0:
        raise CollectiveError("weight must be finite and >= 0")
    if not isinstance(collective, GathersPayloads):
        raise CollectiveError(f"{type(collective).__name__} cannot all-gather (no GathersPayloads capability)")
    return await collective.all_gather(payload, round_id=round_id, tag=tag, weight=weight)


async def gather_over_streams(
    collective: Any, payload: dict[str, torch.Tensor], *, round_id: int, tag: str = "", weight: float = 1.0
) -> GatherResult:
    """The gather (module docstring) over `collective.streams`, a `SwarmCollective`'s data plane,
    its deadlines from `collective.config`, its agreement through `collective.all_reduce`."""
    from meshtrain.transport.tensor_streams import TransferError

    if not math.isfinite(weight) or weight < 0:
        raise CollectiveError("weight must be finite and >= 0")
    streams, config = collective.streams, collective.config
    me = collective.peer_id
    group = tuple(sorted(collective.group(round_id)))
    others = [p for p in group if p != me]
    nbytes = sum(t.numel() * t.element_size() for t in payload.values())
    deadline = config.part_timeout + len(group) * nbytes / config.min_bandwidth
    wire_tag = f"sg/{round_id}/{tag}"
    got: dict[str, dict[str, torch.Tensor]] = {me: payload}
    weights: dict[str, float] = {me: weight}
    why: dict[str, str] = {}
    stats = {"sent": 0, "received": 0}

    async def send(peer: str) -> None:
        try:
            rep = await streams.send(peer, wire_tag, payload, meta={"w": weight}, timeout=deadline)
            stats["sent"] += rep.nbytes
        except TransferError as e:
            log.info(kv("sparse gather: send failed", peer=peer[-8:], error=str(e)[:200]))

    async def receive(peer: str) -> None:
        try:
            r = await streams.receive(peer, wire_tag, timeout=deadline, max_bytes=nbytes + (1 << 16))
        except TransferError as e:
            why[peer] = f"no payload: {str(e)[:120]}"
            return
        stats["received"] += r.nbytes
        w = r.meta.get("w")
        if not _same_layout(r.tensors, payload) or not isinstance(w, int | float) or not (math.isfinite(w) and w >= 0):
            why[peer] = "malformed payload"
            return
        got[peer], weights[peer] = dict(r.tensors), float(w)

    async def watch(peer: str, scope: trio.CancelScope) -> None:
        """Give up on `peer` once it says it is past this round (module docstring, "Failures")."""
        await trio.sleep(PROBE_AFTER)
        while not past_exchange(await collective.where(peer, round_id, f"{tag}/agree"), round_id):
            await trio.sleep(PROBE_EVERY)
        why[peer] = "it was past this round's exchange"
        log.info(
            kv("sparse gather: peer is past this round's exchange; not waiting for it", peer=peer[-8:], tag=wire_tag)
        )
        scope.cancel()

    async def exchange(peer: str) -> None:
        async with trio.open_nursery() as watching:
            watching.start_soon(watch, peer, watching.cancel_scope)
            async with trio.open_nursery() as transfers:
                transfers.start_soon(send, peer)
                transfers.start_soon(receive, peer)
            watching.cancel_scope.cancel()

    async with trio.open_nursery() as nursery:
        for peer in others:
            nursery.start_soon(exchange, peer)

    # Agreement (module docstring): one all-reduce of [g, g², (have_j, h_j, h_j²) for j in group].
    g = _hash10(",".join(group).encode())
    vec = [float(g), float(g * g)]
    for p in group:
        h = _hash10(_payload_bytes(got[p])) if p in got else 0
        vec += [1.0 if p in got else 0.0, float(h), float(h * h)]
    agreed = await collective.all_reduce(
        RoundRequest({"agree": torch.tensor(vec, dtype=torch.float32)}, round_id, f"{tag}/agree")
    )
    m = agreed.tensors["agree"].to(torch.float32)
    if float(m[1]) != float(m[0]) * float(m[0]):
        raise CollectiveError(f"sparse gather {wire_tag}: peers disagree on the round's group; proceed alone")
    included: list[str] = []
    excluded = dict(agreed.excluded)
    for j, p in enumerate(group):
        have, h_sum, h2_sum = (float(x) for x in m[2 + 3 * j : 5 + 3 * j])
        if have == 1.0 and h2_sum == h_sum * h_sum:
            included.append(p)
        else:
            excluded.setdefault(
                p,
                why.get(
                    p, "not every peer holds its payload" if have != 1.0 else "peers hold different payloads from it"
                ),
            )
    payloads = {p: got[p] for p in included}
    contributors = tuple(p for p in included if weights[p] > 0)
    return GatherResult(
        payloads,
        {p: weights[p] for p in included},
        contributors,
        stats["sent"] + agreed.bytes_sent,
        stats["received"] + agreed.bytes_received,
        excluded,
    )


def past_exchange(where: WhereReply | None, round_id: int) -> bool:
    """Whether a peer's answer to WHERE (about the agreement's series) puts it past the exchange of
    round `round_id`: it agrees on that round (its exchange is over), or ended it, or is in a later
    one. None (no answer) is not past."""
    return where is not None and (where.round_id >= round_id or where.finished >= round_id)


def _same_layout(theirs: Mapping[str, torch.Tensor], ours: Mapping[str, torch.Tensor]) -> bool:
    if set(theirs) != set(ours):
        return False
    return all(
        isinstance(t, torch.Tensor) and t.dtype == ours[k].dtype and t.shape == ours[k].shape for k, t in theirs.items()
    )


def _payload_bytes(payload: Mapping[str, torch.Tensor]) -> bytes:
    h = blake3.blake3()
    for k in sorted(payload):
        t = payload[k]
        h.update(k.encode())
        h.update(t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    return h.digest()


def _hash10(data: bytes) -> int:
    return int.from_bytes(blake3.blake3(data).digest()[:2], "little") & ((1 << HASH_BITS) - 1)
