"""The run state: which state a peer trains on, and keeping it — resume, download, parity,
donor publishing and checkpoints.

Problem. A peer must train on the swarm's state, not its own idea of it. At start it resumes its
checkpoint, unless the swarm is past it; then, and whenever it falls out of step (a split round,
a round spent alone, a group left behind), it downloads the swarm's state from several peers.
Meanwhile it offers its own state to joiners after every round and checkpoints in the
background, so nothing is lost on a crash.

Design. `RunState` is a `Service` over the trainer, `PeerPresence` and the data plane:
- `enter()`: resume the latest checkpoint; while cut off from the trainers our address book
  names (`PeerPresence.cut_off`: a restart whose bootstrap address is dead), wait, saying so,
  rather than train — and commit rounds — alone; wait up to `ENTER_WAIT` for the others'
  progress; download if a peer training now is past our next exchange.
- `downloads` (`SwarmDownload`, node/state/download.py): fetch the swarm's state from the parity
  winners at the front and join at their step, unless our resumed state is the front (the front
  rule, below); retried on every transient; `resync()` after we fell out of step. Once joined,
  `_joined` records φ's digest (or withholds it: the donors' round alone) and offers the joined
  state to joiners at once (a snapshot from before the download would hand them an older φ).
- `Phase` listeners: while the node trains, `PeerPresence.keep_progress_live` keeps our progress
  record fresh at every heartbeat, also while the trainer waits inside a round — else a joiner
  we wait for reads us as "not training", finds no donor, and after `ORPHAN_WAIT` (download.py)
  trains a lineage of its own.
- Parity (`node/state/parity.py`): after every round φ is hashed into our progress record — except
  after a round we proceeded alone in because it failed (`needs_resync` is set then): that φ is
  known not to be the swarm's, so no digest is published for it (`ParityMonitor.withheld`), and
  the re-sync follows before the next round. A watcher
  compares our digests with every peer that trains now. In the minority, or `BEHIND_ROUNDS`
  rounds behind the furthest connected peer (the front rule: the furthest step wins), it sets
  the outer optimizer's `needs_resync`; the node's training loop then calls
  `downloads.resync()`.
- `after_step(trainer)` runs between two steps in the trainer's thread: it records φ's digest,
  writes a checkpoint every `checkpoint_every` seconds (never while an exchange is in flight,
  nor of a state known not to be the swarm's: a round proceeded alone in, a withheld φ),
  and hops onto the trio thread to report progress and metrics, publish a finished round's state
  to joiners (`StateDonor`) and commit the checkpoint in the background (one at a time).
- `save_final()`: the checkpoint written on a clean stop — not of a state known not to be the
  swarm's either.

Memory (the budget, docs/guide.md): nothing here copies the state. The state offered to joiners
is the outer optimizer's live φ and outer state, lent to the donor (`publish(..., live=True)`)
until the next round changes them: the optimizer's `before_state_change` awaits
`StateDonor.reclaim` first, which copies the snapshot only if a joiner is fetching it; a
download reclaims it before `join` overwrites φ. A checkpoint is written from the live tensors
on the trainer's thread between two steps (`CheckpointStore.write`): training pauses for the
write (`last_checkpoint["pause_s"]`; the bytes go to the page cache, ~20 B/param with AdamW),
and digests, fsyncs and renames (`PendingCheckpoint.commit`) run in a worker thread after it.

Not here: the checkpoint format (`node/state/checkpoint.py`), downloading and re-syncing
(`node/state/download.py`), the download protocol and the donor's admission
(`node/state/sync.py`), the parity rule (`node/state/parity.py`), who is in the swarm
(`node/presence.py`).
"""

from __future__ import annotations

import math
import time
from collections.abc import Iterable
from contextlib import AsyncExitStack
from pathlib import Path
from typing import Any

import trio

