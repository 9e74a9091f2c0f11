"""`Exchanges`: an outer optimizer's round logic — which exchanges an inner step sends and merges,
what each weighs, the ones in flight, and what completing one does.

Problem. Every inner step of the training loop may send a fragment's pseudo-gradient, merge an
exchange sent τ steps before, or prepare the rounds of the next send step. What is due follows
from the schedule; what an exchange weighs, from the steps this peer trained since the fragment's
last send and from whether it is still a joiner in its warm-up. The same logic runs from the
trainer's thread (`step()`) and inline in trio (`astep()`), so it must not do I/O itself.

Design. `advance` is one inner step's rounds as a generator with no I/O inside: it decides what is
due, does the tensor work inline (Δ, error feedback; for a merge the outer update and the merge)
and yields the async calls it needs — the exchange (`run`, which calls `communicate`), a wait for
one in flight, a prepare — as `RoundCall`s, which the `TrioBridge` (outer_round.py) runs on the
trio side: from the trainer's thread for `step()`, inline for `astep()`. So the pseudo-gradient
goes from `pseudo_gradient` through `run` and `communicate` straight into the collective's
`RoundRequest`. `flush` completes the exchanges still in flight (`finish()`). The hooks are the
optimizer's (`OuterOptimizer`, outer.py), reached through `RoundOwner`, the part of it the logic
needs; what the logic keeps is its own: the exchanges in flight (fragment -> `Exchange`), each
fragment's last send, the step a joiner joined at, and the timing of prepared rounds
(`RoundPreparation`, outer_round.py). Every completed exchange is counted in the optimizer's
counters (`rounds`, bytes, waits) and kept as a `RoundReport` in its `history`.

Schedule (Streaming DiLoCo, Douillard et al. 2025 §2; torchft `local_sgd.py`). The trainable
parameters are split into P `fragments` (default: one, i.e. DiLoCo). Fragment p sends at inner
steps s >= 1 with s ≡ p·H/P (mod H), so at most one fragment is in flight and the peak traffic
is ~1/P of a full sync. With `delay` τ = 0 the round blocks: send, average, apply, merge. With
τ >= 1 the exchange runs in the background (in the nursery `async with outer` opens) while τ
more inner steps run, and the result is applied and merged at step s + τ — the only point where
an inner step may wait on the network, and only if the exchange has not finished. Requires
H % P == 0 and τ < H/P (ValueError otherwise): the rules and the formula are `RoundSchedule`'s
(optim/schedule.py), the one statement of them. Round ids: an exchange is the inner step s it is
sent at (`round_id=s`) and its fragment's tag (outer_round.py `exchange_tag`).

Weights. Each fragment's exchange carries as its weight the share of the steps since the
fragment's last send (H, except for the first) that the peer trained, the rest skipped to keep
the swarm's pace (outer.py, "Swarm pace"): the mean weighs each peer's Δ by its samples,
hivemind's `target_batch_size` in DiLoCo's terms. A robust rule (trimmed or clipped mean) takes
every weighted contribution alike: weights are each peer's own claim, which strangers'
contributions must not be scaled by. A joiner weighs 0 until it has done a full H steps of its
own, and at least the optimizer's `join_warmup_steps` (outer.py, "Late joiners"), and its error
feedback waits as long. A state loaded, or a join, starts the counting afresh (`count_from`).

Joiners enter at a step. A joiner whose state is from an earlier step than the swarm's enters
the round the swarm is in (`entry_step`, for `OuterOptimizer.join`): it jumps its step counter
there, trains the rest of the round and enters the swarm's next exchange with it — that
exchange's outer update is the same on the φ it holds, so its outer state stays identical. The
step must lie in [state's step, the next send step): beyond, the state is a round old — except
while the swarm is in that send's exchange: a peer counts the send step as it enters the
exchange and publishes no newer state until it ends, and with delay τ ≥ 1 the exchange overlaps
its training (it reports steps [send, send + max(τ, 1))). That exchange may be waiting for the
joiner — the swarm expects a joiner at its next round, and a member that re-syncs is still one
of the round's peers — so it enters a step before it and takes part (weight 0). Refusing left
both sides waiting for each other until the round's hard deadline (seen in CI: with τ ≥ 1 round
after round; with τ = 0 two of three peers re-syncing, each refused the state from before the
round the third waited in, for 90 s). A state offered just before its donor publishes the
round's result takes the joiner into a round that has ended: it is told so and re-syncs, as
after any missed round.

Failures. `run` catches the `CollectiveError` of an exchange this peer could not take part in:
the exchange's result is its own Δ as a group of one, the report carries the error, and the
optimizer's `needs_resync` is set (outer.py, "Failures"). Anything else a call raises ends the
round logic with the error, in the caller's thread.

Not here: the hooks and the state an optimizer keeps (outer.py); how the calls reach trio, and
when a round's group is formed ahead of it (outer_round.py); the schedule's formula and rules
(schedule.py); who decides to skip a step (node/pace.py).
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Awaitable, Callable, Generator, Sequence
from functools import partial
from typing import Any, Protocol

import torch

from meshtrain.collective.contract import Collective, CollectiveError, ReduceResult
from meshtrain.log import get_logger, kv
from meshtrain.optim.outer_round import Exchange, RoundCall, RoundLogic, RoundPreparation, RoundReport, exchange_tag
from meshtrain.optim.outer_state import StaleStateError
from meshtrain.optim.schedule import RoundSchedule

__all__ = ["Exchanges", "RoundOwner"]

log = get_logger(__name__)


class RoundOwner(Protocol):
    """What the round logic needs of its optimizer (`OuterOptimizer`, outer.py): the hooks a round
    calls, the counters it advances and the flags it reads."""

    collective: Collective
    inner_steps: int
    skipped_steps: int
    needs_resync: bool
    rounds: int
    bytes_sent: int
    bytes_received: int
    peak_bytes_per_sync: int
    comm_wait_seconds: float
    history: deque[RoundReport]
    before_state_change: list[Callable[[], Awaitable[None]]]

    @property
    def fragments(self) -> Sequence[Sequence[str]]: ...
    @property
    def join_warmup_steps(self) -> int: ...
    @property
    def error_feedback(self) -> float | None: ...
    @property
    def prepares_rounds(self) -> bool: ...
    def pseudo_gradient(self, names: Sequence[str]) -> dict[str, torch.Tensor]: ...
    def feed_back(self, delta: dict[str, torch.Tensor], names: Sequence[str]) -> dict[str, torch.Tensor]: ...
    async def communicate(
        self, tensors: dict[str, torch.Tensor], *, round_id: int, tag: str, weight: float
    ) -> ReduceResult: ...
    async def prepare(self, *, round_id: int, tag: str, within: float) -> None: ...
    async def unprepare(self, *, round_id: int, tag: str) -> None: ...
    def apply(self, result: ReduceResult, names: Sequence[str]) -> None: ...
    def merge(self, names: Sequence[str]) -> None: ...


class Exchanges:
    """An optimizer's round logic and the exchanges it has in flight (module docstring).

    owner: the optimizer whose hooks a round calls and whose counters it advances.
    schedule: when each fragment is sent and merged (optim/schedule.py).
    """

    def __init__(self, owner: RoundOwner, schedule: RoundSchedule) -> None:
        self.owner = owner
        self.schedule = schedule
        self.pending: dict[int, Exchange] = {}  # fragment -> its exchange in flight (delay >= 1)
        self.joined_at: int | None = None  # the inner step we joined at (weight 0 for a warm-up)
        self.preparation = RoundPreparation(schedule)
        # fragment -> (inner step, skipped_steps) at its last send; before one, `_counted_from`
        # (where this process, or the last state loaded, began counting)
        self._sent_at: dict[int, tuple[int, int]] = {}
        self._counted_from = (0, 0)

    @property
    def in_flight(self) -> bool:
        return bool(self.pending)

    def due(self, step: int) -> tuple[list[int], list[int]]:
        """(fragments to merge, fragments to send) at inner step `step`."""
        merges = [p for p, ex in self.pending.items() if ex.merge_step <= step]
        return sorted(merges), self.schedule.sends_at(step)

    def count_from(self, step: int, skipped_steps: int) -> None:
        """Weigh every fragment's next exchange by the steps from inner step `step`, with
        `skipped_steps` skipped before it (a state loaded or joined: module docstring, "Weights")."""
        self._sent_at, self._counted_from = {}, (step, skipped_steps)

    def entry_step(self, state_step: int, at_step: int) -> int:
        """The step a joiner enters at with a state from inner step `state_step` while the swarm
        is at `at_step` (module docstring, "Joiners enter at a step"); `StaleStateError` if that
        state is a round old."""
        send = self.schedule.next_send_step(state_step)
        if send <= at_step < send + max(self.schedule.delay, 1):  # the swarm is in that exchange
            at_step = send - 1
        if not state_step <= at_step < send:
            raise StaleStateError(
                f"state is from step {state_step}; cannot enter at step {at_step} "
                f"(an exchange happened in between): fetch a newer state"
            )
        return at_step

    def advance(self, trained: bool = True) -> RoundLogic:
        """The round logic for one inner step, as a generator that yields the async calls it
        needs: the bridge runs them on the trio side (from a thread or inline). `trained`: False
        for a step skipped to keep the swarm's pace (`skip`)."""
        owner = self.owner
        owner.inner_steps += 1
        step = owner.inner_steps
        if not trained:
            owner.skipped_steps += 1
        self.preparation.step_began()
        merges, sends = self.due(step)
        reports = []
        for p in merges:
            reports.append((yield from self.complete(self.pending.pop(p))))
        if not sends:  # a step after the last send: that round's join went out first
            yield from self.prepare_next(step)
        for p in sends:
            names = owner.fragments[p]
            warm_up = max(self.schedule.H, owner.join_warmup_steps)
            ready = self.joined_at is None or step - self.joined_at >= warm_up
            with torch.no_grad():
                tensors = owner.pseudo_gradient(names)
                if owner.error_feedback is not None and ready:
                    tensors = owner.feed_back(tensors, names)
            # the share of the fragment's steps since its last send that were trained (all, unless
            # some were skipped: module docstring, "Weights")
            since_step, since_skipped = self._sent_at.get(p, self._counted_from)
            skipped = owner.skipped_steps - since_skipped
            weight = max(0.0, 1.0 - skipped / max(step - since_step, 1)) if ready else 0.0
            self._sent_at[p] = (step, owner.skipped_steps)
            ex = Exchange(p, step, tuple(names), tensors, weight, self.schedule.merge_step(step))
            if self.schedule.delay == 0:
                yield RoundCall(self.run, (ex,), what=ex.describe())
                reports.append((yield from self.complete(ex)))
            else:
                self.pending[p] = ex
                yield RoundCall(self.run, (ex,), spawn=True)
        self.preparation.step_ended()
        return reports

    def prepare_next(self, step: int) -> Generator[RoundCall, Any, None]:
        """Prepare the rounds of the next send step once they are due (outer_round.py,
        "Prepared rounds")."""
        if not self.owner.prepares_rounds:
            return
        due = self.preparation.due(step)
        if due is None:
            return
        nxt, within = due
        for p in self.schedule.sends_at(nxt):
            yield RoundCall(partial(self.owner.prepare, round_id=nxt, tag=exchange_tag(p), within=within))

    def flush(self) -> RoundLogic:
        """Complete the exchanges still in flight, and withdraw the rounds prepared for a step
        that training did not reach (end of training)."""
        reports = []
        for p in sorted(self.pending):
            reports.append((yield from self.complete(self.pending.pop(p))))
        # Training ended: the exchanges prepared for a step it did not reach will not run.
        unreached = self.preparation.unreached(self.owner.inner_steps)
        if unreached is not None:
            for p in self.schedule.sends_at(unreached):
                yield RoundCall(partial(self.owner.unprepare, round_id=unreached, tag=exchange_tag(p)))
            self.preparation.withdrawn(self.owner.inner_steps)
        return reports

    def complete(self, ex: Exchange) -> Generator[RoundCall, Any, RoundReport]:
        """Wait for `ex` if it is still running, then apply and merge its result and count it."""
        owner = self.owner
        t0 = time.monotonic()
        if not ex.done.is_set():
            yield RoundCall(ex.done.wait, what=ex.describe())
        waited = time.monotonic() - t0
        result = ex.result
        assert result is not None  # set before done
        for hook in owner.before_state_change:
            yield RoundCall(hook)
        with torch.no_grad():
            owner.apply(result, ex.names)
            owner.merge(ex.names)
        owner.rounds += 1
        owner.bytes_sent += result.bytes_sent
        owner.bytes_received += result.bytes_received
        owner.peak_bytes_per_sync = max(owner.peak_bytes_per_sync, result.bytes_sent)
        owner.comm_wait_seconds += waited + (ex.finished - ex.started if self.schedule.delay == 0 else 0.0)
        report = RoundReport(
            ex.step,
            ex.fragment,
            len(result.contributors),
            result.bytes_sent,
            result.bytes_received,
            ex.finished - ex.started,
            waited,
            ex.error,
            tuple(sorted({*(result.members or result.contributors), *result.excluded})),
            set(result.members or result.contributors) <= {owner.collective.peer_id},
        )
        owner.history.append(report)
        return report

    async def run(self, ex: Exchange) -> None:
        """Run `communicate` for one exchange (trio side); on CollectiveError proceed alone."""
        owner = self.owner
        try:
            ex.result = await owner.communicate(
                ex.tensors, round_id=ex.step, tag=exchange_tag(ex.fragment), weight=ex.weight
            )
        except CollectiveError as e:
            log.warning(
                kv(
                    "outer round without the swarm; proceeding alone",
                    step=ex.step,
                    fragment=ex.fragment,
                    error=str(e)[:200],
                )
            )
            owner.needs_resync = True
            ex.error = str(e) or type(e).__name__
            me = owner.collective.peer_id
            ex.result = ReduceResult(ex.tensors, (me,), b"", 0, 0, {})
        ex.finished = time.monotonic()
        ex.done.set()
