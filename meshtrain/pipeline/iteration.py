"""One pipeline iteration on one peer: its state, the worker that runs this peer's visits in the
schedule's order, and the iteration's end (commit, replica sync, optimizer step).

What it does. `IterationWorker` is the part of `PipelineRuntime` (`runtime.py`) that computes; the
runtime constructs it and hands it only what it needs: this peer's stage and data, the run's
`DeadPeers`, the replica sync's collective and the runtime's sending side (`Wire`: send a hop,
report a lost attempt, broadcast, spawn a background task). At the start of an iteration the
runtime fills an `IterationState` from the `Schedule`; the worker (`work`) then takes this
peer's next visit — re-routed work first, then the schedule's `peer_order()` — and runs it in a
worker thread: embedding on an origin, a block stage's forward, head + loss + backward through
the head back on the origin, and the backward visits that retrace the path. Each visit's output
leaves through `Wire.send`; gradients are kept per (microbatch, attempt) so that only the
attempts the origins commit are summed.

Replica sync (`sync_gradients`, the default; `finish`): at the end of an iteration the replicas of
each stage all-reduce their gradient sums and microbatch counts (`SwarmCollective`, bit-identical
on all contributors; summed on the stage's device, copied to the host for the all-reduce and back)
and every replica steps its optimizer with sum / count — synchronous data parallelism per stage, as in the
SkipPipe reference, chosen over a DiLoCo-style outer step because replicas then stay bit-identical
every iteration (a microbatch may be re-routed to any replica, so replicas must be interchangeable),
and a stage's gradients (one stage of a model) are small enough to all-reduce every iteration.
The mean is per stage over the microbatches that visited it: with skips each stage sees a
different number of microbatches, and each should take an average, not a share, of their signal.
Over slow links the caller may instead turn the per-iteration all-reduce off and synchronise the
replicas with an outer optimizer every H iterations (`pipeline/replica_sync.py`, DiLoCo or NoLoCo
per stage, over this runtime's collective): replicas then differ between two rounds, which the
re-routing tolerates (any replica computes a valid forward, just not the same bits).

Also here: the origin's `done` (`maybe_done`: which attempts count, sent to every live peer
once all its microbatches finished), the `IterationReport` that `run_iteration` returns, and
`DeadPeers`, the peers the run knows dead (seen by this peer; agreed by the origins). The replica
sync's share of the traffic and of the simulated links is the runtime's `account_sync` (runtime
docstring, Simulation hooks), which `finish` calls after the all-reduce.

Not here: the wire protocol, the RPC handlers and sending (`runtime.py`; the hop and the RPC
names: `hop.py`), what happens when a peer fails (`rerouting.py`).
"""

from __future__ import annotations

import math
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field, replace
from typing import Any, Literal

import torch
import trio

from meshtrain.collective.contract import Collective, CollectiveError, RoundRequest
from meshtrain.log import get_logger, kv
from meshtrain.models.gpt import ModelInputError
from meshtrain.pipeline.hop import DONE_RPC, Hop, sender_of, shape_of
from meshtrain.pipeline.run import PipelineRun
from meshtrain.pipeline.scheduler import BACKWARD_FACTOR, HEAD_FACTOR, Schedule
from meshtrain.pipeline.stages import StageError, StageReplica, Tape

log = get_logger(__name__)


@dataclass(frozen=True)
class IterationReport:
    """One iteration as this peer saw it.

    loss: mean training loss over the committed microbatches (all origins'), NaN if none;
    committed / dropped: microbatches that counted / were given up; restarts: attempts this peer
    (as an origin) re-routed; seconds: wall time of the iteration including the replica sync and
    the optimizer step; dead: peers reported dead so far; stop: an origin asked to stop the run.
    """

    iteration: int
    loss: float
    committed: int
    dropped: int
    restarts: int
    seconds: float
    dead: tuple[str, ...]
    stop: bool
    grads: dict[str, torch.Tensor] | None = None  # the stage's averaged gradient (keep_grads)


