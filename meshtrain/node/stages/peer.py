"""A pipeline swarm's peer: the daemon's run path when the spec says `pipeline = "skippipe"`.

Problem. SkipPipe's runtime (pipeline/runtime.py) runs a fixed set of peers with a fixed stage
each, started together. A swarm has strangers that join, leave and die, and no coordinator. This
module turns the one into the other: it places this peer on a stage from the CRDT membership,
agrees with the others on *when* a placement takes effect, runs the runtime for as long as the
placement holds, synchronises its stage's replicas, and checkpoints its own stage.

Design — epochs. An *epoch* is one placement run by one `PipelineRuntime`:
1. Place. Every live trainer we are connected to (and we) is a `placement.Member` with the stage,
   forward time and step it announces in its membership record's capabilities
   (node/stages/announce.py: `{"stage", "fwd", "step", "epoch", "ready", "offer", "cut"}`; a
   peer at step 0 is fresh: placement may move it to even the stages out). `placement.place` gives every peer's
   stage; if ours changed we take the new stage (fresh: its state is downloaded when the epoch
   starts, below) and announce it.
2. Agree. The epoch is the placement, the peers' forward times and the base step (the furthest
   step any of them announces); its key is a digest of all three. We announce the key as
   `epoch`; once every peer of the placement announces the same key, a peer that does not hold
   its stage's state at the base step downloads it (below), then we build the runtime
   (`PipelineRun` named after the key, so two epochs' messages never mix), announce `ready`, and
   start iteration 0 once every peer is ready (a hop that reached a peer still in the last epoch
   would be refused, and its microbatch re-routed for nothing).
3. Run. Iterations follow one another; at the end of each, every origin (stage 0) asks
   `should_stop`: our stop request, the spec's steps, or a placement that is no longer the
   epoch's (a peer joined, left or died). Any origin's "stop" ends the epoch for everyone after
   that same iteration (the runtime's `done` message), so all peers end an epoch at the same
   step and go back to 1. A peer that dies mid-iteration is re-routed around by the runtime; an
   iteration that cannot be scheduled at all (`PipelineError`: a stage left without a replica),
   or that has not finished after `ITERATION_DEADLINE_FACTOR` times the slowest recent one (at
   least `ITERATION_DEADLINE_MIN`), ends the epoch too.

Data. Origins draw microbatch m of step t as `corpus.batch(batch_size, context, seed, peer=
"pipeline", step=t, microbatch=m)`: a pure function of seed, step and microbatch, the same
whichever origin runs it. An iteration trains `microbatches` × `batch_size` sequences.

Replica sync (the spec's `replica_sync`): "every-step" is the runtime's per-iteration gradient
all-reduce among a stage's replicas; "diloco" and "noloco" run the runtime without it and an
outer optimizer per stage every H iterations over the runtime's collective
(`pipeline/replica_sync.py`: each stage's rounds have their own tag).

Hops (the spec's `activation_codec`): every activation and gradient hop of the runtime is encoded
with it (pipeline/hop_codec.py), and the scheduler's link cost is that encoded size.

Devices and precision. The stage trains on the node's `--device` (`resolve_device`, as a
data-parallel peer's: "auto" takes CUDA, then MPS, then the CPU) in the spec's precision (fp32 or
bf16 autocast; node/stages/trainer.py); its activations and gradients cross to the host at the hop
codec and to the collective at the replica sync, nowhere else. The announced forward time is
measured there too, in that precision: on the device when the whole model's weights fit in half
its free memory, else on the host (a model cut because no one device holds it is timed slower
than it runs; placement only compares peers). A stage peer is one process on one device; several
local ranks (`--nproc-per-node`) are refused (the daemon), since a stage's replicas already are
data parallelism: a machine with N GPUs runs N stage peers, one per `--device cuda:i`.

Late joiners, moved peers, refills (node/stages/handover.py decides, node/stages/state.py moves). At the end of every epoch a peer
publishes its stage's state under the stage's key in its `StateDonor` and announces the step as
`offer`. A peer whose stage is fresh (it joined, or placement moved it) or whose state is behind
the epoch's base step (a restart from an old checkpoint) downloads its stage's state before the
epoch starts, from the epoch's peers on that stage that offer the base step (their majority's
state; every-step: weights + AdamW; diloco / noloco: the outer state, entered with `join`). A
stage that lost its last replica is refilled by placement (rule 3: a peer of the most
replicated stage moves); the mover takes the newest snapshot of that stage any connected peer
still holds (the epoch's peers, and the last epoch's that are leaving but still connected;
the stage's backer, below) — a last replica that *stops* keeps serving its stage for up to
`HANDOVER_WAIT` seconds after it left, until someone downloaded it — or, if none does (the last
replica died before any backup of it was taken, and the swarm keeps no shared checkpoints),
starts the stage from its initial weights and says so.
At base step 0 everyone starts from θ0: no download. A joiner that sees a peer announce the
spec's last step came too late — the swarm is done — and ends, saying so, instead of waiting for
peers that will not come back.

Backups (node/stages/state.py, Backups). A crashed last replica hands nothing over, so as every
epoch starts and again at its end, for each stage with one replica, one peer of another stage
(`backers`) copies that replica's newest snapshot in the background and offers
it under the stage's key, where a refill finds it (`joined_from.from_backup`; a mover that is the
backer uses its own copy). Cost: at most two stage downloads per such stage per epoch (one when it
stays at one replica). Still lost: a
stage whose replica dies before it ever published (the swarm's first epoch: θ0 is a fine
restart there), or whose replica and backer both die; the refill resumes at the backup's step,
losing the steps since. The spec's `stage_backup = false` turns backups off.

Checkpoints. A peer checkpoints its own stage — weights, AdamW state, the outer optimizer's state
and the step (node/stages/trainer.py: the stage and its state's forms) — every `checkpoint_every`
seconds (in the background) and when it stops; a restart resumes it and announces that stage
again, so the placement keeps it there.

Lab. With `NodeConfig.pipeline_lab` (node/stages/lab.py) the scheduler and the runtime use the
lab's simulated links and forward times (user-space throttling, for benchmarks on one machine).

Status: `status()` is the status document's `pipeline` section (our stage, the stage map, the
epoch, how we took our stage's state, the stage we back up, the bytes we sent to each peer, what
we wait for);
`training_status()` fills its `training` section.

A dead origin's microbatches are taken over within the iteration by the runtime (the live origin
with the lowest id re-runs them: pipeline/rerouting.py, `Rerouter`).

Export (node/stages/export.py). `meshtrain export` on any peer asks its running daemon for the
whole model: `request_epoch_end` announces a `cut` counter, the origins end the epoch after the
iteration in which they see it pass its value at the last epoch end, every peer publishes its
stage at that one step, and the exporter takes our stage from `states.published` and every other
stage from its replicas (node/stages/handover.py `StageHandover.donors`).

Models: whatever models/staged.py can cut (the built-in GPTs, hf: / hf-config: models of
its transformers families); this module does not look inside the model: every peer builds it whole from the spec
and trains its stage (node/stages/trainer.py).

Not here yet: measured links for the scheduler (every link is `DEFAULT_LINK`, or the
lab's), evaluation of the assembled model.
"""

