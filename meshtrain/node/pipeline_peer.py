"""A pipeline swarm's peer: the daemon's run path when the spec says `pipeline = "skippipe"`.

Problem. SkipPipe's runtime (pipeline/runtime.py) runs a fixed set of peers with a fixed stage
each, started together. A swarm has strangers that join, leave and die, and no coordinator. This
module turns the one into the other: it places this peer on a stage from the CRDT membership,
agrees with the others on *when* a placement takes effect, runs the runtime for as long as the
placement holds, synchronises its stage's replicas, and checkpoints its own stage.

Design — epochs. An *epoch* is one placement run by one `PipelineRuntime`:
1. Place. Every live trainer we are connected to (and we) is a `placement.Member` with the stage,
   forward time and step it announces in its membership record's capabilities
   (`{"stage", "fwd", "step", "epoch", "ready", "offer", "cut"}`; a peer at step 0 is fresh:
   placement may move it to even the stages out). `placement.place` gives every peer's
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

Late joiners, moved peers, refills (node/stage_state.py). At the end of every epoch a peer
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
At base step 0 everyone starts from θ0: no download.

Backups (node/stage_state.py, Backups). A crashed last replica hands nothing over, so as every
epoch starts and again at its end, for each stage with one replica, one peer of another stage
(`backers`) copies that replica's newest snapshot in the background (`_start_backup`) and offers
it under the stage's key, where a refill finds it (`joined_from.from_backup`; a mover that is the
backer uses its own copy). Cost: at most two stage downloads per such stage per epoch (one when it
stays at one replica). Still lost: a
stage whose replica dies before it ever published (the swarm's first epoch: θ0 is a fine
restart there), or whose replica and backer both die; the refill resumes at the backup's step,
losing the steps since. The spec's `stage_backup = false` turns backups off.

Checkpoints. A peer checkpoints its own stage — weights, AdamW state, the outer optimizer's state
and the step (node/stage_trainer.py: the stage and its state's forms) — every `checkpoint_every`
seconds (in the background) and when it stops; a restart resumes it and announces that stage
again, so the placement keeps it there.

Lab. With `NodeConfig.pipeline_lab` (node/pipeline_lab.py) the scheduler and the runtime use the
lab's simulated links and forward times (user-space throttling, for benchmarks on one machine).

Status: `status()` is the status document's `pipeline` section (our stage, the stage map, the
epoch, how we took our stage's state, the stage we back up, the bytes we sent to each peer, what
we wait for);
`training_status()` fills its `training` section.

A dead origin's microbatches are taken over within the iteration by the runtime (the live origin
with the lowest id re-runs them: pipeline/rerouting.py, `Rerouting._adopt`).

Export (node/pipeline_export.py). `meshtrain export` on any peer asks its running daemon for the
whole model: `request_epoch_end` announces a `cut` counter, the origins end the epoch after the
iteration in which they see it pass its value at the last epoch end, every peer publishes its
stage at that one step, and the exporter takes our stage from `states.published` and every other
stage from its replicas (`stage_donors`).

Models: whatever models/staged.py can cut (the built-in GPTs, LLaMA-family hf: / hf-config:
models); this module does not look inside the model: every peer builds it whole from the spec
and trains its stage (node/stage_trainer.py).

Not here yet (issue 18): measured links for the scheduler (every link is `DEFAULT_LINK`, or the
lab's), evaluation of the assembled model.
"""

from __future__ import annotations

