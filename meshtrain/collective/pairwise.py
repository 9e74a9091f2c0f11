"""Averaging with one partner (NoLoCo's gossip step): `average_pair`.

Both peers send each other their tensors (optionally codec-encoded) over the tensor streams and
each computes the mean of the *decoded* pair in peer-id order, so both hold bit-identical results
without a third message carrying the result; a 32-byte digest exchange then confirms it. If the
partner does not show up, or fails mid-way, the caller proceeds alone with its own input
(`contributors == (self,)`) — NoLoCo has no global barrier, and one missing partner must not stall
anyone for longer than the deadline.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import trio

from meshtrain.collective.compression import CodecError, get_codec
from meshtrain.collective.contract import CollectiveError, ReduceResult
from meshtrain.collective.flat import all_finite, result_digest
from meshtrain.log import get_logger, kv
from meshtrain.transport.tensor_streams import TensorStreams, TransferError

log = get_logger(__name__)


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
) -> ReduceResult:
    """The mean of our `tensors` and `partner`'s, or our own if the partner is absent."""
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
            async with trio.open_nursery() as nursery:

                async def send() -> None:
                    out["sent"] = (await streams.send(partner, base, enc)).nbytes

                async def receive() -> None:
                    got = await streams.receive(partner, base, max_bytes=8 * numel + (1 << 20))
                    out["got_bytes"], out["got_tensors"] = got.nbytes, got.tensors

                nursery.start_soon(send)
                nursery.start_soon(receive)
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
    except (TransferError, trio.TooSlowError, CodecError, KeyError, BaseExceptionGroup) as e:
        if isinstance(e, BaseExceptionGroup) and not all(
            isinstance(x, TransferError | trio.TooSlowError) for x in e.exceptions
        ):
            raise
        log.info(
            kv("pairwise average failed; proceeding alone", round=round_id, partner=partner[-8:], error=repr(e)[:200])
        )
        return ReduceResult(tensors, (me,), result_digest(tensors), 0, 0, {partner: str(e)[:200]})
    if not math.isfinite(float(sum(v.float().sum() for v in result.values()))):
        raise CollectiveError("non-finite pairwise result")
    return ReduceResult(result, tuple(sorted((me, partner))), digest, out["sent"], out["got_bytes"], {})
