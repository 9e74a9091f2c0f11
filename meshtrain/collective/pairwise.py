"""Averaging with one partner (NoLoCo's gossip step): `average_pair`.

Both peers send each other their tensors (optionally codec-encoded) over the tensor streams and
each computes the mean of the *decoded* pair in peer-id order, so both hold bit-identical results
without a third message carrying the result; a 32-byte digest exchange then confirms it. If the
partner does not show up, or fails mid-way, the caller proceeds alone with its own input
(`contributors == (self,)`) — NoLoCo has no global barrier, and one missing partner must not stall
anyone for longer than the deadline.

A partner already past our round will not come to it: `partner_past()`, polled every
`PARTNER_POLL_S` while we wait for its tensors (the caller reads the step the partner last reported
to the swarm), ends the wait at once. Without it, a restarted peer that trained to round r while
its partner, which had not yet seen it back, went on alone waited out the whole deadline at r, and
the partner, pairing with it again at a later round, waited out its own (the daemon matrix's
NoLoCo case: 20 s each).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch
import trio

from meshtrain.collective.compression import CodecError, get_codec
from meshtrain.collective.contract import CollectiveError, ReduceResult
from meshtrain.collective.flat import all_finite, result_digest
from meshtrain.log import get_logger, kv
from meshtrain.transport.tensor_streams import TensorStreams, TransferError

log = get_logger(__name__)

PARTNER_POLL_S = 0.25  # how often a wait for the partner asks whether it is past our round


class PartnerPassed(Exception):
    """The partner reported a step past our round while we waited for it."""


async def _end_when(past: Callable[[], bool], scope: trio.CancelScope) -> None:
    while not past():
        await trio.sleep(PARTNER_POLL_S)
    scope.cancel()


async def average_pair(
    streams: TensorStreams,
    me: str,
    partner: str | None,
    tensors: dict[str, torch.Tensor],
    *,
    round_id: int,
    tag: str = "",
    codec: str = "none",
    timeout: float = 30.0,
    min_bandwidth: float = 10e6,
    partner_past: Callable[[], bool] | None = None,
) -> ReduceResult:
    """The mean of our `tensors` and `partner`'s, or our own if the partner is absent (or, per
    `partner_past`, already past this round)."""
    if partner is None or partner == me:
        return ReduceResult(tensors, (me,), result_digest(tensors), 0, 0, {})
    try:
        c = get_codec(codec)
        encoded = {k: c.encode(v) for k, v in tensors.items()}  # once: sent, and decoded as ours below
        enc = {f"{k}|{part}": t for k, parts in encoded.items() for part, t in parts.items()}
    except CodecError as e:
        raise CollectiveError(f"cannot encode our input: {e}") from None
    numel = sum(v.numel() for v in tensors.values())
    deadline = timeout + 4 * numel / min_bandwidth
    base = f"pair/{round_id}/{tag}"
    out: dict[str, Any] = {}  # what the two transfers below bring back
    try:
        with trio.fail_after(deadline):
            with trio.CancelScope() as exchange:
                async with trio.open_nursery() as nursery:

                    async def send() -> None:
                        out["sent"] = (await streams.send(partner, base, enc)).nbytes

                    async def receive() -> None:
                        got = await streams.receive(partner, base, max_bytes=8 * numel + (1 << 20))
                        out["got_bytes"], out["got_tensors"] = got.nbytes, got.tensors

                    async def transfers() -> None:
                        async with trio.open_nursery() as both:
                            both.start_soon(send)
                            both.start_soon(receive)
                        nursery.cancel_scope.cancel()  # done: the watcher below stops too

                    nursery.start_soon(transfers)
                    if partner_past is not None:
                        nursery.start_soon(_end_when, partner_past, exchange)
            if exchange.cancelled_caught:
                raise PartnerPassed(f"{partner[-8:]} is past round {round_id}")
            got_parts: dict[str, dict[str, torch.Tensor]] = {}
            for key, t in out.pop("got_tensors").items():
                name, part = key.split("|", 1)
                got_parts.setdefault(name, {})[part] = t
            theirs = {}
            for k, v in tensors.items():
                theirs[k] = c.decode(got_parts.pop(k, {}), v.shape, torch.float32)
            if not all(all_finite(t) for t in theirs.values()):
                raise CodecError("partner sent non-finite values")
            # The mean of the decoded pair, in the partner's decoded buffers: IEEE addition is
            # commutative, so theirs + ours has the bits of ours + theirs and both peers agree;
            # our decoded input exists one tensor at a time (NoLoCo's round held Δ and φ five
            # times over, with every decode and the result made up front).
            result = {}
            for k in tensors:
                ours = c.decode(encoded.pop(k), tensors[k].shape, torch.float32)
                result[k] = theirs.pop(k).add_(ours).div_(2).to(tensors[k].dtype)
            digest = result_digest(result)
            async with trio.open_nursery() as nursery:
                dig = torch.frombuffer(bytearray(digest), dtype=torch.uint8)
                nursery.start_soon(streams.send, partner, base + "/digest", {"d": dig})
                got = await streams.receive(partner, base + "/digest", max_bytes=64)
            if bytes(got.tensors["d"].numpy()) != digest:
                raise CodecError("partner computed a different result")
    except (TransferError, trio.TooSlowError, CodecError, KeyError, PartnerPassed, BaseExceptionGroup) as e:
        # A transfer's failure comes wrapped in its nurseries' groups (nested: the transfers run
        # in a nursery of their own beside the watcher); anything else in them is a bug: raised.
        if isinstance(e, BaseExceptionGroup) and e.split((TransferError, trio.TooSlowError))[1] is not None:
            raise
        while isinstance(e, BaseExceptionGroup):  # the transfer's own error, not its nurseries'
            e = e.exceptions[0]
        log.info(
            kv("pairwise average failed; proceeding alone", round=round_id, partner=partner[-8:], error=repr(e)[:200])
        )
        return ReduceResult(tensors, (me,), result_digest(tensors), 0, 0, {partner: str(e)[:200]})
    if not math.isfinite(float(sum(v.float().sum() for v in result.values()))):
        raise CollectiveError("non-finite pairwise result")
    return ReduceResult(result, tuple(sorted((me, partner))), digest, out["sent"], out["got_bytes"], {})
