"""The SkipPipe runtime: microbatches through peers, forward and back, following the scheduler.

What it does. Every peer of a pipeline run holds one stage (`stages.StageReplica`) and runs the
same iterations. At the start of an iteration each peer computes the same `Schedule` (the
scheduler is a pure function of the shared `PipelineProblem` and of the peers agreed dead), and
executes *its* visits in the order `Schedule.peer_order()` gives it — the 1F1B-like per-peer order
of the timetable. A microbatch starts at its origin (a stage-0 peer: embedding), visits the path's
block stages, returns to the origin (head + loss + backward through the head) and its gradient
retraces the path back to the origin (backward through the embedding). Compute runs in a worker
thread, one visit at a time per peer; sends run as their own tasks, so many microbatches are in
flight at once and a peer computes the next visit while its last output is still on the wire.

Wire protocol (this file is its whole story; the RPC names and the `Hop` are `hop.py`'s).
Control travels over RPC, tensors over the data plane (`TensorStreams`: encrypted,
digest-checked, back-pressured):
- `pipeline/hop` {run, it, mb, att, kind, pos, route, shape, codec}: "I am about to send you the
  activations (kind "fwd") or gradients ("bwd") of microbatch `mb`, attempt `att`, at position
  `pos` of `route`, a tensor of `shape` encoded with the run's activation codec `codec`". The
  receiver checks everything (below), starts a `receive` of exactly that payload under the tag
  `pp/<run>/<it>/<mb>/<att>/<kind>/<pos>`, and answers; the sender then sends. The payload is
  `hop_codec.py`'s (its whole story): with codec "none" the float32 tensor itself ("h"), else the
  codec's parts (e.g. int8: codes and per-block absmax, ~1/4 of the bytes); the sender encodes
  and the receiver decodes in a worker thread. The codec is also the device's edge: a stage's
  tensors live on its peer's device (`StageReplica.device`), the wire sees host tensors only.
  `route` = [origin, hop 1, ..., hop L]: position p ≤ L is route[p]; L + 1 (forward) and 0
  (backward) are the origin. A source route, so a re-planned attempt needs no state elsewhere.
- `pipeline/abandon` {run, it, mb, floor}: from the origin: attempts of `mb` below `floor` are void
  (drop their tapes, gradients and pending visits).
- `pipeline/failed` {run, it, mb, att, suspect}: to the origin: "I could not deliver `mb`".
- `pipeline/done` {run, it, final, dead, loss, count, stop}: from each origin to every peer once
  all its microbatches finished: which attempt of each microbatch counts, who it saw die, its
  loss, and whether the run should stop after this iteration.
Every field is validated with explicit checks; a bad request is answered with a `RemoteError`
whose code says why (`malformed`, `unknown-run`, `bad-codec`, `stale-iteration`,
`unknown-microbatch`, `stale-attempt`, `bad-route`, `bad-shape`, `too-large`, `duplicate`,
`not-origin`) and never reaches the compute. Payloads land in buffers of exactly the announced
shape's encoding (`receive(into=...)`), so a sender that announces one shape and sends another,
or a truncated payload, is refused by the data plane; a payload that does not decode (NaN, ±inf
or negative scales) is refused by `HopCodec.decode`, and NaN/inf inputs by the stage — both
reported to the origin as a failed hop, which re-runs the microbatch. A tensor the sender's codec
cannot encode (non-finite) is reported the same way instead of sent. Nothing from the network can
raise out of a handler or the worker.

Failures (`rerouting.py`, its whole story). The origin owns its microbatches and restarts one —
attempt + 1, from its data, on a route without the dead peer — when a peer on its route drops
its connection or a hop reports it could not deliver; a dead origin's microbatches are taken
over by the live origin with the lowest id. Only the attempts the origins list in `done` are
summed. The next iteration is scheduled without the peers the origins reported dead.

Replica sync (`sync_gradients`, the default; `iteration.py`): at the end of an iteration the
replicas of each stage all-reduce their gradient sums and microbatch counts and every replica
steps its optimizer with sum / count. Over slow links the caller may instead synchronise the
replicas with an outer optimizer every H iterations (`pipeline/replica_sync.py`).

Simulation hooks for benchmarks on one machine: `links` delays each send by latency + bytes /
bandwidth of its link (user-space throttling; with `serial`, a link's sends share its bandwidth),
`compute_floor` pads each visit to at least the scheduler's modelled compute time (forward, 1.5×
backward, 0.25× head), so a peer can be slowed.
The replica sync's all-reduce runs over the collective, which `links` does not reach: with links,
`account_sync` (called after the gradient all-reduce, and by the caller after an outer round)
waits as long as sending those bytes over the slowest link to a replica would take.

Traffic: `stats` counts hop (encoded payload) and replica-sync bytes sent; `hop_bytes_to` and
`sync_bytes_to` split them by destination (a sync's bytes evenly over the other replicas), so a
benchmark can tell the bytes that cross regions.

This module keeps the wire protocol's checks, sending, the RPC handlers, the traffic counters and
the lifecycle. `PipelineRuntime` is composed of two parts, each owning its state, that it
constructs and hands only what they need (a `Wire` of four callables into its sending side, the
run's `DeadPeers`, ...): the worker and the end of an iteration (`iteration.py`'s
`IterationWorker`) and the re-routing (`rerouting.py`'s `Rerouter`). Their background tasks run
in the runtime's nursery (`Wire.spawn`), which lives as long as the runtime (`Service`). What the
peers of a run agree on, `PipelineRun`, is `run.py`'s.

What it does not do: place stages on peers, join a swarm, checkpoint.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from contextlib import AsyncExitStack
from dataclasses import dataclass, field, replace
from typing import Any

import torch
import trio

from meshtrain.collective.allreduce import AllReduceConfig, SwarmCollective
from meshtrain.collective.compression import CodecError
from meshtrain.lifecycle import Service
from meshtrain.log import get_logger, kv
from meshtrain.pipeline.hop import (
    ABANDON_RPC,
    DONE_RPC,
    FAILED_RPC,
    HOP_RPC,
    Hop,
    at,
    sender_of,
    shape_of,
)
from meshtrain.pipeline.hop_codec import HopCodec
from meshtrain.pipeline.iteration import (
    DeadPeers,
    IterationReport,
    IterationState,
    IterationWorker,
    OriginMicrobatch,
    Wire,
)
from meshtrain.pipeline.rerouting import MAX_ATTEMPTS, Rerouter
from meshtrain.pipeline.run import MAX_RUN_CHARS, PipelineError, PipelineRun
from meshtrain.pipeline.scheduler import Link, Schedule
from meshtrain.pipeline.stages import StageReplica
from meshtrain.transport.host import Host
from meshtrain.transport.rpc import RemoteError, RpcError
from meshtrain.transport.tensor_streams import TensorStreams, TransferError
from meshtrain.transport.validate import (
    MALFORMED,
    is_int,
    require_bool,
    require_int,
    require_map,
    require_number,
    require_str,
)

log = get_logger(__name__)

LOOKAHEAD = 2  # accept messages for iterations up to this far ahead of ours (buffered)
CALL_TIMEOUT = 10.0  # control RPCs
SEND_TIMEOUT = 60.0  # one activation/gradient transfer, beyond the simulated link delay
RECEIVE_TIMEOUT = 60.0  # an announced transfer must arrive within this
CONNECT_WAIT = 20.0  # at start, how long to wait for connections to every peer of the run


class HopRejected(PipelineError):
    """A pipeline message from a peer was refused; `code` is what the sender is told."""

    def __init__(self, code: str, text: str) -> None:
        super().__init__(f"{code}: {text}")
        self.code = code
        self.text = text


# ---------------------------------------------------------------------------------------------
# Simulation hooks (module docstring)


@dataclass(frozen=True)
class SimulatedLinks:
    """User-space link throttling: a send from a to b of n bytes first waits latency + n /
    bandwidth (the scheduler's edge cost), as if the link were that slow.

    serial: False (the default): concurrent sends on one link each wait their own delay, as if
    the link's bandwidth were per transfer. True: the sends from a to b share the bandwidth — one
    transmits after the ones queued before it (`send_delay`), as on a real throttled link; the
    codec benchmark (scripts/bench/bench_skippipe.py --activation-codec) uses it.
    """

    links: Mapping[tuple[str, str], Link]
    serial: bool = False
    busy_until: dict[tuple[str, str], float] = field(default_factory=dict, compare=False, repr=False)

    def delay(self, a: str, b: str, nbytes: int) -> float:
        link = self.links.get((a, b)) or self.links.get((b, a))
        return 0.0 if link is None else link.latency + nbytes / link.bandwidth

    def send_delay(self, a: str, b: str, nbytes: int) -> float:
        """How long a send of `nbytes` from a to b starting now waits: `delay`, or with `serial`,
        its transmission queued behind the earlier sends on a → b, plus the latency."""
        link = self.links.get((a, b)) or self.links.get((b, a))
        if link is None or not self.serial:
            return self.delay(a, b, nbytes)
        now = time.monotonic()
        done = max(now, self.busy_until.get((a, b), now)) + nbytes / link.bandwidth
        self.busy_until[(a, b)] = done
        return done - now + link.latency


# ---------------------------------------------------------------------------------------------
# Message validation (pure functions: unit-testable without a network)


def _malformed(text: str) -> HopRejected:
    return HopRejected(MALFORMED, text)


def _int(v: Any, name: str, lo: int, hi: int, code: str = MALFORMED) -> int:
    """An integer field: not an integer is `malformed`; outside lo..hi is `code`."""
    require_int(v, name, error=_malformed)
    return require_int(v, name, lo, hi, error=lambda text: HopRejected(code, text))


def parse_hop(req: Any, *, run: PipelineRun, me: str, caller: str, d_model: int, current: int) -> Hop:
    """Validate a `pipeline/hop` request from `caller` to us; raise `HopRejected` with a code."""
    req = require_map(req, "run", "it", "mb", "att", "kind", "pos", "route", "shape", "codec", error=_malformed)
    if req["run"] != run.run:
        raise HopRejected("unknown-run", "not a run this peer is in")
    if require_str(req["codec"], "codec", MAX_RUN_CHARS, error=_malformed) != run.activation_codec:
        raise HopRejected("bad-codec", f"this run's activation codec is {run.activation_codec!r}, not {req['codec']!r}")
    it = _int(req["it"], "iteration", 0, 1 << 40)
    if not current <= it <= current + LOOKAHEAD:
        raise HopRejected("stale-iteration", f"iteration {it}, this peer is at {current}")
    mb = _int(req["mb"], "microbatch", 0, run.problem.microbatches - 1, "unknown-microbatch")
    att = _int(req["att"], "attempt", 0, MAX_ATTEMPTS - 1, "stale-attempt")
    kind = req["kind"]
    if kind not in ("fwd", "bwd"):
        raise HopRejected(MALFORMED, "kind must be 'fwd' or 'bwd'")
    route = req["route"]
    S = run.problem.num_stages
    if not isinstance(route, list) or not 2 <= len(route) <= S or not all(isinstance(p, str) for p in route):
        raise HopRejected("bad-route", f"a route is 2..{S} peer ids")
    route = tuple(route)
    placement = run.problem.placement
    if len(set(route)) != len(route) or any(p not in placement for p in route):
        raise HopRejected("bad-route", "route has repeated or unknown peers")
    stages = [placement[p] for p in route]
    if stages[0] != 0 or 0 in stages[1:] or len(set(stages)) != len(stages):
        raise HopRejected("bad-route", "route must start at a stage-0 peer and visit distinct block stages")
    L = len(route) - 1
    pos = _int(req["pos"], "position", 1 if kind == "fwd" else 0, L + 1 if kind == "fwd" else L, "bad-route")
    hop = Hop(it, mb, att, kind, pos, route, (0, 0, 0))
    if at(route, pos) != me:
        raise HopRejected("bad-route", "this peer is not at that position of the route")
    if sender_of(hop) != caller:
        raise HopRejected("bad-route", "the caller is not the previous hop of the route")
    shape = req["shape"]
    if not isinstance(shape, list) or len(shape) != 3 or not all(is_int(x) for x in shape):
        raise HopRejected("bad-shape", "shape must be [batch, time, d_model]")
    b, t, d = shape
    if b < 1 or t < 1 or d != d_model:
        raise HopRejected("bad-shape", f"shape {shape} is not [batch ≥ 1, time ≥ 1, {d_model}]")
    if b > run.microbatch_size or t > run.context:
        raise HopRejected("too-large", f"{shape} exceeds [{run.microbatch_size}, {run.context}, {d_model}]")
    return replace(hop, shape=(b, t, d))


# ---------------------------------------------------------------------------------------------
# The runtime


class PipelineRuntime(Service):
    """One peer's part of a pipeline run. Use as `async with PipelineRuntime(...) as rt:` inside
    a running host and data plane, then `await rt.run_iteration(i)` for i = 0, 1, ... on every
    peer of the run.

    host, streams: this peer's libp2p host and data plane; every peer of the run must be
        connected to every other (liveness is read from those connections).
    replica: the stage this peer holds (`run.problem.placement[host.peer_id]` must match); hops
        arrive on its `device` and leave it through the hop codec (`hop_codec.py`).
    run: the shared `PipelineRun`.
    data: (iteration, microbatch) -> (token ids, targets), each [microbatch_size, context];
        called on origins only. Must be a pure function so a re-run attempt sees the same data.
    links: optional `SimulatedLinks` delay before every send (benchmarks on one machine).
    compute_floor: optional seconds a forward visit takes at least on this peer (benchmarks).
    should_stop: optional (iteration, seconds of the run so far) -> bool, asked by origins at the
        end of an iteration; the run stops after an iteration any origin asked to stop at.
    keep_grads: put each iteration's averaged stage gradient in its report (tests).
    allreduce: the replica sync's `AllReduceConfig`.
    sync_gradients: all-reduce each stage's gradients among its replicas every iteration (the
        default); False: every replica steps on its own gradients, and the caller synchronises
        the replicas some other way (an outer optimizer every H iterations over `collective`,
        whose group is `replica_group`: pipeline/replica_sync.py).

    Contract on failure: a peer that dies mid-iteration costs the others at most about one
    liveness interval plus the re-run of the microbatches it held; `run_iteration` returns on
    every surviving peer. It raises `PipelineError` only when the run cannot continue at all (a
    stage with no live peer in a full-pipeline run).
    """

    def __init__(
        self,
        host: Host,
        streams: TensorStreams,
        replica: StageReplica,
        run: PipelineRun,
        data: Callable[[int, int], tuple[torch.Tensor, torch.Tensor]],
        *,
        links: SimulatedLinks | None = None,
        compute_floor: float | None = None,
        should_stop: Callable[[int, float], bool] | None = None,
        keep_grads: bool = False,
        allreduce: AllReduceConfig | None = None,
        sync_gradients: bool = True,
    ) -> None:
        me = host.peer_id
        if run.problem.placement.get(me) != replica.index:
            raise PipelineError(
                f"peer {me} is placed on stage {run.problem.placement.get(me)}, but holds stage {replica.index}"
            )
        if replica.n_stages != run.problem.num_stages:
            raise PipelineError("the replica's stage count differs from the run's")
        self.host = host
        self.streams = streams
        self.replica = replica
        self.run = run
        self.links = links
        self.hop_codec = HopCodec(run.activation_codec, replica.device)  # the host edge of every hop
        self.me = me
        self.stage = replica.index
        self.current = 0
        self._deaths = DeadPeers(me, tuple(run.problem.placement))
        self._schedules: dict[frozenset[str], Schedule] = {}
        self._iters: dict[int, IterationState] = {}
        self._nursery: trio.Nursery | None = None
        self._started = time.monotonic()
        self.collective = SwarmCollective(
            host,
            streams,
            lambda _round: self.replica_group,
            allreduce or AllReduceConfig(join_timeout=15, part_timeout=15),
        )
        self.stats = {
            "hops_sent": 0,
            "hops_received": 0,
            "rejected": 0,
            "send_failures": 0,
            "hop_bytes": 0,
            "sync_bytes": 0,
        }
        self.hop_bytes_to: dict[str, int] = {}  # bytes sent per destination peer: activations, gradients
        self.sync_bytes_to: dict[str, int] = {}  # ... and replica sync
        # The parts (iteration.py, rerouting.py) get what they need of us, and nothing else.
        wire = Wire(self._send, self._report_failure, self._broadcast, self._spawn)
        self._worker = IterationWorker(
            me,
            run,
            replica,
            data,
            self._deaths,
            self.collective,
            wire,
            self.account_sync,
            should_stop=None if should_stop is None else lambda it: should_stop(it, time.monotonic() - self._started),
            compute_floor=compute_floor,
            keep_grads=keep_grads,
            sync_gradients=sync_gradients,
        )
        self._rerouter = Rerouter(host, run, self._deaths, wire, self._iters.values, self._worker.maybe_done)

    @property
    def replica_group(self) -> tuple[str, ...]:
        """This stage's replicas as of the last iteration's end (sorted; us included; the peers
        seen dead left out): the group of the replica sync's rounds."""
        return self._worker.replica_group

    # -- lifecycle -------------------------------------------------------------------------------

    async def _start(self, stack: AsyncExitStack) -> None:
        await stack.enter_async_context(self.collective)  # the replica sync's rounds end with us
        self._nursery = await stack.enter_async_context(trio.open_nursery())
        self.host.rpc.serve(HOP_RPC, self._rpc_hop)
        self.host.rpc.serve(ABANDON_RPC, self._rpc_abandon)
        self.host.rpc.serve(FAILED_RPC, self._rpc_failed)
        self.host.rpc.serve(DONE_RPC, self._rpc_done)
        others = [p for p in self.run.problem.placement if p != self.me]
        with trio.move_on_after(CONNECT_WAIT):
            await self.host.wait_until(lambda: all(self.host.is_connected(p) for p in others))
        missing = [p for p in others if not self.host.is_connected(p)]
        if missing:
            raise PipelineError(
                f"not connected to {len(missing)} peers of run {self.run.run}; "
                "connect every peer of the run to every other first"
            )
        self._started = time.monotonic()

    # -- one iteration ---------------------------------------------------------------------------

    async def run_iteration(self, it: int) -> IterationReport:
        """Run iteration `it` (0, 1, 2, ... in turn) to completion on this peer; see the class
        docstring for what happens when peers fail."""
        if it != self.current:
            raise PipelineError(f"iterations run in turn: expected {self.current}, got {it}")
        t0 = time.monotonic()
        if it == 0:
            self._started = t0  # `should_stop` budgets count from the first iteration
        st = self._state(it)
        schedule = await self._schedule(frozenset(self._deaths.agreed))
        st.origins = tuple(sorted({p.origin for p in schedule.plans}))
        st.origin_of = {p.microbatch: p.origin for p in schedule.plans}
        st.order = list(schedule.peer_order().get(self.me, ()))
        st.remaining = set(st.order)
        for plan in schedule.plans:
            if plan.origin == self.me:
                st.mine[plan.microbatch] = OriginMicrobatch(0, (plan.origin,) + tuple(q for _, q in plan.path[1:-1]))
        st.schedule = schedule  # from here on the worker may start
        st.notify()
        if self.stage == 0 and self.me in st.origins:
            self._worker.maybe_done(st)
        async with trio.open_nursery() as nursery:
            nursery.start_soon(self._rerouter.watch_liveness, st)
            await self._worker.work(st)
            if self.me in st.done_from:
                # the others need our `done` to finish: never leave (e.g. end the run) before it
                # was delivered or failed
                await st.done_delivered.wait()
            nursery.cancel_scope.cancel()
        report = await self._worker.finish(st, t0)
        del self._iters[it]
        self.current = it + 1
        return report

    async def _schedule(self, dead: frozenset[str]) -> Schedule:
        """Every peer computes the same schedule from the same inputs; cached per dead set, and
        computed in a thread because a search takes ~0.1 s and the network must keep flowing."""
        if dead not in self._schedules:
            self._schedules[dead] = await trio.to_thread.run_sync(self.run.schedule, dead)
        return self._schedules[dead]

    def _state(self, it: int) -> IterationState:
        st = self._iters.get(it)
        if st is None:
            st = self._iters[it] = IterationState(it)
        return st

    # -- sending ---------------------------------------------------------------------------------

    def _spawn(self, fn: Callable[..., Any], *args: Any) -> None:
        """Run `fn(*args)` in the background, in our nursery (it ends with us at the latest)."""
        assert self._nursery is not None  # our own lifecycle, not peer input
        self._nursery.start_soon(fn, *args)

    def _send(self, st: IterationState, hop: Hop, tensor: torch.Tensor) -> None:
        self._spawn(self._send_hop, st, hop, tensor.detach().contiguous())

    async def _send_hop(self, st: IterationState, hop: Hop, tensor: torch.Tensor) -> None:
        to = at(hop.route, hop.pos)
        codec = self.hop_codec
        try:
            # Off the event loop unless it is no work: on a GPU the copy to the host waits for the
            # stage's queued kernels.
            payload = codec.encode(tensor) if codec.inline else await trio.to_thread.run_sync(codec.encode, tensor)
        except CodecError as e:
            # Non-finite (or, fp16, out of range): nothing the next stage could use. Tell the
            # origin, as the next stage would have on refusing it.
            self.stats["send_failures"] += 1
            log.warning(kv("pipeline hop not encodable", it=hop.it, mb=hop.mb, att=hop.att, error=str(e)))
            await self._report_failure(st, hop.mb, hop.att, self.me, hop.route)
            return
        nbytes = codec.nbytes(hop.shape)
        if self.links is not None:
            await trio.sleep(self.links.send_delay(self.me, to, nbytes))
        req = {
            "run": self.run.run,
            "it": hop.it,
            "mb": hop.mb,
            "att": hop.att,
            "kind": hop.kind,
            "pos": hop.pos,
            "route": list(hop.route),
            "shape": list(hop.shape),
            "codec": codec.name,
        }
        try:
            await self.host.rpc.call(to, HOP_RPC, req, timeout=CALL_TIMEOUT)
            await self.streams.send(to, hop.tag(self.run.run), payload, timeout=SEND_TIMEOUT)
            self.stats["hops_sent"] += 1
            self.stats["hop_bytes"] += nbytes
            self.hop_bytes_to[to] = self.hop_bytes_to.get(to, 0) + nbytes
        except (RpcError, TransferError) as e:
            self.stats["send_failures"] += 1
            if isinstance(e, RemoteError) and e.code == "stale-attempt":
                return  # the origin already re-routed this microbatch
            log.info(kv("pipeline hop failed", it=hop.it, mb=hop.mb, att=hop.att, to=to[-8:], error=str(e)))
            await self._report_failure(st, hop.mb, hop.att, to, hop.route)

    async def _report_failure(
        self, st: IterationState, mb: int, att: int, suspect: str, route: tuple[str, ...] | None
    ) -> None:
        origin = route[0] if route else st.origin_of.get(mb)
        if origin is None:
            return
        if origin == self.me:
            self._rerouter.restart(st, mb, att, {suspect})
            return
        req = {"run": self.run.run, "it": st.it, "mb": mb, "att": att, "suspect": suspect}
        try:
            await self.host.rpc.call(origin, FAILED_RPC, req, timeout=CALL_TIMEOUT)
        except RpcError as e:
            log.info(kv("pipeline failure report not delivered", origin=origin[-8:], error=str(e)))

    async def _broadcast(self, name: str, req: dict[str, Any], peers: list[str]) -> None:
        async def one(peer: str) -> None:
            try:
                await self.host.rpc.call(peer, name, req, timeout=CALL_TIMEOUT)
            except RpcError as e:
                log.info(kv("pipeline broadcast not delivered", rpc=name, peer=peer[-8:], error=str(e)))

        async with trio.open_nursery() as nursery:
            for p in peers:
                nursery.start_soon(one, p)

    async def account_sync(self, nbytes: int) -> None:
        """Count `nbytes` of replica-sync traffic we sent (split evenly over the other replicas)
        and, with simulated links, wait as long as sending them over the slowest link to a replica
        would take (module docstring, Simulation hooks). Called after the gradient all-reduce, and
        by the caller after an outer round."""
        partners = [p for p in self.replica_group if p != self.me]
        if not partners or nbytes <= 0:
            return
        self.stats["sync_bytes"] += nbytes
        for p in partners:
            self.sync_bytes_to[p] = self.sync_bytes_to.get(p, 0) + nbytes // len(partners)
        if self.links is not None:
            await trio.sleep(max(self.links.delay(self.me, p, nbytes) for p in partners))

    # -- RPC handlers ----------------------------------------------------------------------------

    def _refuse(self, e: HopRejected) -> RemoteError:
        self.stats["rejected"] += 1
        log.info(kv("pipeline message refused", code=e.code, text=e.text))
        return RemoteError(e.code, e.text)

    async def _rpc_hop(self, peer: str, req: Any) -> dict:
        try:
            hop = parse_hop(
                req, run=self.run, me=self.me, caller=peer, d_model=self.replica.d_model, current=self.current
            )
            st = self._state(hop.it)
            if hop.att < st.floor.get(hop.mb, 0):
                raise HopRejected("stale-attempt", f"attempt {hop.att} of microbatch {hop.mb} was re-routed")
            key = (hop.mb, hop.att, hop.kind, hop.pos)
            if key in st.announced:
                raise HopRejected("duplicate", "this hop was already announced")
            if self.stage == 0 and hop.route[0] != self.me:
                raise HopRejected("not-origin", "microbatches return only to their own origin")
            if hop.kind == "bwd" or self.stage == 0:
                # a gradient (or a path returning home) needs the forward it belongs to, here
                entry = st.tapes.get((hop.mb, hop.att))
                if entry is None:
                    raise HopRejected(
                        "unknown-microbatch", f"no forward of microbatch {hop.mb} attempt {hop.att} on this peer"
                    )
                if shape_of(entry[0].output) != hop.shape:
                    raise HopRejected(
                        "bad-shape", f"gradient {list(hop.shape)} for activations {list(shape_of(entry[0].output))}"
                    )
            st.announced.add(key)
        except HopRejected as e:
            raise self._refuse(e) from None
        self._spawn(self._receive_hop, st, peer, hop)
        return {"accepted": True}

    async def _receive_hop(self, st: IterationState, peer: str, hop: Hop) -> None:
        codec = self.hop_codec
        buf = codec.buffers(hop.shape)
        try:
            got = await self.streams.receive(
                peer, hop.tag(self.run.run), into=buf, max_bytes=codec.nbytes(hop.shape), timeout=RECEIVE_TIMEOUT
            )
        except TransferError as e:
            log.info(kv("pipeline transfer failed", it=hop.it, mb=hop.mb, frm=peer[-8:], error=str(e)))
            return  # the sender sees its send fail and tells the origin
        if hop.att < st.floor.get(hop.mb, 0) or st.it < self.current:
            return
        try:
            if codec.inline:
                h = codec.decode(got.tensors, hop.shape)
            else:
                h = await trio.to_thread.run_sync(codec.decode, got.tensors, hop.shape)
        except CodecError as e:
            # Delivered intact but not a valid encoding (NaN or negative scales): as for input
            # the stage refuses, this attempt is lost and its origin re-runs it.
            self.stats["rejected"] += 1
            log.warning(kv("pipeline hop payload refused", it=hop.it, mb=hop.mb, frm=peer[-8:], error=str(e)))
            await self._report_failure(st, hop.mb, hop.att, peer, hop.route)
            return
        self.stats["hops_received"] += 1
        st.inputs[(hop.mb, hop.att, hop.kind)] = (h, hop)
        st.notify()

    def _control_state(self, req: Any, *keys: str) -> tuple[dict[str, Any], IterationState]:
        req = require_map(req, "run", "it", *keys, error=_malformed)
        if req["run"] != self.run.run:
            raise HopRejected("unknown-run", "not a run this peer is in")
        it = _int(req["it"], "iteration", 0, 1 << 40)
        if not self.current <= it <= self.current + LOOKAHEAD:
            raise HopRejected("stale-iteration", f"iteration {it}, this peer is at {self.current}")
        return req, self._state(it)

    async def _rpc_abandon(self, peer: str, req: Any) -> dict:
        try:
            req, st = self._control_state(req, "mb", "floor")
            mb = _int(req["mb"], "microbatch", 0, self.run.problem.microbatches - 1, "unknown-microbatch")
            floor = _int(req["floor"], "floor", 1, MAX_ATTEMPTS, "stale-attempt")
            if self.run.problem.placement.get(peer) != 0:
                raise HopRejected("not-origin", "only an origin voids its microbatches")
            owner = st.origin_of.get(mb)
            if owner is not None and owner != peer:
                if owner not in self._deaths.seen and self.host.is_connected(owner):
                    raise HopRejected("not-origin", f"microbatch {mb} is not the caller's")
                st.origin_of[mb] = peer  # a live origin took a dead one's microbatch over
        except HopRejected as e:
            raise self._refuse(e) from None
        st.void(mb, floor)
        return {}

    async def _rpc_failed(self, peer: str, req: Any) -> dict:
        try:
            req, st = self._control_state(req, "mb", "att", "suspect")
            mb = _int(req["mb"], "microbatch", 0, self.run.problem.microbatches - 1, "unknown-microbatch")
            att = _int(req["att"], "attempt", 0, MAX_ATTEMPTS - 1, "stale-attempt")
            suspect = req["suspect"]
            if not isinstance(suspect, str) or suspect not in self.run.problem.placement:
                raise HopRejected(MALFORMED, "suspect must be a peer of the run")
            if mb not in st.mine:
                raise HopRejected("not-origin", f"microbatch {mb} does not start here")
        except HopRejected as e:
            raise self._refuse(e) from None
        if peer in st.mine[mb].route:  # only a peer on the path can know it broke
            self._rerouter.restart(st, mb, att, {suspect})
        return {}

    async def _rpc_done(self, peer: str, req: Any) -> dict:
        try:
            req, st = self._control_state(req, "final", "dead", "loss", "count", "dropped", "stop")
            if self.run.problem.placement.get(peer) != 0:
                raise HopRejected("not-origin", "only origins report an iteration done")
            M = self.run.problem.microbatches
            final, dead = req["final"], req["dead"]
            if (
                not isinstance(final, list)
                or len(final) > M
                or not all(isinstance(x, list) and len(x) == 2 for x in final)
            ):
                raise HopRejected(MALFORMED, "final must be a list of [microbatch, attempt]")
            final = [
                [
                    _int(mb, "microbatch", 0, M - 1, "unknown-microbatch"),
                    _int(att, "attempt", 0, MAX_ATTEMPTS - 1, "stale-attempt"),
                ]
                for mb, att in final
            ]
            if not isinstance(dead, list) or not all(
                isinstance(p, str) and p in self.run.problem.placement for p in dead
            ):
                raise HopRejected(MALFORMED, "dead must list peers of the run")
            loss, count = req["loss"], _int(req["count"], "count", 0, M)
            dropped = _int(req["dropped"], "dropped", 0, M)
            require_number(loss, "loss", error=_malformed)
            require_bool(req["stop"], "stop", error=_malformed)
        except HopRejected as e:
            raise self._refuse(e) from None
        st.done_from[peer] = {
            "final": final,
            "dead": dead,
            "loss": float(loss),
            "count": count,
            "dropped": dropped,
            "stop": req["stop"],
        }
        st.notify()
        return {}
