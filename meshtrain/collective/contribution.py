"""One peer's input to one all-reduce round, flattened and checked once, off the event loop.

The problem: before a peer can send anything it needs its input as one flat fp32 vector
(flat.py `flatten_fp32`) and must know that it is finite — a NaN sent to an owner gets us
excluded from the round, so non-finite input takes part with weight 0 and contributes zeros
(the others must not wait for us). Both are passes over the whole input: ~75 ms for 100 MB,
seconds for a model of a few GB. Done on the event loop before the join, as they were, they
delayed every peer's join by that much (the coordinator waits for the last join) and stalled
every other task of the node — its RPCs, heartbeats and transfers — meanwhile. In the WAN lab
(scripts/bench/bench_wan.py), with 8 peers sharing two cores, the check alone held the first
round's joins back 1.1 s.

Design: `Contribution` starts the work in a worker thread (`start`, in the collective's
nursery) as the round begins; the join goes out at once, and the data phase awaits `ready()`
while it opens its connections. One flattening per round, not one per attempt: a retry reuses
it. Input that already is one flat fp32 vector (flat.py `flat_view`: an outer optimizer's Δ,
written into one buffer) is used as it is, not copied — at a 1-8B model's size that copy was
4 bytes per parameter more at every round's peak; the collective only reads it, and the caller
must not change it until the round returns. Non-finite input is replaced by zeros of our own,
never zeroed in the caller's memory.

Failures: an error in the worker (memory) is re-raised by `ready()` in the round that awaits it,
never in the nursery that ran it.
"""

from __future__ import annotations

import torch
import trio

from meshtrain.collective.contract import CollectiveError
from meshtrain.collective.flat import all_finite, flat_view, flatten_fp32
from meshtrain.log import get_logger, kv

log = get_logger(__name__)


def flatten_checked(tensors: dict[str, torch.Tensor]) -> tuple[torch.Tensor, bool]:
    """`tensors` as one flat fp32 vector (a view when they already are one, else a fresh copy:
    read it, never write it) and whether all of it is finite."""
    flat = flat_view(tensors)
    if flat is None:
        flat = flatten_fp32(tensors)
    return flat, all_finite(flat)


class Contribution:
    """What we put into one round: the caller's `tensors` (their names, shapes and dtypes shape
    the result) and, once `ready()`, the flat fp32 vector and the weight we contribute with."""

    def __init__(self, tensors: dict[str, torch.Tensor], weight: float, round_id: int) -> None:
        self.tensors = tensors
        self.numel = sum(t.numel() for t in tensors.values())
        self.round_id = round_id
        self._weight = weight
        self._flat: torch.Tensor | None = None
        self._error: BaseException | None = None
        self._done = trio.Event()

    def start(self, nursery: trio.Nursery) -> None:
        nursery.start_soon(self._prepare)

    async def _prepare(self) -> None:
        try:
            flat, finite = await trio.to_thread.run_sync(flatten_checked, self.tensors)
            if not finite:
                log.warning(kv("allreduce input is not finite; contributing weight 0", round=self.round_id))
                flat = torch.zeros_like(flat)  # not in place: it may be the caller's memory
                self._weight = 0.0
            self._flat = flat
        except trio.Cancelled:
            self._error = CollectiveError("the collective stopped while it prepared the input")
            raise
        except Exception as e:  # re-raised in the round that awaits it
            self._error = e
        finally:
            self._done.set()

    async def ready(self) -> tuple[torch.Tensor, float]:
        """The flat vector and our weight (0 if the input was not finite)."""
        await self._done.wait()
        if self._error is not None:
            raise self._error
        assert self._flat is not None  # set before the event
        return self._flat, self._weight