from __future__ import annotations

import math
import statistics
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import blake3
import torch
import trio

from meshtrain.collective.allreduce import AllReduceConfig
from meshtrain.crdt.swarm_view import PeerInfo
from meshtrain.log import get_logger, kv
from meshtrain.models.sources import resolve_context
from meshtrain.node.phase import Phase, StopRequest
from meshtrain.node.presence import PeerPresence
from meshtrain.node.ranks.devices import Precision, device_label, free_bytes, resolve_device, synchronize
from meshtrain.node.spec.config import NodeConfig
from meshtrain.node.spec.data_dir import CHECKPOINT_DIR
from meshtrain.node.spec.swarm import SwarmSpec
from meshtrain.node.stages.announce import PipelineAnnouncements
from meshtrain.node.stages.handover import StageHandover
from meshtrain.node.stages.lab import PipelineLab
from meshtrain.node.stages.trainer import StageTrainer, checkpoint_stage
from meshtrain.node.state.checkpoint import CheckpointStore
from meshtrain.node.trainer import build_model, load_data
from meshtrain.pipeline.hop_codec import HopCodec
from meshtrain.pipeline.placement import place, stage_map
from meshtrain.pipeline.run import PipelineError, PipelineRun
from meshtrain.pipeline.runtime import PipelineRuntime, SimulatedLinks
from meshtrain.pipeline.scheduler import Link, PipelineProblem
from meshtrain.transport.framing import packb_canonical
from meshtrain.transport.tensor_streams import TensorStreams

