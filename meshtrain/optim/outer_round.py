"""`OuterRounds`: when an outer optimizer's rounds happen, and how their network part runs.

Problem. An outer round is tensor work (Δ, the outer update, the merge) around one network call
(the `Collective`'s average, a trio coroutine), due every H inner steps of a training loop that
runs torch in a worker thread. The trio loop must never run a forward pass or the outer update —
it would stop serving the network during compute — and the trainer must wait on the network only
where the algorithm says so: with overlap (Streaming DiLoCo) an exchange runs while the next inner
steps do. A peer cut off from the swarm must keep training.

Design. `OuterRounds` is the base class of `OuterOptimizer` (outer.py) and is never used alone:
it holds the training-loop side (`zero_grad`, `step`, `finish`, their trio twins, the nursery
`async with outer` opens) and the round logic, and calls back into the optimizer's hooks
(`pseudo_gradient`, `feed_back`, `communicate`, `apply`, `merge`) for what a round computes. The
round logic for one inner step (`_advance`) is a generator with no I/O inside: it decides what is
due, does the tensor work inline and yields the async calls it needs (`_Call`); two drivers run
those calls on the trio side — `_drive_from_thread` for `step()`, `_drive_async` for `astep()`.
One piece of logic, two ways of running it. Every completed exchange is counted (bytes, waits)
and kept as a `RoundReport` in `history`.

Threading. `step()` is called from a worker thread (`trio.to_thread.run_sync`, or any thread if
the optimizer was entered with `async with`, which records the trio token). The inner step and
every tensor operation of a round (Δ, the outer update, the merge) run in that thread; only the
collective call hops onto the trio side (`trio.from_thread.run`), so the trio loop never runs a
forward pass and keeps serving the network during compute. Steps with nothing due never touch
trio at all. Code already running in trio (simulations with `LocalSwarm`, tests) calls
`await astep()` instead — same logic, tensor work inline.

Hooks. `step_hooks` are called with the optimizer at the start of every `step()`, in the
caller's thread; a collective that `WatchesOptimizer` (`meshtrain.Swarm`, for a loop you write
yourself) is told of the optimizer at the end of `OuterOptimizer.__init__` and installs its hook
there. With no hook the list costs one empty loop per step.

Schedule (Streaming DiLoCo, Douillard et al. 2025 §2; torchft `local_sgd.py`). The trainable
parameters are split into P `fragments` (default: one, i.e. DiLoCo). Fragment p sends at inner
steps s >= 1 with s ≡ p·H/P (mod H), so at most one fragment is in flight and the peak traffic
is ~1/P of a full sync. With `delay` τ = 0 the round blocks: send, average, apply, merge. With
τ >= 1 the exchange runs in the background (in the nursery `async with outer` opens) while τ
more inner steps run, and the result is applied and merged at step s + τ — the only point where
an inner step may wait on the network, and only if the exchange has not finished. Requires
H % P == 0 and τ < H/P (ValueError otherwise): the rules and the formula are `RoundSchedule`'s
(optim/schedule.py), the one statement of them.

Prepared rounds. A round's group can be formed before its data exists: the join carries nothing
from the data. When the next send step is due within `PREPARE_LEAD_S` (about a second, judged
from a moving average of the caller's inner step time), the round logic asks the optimizer to
`prepare` those exchanges: a collective that `PreparesRounds` sends their joins now, in the
background (collective/prepared.py; the round's coordinator, whose join is local, does not), and
an exchange starts once its coordinator has joined instead of a join round trip after our data.
Over a WAN link that round trip is a good share of a fragment round's time: a third of Streaming
DiLoCo's at 20 ms one way (scripts/bench/bench_wan.py). A blocking round saves it too. Nothing is
prepared before the first inner step has been timed, or when a step takes longer than the lead
(the join is then small beside it). Preparing waits for a step after a send step, so the join of
the round just sent reaches its coordinator first: a coordinator that saw us join a later round
of a series before this one would count us as past it. `finish` unprepares the
exchanges of a step that training did not reach, and their joins are withdrawn at once.

Round ids. Every exchange is identified by the inner step s at which it is sent (`round_id=s`)
and the fragment (`tag="f<p>"`): equal on every peer that follows the swarm's step counter, and
never reused.

Failures. The collective already averages over the survivors when a peer dies mid-round. If
*this* peer could not take part at all (`CollectiveError`: cut off, or late for the group), it
proceeds alone — its own Δ is applied as a group of one — so training never stops, and
`needs_resync` is set: its φ and outer state now differ from the swarm's, and the node should
download the swarm's state (`join`).

Not here: what a round computes and the state an optimizer keeps (φ, the hooks, error feedback,
`state_dict`, late joiners: `OuterOptimizer`, outer.py); the schedule's formula and rules
(`RoundSchedule`, schedule.py); the attributes this class reads (`OuterOptimizer.__init__`);
which peers are in a round (the collective's membership).
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Generator, Sequence
from contextlib import AsyncExitStack
from dataclasses import dataclass, field
from functools import partial
from typing import TYPE_CHECKING, Any

import torch
import trio

from meshtrain.collective.contract import Collective, CollectiveError, ReduceResult
from meshtrain.lifecycle import Service
from meshtrain.log import get_logger, kv
from meshtrain.optim.schedule import RoundSchedule

log = get_logger(__name__)

PREPARE_LEAD_S = 1.0  # a round's group is formed at most this long (in inner steps) before it
STEP_TIME_WEIGHT = 0.2  # of the newest inner step in the moving average of step times


@dataclass(frozen=True)
class RoundReport:
    """One exchange, as this peer saw it."""

    step: int  # inner step at which the fragment was sent (= round_id)
    fragment: int
    contributors: int  # peers whose input is in the mean (1 = alone)
    bytes_sent: int
    bytes_received: int
    seconds: float  # send to result
    waited: float  # how long the inner loop blocked on it
    error: str = ""  # why we proceeded alone, if we did


@dataclass
class Exchange:
    """One fragment's exchange, from its send at `step` to its merge at `merge_step`."""

    fragment: int
    step: int
    names: tuple[str, ...]
    tensors: dict[str, torch.Tensor]
    weight: float
    merge_step: int
    started: float = field(default_factory=time.monotonic)
    done: trio.Event = field(default_factory=trio.Event)
    result: ReduceResult | None = None
    error: str = ""
    finished: float = 0.0