from meshtrain.lifecycle import Service
from meshtrain.log import get_logger, kv
from meshtrain.node.phase import Phase, StoppedWhileStarting, StopRequest
from meshtrain.node.presence import PeerPresence
from meshtrain.node.spec.config import NodeConfig
from meshtrain.node.spec.data_dir import CHECKPOINT_DIR
from meshtrain.node.state.checkpoint import CheckpointStore, PendingCheckpoint, flatten_state
from meshtrain.node.state.donor import StateDonor
from meshtrain.node.state.download import SwarmDownload
from meshtrain.node.state.parity import PHI_WITHHELD, AloneRounds, BesideAlone, ParityMonitor, phi_digest
from meshtrain.node.trainer import TrainedState
from meshtrain.optim.outer_round import RoundReport
from meshtrain.transport.tensor_streams import TensorStreams

log = get_logger(__name__)

ENTER_WAIT = 10.0  # at start, how long to wait for the others' progress before training on our own state
PARITY_INTERVAL = 0.5  # seconds between two parity checks against the swarm's φ digests
PAUSE_ALONE_S = 30.0  # after a pause of ours, a round completed alone keeps its φ digest this long


class RunState(Service):
    """`async with RunState(trainer, presence, streams, config, ...) as run:` — see the module
    docstring. `waiting` says what the run waits for now (a download, a donor), or None."""

    def __init__(
        self,
        trainer: TrainedState,
        presence: PeerPresence,
        streams: TensorStreams,
        config: NodeConfig,
        data_dir: Path,
        *,
        phase: Phase,
        stop: StopRequest,
    ) -> None:
        self.trainer = trainer
        self.presence = presence
        self.streams = streams
        self.config = config
        self.phase = phase
        self.stop = stop
        self.store = CheckpointStore(data_dir / CHECKPOINT_DIR, keep=config.keep_checkpoints)
        self.parity = ParityMonitor(presence.me, enabled=trainer.outer.replicas_identical)
        self.donor = StateDonor(presence.host, streams, upload_limit=config.donor_upload_mib * 2**20 or None)
        trainer.outer.before_state_change.append(self.donor.reclaim)  # the lent state comes back first
        self.last_checkpoint: dict[str, Any] = {"last_step": None, "path": None, "saved_at": None}
        self.downloads = SwarmDownload(
            trainer, presence, streams, config, self.donor, self._joined, phase=phase, stop=stop
        )
        self._cut_off: str | None = None  # why we wait before training (`_wait_until_reached`)
        self._ckpt_busy = False
        self._last_ckpt_time = time.monotonic()
        self._published_round = -1
        # The newest round another trainer published a φ digest for (any record, fresh or not;
        # updated on the trio thread every `PARITY_INTERVAL`, read between steps in the trainer's):
        # -1 for none.
        self.others_phi_round = -1
        self._token: trio.lowlevel.TrioToken | None = None
        self._last_report: tuple[int, int] = (-1, -1)  # (step, fragment) of the last round counted

    @property
    def waiting(self) -> str | None:
        """What the run waits for now (reaching the swarm, a download, a donor), or None."""
        return self._cut_off or self.downloads.waiting

    @property
    def joined_from(self) -> dict[str, Any] | None:
        """How the last download went (donors, seconds, step, bytes), or None: never downloaded."""
        return self.downloads.joined_from

    async def _start(self, stack: AsyncExitStack) -> None:
        self._token = trio.lowlevel.current_trio_token()
        self._nursery = await stack.enter_async_context(trio.open_nursery())
        self._nursery.start_soon(self._watch_parity)

    # -- entering the swarm ----------------------------------------------------------------------

    async def enter(self) -> None:
        """Resume our checkpoint, or fetch the swarm's state if the swarm is past it."""
        trainer, presence = self.trainer, self.presence
        ckpt = await trio.to_thread.run_sync(self.store.load_latest)
        if ckpt is not None:
            trainer.load_checkpoint(ckpt.state)
            self.last_checkpoint = {"last_step": ckpt.step, "path": str(ckpt.path), "saved_at": None}
            log.warning(kv("resumed from checkpoint", step=ckpt.step, digest=ckpt.digest[:16]))
            self.downloads.resumed = True
        await self._wait_until_reached()
        view = presence.view
        with trio.move_on_after(ENTER_WAIT):  # let membership and progress from the others arrive
            while presence.swarm_step() is None and view is not None and len(view.live_peers()) > 1:
                await trio.sleep(0.2)
        swarm_step = presence.swarm_step()
        if swarm_step is None or swarm_step < trainer.outer.next_send_step(trainer.step):
            return  # nobody is past our next exchange: our state is the swarm's; train on from it
        await self.downloads.download()

    async def _wait_until_reached(self) -> None:
        """While our address book names trainers of the swarm that are probably still there and
        we reach none of them (a restart whose one bootstrap address is dead), do not train: every
        round would be committed alone, a fork of the swarm. Presence re-dials them (and the DHT)
        with backoff; we wait, saying so, until one answers or each is taken for gone."""
        told = False
        while (why := self.presence.cut_off()) is not None and not self.stop.is_set():
            self._cut_off = why
            if not told:
                log.warning(kv("not training alone: cut off from the swarm's known trainers", why=why))
                told = True
            await self.stop.sleep(0.25)
        self._cut_off = None
        if self.stop.is_set():
            raise StoppedWhileStarting("stopped while cut off from the swarm; nothing was trained")
        if told:
            log.warning(
                kv("reached the swarm again" if self.presence.met_swarm else "no known trainer answered; going on")
            )

    def _joined(self, withheld: bool) -> None:
        """A downloaded state was entered (trio thread, the trainer stopped): record φ's digest,
        or withhold it (`withheld`: the donors' own φ of a round they spent alone), and offer
        the state at once — a donor that kept serving its snapshot from before the download
        handed joiners a state older than its own φ (they joined a round behind, were refused as
        out of window, downloaded the old state again, and so on)."""
        trainer = self.trainer
        if withheld:
            self.parity.withhold(trainer.outer.rounds)
        else:
            self.record_phi()
        self._published_round = trainer.outer.rounds
        self.donor.inner_moments = trainer.outer.inner_moments()
        phi_withheld = self.parity.is_withheld(trainer.outer.rounds)
        self.donor.publish(*self.donor_snapshot(trainer, phi_withheld=phi_withheld), live=True)

    # -- parity ----------------------------------------------------------------------------------

    def record_phi(self) -> None:
        """Hash φ after a round (or a download) for our progress record (trainer thread or trio
        thread: the caller owns φ at that moment). Not while the outer optimizer `needs_resync`:
        we proceeded alone after a failed round (a coordinator refused our join, or vanished), so
        our φ is known not to be the swarm's, and publishing its digest as a member's of that
        round would split the round's record; the re-sync that follows at once records the
        swarm's φ instead (`ParityMonitor.withheld` counts these)."""
        if not self.parity.enabled:
            return
        if self.trainer.outer.needs_resync:
            self.parity.withhold(self.trainer.outer.rounds)
            return
        self.parity.record(self.trainer.outer.rounds, phi_digest(self.trainer.outer.outer_params))

    def _state_may_be_the_swarms(self) -> bool:
        """Whether our state may be checkpointed (trainer thread, between two steps): not after a
        round we proceeded alone in (`needs_resync`) or whose φ we withheld — ours alone beside
        the swarm's. Resumed after a crash, such a checkpoint had its φ published as the
        swarm's: a CI run's SparseLoCo peer checkpointed the round it proceeded alone in 10 ms
        before re-syncing, was killed, resumed it, and pulled its one partner — the swarm — to
        it (a parity vote of one against one). The next checkpoint is written once re-synced."""
        outer = self.trainer.outer
        return not outer.needs_resync and not self.parity.is_withheld(outer.rounds)

    def _alone_beside_the_swarm(self) -> bool:
        """Whether the round just completed in a group of one (trainer thread, between two steps)
        may be a round the swarm completed without us, so that our φ for it is not published:
        another trainer published a φ for it or a later one (`others_phi_round`, any record, even
        a dead peer's), or our own loop was paused less than `PAUSE_ALONE_S` ago (our partners
        may have gone on meanwhile). A DEBUG
        soak's peer, stopped 11 s, woke to its partner killed and nobody else training, and
        published φ for five rounds that partner had completed with others during the stop."""
        outer = self.trainer.outer
        last = outer.history[-1] if outer.history else None
        if last is None or not last.alone or last.error:
            return False
        if outer.rounds <= self.others_phi_round:
            return True
        view = self.presence.view
        woke = view.woke_at if view is not None else None
        return woke is not None and time.monotonic() - woke < PAUSE_ALONE_S

    def _note_others_phi_round(self) -> None:
        """`others_phi_round` from every progress record but ours, fresh or not (every
        `PARITY_INTERVAL`, not every step: a record is parsed per peer)."""
        view, me = self.presence.view, self.presence.me
        if view is not None:
            self.others_phi_round = max(
                (pr.phi[-1][0] for p, pr in view.progress().items() if p != me and pr.phi), default=-1
            )

    async def _watch_parity(self) -> None:
        """Compare our φ digests with every peer training now, continuously; in the minority, or
        left behind, have the training loop re-sync from the swarm, and say so."""
        trainer, parity, presence = self.trainer, self.parity, self.presence
        acted_on: int | None = None
        while True:
            await trio.sleep(PARITY_INTERVAL)
            self._note_others_phi_round()
            if self.phase.value != "training" or not parity.enabled or trainer.outer.needs_resync:
                continue
            others = {p: pr.phi for p, pr in presence.training_peers(connected=False).items()}
            verdict = parity.check(others)
            if verdict.status == "minority" and verdict.outer_round != acted_on:
                acted_on = verdict.outer_round
                parity.resyncs += 1
                log.warning(
                    kv(
                        "out of step with the swarm: φ differs from the majority's; re-syncing",
                        round=verdict.outer_round,
                        mine=verdict.mine.hex()[:16] if verdict.mine else None,
                        majority=verdict.majority.hex()[:16] if verdict.majority else None,
                        agreeing=verdict.agreeing,
                        compared=verdict.compared,
                        holders=",".join(p[-8:] for p in verdict.holders),
                    )
                )
                trainer.outer.needs_resync = True
                continue
            front = presence.front_step()
            if front is not None and front >= trainer.step + self.downloads.behind_margin():
                # A group left behind (its members restarted from old checkpoints and found each
                # other) completes rounds among itself that the swarm passed long ago; parity never
                # compares them. Catch up with the front instead.
                log.warning(kv("behind the swarm; re-syncing", step=trainer.step, swarm_step=front))
                parity.resyncs += 1
                trainer.outer.needs_resync = True

    # -- between steps, and checkpoints ----------------------------------------------------------

    @staticmethod
    def donor_snapshot(trainer: TrainedState, *, phi_withheld: bool = False) -> tuple[dict[str, Any], dict[str, Any]]:
        """What our state donor offers joiners now: (meta, tensors) of the outer state, its live
        tensors, to be lent (`publish(..., live=True)`; the caller owns φ at that moment: the
        trainer's thread between steps, or the trio thread while the trainer is stopped for a
        download). `phi_withheld`: φ is ours alone, its digest withheld (`PHI_WITHHELD`).

        The state is offered as of the step it dates from — its last merge
        (`RoundSchedule.last_merge_step`) —, not the step we are at: every peer holding it then
        offers it byte for byte alike, as a joiner's vote needs (node/state/fetch.py). Offered at
        our own step, a peer that had joined (at the swarm's step, past the round's), resumed a
        checkpoint or published a few steps late offered the same φ as a different state: a
        30-minute soak's joiners failed 39 of their 42 failed votes so ("no state is offered
        identically by 2 of the 2 donors", the same round and digest twice), one for 95 s."""
        state = trainer.donor_state()
        state["inner_steps"] = step = trainer.outer.schedule.last_merge_step(state["inner_steps"])
        skeleton, tensors = flatten_state(state)
        meta = {"skeleton": skeleton, "step": step, "round": trainer.outer.rounds}
        if phi_withheld:
            meta[PHI_WITHHELD] = True
        return meta, tensors

    def after_step(self, trainer: TrainedState) -> None:
        """Between two steps, in the trainer's thread: report, publish, checkpoint."""
        assert self._token is not None  # entered
        info, outer, parity = trainer.info, trainer.outer, self.parity
        publish = checkpoint = None
        if (
            parity.enabled
            and (not parity.history or parity.history[-1][0] != outer.rounds)
            and parity.withheld_round != outer.rounds
        ):
            if self._alone_beside_the_swarm():
                parity.withhold(outer.rounds)
            else:
                self.record_phi()  # φ is ours between steps, even with a fragment in flight
        phi = list(parity.history) if parity.enabled else None
        moments = None
        # Also while we `needs_resync` (we proceeded alone after a failed round, or parity found
        # us in the minority), though that state may not be the swarm's: a joiner's vote then
        # may disagree for a round (fetch.py), but withholding it left our offer a round old
        # while we trained on, and where every trainer needed a re-sync — two peers that each
        # went on alone — each downloaded the other's old state, entered behind, failed again,
        # and no round formed for 90 s (tests/test_daemon_matrix.py, loaded CI runs).
        if outer.rounds != self._published_round and not outer.in_flight:
            self._published_round = outer.rounds
            publish = self.donor_snapshot(trainer, phi_withheld=parity.is_withheld(outer.rounds))
            moments = outer.inner_moments()  # described to joiners beside it (optim/inner_moments.py)
        if (
            time.monotonic() - self._last_ckpt_time >= self.config.checkpoint_every
            and not self._ckpt_busy
            and not outer.in_flight
            and self._state_may_be_the_swarms()
        ):
            self._last_ckpt_time = time.monotonic()
            checkpoint = self._write_checkpoint(trainer)

        def on_trio() -> None:
            view = self.presence.view
            assert view is not None
            self._count_solo_rounds(outer.history)
            self.report_progress(phi)
            view.report_metrics(
                {
                    k: v
                    for k, v in (
                        ("loss", info.loss),
                        ("eval_loss", info.eval_loss),
                        ("samples_per_s", info.samples_per_s),
                        ("steps_per_s", info.steps_per_s),
                    )
                    if v is not None and math.isfinite(v)
                }
            )
            if publish is not None:
                self.donor.inner_moments = moments
                self.donor.publish(*publish, live=True)
            if checkpoint is not None and self._nursery is not None:
                self._ckpt_busy = True
                self._nursery.start_soon(self._commit_checkpoint, *checkpoint)

        trio.from_thread.run_sync(on_trio, trio_token=self._token)

    def report_progress(self, phi: list[tuple[int, bytes]] | None, *, announce: bool = False) -> None:
        """Our step, round and φ digests (`phi`) into the swarm's progress record (trio thread).
        `announce`: we start training (entered, or re-synced) — written at once, the trainer not
        stepping, so a peer left behind sees our step before it trains past it (the trainer's
        first report comes after its first step, which may wait inside a round)."""
        view, trainer = self.presence.view, self.trainer
        assert view is not None  # entered
        view.report_progress(
            step=trainer.step,
            samples=trainer.step * trainer.spec.data.batch_size,
            outer_round=trainer.outer.rounds,
            phi=phi,
            announce=announce,
        )

    async def announce_progress(self) -> None:
        """`report_progress(announce=True)` with our φ digests, while the trainer does not step,
        handed to a few connected peers at once (`SwarmView.hand_out`): a peer that connected to
        us as we started learns our step now, not when gossip grafts it, a second later. In
        rounds not grouped, the lowest-id candidates first: the next round's coordinator, which
        takes us into its group only once it counts us a trainer (a donor training alone, its
        rounds 0.1 s apart, formed the next one without the joiner it had just served). Where
        rounds run in groups, the lowest ids coordinate no group of ours, and every start in a
        swarm of hundreds would land on the same two peers: random ones, as gossip picks."""
        self.report_progress(list(self.parity.history) if self.parity.enabled else None, announce=True)
        presence = self.presence
        assert presence.view is not None  # entered
        grouped = presence.rounds_grouped()
        first = () if grouped else sorted(p for p in presence.candidates() if p != presence.me)
        await presence.view.hand_out(first=first)

    def _count_solo_rounds(self, history: Iterable[RoundReport]) -> None:
        """Count the rounds completed since the last call whose result was our own contribution
        alone while other trainers were in our view, and of them the solo ones — another trainer
        trained and was connected to us: a φ of our own beside a live one, which the parity rule
        must heal (trio thread; `ParityMonitor.completed_alone`; the chaos soak sums both)."""
        new = [r for r in history if (r.step, r.fragment) > self._last_report]
        if not new:
            return
        self._last_report = (new[-1].step, new[-1].fragment)
        alone = [r for r in new if r.alone]
        if not alone or not self.parity.enabled or len(self.presence.trainers()) <= 1:
            return
        # A partner further behind the rounds than the round window is refused in them (and a
        # coordinator fixes its group without it: collective/missing_peers.py `without_silent`):
        # it re-syncs before it can share them, so holds no φ of its own for them; nor does one
        # that carries our own state (parity.py `BesideAlone`).
        spec = self.trainer.spec
        presence = self.presence
        training = {
            p: pr for p, pr in presence.training_peers(connected=True).items() if presence.heard_since_connected(p)
        }
        beside = BesideAlone.of(
            {p: pr.step for p, pr in training.items()},
            min(r.step for r in alone),
            spec.round_window(),
            spec.outer.H,
            self.donor.states_taken,
        )
        me = self.presence.me
        solo = self.parity.completed_alone(AloneRounds.of(alone, me), beside.partners)
        completed = [r for r in alone if not r.error]  # a failure is logged where it fails
        if not completed:
            return
        (log.warning if solo else log.info)(
            kv(
                "outer round completed alone" + (" while peers train and are connected" if solo else ""),
                step=completed[-1].step,
                rounds=len(completed),
                dropped=",".join(sorted(p[-8:] for r in completed for p in r.peers if p != me)),
                partners=",".join(p[-8:] for p in beside.partners),
                behind=",".join(p[-8:] for p in beside.behind),
                ours=",".join(p[-8:] for p in beside.ours),
            )
        )

    def _write_checkpoint(self, trainer: TrainedState) -> tuple[PendingCheckpoint, float] | None:
        """Write a checkpoint from the live state (the trainer's thread, between two steps: the
        pause this costs is returned with it); None if the disk refused it."""
        t0 = time.monotonic()
        state = trainer.checkpoint_state()  # an FSDP peer's ranks save their inner shards now (node/ranks/sharding.py)
        step, rnd = state["outer"]["inner_steps"], state["outer"]["rounds"]
        try:
            pending = self.store.write(state, step=step, round=rnd)
        except OSError as e:
            log.warning(kv("checkpoint failed", step=step, error=str(e)))
            return None
        return pending, time.monotonic() - t0

    async def _commit_checkpoint(self, pending: PendingCheckpoint, pause: float) -> None:
        try:
            ck = await trio.to_thread.run_sync(pending.commit)
            self.last_checkpoint = {
                "last_step": ck.step,
                "path": str(ck.path),
                "saved_at": time.time(),
                "pause_s": round(pause, 3),
            }
            log.info(kv("training paused for a checkpoint", step=ck.step, pause_s=round(pause, 3)))
        except OSError as e:
            log.warning(kv("checkpoint failed", step=pending.step, error=str(e)))
        finally:
            self._ckpt_busy = False

    async def save_final(self) -> str | None:
        """The checkpoint of a clean stop (or a user's `save_checkpoint`); its path. None where our
        state is known not to be the swarm's (`_state_may_be_the_swarms`: a round proceeded alone
        in, its re-sync cut short by the stop): resumed, such a checkpoint would publish its φ as
        the swarm's, as a periodic one would have; the last periodic checkpoint stands."""
        if not self._state_may_be_the_swarms():
            log.warning(
                kv(
                    "no checkpoint of a state proceeded alone in (the re-sync did not come before the stop); "
                    "the last periodic checkpoint stands",
                    round=self.trainer.outer.rounds,
                    checkpoint=self.last_checkpoint.get("path"),
                )
            )
            return None
        state = self.trainer.checkpoint_state()
        step, rnd = (
            state["outer"]["inner_steps"],
            state["outer"]["rounds"],
        )  # the state's own (FSDP: the run end's save)
        ck = await trio.to_thread.run_sync(lambda: self.store.save(state, step=step, round=rnd))
        self.last_checkpoint = {"last_step": step, "path": str(ck.path), "saved_at": time.time()}
        return str(ck.path)