log = get_logger(__name__)

DEFAULT_LINK = Link(0.005, 100e6)  # what the scheduler assumes of every link until links are measured
AGREE_POLL = 0.2  # seconds between two looks at the others' announcements while forming an epoch
STOP_GRACE = 20.0  # seconds a stopping peer keeps serving its epoch before it leaves regardless
FORWARD_REPEATS = 3  # forwards timed at start (the median is announced)
ITERATION_DEADLINE_MIN = 60.0  # seconds an iteration may take at least before the epoch is given up
ITERATION_DEADLINE_FACTOR = 10.0  # ... or this many times the slowest of the last iterations


@dataclass(frozen=True)
class Epoch:
    """One placement as every peer of it runs it: peer -> stage, peer -> forward seconds, and
    the step its first iteration trains."""

    placement: dict[str, int]
    forward_s: dict[str, float]
    base_step: int

    @property
    def key(self) -> str:
        body = packb_canonical(
            {"placement": sorted(self.placement.items()), "fwd": sorted(self.forward_s.items()), "step": self.base_step}
        )
        return blake3.blake3(body).hexdigest()[:32]


class PipelinePeer:
    """The run path of a pipeline swarm's node (module docstring). Built and run by `Node`.

    spec, swarm_id: the swarm. host/presence/streams: the node's (entered). config, data_dir: the
    node's. phase, stop: the node's state and stop request.
    """

    def __init__(
        self,
        spec: SwarmSpec,
        swarm_id: str,
        presence: PeerPresence,
        streams: TensorStreams,
        config: NodeConfig,
        data_dir: Path,
        *,
        phase: Phase,
        stop: StopRequest,
    ) -> None:
        self.spec = spec
        self.swarm_id = swarm_id
        self.presence = presence
        self.host = presence.host
        self.me = presence.me
        self.streams = streams
        self.config = config
        self.phase = phase
        self.stop = stop
        self.store = CheckpointStore(data_dir / CHECKPOINT_DIR, keep=config.keep_checkpoints)
        self.announcements = PipelineAnnouncements(presence, spec.pipeline.stages)
        self.handover = StageHandover(spec, config, streams, self.announcements, stop)
        self.states = self.handover.states
        self.lab = PipelineLab.load(config.pipeline_lab) if config.pipeline_lab else None
        self.traffic: dict[str, dict[str, int]] = {"hop_bytes_to": {}, "sync_bytes_to": {}}  # ended epochs'
        self.corpus = load_data(spec, data_dir)
        self.device = resolve_device(config.device)
        self.trainer: StageTrainer | None = None
        self.runtime: PipelineRuntime | None = None
        self.epoch: Epoch | None = None
        self.epochs = 0
        self.forward_s = 0.0
        self._waiting: str | None = None  # what the epoch loop waits for (the handover says its own)
        self.last_checkpoint: dict[str, Any] = {"last_step": None, "path": None, "saved_at": None}
        self.export: dict[str, Any] | None = None  # `meshtrain export`'s progress (node/stages/export.py)
        self._cuts_requested = 0  # epoch ends we asked for (announced as `cut`)
        self._cuts_served: dict[str, int] = {}  # each peer's `cut` as of the last epoch end
        self._background: trio.Nursery | None = None
        self._ckpt_busy = False
        self._last_ckpt = time.monotonic()
        self._t_last, self._step_last = time.monotonic(), 0

    @property
    def waiting(self) -> str | None:
        """What we wait for, if anything (the status page)."""
        return self.handover.waiting or self._waiting

    @property
    def joined_from(self) -> dict[str, Any] | None:
        """How we last took a stage's state (node/stages/handover.py)."""
        return self.handover.joined_from

    def announced_stage(self, peer: PeerInfo) -> int | None:
        """The stage a member's record announces (the status page's peer list)."""
        if peer.peer_id == self.me:
            return self.trainer.stage if self.trainer is not None else None
        return self.announcements.stage_of(peer)

    # -- the run -----------------------------------------------------------------------------------

    async def run(self, until: int) -> None:
        """Train until the spec's steps (`until`, 0: forever) or a stop; epochs in turn."""
        spec = self.spec
        ckpt = await trio.to_thread.run_sync(self.store.load_latest)
        stage = checkpoint_stage(ckpt.state, spec) if ckpt is not None else None
        if stage is not None:
            await self._take_stage(stage)
            assert self.trainer is not None
            self.trainer.load_checkpoint(ckpt.state)  # type: ignore[union-attr]
            self.last_checkpoint = {"last_step": ckpt.step, "path": str(ckpt.path), "saved_at": None}  # type: ignore[union-attr]
            log.warning(kv("resumed this stage from its checkpoint", stage=stage, step=self.trainer.step))
            self.handover.publish(self.trainer)
        elif ckpt is not None:
            log.warning(kv("ignoring a checkpoint of another pipeline cut", path=str(ckpt.path)))
        self.forward_s = await trio.to_thread.run_sync(self._measure_forward)
        view = self.presence.view
        assert view is not None
        self.announcements.announce(fwd=self.forward_s, step=self.trainer.step if self.trainer else 0, stage=stage)
        view.role = "trainer"
        view.heartbeat()
        first = True
        async with trio.open_nursery() as self._background:  # background checkpoints end with the run
            while not self.stop.is_set() and (until == 0 or self._step() < until):
                epoch = await self._form(first)
                if epoch is None:
                    break
                first = False
                await self._run_epoch(epoch, until)
            self.states.cancel_backup()  # leaving: another stage's backup is no longer ours to keep
            await self.handover.hand_over(self.trainer)
        self._background = None

    def _step(self) -> int:
        return self.trainer.step if self.trainer is not None else 0

    def _measure_forward(self) -> float:
        """Median seconds of one microbatch's forward through the whole model (the announced
        speed: placement puts fast peers first, the scheduler weighs paths with it). In a lab
        (node/stages/lab.py), the lab's simulated time instead."""
        if self.lab is not None and self.me in self.lab.forward_s:
            return self.lab.forward_s[self.me]
        model = build_model(self.spec, self.corpus.vocab_size)
        T = resolve_context(model, self.spec.model.context, self.spec.model.source)
        x, y = self.corpus.batch(self.spec.data.batch_size, T, seed=self.spec.seed, peer="pipeline", step=0)
        weights = sum(p.numel() * p.element_size() for p in model.parameters())
        free = free_bytes(self.device) if self.device.type != "cpu" else None
        device = self.device if free is not None and 2 * weights <= free else torch.device("cpu")
        model, x, y = model.to(device), x.to(device), y.to(device)
        precision = Precision(self.spec.model.precision, device)
        times = []
        with torch.no_grad(), precision.autocast():
            for _ in range(FORWARD_REPEATS):
                t0 = time.perf_counter()
                model(x, y)
                synchronize(device)  # a GPU's forward is queued, not done, when the call returns
                times.append(time.perf_counter() - t0)
        return float(f"{statistics.median(times):.3g}")

    async def _take_stage(self, stage: int) -> None:
        if self.trainer is not None and self.trainer.stage == stage:
            return
        old = self.trainer
        if old is not None:
            log.warning(
                kv("moving to another stage (its state is downloaded as the epoch starts)", frm=old.stage, to=stage)
            )
        trainer = await trio.to_thread.run_sync(StageTrainer, self.spec, stage, self.corpus.vocab_size, self.device)
        if old is not None:  # the loss curve and byte counts go on across a move
            trainer.step, trainer.info.history = old.step, old.info.history
            trainer.bytes_sent, trainer.bytes_received = old.bytes_sent, old.bytes_received
        trainer.attach_sync(self._collective)
        self.trainer = trainer
        self.announcements.announce(stage=stage, offer=None)

    def _collective(self) -> Any:
        if self.runtime is None:
            raise PipelineError("no pipeline epoch is running")
        return self.runtime.collective

    async def _form(self, first: bool) -> Epoch | None:
        """Place, announce, and wait until every peer of the placement announces the same epoch
        (module docstring, 1-2); None if we were stopped first."""
        self.phase.set("syncing")
        S = self.spec.pipeline.stages
        want = max(S, self.config.wait_peers) if first else S
        deadline = time.monotonic() + self.config.wait_peers_timeout
        while not self.stop.is_set():
            members = self.announcements.members()
            if self._swarm_finished():
                return None
            need = want if time.monotonic() < deadline else S
            if len(members) < need:
                self._waiting = f"pipeline: {len(members)} of {need} peers are here (each of {S} stages needs one)"
                await self.stop.sleep(AGREE_POLL)
                continue
            placement = place(members.values(), S)
            await self._take_stage(placement[self.me])
            steps = [self.announcements.of(p).get("step", 0) for p in placement]
            fwd = {p: members[p].forward_s or 1.0 for p in placement}
            epoch = Epoch(placement, fwd, max([self._step(), *steps]))
            self.announcements.announce(epoch=epoch.key, step=self._step())
            late = [p for p in placement if p != self.me and self.announcements.of(p).get("epoch") != epoch.key]
            if not late:
                self._waiting = None
                return epoch
            self._waiting = f"pipeline: agreeing on the stage placement with {len(late)} peer(s)"
            await self.stop.sleep(AGREE_POLL)
        return None

    def _swarm_finished(self) -> bool:
        """The swarm trained all its steps before we got a stage (a late joiner that came too
        late: `PipelineAnnouncements.finished`). Waiting would be for ever: we end instead."""
        last = self.spec.steps
        if self._step() >= last:
            return False
        done = self.announcements.finished(last)
        if done is not None:
            log.warning(kv("the swarm has trained all its steps; nothing left to train here", steps=last, peer=done))
        return done is not None

    def _problem(self, epoch: Epoch) -> PipelineRun:
        spec, trainer = self.spec, self.trainer
        assert trainer is not None
        peers = sorted(epoch.placement)
        hop_bytes = HopCodec(spec.pipeline.activation_codec).nbytes(
            (spec.data.batch_size, trainer.context, trainer.replica.d_model)
        )
        problem = PipelineProblem(
            num_stages=spec.pipeline.stages,
            placement=epoch.placement,
            forward_time=epoch.forward_s,
            links={(a, b): self._link(a, b) for i, a in enumerate(peers) for b in peers[i + 1 :]},
            activation_bytes=hop_bytes,  # what a hop sends: the scheduler's link cost
            microbatches=spec.pipeline.microbatches,
            skip_ratio=spec.pipeline.skip_ratio,
        )
        return PipelineRun(
            f"{self.swarm_id[-8:]}-{epoch.key[:16]}",
            problem,
            "skippipe",
            spec.data.batch_size,
            trainer.context,
            activation_codec=spec.pipeline.activation_codec,
        )

    def _link(self, a: str, b: str) -> Link:
        return self.lab.link(a, b) if self.lab is not None else DEFAULT_LINK

    async def _run_epoch(self, epoch: Epoch, until: int) -> None:
        trainer = self.trainer
        assert trainer is not None
        spec = self.spec
        await self.handover.take(epoch.placement, epoch.base_step, trainer)
        if trainer.sync is not None:
            trainer.sync.outer.inner_steps = trainer.step  # round ids are the swarm's step
        base = trainer.step

        def data(it: int, mb: int) -> tuple[torch.Tensor, torch.Tensor]:
            return self.corpus.batch(
                spec.data.batch_size, trainer.context, seed=spec.seed, peer="pipeline", step=base + it, microbatch=mb
            )

        def should_stop(it: int, _elapsed: float) -> bool:
            if self.stop.is_set() or (until and base + it + 1 >= until) or self._cut_wanted(epoch):
                return True
            return place(self.announcements.members().values(), spec.pipeline.stages) != epoch.placement

        run = self._problem(epoch)
        allreduce = AllReduceConfig(join_timeout=self.config.join_timeout, part_timeout=self.config.part_timeout)
        self.epoch = epoch
        self.handover.epoch_started(epoch.placement)
        self.epochs += 1
        # A stage this placement leaves with one replica is backed up now, from the snapshot its
        # replica published as the last epoch ended: else it would be unprotected until this
        # epoch's end, and a crash before then (the bench's kill run) would lose it.
        self.handover.start_backup(epoch.placement, trainer, self._background)
        log.warning(
            kv(
                "pipeline epoch",
                epoch=epoch.key[:12],
                stage=trainer.stage,
                step=base,
                peers=len(epoch.placement),
                stages="/".join(str(len(x)) for x in stage_map(epoch.placement, spec.pipeline.stages)),
            )
        )
        try:
            with trio.CancelScope() as scope:
                async with trio.open_nursery() as nursery:
                    nursery.start_soon(self._leave_when_stopped, scope)
                    async with PipelineRuntime(
                        self.host,
                        self.streams,
                        trainer.replica,
                        run,
                        data,
                        should_stop=should_stop,
                        allreduce=allreduce,
                        sync_gradients=spec.pipeline.replica_sync == "every-step",
                        links=SimulatedLinks(run.problem.links) if self.lab is not None else None,
                        compute_floor=epoch.forward_s[self.me] if self.lab is not None else None,
                    ) as rt:
                        self.runtime = rt
                        await self._wait_ready(epoch)
                        self.phase.set("training")
                        await self._iterate(rt, trainer)
                    nursery.cancel_scope.cancel()
        except* PipelineError as eg:  # raised inside the nursery: it arrives in an exception group
            reason = "; ".join(str(e) for e in eg.exceptions)
            log.warning(kv("pipeline epoch ended", epoch=epoch.key[:12], reason=reason[:300]))
        finally:
            if self.runtime is not None:
                self.traffic = self._traffic()
            self.runtime = None
            self.epoch = None
            self._cuts_served = {p: self.announcements.of(p).get("cut", 0) for p in epoch.placement}
            self.handover.publish(self.trainer)
            self.handover.start_backup(epoch.placement, self.trainer, self._background)

    def request_epoch_end(self) -> int:
        """Ask the swarm to end the running epoch after its current iteration, so that every
        stage publishes its state at one step (`meshtrain export`, node/stages/export.py). We
        announce a counter, `cut`; an origin that sees a peer's counter pass what it was at the
        last epoch end stops the epoch (the same path as a placement change). Returns the number
        of our publishes so far: a `states.published.count` above it came after this request."""
        # Milliseconds, not 1, 2, ...: a restarted peer's first request must still pass the value
        # the others saw from it before the restart.
        self._cuts_requested = max(self._cuts_requested + 1, int(time.time() * 1000))
        self.announcements.announce(cut=self._cuts_requested)
        return self.states.published.count if self.states.published is not None else 0

    def _cut_wanted(self, epoch: Epoch) -> bool:
        return any(self.announcements.of(p).get("cut", 0) > self._cuts_served.get(p, 0) for p in epoch.placement)

    async def _wait_ready(self, epoch: Epoch) -> None:
        """Every peer of the epoch serves its runtime: only then is iteration 0 started."""
        self.announcements.announce(ready=epoch.key)
        others = [p for p in epoch.placement if p != self.me]
        with trio.move_on_after(self.config.join_timeout):
            while True:
                late = [p for p in others if self.announcements.of(p).get("ready") != epoch.key]
                if not late:
                    return
                members = self.announcements.members()
                if any(p not in members or self.announcements.of(p).get("epoch") != epoch.key for p in late):
                    raise PipelineError("the placement changed before the epoch started")
                self._waiting = f"pipeline: waiting for {len(late)} peer(s) to start the epoch"
                await trio.sleep(AGREE_POLL / 2)
        raise PipelineError(f"peers of the epoch did not start it within {self.config.join_timeout:.0f} s")

    async def _iterate(self, rt: PipelineRuntime, trainer: StageTrainer) -> None:
        it = 0
        self._waiting = None
        seconds: list[float] = []
        while True:
            # A watchdog: an iteration the runtime cannot finish (seen once after a SIGKILL, not
            # reproduced) ends the epoch, and the peers agree on the next, rather than hang.
            deadline = max(ITERATION_DEADLINE_MIN, ITERATION_DEADLINE_FACTOR * max(seconds[-20:], default=0.0))
            with trio.move_on_after(deadline):
                rep = await rt.run_iteration(it)
                seconds.append(rep.seconds)
            if len(seconds) <= it:
                raise PipelineError(f"iteration {trainer.step} did not complete within {deadline:.0f} s")
            it += 1
            trainer.step += 1
            if trainer.sync is not None:
                for r in await trainer.sync.after_iteration():
                    trainer.bytes_sent += r.bytes_sent
                    trainer.bytes_received += r.bytes_received
                    await rt.account_sync(r.bytes_sent)
            self._after_iteration(trainer, rep.loss, rep.committed)
            if rep.stop:
                return

    async def _leave_when_stopped(self, scope: trio.CancelScope) -> None:
        """On a stop, leave the membership (the origins then end the epoch after this iteration)
        and give the epoch `STOP_GRACE` seconds to end before leaving it regardless."""
        await self.stop.requested.wait()
        view = self.presence.view
        assert view is not None
        await view.leave()
        await trio.sleep(STOP_GRACE)
        log.warning("the epoch did not end in time after the stop; leaving it")
        scope.cancel()

    # -- after each iteration -----------------------------------------------------------------------

    def _after_iteration(self, trainer: StageTrainer, loss: float, committed: int) -> None:
        step = trainer.step
        now = time.monotonic()
        rate = self.spec.data.batch_size * committed / max(now - self._t_last, 1e-9)
        self._t_last = now
        value = loss if math.isfinite(loss) else None
        with trainer.lock:
            info = trainer.info
            info.step, info.loss, info.rounds, info.samples_per_s = step, value, trainer.rounds, rate
            info.history.append(
                {
                    "step": step,
                    "t": time.time(),
                    "loss": value,
                    "eval_loss": None,
                    "bytes_sent": trainer.bytes_sent,
                    "bytes_received": trainer.bytes_received,
                }
            )
            del info.history[:-500]
        view = self.presence.view
        assert view is not None
        view.report_progress(step=step, samples=step * self.spec.data.batch_size * self.spec.pipeline.microbatches)
        if value is not None:
            view.report_metrics({"loss": value, "samples_per_s": rate})
        if not self._ckpt_busy and now - self._last_ckpt >= self.config.checkpoint_every:
            self._last_ckpt = now
            self._ckpt_busy = True
            assert self._background is not None  # run() opened it
            self._background.start_soon(self._write_checkpoint, trainer.checkpoint_state())

    async def _write_checkpoint(self, state: dict[str, Any]) -> None:
        try:
            await self.save(state)
        except OSError as e:
            log.warning(kv("checkpoint failed", step=state["step"], error=str(e)))
        finally:
            self._ckpt_busy = False

    async def save(self, state: dict[str, Any] | None = None) -> str | None:
        """Checkpoint this stage (`state`: a snapshot taken between iterations; default: now).
        None if we never held a stage's state (none, or a taken stage still waiting for it)."""
        if state is None:
            if self.trainer is None or self.trainer.needs_state:
                return None
            state = self.trainer.checkpoint_state()
        step, rounds = state["step"], self.trainer.rounds if self.trainer is not None else 0
        ck = await trio.to_thread.run_sync(lambda: self.store.save(state, step=step, round=rounds))
        self.last_checkpoint = {"last_step": step, "path": str(ck.path), "saved_at": time.time()}
        return str(ck.path)

    # -- status ------------------------------------------------------------------------------------

    def status(self) -> dict[str, Any]:
        """The status document's `pipeline` section: our stage, the stage map (the running
        epoch's, else what the members announce), the device and precision our stage trains in,
        the epoch and what we wait for."""
        S = self.spec.pipeline.stages
        if self.epoch is not None:
            placement = self.epoch.placement
        else:
            placement = {p: m.stage for p, m in self.announcements.members().items() if m.stage is not None}
        backup = self.states.backup
        return {
            "mode": self.spec.pipeline.kind,
            "stages": S,
            "stage": self.trainer.stage if self.trainer is not None else None,
            "stage_map": stage_map(placement, S),
            "stage_cut": self.spec.pipeline.stage_cut,
            "replica_sync": self.spec.pipeline.replica_sync,
            "activation_codec": self.spec.pipeline.activation_codec,
            "device": device_label(self.device),
            "precision": self.spec.model.precision,
            "epoch": self.epoch.key if self.epoch is not None else None,
            "epochs": self.epochs,
            "forward_s": self.forward_s,
            "joined_from": self.handover.joined_from,
            "backup": {"stage": backup.stage, "step": backup.step} if backup is not None else None,
            "traffic": self._traffic(),
            "waiting": self.waiting,
            "export": self.export,
        }

    def _traffic(self) -> dict[str, dict[str, int]]:
        """Bytes we sent since start, by destination peer: pipeline hops (activations, gradients)
        and replica sync (gradient all-reduce or outer rounds) — the runtime's counters, summed
        over every epoch."""
        out = {k: dict(v) for k, v in self.traffic.items()}
        rt = self.runtime
        if rt is not None:
            for key, counts in (("hop_bytes_to", rt.hop_bytes_to), ("sync_bytes_to", rt.sync_bytes_to)):
                for p, n in counts.items():
                    out[key][p] = out[key].get(p, 0) + n
        return out

    def training_status(self) -> dict[str, Any]:
        """The `training` section's numbers (the status document's schema)."""
        trainer = self.trainer
        if trainer is None:
            return {"optimizer": f"{self.spec.pipeline.kind}/{self.spec.pipeline.replica_sync}"}
        with trainer.lock:
            info = trainer.info
            out = {
                "step": info.step,
                "round": info.rounds,
                "loss": info.loss,
                "samples_per_s": info.samples_per_s,
                "history": list(info.history),
            }
        stats = self.runtime.stats if self.runtime is not None else {}
        out.update(
            optimizer=f"{self.spec.pipeline.kind}/{self.spec.pipeline.replica_sync}",
            bytes_sent=trainer.bytes_sent,
            bytes_received=trainer.bytes_received,
            hops_sent=stats.get("hops_sent", 0),
        )
        return out
