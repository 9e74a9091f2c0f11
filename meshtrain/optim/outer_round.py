"""How an outer optimizer's rounds reach trio, and when a round's group is formed ahead of it.

Problem. An outer round is tensor work (Δ, the outer update, the merge) around one network call
(the `Collective`'s average, a trio coroutine), due every H inner steps of a training loop that
runs torch in a worker thread. The trio loop must never run a forward pass or the outer update —
it would stop serving the network during compute — and the trainer must wait on the network only
where the algorithm says so: with overlap (Streaming DiLoCo) an exchange runs while the next inner
steps do. Over a WAN, the join of a round is a round trip the round need not wait for.

Design. Two parts that `OuterOptimizer` (outer.py) composes, each owning its state and knowing
nothing of the optimizer's hooks:

    TrioBridge        runs the round logic's async calls on the trio side, and owns the nursery
                      the exchanges overlapping training run in (the trio token, the nursery)
    RoundPreparation  times the caller's inner steps and says when the next send step's rounds
                      are due to be prepared, and which prepared ones training did not reach
                      (the moving step time, the newest step prepared)

The round logic itself (`Exchanges.advance`, outer_exchanges.py) is a generator with no I/O
inside: it decides what is due, does the tensor work inline and yields the async calls it needs
(`RoundCall`); the bridge has two drivers that run those calls — `run_from_thread` for `step()`,
`run_async` for `astep()`. One piece of logic, two ways of running it. A driver runs a call
without reading what it carries. A fragment's exchange, from its send to its merge, is an
`Exchange` (its tensors, weight, result and the event its completion sets); every completed
exchange becomes a `RoundReport`.

Threading. `step()` is called from a worker thread (`trio.to_thread.run_sync`, or any thread if
the optimizer was entered with `async with`, which records the trio token). The inner step and
every tensor operation of a round (Δ, the outer update, the merge) run in that thread; only the
collective call hops onto the trio side (`trio.from_thread.run`), so the trio loop never runs a
forward pass and keeps serving the network during compute. Steps with nothing due never touch
trio at all. Code already running in trio (simulations with `LocalSwarm`, tests) calls
`await astep()` instead — same logic, tensor work inline. An exchange that overlaps training
(`RoundCall.spawn`) starts in the bridge's nursery, which `async with outer` enters; leaving it
cancels the exchanges still in flight.

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
and the fragment (`tag="f<p>"`, `exchange_tag`): equal on every peer that follows the swarm's
step counter, and never reused.

Failures. A call that raises ends the round logic with the error, in the caller's thread: the
bridge does not catch (what a failed exchange means is the round logic's, outer_exchanges.py
"Failures"). `step()` called in the trio thread is a RuntimeError that says to use `astep()`; an
overlapping exchange spawned outside `async with outer` is a RuntimeError that says to enter it.

Not here: what a round computes (`OuterOptimizer`'s hooks, outer.py), when it is due and what
happens when this peer misses an exchange (`Exchanges`, outer_exchanges.py), the state an
optimizer keeps (outer.py, outer_state.py); the schedule's formula and rules (`RoundSchedule`,
schedule.py); which peers are in a round (the collective's membership).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Generator, Iterator
from contextlib import AsyncExitStack, contextmanager
from dataclasses import dataclass, field
from functools import partial
from typing import Any

import torch
import trio

from meshtrain.collective.contract import ReduceResult
from meshtrain.lifecycle import Service
from meshtrain.optim.schedule import RoundSchedule

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
    # Who took part by id, sorted: the round's members (weight-0 ones too: a joiner, or a peer
    # back from a re-sync, in its warm-up) and those excluded.
    peers: tuple[str, ...] = ()
    alone: bool = False  # nobody else took part: a group of one (after retries), or proceeding alone


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

    def describe(self) -> str:
        return f"the exchange of step {self.step}" + (f", fragment {self.fragment}" if self.fragment else "")


@dataclass(frozen=True)
class RoundCall:
    """A request from the round logic to run an async function on the trio side."""

    fn: Callable[..., Any]
    args: tuple[Any, ...] = ()
    spawn: bool = False  # start in the bridge's nursery instead of awaiting
    what: str = ""  # what the caller waits on, in words (`TrioBridge.awaiting`); default: fn's name

    def describe(self) -> str:
        if self.what:
            return self.what
        fn = self.fn.func if isinstance(self.fn, partial) else self.fn
        return getattr(fn, "__qualname__", None) or repr(fn)


RoundLogic = Generator[RoundCall, Any, list[RoundReport]]


class TrioBridge(Service):
    """Runs the round logic's `RoundCall`s on the trio side (module docstring, "Threading").

    owner: the optimizer's class name, for the error that says to enter `async with outer`.
    delay: τ, the inner steps an exchange overlaps with (named in that error).
    """

    def __init__(self, owner: str, delay: int) -> None:
        self.owner = owner
        self.delay = delay
        self._token: trio.lowlevel.TrioToken | None = None
        # What the caller's thread waits on now, and since when (time.monotonic()): a call that
        # blocks it, or None. Read from any thread (a status page: "the trainer waits on ...").
        self.awaiting: tuple[str, float] | None = None

    async def _start(self, stack: AsyncExitStack) -> None:
        self._token = trio.lowlevel.current_trio_token()
        self._nursery = await stack.enter_async_context(trio.open_nursery())

    def run_from_thread(self, logic: RoundLogic) -> list[RoundReport]:
        """Run `logic` in this (worker) thread, its calls on the trio side; its reports."""
        value: Any = None
        # In a `trio.to_thread` worker, call back without the token: the call then runs in the
        # caller's task, so cancelling that task (a node shutting down) cancels the exchange too.
        kw = {"trio_token": self._token} if self._token is not None and not _in_trio_worker() else {}
        while True:
            try:
                call = logic.send(value)
            except StopIteration as stop:
                reports: list[RoundReport] = stop.value
                return reports
            check_not_in_trio_thread()
            if call.spawn:
                value = trio.from_thread.run_sync(self._spawn, call, **kw)
                continue
            with self._awaiting(call):
                value = trio.from_thread.run(call.fn, *call.args, **kw)

    async def run_async(self, logic: RoundLogic) -> list[RoundReport]:
        """Run `logic` inline in the trio thread; its reports."""
        value: Any = None
        while True:
            try:
                call = logic.send(value)
            except StopIteration as stop:
                reports: list[RoundReport] = stop.value
                return reports
            if call.spawn:
                self._spawn(call)
                value = None
                continue
            with self._awaiting(call):
                value = await call.fn(*call.args)

    @contextmanager
    def _awaiting(self, call: RoundCall) -> Iterator[None]:
        """The caller waits on `call` meanwhile (`awaiting`)."""
        self.awaiting = (call.describe(), time.monotonic())
        try:
            yield
        finally:
            self.awaiting = None

    def _spawn(self, call: RoundCall) -> None:
        if self._nursery is None:
            raise RuntimeError(
                f"{self.owner} overlaps communication with training (delay="
                f"{self.delay}): enter `async with outer:` before training"
            )
        self._nursery.start_soon(call.fn, *call.args)


class RoundPreparation:
    """When the rounds of the next send step are prepared (module docstring, "Prepared rounds").

    schedule: when each fragment is sent (optim/schedule.py).
    """

    def __init__(self, schedule: RoundSchedule) -> None:
        self.schedule = schedule
        self._prepared_through = 0  # the newest send step whose rounds were prepared
        self._step_seconds: float | None = None  # the caller's inner step time, a moving average
        self._step_ended: float | None = None  # when the round logic last returned to the caller

    def step_began(self) -> None:
        """Fold the caller's time since the round logic last returned (its forward, backward and
        inner step: no exchange waits) into the moving step time."""
        if self._step_ended is not None:
            took = time.monotonic() - self._step_ended
            ema = self._step_seconds
            self._step_seconds = took if ema is None else ema + STEP_TIME_WEIGHT * (took - ema)

    def step_ended(self) -> None:
        self._step_ended = time.monotonic()

    def due(self, step: int) -> tuple[int, float] | None:
        """(the next send step after `step`, seconds until it) if its rounds are to be prepared
        now, and they count as prepared; None if not (already prepared, step time unknown, or
        due later than `PREPARE_LEAD_S`)."""
        nxt = self.schedule.next_send_step(step)
        if nxt <= self._prepared_through or self._step_seconds is None:
            return None
        within = (nxt - step) * self._step_seconds
        if within > PREPARE_LEAD_S:
            return None
        self._prepared_through = nxt
        return nxt, within

    def unreached(self, step: int) -> int | None:
        """Training ended at inner step `step`: the send step prepared beyond it, whose rounds
        will not run, or None. They count as prepared until `withdrawn`."""
        return self._prepared_through if self._prepared_through > step else None

    def withdrawn(self, step: int) -> None:
        """The rounds prepared beyond inner step `step` were unprepared."""
        self._prepared_through = min(self._prepared_through, step)


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