import math
import statistics
import time
from collections import deque
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
from meshtrain.node.checkpoint import CheckpointStore
from meshtrain.node.config import NodeConfig
from meshtrain.node.pipeline_lab import PipelineLab
from meshtrain.node.presence import PeerPresence
from meshtrain.node.run_state import Phase, StopRequest
from meshtrain.node.stage_state import StageStates, backers
from meshtrain.node.stage_trainer import StageTrainer, checkpoint_stage
from meshtrain.node.swarm_spec import SwarmSpec
from meshtrain.node.trainer import build_model, load_data
from meshtrain.pipeline.hop_codec import HopCodec
from meshtrain.pipeline.placement import Member, announced, place, stage_map
from meshtrain.pipeline.runtime import PipelineError, PipelineRun, PipelineRuntime, SimulatedLinks
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
HANDOVER_WAIT = 20.0  # seconds a stopping last replica of its stage serves it for the peer moving there
BACKUP_FINISH_WAIT = 10.0  # seconds a mover waits for its own backup of the stage it takes, in flight
RECENT_EPOCHS = 4  # epochs whose backers count as such when a refill names where its state came from


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
        self.store = CheckpointStore(data_dir / "checkpoints", keep=config.keep_checkpoints)
        self.states = StageStates(
            self.host, streams, spec.replica_sync, upload_limit=config.donor_upload_mib * 2**20 or None
        )
        self.joined_from: dict[str, Any] | None = None  # how we last took a stage's state
        self.lab = PipelineLab.load(config.pipeline_lab) if config.pipeline_lab else None
        self.traffic: dict[str, dict[str, int]] = {"hop_bytes_to": {}, "sync_bytes_to": {}}  # ended epochs'
        self.corpus = load_data(spec, data_dir)
        self.trainer: StageTrainer | None = None
        self.runtime: PipelineRuntime | None = None
        self.epoch: Epoch | None = None
        self.last_placement: dict[str, int] = {}  # the last epoch's
        # the last few epochs' (a backup taken a few epochs back is still the newest snapshot)
        self.recent_placements: deque[dict[str, int]] = deque(maxlen=RECENT_EPOCHS)
        self.epochs = 0
        self.forward_s = 0.0
        self.waiting: str | None = None
        self.last_checkpoint: dict[str, Any] = {"last_step": None, "path": None, "saved_at": None}
        self.export: dict[str, Any] | None = None  # `meshtrain export`'s progress (node/pipeline_export.py)
        self._cuts_requested = 0  # epoch ends we asked for (announced as `cut`)
        self._cuts_served: dict[str, int] = {}  # each peer's `cut` as of the last epoch end
        self._caps: dict[str, Any] = {}
        self._background: trio.Nursery | None = None
        self._ckpt_busy = False
        self._last_ckpt = time.monotonic()
        self._t_last, self._step_last = time.monotonic(), 0

    # -- announcing --------------------------------------------------------------------------------

    def _announce(self, **changes: Any) -> None:
        caps = {**self._caps, **changes}
        if caps == self._caps:
            return
        self._caps = caps
        view = self.presence.view
        assert view is not None  # entered before us
        view.capabilities = {**view.capabilities, "pipeline": caps}  # beside the others (the proof of work)
        view.heartbeat()

    def members(self) -> dict[str, Member]:
        """Every live trainer we are connected to, and us, as placement sees them."""
        view = self.presence.view
        assert view is not None
        live = set(self.presence.candidates())
        out: dict[str, Member] = {}
        for p in view.live_peers():
            if p.peer_id not in live:
                continue
            caps = self._caps if p.peer_id == self.me else announced(p.capabilities, self.spec.stages)
            out[p.peer_id] = Member(p.peer_id, caps.get("stage"), caps.get("fwd"), fresh=caps.get("step", 0) == 0)
        return out

    def announced_stage(self, peer: PeerInfo) -> int | None:
        """The stage a member's record announces (the status page's peer list)."""
        if peer.peer_id == self.me:
            return self.trainer.stage if self.trainer is not None else None
        return announced(peer.capabilities, self.spec.stages).get("stage")

    def _announced(self, peer: str) -> dict[str, Any]:
        if peer == self.me:
            return self._caps
        view = self.presence.view
        assert view is not None
        rec = next((p for p in view.live_peers() if p.peer_id == peer), None)
        return announced(rec.capabilities, self.spec.stages) if rec is not None else {}

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
            self._publish_stage()
        elif ckpt is not None:
            log.warning(kv("ignoring a checkpoint of another pipeline cut", path=str(ckpt.path)))
        self.forward_s = await trio.to_thread.run_sync(self._measure_forward)
        view = self.presence.view
        assert view is not None
        self._announce(fwd=self.forward_s, step=self.trainer.step if self.trainer else 0, stage=stage)
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
            await self._hand_over()
        self._background = None

    async def _hand_over(self) -> None:
        """Stopping as the last replica of our stage, with enough peers left to refill it: keep
        serving the stage's state (published at the epoch's end) until a peer has downloaded it,
        for at most `HANDOVER_WAIT` seconds — else the stage would restart from θ0."""
        trainer, placement = self.trainer, self.last_placement
        if not self.stop.is_set() or trainer is None or trainer.needs_state or HANDOVER_WAIT <= 0:
            return
        if [p for p, s in placement.items() if s == trainer.stage] != [self.me] or len(placement) <= self.spec.stages:
            return
        served = self.states.donor.stats["chunks_served"]
        self.waiting = f"pipeline: handing stage {trainer.stage} over (up to {HANDOVER_WAIT:.0f} s)"
        log.warning(
            kv(
                "stopping as the last replica of this stage: serving it to the peer that takes it over",
                stage=trainer.stage,
                wait_s=HANDOVER_WAIT,
            )
        )
        with trio.move_on_after(HANDOVER_WAIT):
            while self.states.donor.stats["chunks_served"] == served:
                await trio.sleep(AGREE_POLL)
        self.waiting = None

    def _step(self) -> int:
        return self.trainer.step if self.trainer is not None else 0

    def _measure_forward(self) -> float:
        """Median seconds of one microbatch's forward through the whole model (the announced
        speed: placement puts fast peers first, the scheduler weighs paths with it). In a lab
        (node/pipeline_lab.py), the lab's simulated time instead."""
        if self.lab is not None and self.me in self.lab.forward_s:
            return self.lab.forward_s[self.me]
        model = build_model(self.spec, self.corpus.vocab_size)
        T = resolve_context(model, self.spec.context, self.spec.model)
        x, y = self.corpus.batch(self.spec.batch_size, T, seed=self.spec.seed, peer="pipeline", step=0)
        times = []
        with torch.no_grad():
            for _ in range(FORWARD_REPEATS):
                t0 = time.perf_counter()
                model(x, y)
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
        trainer = await trio.to_thread.run_sync(StageTrainer, self.spec, stage, self.corpus.vocab_size)
        if old is not None:  # the loss curve and byte counts go on across a move
            trainer.step, trainer.info.history = old.step, old.info.history
            trainer.bytes_sent, trainer.bytes_received = old.bytes_sent, old.bytes_received
        trainer.attach_sync(self._collective)
        self.trainer = trainer
        self._announce(stage=stage, offer=None)

    def _collective(self) -> Any:
        if self.runtime is None:
            raise PipelineError("no pipeline epoch is running")
        return self.runtime.collective

    async def _form(self, first: bool) -> Epoch | None:
        """Place, announce, and wait until every peer of the placement announces the same epoch
        (module docstring, 1-2); None if we were stopped first."""
        self.phase.set("syncing")
        S = self.spec.stages
        want = max(S, self.config.wait_peers) if first else S
        deadline = time.monotonic() + self.config.wait_peers_timeout
        while not self.stop.is_set():
            members = self.members()
            need = want if time.monotonic() < deadline else S
            if len(members) < need:
                self.waiting = f"pipeline: {len(members)} of {need} peers are here (each of {S} stages needs one)"
                await self.stop.sleep(AGREE_POLL)
                continue
            placement = place(members.values(), S)
            await self._take_stage(placement[self.me])
            steps = [self._announced(p).get("step", 0) for p in placement]
            fwd = {p: members[p].forward_s or 1.0 for p in placement}
            epoch = Epoch(placement, fwd, max([self._step(), *steps]))
            self._announce(epoch=epoch.key, step=self._step())
            late = [p for p in placement if p != self.me and self._announced(p).get("epoch") != epoch.key]
            if not late:
                self.waiting = None
                return epoch
            self.waiting = f"pipeline: agreeing on the stage placement with {len(late)} peer(s)"
            await self.stop.sleep(AGREE_POLL)
        return None

    def _problem(self, epoch: Epoch) -> PipelineRun:
        spec, trainer = self.spec, self.trainer
        assert trainer is not None
        peers = sorted(epoch.placement)
        hop_bytes = HopCodec(spec.activation_codec).nbytes((spec.batch_size, trainer.context, trainer.replica.d_model))
        problem = PipelineProblem(
            num_stages=spec.stages,
            placement=epoch.placement,
            forward_time=epoch.forward_s,
            links={(a, b): self._link(a, b) for i, a in enumerate(peers) for b in peers[i + 1 :]},
            activation_bytes=hop_bytes,  # what a hop sends: the scheduler's link cost
            microbatches=spec.microbatches,
            skip_ratio=spec.skip_ratio,
        )
        return PipelineRun(
            f"{self.swarm_id[-8:]}-{epoch.key[:16]}",
            problem,
            "skippipe",
            spec.batch_size,
            trainer.context,
            activation_codec=spec.activation_codec,
        )

    def _link(self, a: str, b: str) -> Link:
        return self.lab.link(a, b) if self.lab is not None else DEFAULT_LINK

    async def _run_epoch(self, epoch: Epoch, until: int) -> None:
        trainer = self.trainer
        assert trainer is not None
        spec = self.spec
        await self._take_stage_state(epoch, trainer)
        if trainer.sync is not None:
            trainer.sync.outer.inner_steps = trainer.step  # round ids are the swarm's step
        base = trainer.step

        def data(it: int, mb: int) -> tuple[torch.Tensor, torch.Tensor]:
            return self.corpus.batch(
                spec.batch_size, trainer.context, seed=spec.seed, peer="pipeline", step=base + it, microbatch=mb
            )

        def should_stop(it: int, _elapsed: float) -> bool:
            if self.stop.is_set() or (until and base + it + 1 >= until) or self._cut_wanted(epoch):
                return True
            return place(self.members().values(), spec.stages) != epoch.placement

        run = self._problem(epoch)
        allreduce = AllReduceConfig(join_timeout=self.config.join_timeout, part_timeout=self.config.part_timeout)
        self.epoch = epoch
        self.last_placement = epoch.placement
        self.recent_placements.append(epoch.placement)
        self.epochs += 1
        # A stage this placement leaves with one replica is backed up now, from the snapshot its
        # replica published as the last epoch ended: else it would be unprotected until this
        # epoch's end, and a crash before then (the bench's kill run) would lose it.
        self._start_backup(epoch)
        log.warning(
            kv(
                "pipeline epoch",
                epoch=epoch.key[:12],
                stage=trainer.stage,
                step=base,
                peers=len(epoch.placement),
                stages="/".join(str(len(x)) for x in stage_map(epoch.placement, spec.stages)),
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
                        sync_gradients=spec.replica_sync == "every-step",
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
            self._cuts_served = {p: self._announced(p).get("cut", 0) for p in epoch.placement}
            self._publish_stage()
            self._start_backup(epoch)

    def request_epoch_end(self) -> int:
        """Ask the swarm to end the running epoch after its current iteration, so that every
        stage publishes its state at one step (`meshtrain export`, node/pipeline_export.py). We
        announce a counter, `cut`; an origin that sees a peer's counter pass what it was at the
        last epoch end stops the epoch (the same path as a placement change). Returns the number
        of our publishes so far: a `states.published.count` above it came after this request."""
        # Milliseconds, not 1, 2, ...: a restarted peer's first request must still pass the value
        # the others saw from it before the restart.
        self._cuts_requested = max(self._cuts_requested + 1, int(time.time() * 1000))
        self._announce(cut=self._cuts_requested)
        return self.states.published.count if self.states.published is not None else 0

    def _cut_wanted(self, epoch: Epoch) -> bool:
        return any(self._announced(p).get("cut", 0) > self._cuts_served.get(p, 0) for p in epoch.placement)

    def stage_donors(self, stage: int, step: int = 0) -> tuple[list[str], list[str], list[str]]:
        """Whom to ask for `stage`'s published state: (the connected peers on that stage that offer
        a state of `step` or later, those on it that do not yet, every other connected member).
        Not us: our own is `states.published`."""
        members = self.members()
        others = sorted(p for p in members if p != self.me and self.host.is_connected(p))
        on_stage = [p for p in others if members[p].stage == stage]
        replicas = [p for p in on_stage if self._announced(p).get("offer", -1) >= step]
        return replicas, [p for p in on_stage if p not in replicas], others

    def _publish_stage(self) -> None:
        """Offer our stage's state to peers that take the stage over (between two iterations)."""
        trainer = self.trainer
        if trainer is None or trainer.needs_state:
            return
        self.states.publish(trainer.stage, trainer.step, trainer.donated_state())
        self._announce(offer=trainer.step)

    def _start_backup(self, epoch: Epoch) -> None:
        """As an epoch starts, and at its end after publishing: if `backers` names us for a stage
        with one replica in the epoch, back that replica's newest snapshot (of our step) up in
        the background, once it announces it (node/stage_state.py, Backups)."""
        trainer = self.trainer
        if not self.spec.stage_backup or self.stop.is_set() or self._background is None or trainer is None:
            return
        mine = sorted(s for s, p in backers(epoch.placement, self.spec.stages).items() if p == self.me)
        if mine:  # one backup per peer (`backers` doubles up only with fewer peers than stages)
            (replica,) = stage_map(epoch.placement, self.spec.stages)[mine[0]]
            step = trainer.step

            def offered() -> bool:  # ... or the replica is gone (left, or not reachable): try at once
                caps = self._announced(replica)
                return not caps or caps.get("offer", -1) >= step or not self.host.is_connected(replica)

            self.states.start_backup(self._background, mine[0], replica, step, offered)

    async def _take_stage_state(self, epoch: Epoch, trainer: StageTrainer) -> None:
        """Before the epoch starts: a fresh stage, or a state behind the epoch's base step, is
        replaced by the stage's state downloaded from its replicas (module docstring)."""
        base = epoch.base_step
        if not trainer.needs_state and trainer.step >= base:
            return
        if base == 0:  # the swarm has not trained: θ0 is every replica's state
            trainer.needs_state = False
            return
        stage = trainer.stage
        left = [p for p in self.last_placement if p not in epoch.placement and self.host.is_connected(p)]
        peers = sorted(p for p in {*epoch.placement, *left} if p != self.me)  # + the last epoch's, leaving
        replicas = [p for p in peers if epoch.placement.get(p) == stage and self._announced(p).get("offer") == base]
        if not replicas:  # a backup of the stage we take may be in flight: ours, if we are its backer
            await self.states.finish_backup(stage, min(self.config.join_timeout, BACKUP_FINISH_WAIT))
        self.waiting = f"pipeline: downloading stage {stage}'s state ({len(replicas)} replica(s) offer step {base})"
        recent = (backers(placement, self.spec.stages).get(stage) for placement in self.recent_placements)
        donated = await self.states.fetch(stage, replicas, peers, backer_peers={b for b in recent if b is not None})
        why = "no peer holds it: its last replica is gone and this swarm keeps no shared checkpoints"
        if donated is not None:
            try:
                trainer.enter_donated(donated.state, at_step=base)
                why = ""
            except ValueError as e:
                why = str(e)
        if why:
            then = "starting the stage from its initial weights" if trainer.needs_state else "training on our own state"
            log.warning(kv(f"cannot take stage {stage}'s state ({why}); {then}", stage=stage, step=base))
            if trainer.needs_state:
                self.joined_from = {"stage": stage, "step": 0, "donors": 0, "initial_weights": True}
            trainer.step, trainer.needs_state = base, False
            return
        assert donated is not None
        self.joined_from = {
            "stage": stage,
            "step": donated.step,
            "donors": len(donated.donors),
            "from_replicas": donated.from_replicas,
            "from_backup": donated.from_backup,
            "seconds": round(donated.seconds, 3),
            "bytes": donated.bytes,
            "initial_weights": False,
        }
        source = "a backup" if donated.from_backup else "a peer no longer on it"
        what = "its replicas" if donated.from_replicas else f"{source} (the stage had no replica left)"
        log.warning(kv(f"took this stage's state from {what}", **self.joined_from))

    async def _wait_ready(self, epoch: Epoch) -> None:
        """Every peer of the epoch serves its runtime: only then is iteration 0 started."""
        self._announce(ready=epoch.key)
        others = [p for p in epoch.placement if p != self.me]
        with trio.move_on_after(self.config.join_timeout):
            while True:
                late = [p for p in others if self._announced(p).get("ready") != epoch.key]
                if not late:
                    return
                members = self.members()
                if any(p not in members or self._announced(p).get("epoch") != epoch.key for p in late):
                    raise PipelineError("the placement changed before the epoch started")
                self.waiting = f"pipeline: waiting for {len(late)} peer(s) to start the epoch"
                await trio.sleep(AGREE_POLL / 2)
        raise PipelineError(f"peers of the epoch did not start it within {self.config.join_timeout:.0f} s")

    async def _iterate(self, rt: PipelineRuntime, trainer: StageTrainer) -> None:
        it = 0
        self.waiting = None
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
        rate = self.spec.batch_size * committed / max(now - self._t_last, 1e-9)
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
        view.report_progress(step=step, samples=step * self.spec.batch_size * self.spec.microbatches)
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
        None if we never held a stage."""
        if state is None:
            if self.trainer is None:
                return None
            state = self.trainer.checkpoint_state()
        step, rounds = state["step"], self.trainer.rounds if self.trainer is not None else 0
        ck = await trio.to_thread.run_sync(lambda: self.store.save(state, step=step, round=rounds))
        self.last_checkpoint = {"last_step": step, "path": str(ck.path), "saved_at": time.time()}
        return str(ck.path)

    # -- status ------------------------------------------------------------------------------------

    def status(self) -> dict[str, Any]:
        """The status document's `pipeline` section: our stage, the stage map (the running
        epoch's, else what the members announce), the epoch and what we wait for."""
        S = self.spec.stages
        if self.epoch is not None:
            placement = self.epoch.placement
        else:
            placement = {p: m.stage for p, m in self.members().items() if m.stage is not None}
        backup = self.states.backup
        return {
            "mode": self.spec.pipeline,
            "stages": S,
            "stage": self.trainer.stage if self.trainer is not None else None,
            "stage_map": stage_map(placement, S),
            "stage_cut": self.spec.stage_cut,
            "replica_sync": self.spec.replica_sync,
            "activation_codec": self.spec.activation_codec,
            "epoch": self.epoch.key if self.epoch is not None else None,
            "epochs": self.epochs,
            "forward_s": self.forward_s,
            "joined_from": self.joined_from,
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
            return {"optimizer": f"{self.spec.pipeline}/{self.spec.replica_sync}"}
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
            optimizer=f"{self.spec.pipeline}/{self.spec.replica_sync}",
            bytes_sent=trainer.bytes_sent,
            bytes_received=trainer.bytes_received,
            hops_sent=stats.get("hops_sent", 0),
        )
        return out