@dataclass(frozen=True)
class _Call:
    """A request from the round logic to run an async function on the trio side."""

    fn: Callable[..., Any]
    args: tuple[Any, ...] = ()
    spawn: bool = False  # start in the optimizer's nursery instead of awaiting


class OuterRounds(Service):
    """The schedule, the exchanges in flight and the threading bridge of `OuterOptimizer` (module
    docstring). It keeps no state of its own: `OuterOptimizer.__init__` sets every attribute
    below, and the round logic calls the optimizer's hooks."""

    model: torch.nn.Module
    inner: torch.optim.Optimizer | None
    collective: Collective
    fragments: list[tuple[str, ...]]
    schedule: RoundSchedule  # when each fragment is sent and merged (optim/schedule.py)
    _pending: dict[int, Exchange]  # fragment -> its exchange in flight (delay >= 1)
    _prepared_through: int  # the newest send step whose rounds were prepared
    _step_seconds: float | None  # the caller's inner step time, a moving average (None: unknown)
    _step_ended: float | None  # when the round logic last returned to the caller
    _joined_at: int | None
    _nursery: trio.Nursery | None
    _token: trio.lowlevel.TrioToken | None
    inner_steps: int
    rounds: int
    needs_resync: bool
    error_feedback: float | None
    bytes_sent: int
    bytes_received: int
    peak_bytes_per_sync: int
    comm_wait_seconds: float
    history: deque[RoundReport]
    step_hooks: list[Callable[[Any], None]]

    if TYPE_CHECKING:  # the optimizer's hooks, which OuterOptimizer defines (outer.py)

        @property
        def prepares_rounds(self) -> bool: ...
        async def prepare(self, *, round_id: int, tag: str, within: float) -> None: ...
        async def unprepare(self, *, round_id: int, tag: str) -> None: ...
        def pseudo_gradient(self, names: Sequence[str]) -> dict[str, torch.Tensor]: ...
        def feed_back(self, delta: dict[str, torch.Tensor], names: Sequence[str]) -> dict[str, torch.Tensor]: ...
        async def communicate(
            self, tensors: dict[str, torch.Tensor], *, round_id: int, tag: str, weight: float
        ) -> ReduceResult: ...
        def apply(self, result: ReduceResult, names: Sequence[str]) -> None: ...
        def merge(self, names: Sequence[str]) -> None: ...

    # -- the training loop --------------------------------------------------------------------

    def zero_grad(self, set_to_none: bool = True) -> None:
        if self.inner is not None:
            self.inner.zero_grad(set_to_none=set_to_none)
        else:
            self.model.zero_grad(set_to_none=set_to_none)

    def step(self) -> list[RoundReport]:
        """The inner step, then whatever the schedule says is due. Call from a worker thread
        (not from the trio thread: use `astep` there). Returns the exchanges completed."""
        for hook in self.step_hooks:
            hook(self)
        if self.inner is not None:
            self.inner.step()
        return self._drive_from_thread(self._advance())

    async def astep(self) -> list[RoundReport]:
        """`step()` for code running in trio (tensor work runs inline in the trio thread)."""
        if self.inner is not None:
            self.inner.step()
        return await self._drive_async(self._advance())

    def finish(self) -> list[RoundReport]:
        """Wait for exchanges still in flight and merge them (end of training; from a thread)."""
        return self._drive_from_thread(self._flush())

    async def afinish(self) -> list[RoundReport]:
        return await self._drive_async(self._flush())

    async def _start(self, stack: AsyncExitStack) -> None:
        # Leaving cancels exchanges still in flight (call `afinish()` first to keep them), then
        # forgets them.
        self._token = trio.lowlevel.current_trio_token()
        stack.callback(self._pending.clear)
        self._nursery = await stack.enter_async_context(trio.open_nursery())

    @property
    def in_flight(self) -> bool:
        return bool(self._pending)

    def pending_merges(self) -> dict[int, int]:
        """fragment -> the inner step at which its exchange in flight is merged."""
        return {p: ex.merge_step for p, ex in self._pending.items()}

    @property
    def H(self) -> int:
        """Inner steps between two syncs of a fragment."""
        return self.schedule.H

    @property
    def delay(self) -> int:
        """τ: inner steps an exchange overlaps with (0: blocking)."""
        return self.schedule.delay

    def next_send_step(self, step: int) -> int:
        """The first inner step after `step` at which some fragment is sent."""
        return self.schedule.next_send_step(step)

    def due(self, step: int) -> tuple[list[int], list[int]]:
        """(fragments to merge, fragments to send) at inner step `step`."""
        merges = [p for p, ex in self._pending.items() if ex.merge_step <= step]
        return sorted(merges), self.sends_at(step)

    def sends_at(self, step: int) -> list[int]:
        """The fragments sent at inner step `step`: the schedule alone (safe to call from another
        thread while the trainer's runs, unlike `due`, which reads the exchanges in flight)."""
        return self.schedule.sends_at(step)

    def _advance(self) -> Generator[_Call, Any, list[RoundReport]]:
        """The round logic for one inner step, as a generator that yields the async calls it
        needs: the drivers run them on the trio side (from a thread or inline)."""
        self.inner_steps += 1
        step = self.inner_steps
        self._time_step()
        merges, sends = self.due(step)
        reports = []
        for p in merges:
            reports.append((yield from self._complete(self._pending.pop(p))))
        if not sends:  # a step after the last send: that round's join went out first
            yield from self._prepare_next(step)
        for p in sends:
            names = self.fragments[p]
            ready = self._joined_at is None or step - self._joined_at >= self.H
            with torch.no_grad():
                tensors = self.pseudo_gradient(names)
                if self.error_feedback is not None and ready:
                    tensors = self.feed_back(tensors, names)
            ex = Exchange(p, step, tuple(names), tensors, 1.0 if ready else 0.0, self.schedule.merge_step(step))
            if self.delay == 0:
                yield _Call(self._exchange, (ex,))
                reports.append((yield from self._complete(ex)))
            else:
                self._pending[p] = ex
                yield _Call(self._exchange, (ex,), spawn=True)
        self._step_ended = time.monotonic()
        return reports

    def _time_step(self) -> None:
        """Fold the caller's time since the round logic last returned (its forward, backward and
        inner step: no exchange waits) into `_step_seconds`."""
        if self._step_ended is not None:
            took = time.monotonic() - self._step_ended
            ema = self._step_seconds
            self._step_seconds = took if ema is None else ema + STEP_TIME_WEIGHT * (took - ema)

    def _prepare_next(self, step: int) -> Generator[_Call, Any, None]:
        """Prepare the rounds of the next send step once it is due within `PREPARE_LEAD_S`
        (module docstring, "Prepared rounds")."""
        nxt = self.next_send_step(step)
        if nxt <= self._prepared_through or self._step_seconds is None or not self.prepares_rounds:
            return
        within = (nxt - step) * self._step_seconds
        if within > PREPARE_LEAD_S:
            return
        self._prepared_through = nxt
        for p in self.sends_at(nxt):
            yield _Call(partial(self.prepare, round_id=nxt, tag=exchange_tag(p), within=within))

    def _flush(self) -> Generator[_Call, Any, list[RoundReport]]:
        reports = []
        for p in sorted(self._pending):
            reports.append((yield from self._complete(self._pending.pop(p))))
        # Training ended: the exchanges prepared for a step it did not reach will not run.
        if self._prepared_through > self.inner_steps:
            for p in self.sends_at(self._prepared_through):
                yield _Call(partial(self.unprepare, round_id=self._prepared_through, tag=exchange_tag(p)))
            self._prepared_through = self.inner_steps
        return reports

    def _complete(self, ex: Exchange) -> Generator[_Call, Any, RoundReport]:
        t0 = time.monotonic()
        if not ex.done.is_set():
            yield _Call(ex.done.wait)
        waited = time.monotonic() - t0
        result = ex.result
        assert result is not None  # set before done
        with torch.no_grad():
            self.apply(result, ex.names)
            self.merge(ex.names)
        self.rounds += 1
        self.bytes_sent += result.bytes_sent
        self.bytes_received += result.bytes_received
        self.peak_bytes_per_sync = max(self.peak_bytes_per_sync, result.bytes_sent)
        self.comm_wait_seconds += waited + (ex.finished - ex.started if self.delay == 0 else 0.0)
        report = RoundReport(
            ex.step,
            ex.fragment,
            len(result.contributors),
            result.bytes_sent,
            result.bytes_received,
            ex.finished - ex.started,
            waited,
            ex.error,
        )
        self.history.append(report)
        return report

    async def _exchange(self, ex: Exchange) -> None:
        """Run `communicate` for one exchange (trio side); on CollectiveError proceed alone."""
        try:
            ex.result = await self.communicate(
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
            self.needs_resync = True
            ex.error = str(e) or type(e).__name__
            me = self.collective.peer_id
            ex.result = ReduceResult(ex.tensors, (me,), b"", 0, 0, {})
        ex.finished = time.monotonic()
        ex.done.set()

    # -- drivers: run the round logic's async calls on the trio side --------------------------

    def _drive_from_thread(self, gen: Generator[_Call, Any, list[RoundReport]]) -> list[RoundReport]:
        value: Any = None
        # In a `trio.to_thread` worker, call back without the token: the call then runs in the
        # caller's task, so cancelling that task (a node shutting down) cancels the exchange too.
        kw = {"trio_token": self._token} if self._token is not None and not _in_trio_worker() else {}
        while True:
            try:
                call = gen.send(value)
            except StopIteration as stop:
                reports: list[RoundReport] = stop.value
                return reports
            check_not_in_trio_thread()
            if call.spawn:
                value = trio.from_thread.run_sync(self._spawn, call, **kw)
            else:
                value = trio.from_thread.run(call.fn, *call.args, **kw)

    async def _drive_async(self, gen: Generator[_Call, Any, list[RoundReport]]) -> list[RoundReport]:
        value: Any = None
        while True:
            try:
                call = gen.send(value)
            except StopIteration as stop:
                reports: list[RoundReport] = stop.value
                return reports
            if call.spawn:
                self._spawn(call)
                value = None
            else:
                value = await call.fn(*call.args)

    def _spawn(self, call: _Call) -> None:
        if self._nursery is None:
            raise RuntimeError(
                f"{type(self).__name__} overlaps communication with training (delay="
                f"{self.delay}): enter `async with outer:` before training"
            )
        self._nursery.start_soon(call.fn, *call.args)


def exchange_tag(fragment: int) -> str:
    """The collective tag of fragment `fragment`'s exchanges."""
    return f"f{fragment}"


def _in_trio_worker() -> bool:
    try:
        trio.from_thread.check_cancelled()
    except RuntimeError:
        return False
    except trio.Cancelled:
        pass
    return True


def check_not_in_trio_thread() -> None:
    try:
        trio.lowlevel.current_trio_token()
    except RuntimeError:
        return  # a worker thread: good
    raise RuntimeError(
        "step()/finish() block; call them from a worker thread (trio.to_thread.run_sync), "
        "or use `await astep()` / `await afinish()` in the trio thread"
    )