@dataclass
class OriginMicrobatch:
    """An origin's view of one of its microbatches."""

    att: int
    route: tuple[str, ...]
    status: Literal["running", "done", "dropped"] = "running"
    loss: float = math.nan


@dataclass
class IterationState:
    it: int
    schedule: Schedule | None = None
    order: list[tuple[int, str]] = field(default_factory=list)
    pos: int = 0
    remaining: set[tuple[int, str]] = field(default_factory=set)
    inputs: dict[tuple[int, int, str], tuple[torch.Tensor, Hop]] = field(default_factory=dict)
    restarts: list[tuple[int, int]] = field(default_factory=list)  # origin: (mb, att) to re-embed
    floor: dict[int, int] = field(default_factory=dict)  # mb -> lowest attempt still valid
    announced: set[tuple[int, int, str, int]] = field(default_factory=set)
    tapes: dict[tuple[int, int], tuple[Tape, Hop | None, torch.Tensor | None]] = field(default_factory=dict)
    grads: dict[tuple[int, int], list[torch.Tensor]] = field(default_factory=dict)
    mine: dict[int, OriginMicrobatch] = field(default_factory=dict)
    origins: tuple[str, ...] = ()
    origin_of: dict[int, str] = field(default_factory=dict)
    done_from: dict[str, dict[str, Any]] = field(default_factory=dict)
    dead_origins: set[str] = field(default_factory=set)
    restart_count: int = 0
    changed: trio.Event = field(default_factory=trio.Event)
    done_delivered: trio.Event = field(default_factory=trio.Event)

    def notify(self) -> None:
        ev, self.changed = self.changed, trio.Event()
        ev.set()

    def void(self, mb: int, floor: int) -> None:
        """Attempts of `mb` below `floor` no longer count: forget everything about them."""
        if floor <= self.floor.get(mb, 0):
            return
        self.floor[mb] = floor
        for key in [k for k in self.inputs if k[0] == mb and k[1] < floor]:
            del self.inputs[key]
        for mb_att in [k for k in self.tapes if k[0] == mb and k[1] < floor]:
            del self.tapes[mb_att]
        for mb_att in [k for k in self.grads if k[0] == mb and k[1] < floor]:
            del self.grads[mb_att]
        self.notify()

    @property
    def finished(self) -> bool:
        return self.schedule is not None and all(o in self.done_from or o in self.dead_origins for o in self.origins)


class DeadPeers:
    """The peers of a run this peer knows dead, shared by the runtime, its worker and its
    re-routing (each reads it; the re-routing and the iteration's end add to it).

    me: this peer (never dead to itself). peers: every peer of the run.
    seen: peers this peer saw die — a dropped connection, or a failed hop to a peer no longer
        connected (`rerouting.py`): routing, liveness, the `dead` of our `done`.
    agreed: peers the origins' `done` reported dead, and origins that died mid-iteration: the next
        iteration is scheduled without them. Every agreed peer is also seen.
    """

    def __init__(self, me: str, peers: tuple[str, ...]) -> None:
        self.me = me
        self.peers = peers
        self.seen: set[str] = set()
        self.agreed: set[str] = set()

    def saw(self, peers: set[str]) -> None:
        """These peers died (this peer noticed)."""
        self.seen |= peers - {self.me}

    def agree(self, peers: set[str]) -> None:
        """The origins agree these peers are dead (the end of an iteration)."""
        self.agreed |= peers - {self.me}
        self.seen |= self.agreed

    def live_others(self) -> list[str]:
        """The run's other peers not seen dead, in the run's order."""
        return [p for p in self.peers if p != self.me and p not in self.seen]


