"""`DataParallel`: synchronous data parallelism over a `Collective`, the upper baseline.

Every inner step all-reduces the gradients before the inner optimizer steps, so every peer applies
the same averaged gradient — what the low-communication outer optimizers (outer.py) are measured
against. It keeps `OuterOptimizer`'s calling convention (`step()` from a worker thread, `await
astep()` in trio) and byte counters, so a training loop or a benchmark can swap one for the other.
If this peer cannot take part in a step's all-reduce it steps on its own gradient and logs it.

Not here: outer rounds, state dicts, late joiners (a baseline needs none of them).
"""

from __future__ import annotations

import time
from typing import Any

import torch
import trio

from meshtrain.collective.contract import Collective, CollectiveError, ReduceResult
from meshtrain.log import get_logger, kv
from meshtrain.optim.outer import check_not_in_trio_thread

log = get_logger(__name__)


class DataParallel:
    """Synchronous data parallelism, the upper baseline: gradients are all-reduced every step
    before the inner step (so every peer applies the same averaged gradient).

    `step()` from a worker thread, `await astep()` in trio, like `OuterOptimizer`. Byte counters
    match `OuterOptimizer.stats()`.
    """

    def __init__(
        self,
        model: torch.nn.Module,
        inner: torch.optim.Optimizer,
        collective: Collective,
        *,
        codec: str = "none",
        clip: float | None = None,
    ) -> None:
        self.model, self.inner, self.collective, self.codec, self.clip = model, inner, collective, codec, clip
        self.params = {n: p for n, p in model.named_parameters() if p.requires_grad}
        self.inner_steps = 0
        self.bytes_sent = self.bytes_received = self.peak_bytes_per_sync = 0
        self.comm_wait_seconds = 0.0

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.inner.zero_grad(set_to_none=set_to_none)

    def _grads(self) -> dict[str, torch.Tensor]:
        return {n: (p.grad if p.grad is not None else torch.zeros_like(p)).detach() for n, p in self.params.items()}

    def _apply(self, result: ReduceResult) -> None:
        for n, p in self.params.items():
            p.grad = result.tensors[n].to(p.dtype)
        if self.clip is not None:
            torch.nn.utils.clip_grad_norm_(list(self.params.values()), self.clip)
        self.inner.step()
        self.inner_steps += 1
        self.bytes_sent += result.bytes_sent
        self.bytes_received += result.bytes_received
        self.peak_bytes_per_sync = max(self.peak_bytes_per_sync, result.bytes_sent)

    async def _reduce(self, grads: dict[str, torch.Tensor]) -> ReduceResult:
        t0 = time.monotonic()
        try:
            return await self.collective.all_reduce(grads, round_id=self.inner_steps + 1, tag="dp", codec=self.codec)
        except CollectiveError as e:
            log.warning(kv("data-parallel step without the swarm", step=self.inner_steps + 1, error=str(e)[:200]))
            return ReduceResult(grads, (self.collective.peer_id,), b"")
        finally:
            self.comm_wait_seconds += time.monotonic() - t0

    def step(self) -> None:
        check_not_in_trio_thread()
        self._apply(trio.from_thread.run(self._reduce, self._grads()))

    async def astep(self) -> None:
        self._apply(await self._reduce(self._grads()))

    def stats(self) -> dict[str, Any]:
        return {
            "inner_steps": self.inner_steps,
            "rounds": self.inner_steps,
            "bytes_sent": self.bytes_sent,
            "bytes_received": self.bytes_received,
            "peak_bytes_per_sync": self.peak_bytes_per_sync,
            "comm_wait_seconds": self.comm_wait_seconds,
            "needs_resync": False,
        }