@dataclass(frozen=True)
class Wire:
    """What the worker and the re-routing use of the runtime's wire (`runtime.py`), and nothing
    else of it.

    send: (st, hop, tensor) send the tensor of `hop` to its peer, in the background; a failure is
        reported to the microbatch's origin.
    report_failure: (st, mb, att, suspect, route) tell the origin of `mb` (`route[0]`, else the
        schedule's; ourselves included) that attempt `att` was lost, `suspect` the peer to blame.
    broadcast: (rpc, request, peers) call `rpc` on every peer at once, each failure logged; returns
        when every call answered or failed.
    spawn: (fn, *args) run `fn(*args)` as a background task of the runtime (its nursery: the task
        ends with the runtime at the latest).
    """

    send: Callable[[IterationState, Hop, torch.Tensor], None]
    report_failure: Callable[[IterationState, int, int, str, tuple[str, ...] | None], Awaitable[None]]
    broadcast: Callable[[str, dict[str, Any], list[str]], Awaitable[None]]
    spawn: Callable[..., None]


class IterationWorker:
    """This peer's visits of an iteration, in the schedule's order, and the iteration's end; one
    per `PipelineRuntime`, which fills each `IterationState` from the schedule and calls `work`,
    then `finish`.

    me: this peer. run: the shared `PipelineRun` (its name, in `done` and the replica sync's tag;
        its placement: who the replicas of our stage are).
    replica: the stage this peer holds (compute, gradients, the optimizer step).
    data: (iteration, microbatch) -> (token ids, targets); called on origins only, a pure function.
    deaths: the run's `DeadPeers` (the `done` lists who we saw die; `finish` adds the agreed).
    collective: the replica sync's collective (its group is `replica_group`).
    wire: the runtime's sending side (`Wire`).
    account_sync: (nbytes) count replica-sync bytes sent and wait their simulated link time.
    should_stop: optional (iteration) -> bool, asked by an origin when it reports `done`.
    compute_floor, keep_grads, sync_gradients: as `PipelineRuntime`'s.

    replica_group: this stage's replicas as of the last iteration's end (sorted; us included; the
    peers seen dead left out).
    """

    def __init__(
        self,
        me: str,
        run: PipelineRun,
        replica: StageReplica,
        data: Callable[[int, int], tuple[torch.Tensor, torch.Tensor]],
        deaths: DeadPeers,
        collective: Collective,
        wire: Wire,
        account_sync: Callable[[int], Awaitable[None]],
        *,
        should_stop: Callable[[int], bool] | None,
        compute_floor: float | None,
        keep_grads: bool,
        sync_gradients: bool,
    ) -> None:
        self.me = me
        self.run = run
        self.replica = replica
        self.stage = replica.index
        self.data = data
        self.deaths = deaths
        self.collective = collective
        self.wire = wire
        self.account_sync = account_sync
        self.should_stop = should_stop
        self.compute_floor = compute_floor
        self.keep_grads = keep_grads
        self.sync_gradients = sync_gradients
        self.replica_group: tuple[str, ...] = (me,)

    # -- the worker: this peer's visits, in schedule order ---------------------------------------

    def _role_kind(self, wire: str) -> str:
        if self.stage == 0:
            return "head" if wire == "fwd" else "backward"
        return "forward" if wire == "fwd" else "backward"

    def _next(self, st: IterationState) -> tuple[str, int, int, tuple[torch.Tensor, Hop] | None] | None:
        """The next visit to run: re-routed work first (it is late already), then the schedule's
        order; None if the next visit in order is still waiting for its input."""
        for key in list(st.inputs):
            mb, att, wire = key
            if att < st.floor.get(mb, 0):
                del st.inputs[key]
                continue
            if att == 0 and (mb, self._role_kind(wire)) in st.remaining:
                continue  # the schedule's order will take it
            return self._role_kind(wire), mb, att, st.inputs.pop(key)
        while st.restarts:
            mb, att = st.restarts.pop(0)
            mine = st.mine.get(mb)
            if mine is not None and mine.status == "running" and mine.att == att:
                return "forward", mb, att, None
        while st.pos < len(st.order):
            mb, kind = st.order[st.pos]
            if st.floor.get(mb, 0) > 0 or st.origin_of.get(mb) in st.dead_origins:
                st.pos += 1  # re-routed or lost: the pending visit of attempt 0 will not come
                st.remaining.discard((mb, kind))
                continue
            if kind == "forward" and self.stage == 0:
                st.pos += 1
                st.remaining.discard((mb, kind))
                return "forward", mb, 0, None
            key = (mb, 0, "fwd" if kind in ("forward", "head") else "bwd")
            if key not in st.inputs:
                return None
            st.pos += 1
            st.remaining.discard((mb, kind))
            return kind, mb, 0, st.inputs.pop(key)
        return None

    async def work(self, st: IterationState) -> None:
        """Run this peer's visits of `st` until every origin's `done` arrived (or it died)."""
        while True:
            item = self._next(st)
            if item is None:
                if st.finished:
                    return
                await st.changed.wait()
                continue
            kind, mb, att, got = item
            try:
                await self._visit(st, kind, mb, att, got)
            except (StageError, ModelInputError) as e:
                # Input that passed the wire checks but not the stage's (NaN, a mismatched
                # gradient): this attempt of the microbatch is lost; its origin re-runs it.
                sender = sender_of(got[1]) if got is not None else self.me
                log.warning(kv("pipeline visit refused", it=st.it, mb=mb, att=att, kind=kind, error=str(e)))
                await self.wire.report_failure(st, mb, att, sender, got[1].route if got else None)

    async def _visit(
        self, st: IterationState, kind: str, mb: int, att: int, got: tuple[torch.Tensor, Hop] | None
    ) -> None:
        t0 = time.monotonic()
        r = self.replica
        if kind == "forward" and self.stage == 0:
            route = st.mine[mb].route
            x, y = self.data(st.it, mb)
            tape = await trio.to_thread.run_sync(r.embed, x)
            st.tapes[(mb, att)] = (tape, None, y)
            await self._pad(t0, 1.0)
            self.wire.send(st, Hop(st.it, mb, att, "fwd", 1, route, shape_of(tape.output)), tape.output)
            return
        assert got is not None  # what arrived: every visit but stage 0's forward has it
        if kind == "forward":
            h, hop = got
            tape = await trio.to_thread.run_sync(r.forward, h)
            st.tapes[(mb, att)] = (tape, hop, None)
            await self._pad(t0, 1.0)
            self.wire.send(st, replace(hop, pos=hop.pos + 1, shape=shape_of(tape.output)), tape.output)
        elif kind == "head":
            h, hop = got
            entry = st.tapes.get((mb, att))
            mine = st.mine.get(mb)
            if entry is None or mine is None or mine.att != att:
                return  # voided while it waited
            loss, grad_h, grads = await trio.to_thread.run_sync(r.head, h, entry[2])
            self._add_grads(st, mb, att, grads)
            mine.loss = loss
            await self._pad(t0, HEAD_FACTOR)
            self.wire.send(st, replace(hop, kind="bwd", pos=len(hop.route) - 1), grad_h)
        else:  # backward
            g, hop = got
            entry = st.tapes.pop((mb, att), None)
            if entry is None:
                return  # voided while it waited
            grad_in, grads = await trio.to_thread.run_sync(r.backward, entry[0], g)
            self._add_grads(st, mb, att, grads)
            await self._pad(t0, BACKWARD_FACTOR)
            if self.stage == 0:
                mine = st.mine.get(mb)
                if mine is not None and mine.att == att and mine.status == "running":
                    mine.status = "done"
                    self.maybe_done(st)
            else:
                assert grad_in is not None  # a stage after the first has an input to pass it back to
                self.wire.send(st, replace(hop, pos=hop.pos - 1), grad_in)

    async def _pad(self, t0: float, factor: float) -> None:
        """Simulated compute: make the visit last at least `compute_floor × factor` seconds."""
        if self.compute_floor:
            left = self.compute_floor * factor - (time.monotonic() - t0)
            if left > 0:
                await trio.sleep(left)

    def _add_grads(self, st: IterationState, mb: int, att: int, grads: list[torch.Tensor]) -> None:
        if att < st.floor.get(mb, 0):
            return
        acc = st.grads.get((mb, att))
        if acc is None:
            st.grads[(mb, att)] = grads
        else:
            for a, g in zip(acc, grads, strict=True):
                a.add_(g)

    # -- end of an iteration ---------------------------------------------------------------------

    def maybe_done(self, st: IterationState) -> None:
        """If we are an origin and none of our microbatches of `st` is still running: our `done`
        (which attempts count), recorded here and sent to every live peer in the background."""
        if self.me in st.done_from or any(m.status == "running" for m in st.mine.values()):
            return
        final = [[mb, m.att] for mb, m in sorted(st.mine.items()) if m.status == "done"]
        losses = [m.loss for m in st.mine.values() if m.status == "done"]
        stop = bool(self.should_stop(st.it)) if self.should_stop else False
        msg = {
            "run": self.run.run,
            "it": st.it,
            "final": final,
            "dead": sorted(self.deaths.seen),
            "loss": float(sum(losses)),
            "count": len(losses),
            "dropped": sum(m.status == "dropped" for m in st.mine.values()),
            "stop": stop,
        }
        st.done_from[self.me] = msg
        st.notify()

        async def announce() -> None:
            await self.wire.broadcast(DONE_RPC, msg, self.deaths.live_others())
            st.done_delivered.set()

        self.wire.spawn(announce)

    async def finish(self, st: IterationState, t0: float) -> IterationReport:
        """Sum the committed attempts' gradients, average them with the stage's replicas, step;
        `t0`: when the iteration started (the report's seconds)."""
        final: set[tuple[int, int]] = set()
        loss_sum, count, dropped, stop = 0.0, 0, 0, False
        agreed: set[str] = set()
        for msg in st.done_from.values():
            final |= {(mb, att) for mb, att in msg["final"]}
            loss_sum += msg["loss"]
            count += msg["count"]
            dropped += msg["dropped"]
            stop |= msg["stop"]
            agreed |= set(msg["dead"])
        self.deaths.agree(agreed | st.dead_origins)
        mine = [g for key, g in st.grads.items() if key in final]
        total = self.replica.zeros()
        for g in mine:
            for a, b in zip(total, g, strict=True):
                a.add_(b)
        n = torch.tensor([float(len(mine))])
        placement, dead = self.run.problem.placement, self.deaths.seen
        self.replica_group = tuple(
            sorted(p for p, s in placement.items() if s == self.stage and (p == self.me or p not in dead))
        )
        if self.sync_gradients and len(self.replica_group) > 1:
            # The collective sees host tensors only: the stage's gradient crosses to the host and
            # back once per iteration (a no-op on the CPU).
            tensors = {f"g{i}": t.to("cpu") for i, t in enumerate(total)} | {"count": n}
            try:
                res = await self.collective.all_reduce(RoundRequest(tensors, st.it, f"{self.run.run}/s{self.stage}"))
                total = [res.tensors[f"g{i}"].to(self.replica.device) for i in range(len(total))]
                n = res.tensors["count"]
                await self.account_sync(res.bytes_sent)
            except CollectiveError as e:
                # Cut off from our replicas: step alone rather than not at all; our replicas
                # will see a different model only if we are the one that is cut off.
                log.warning(kv("pipeline replica sync failed, stepping alone", it=st.it, error=str(e)))
        grads = None
        if float(n) > 0:
            mean = [t / float(n) for t in total]
            grads = self.replica.grads_by_name(mean) if self.keep_grads else None
            await trio.to_thread.run_sync(self.replica.apply_update, mean)
        return IterationReport(
            st.it,
            loss_sum / count if count else math.nan,
            count,
            dropped,
            st.restart_count,
            time.monotonic() - t0,
            tuple(sorted(self.deaths.seen)),
            stop,
            grads,
        )


__all__ = ["DeadPeers", "IterationReport", "IterationState", "IterationWorker", "OriginMicrobatch", "Wire"]
