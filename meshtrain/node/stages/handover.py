"""When a pipeline peer takes, publishes, backs up and hands over its stage's state.

Problem. node/stages/state.py moves a stage's state between peers (publish, fetch, back up); it
does not decide when, from whom, or what a peer does when nobody holds the state. Those choices
follow the epochs of node/stages/peer.py and read the peers' announcements
(node/stages/announce.py); they are this module's one job, so that the epoch loop stays a loop.

Design, per epoch of node/stages/peer.py (its module docstring tells the whole story):
- *Take* (`take`, before an epoch starts). A stage that is fresh here (we joined, or placement
  moved us) or whose state is behind the epoch's base step is downloaded from the epoch's peers
  on that stage that offer the base step; if none does (the stage lost its last replica), from
  whoever still holds its newest snapshot — the last epoch's peers that are leaving but still
  connected, and the stage's backer (ours, waited for up to `BACKUP_FINISH_WAIT`, if we are it).
  `joined_from` records where it came from; `from_backup` counts the backers of the last
  `RECENT_EPOCHS` epochs (a backup taken a few epochs back is still the newest snapshot). If
  nobody holds one, the stage starts from its initial weights and the log says so
  (`joined_from.initial_weights`). At base step 0 everyone starts from θ0: no download.
- *Publish* (`publish`, at every epoch end): our stage's state under its key, and `offer`.
- *Back up* (`start_backup`, as an epoch starts and at its end): for a stage with one replica,
  the peer `backers` names copies that replica's newest snapshot in the background, once the
  replica offers our step (or at once if it is gone).
- *Hand over* (`hand_over`, when stopping): the last replica of its stage, with enough peers left
  to refill it, keeps serving the stage for up to `HANDOVER_WAIT` seconds, until a peer has
  downloaded it. Its state is published as its epoch ends, which can come after the mover formed
  the next epoch: a mover finding no state while such a former replica is still connected asks
  again every `TAKE_RETRY` seconds for up to `HANDOVER_WAIT`.

Failures: a failed download falls back as above; a failed backup is logged by StageStates and
the backer keeps what it had. What is still lost is listed in node/stages/state.py.

Not here: the download protocol (node/state/sync.py), the snapshots (node/stages/state.py),
placement (pipeline/placement.py).
"""

from __future__ import annotations

from collections import deque
from typing import Any

import trio

from meshtrain.log import get_logger, kv
from meshtrain.node.phase import StopRequest
from meshtrain.node.spec.config import NodeConfig
from meshtrain.node.spec.swarm import SwarmSpec
from meshtrain.node.stages.announce import PipelineAnnouncements
from meshtrain.node.stages.state import StageStates, backers
from meshtrain.node.stages.trainer import StageTrainer
from meshtrain.pipeline.placement import stage_map
from meshtrain.transport.tensor_streams import TensorStreams

log = get_logger(__name__)

HANDOVER_WAIT = 20.0  # seconds a stopping last replica of its stage serves it for the peer moving there
HANDOVER_POLL = 0.2  # seconds between two looks at whether it was served
TAKE_RETRY = 1.0  # seconds between a mover's downloads while the stage's stopping last replica is still connected
BACKUP_FINISH_WAIT = 10.0  # seconds a mover waits for its own backup of the stage it takes, in flight
RECENT_EPOCHS = 4  # epochs whose backers count as such when a refill names where its state came from


class StageHandover:
    """A pipeline peer's stage state across epochs (module docstring).

    spec / config: the swarm's and the node's. streams: the node's data plane (the donor and
    downloads). announcements: ours and the others'. stop: the node's stop request."""

    def __init__(
        self,
        spec: SwarmSpec,
        config: NodeConfig,
        streams: TensorStreams,
        announcements: PipelineAnnouncements,
        stop: StopRequest,
    ) -> None:
        self.spec, self.config, self.stop = spec, config, stop
        self.announcements = announcements
        self.host = announcements.presence.host
        self.me = announcements.me
        self.states = StageStates(
            self.host,
            streams,
            spec.pipeline.replica_sync,
            upload_limit=config.donor_upload_mib * 2**20 or None,
            quiet=announcements.presence.heartbeats_stopped,
        )
        self.joined_from: dict[str, Any] | None = None  # how we last took a stage's state
        self.recent_placements: deque[dict[str, int]] = deque(maxlen=RECENT_EPOCHS)  # the last epochs'
        self.waiting: str | None = None

    @property
    def last_placement(self) -> dict[str, int]:
        """The placement of the last epoch that started (empty before the first)."""
        return self.recent_placements[-1] if self.recent_placements else {}

    def epoch_started(self, placement: dict[str, int]) -> None:
        self.recent_placements.append(placement)

    def donors(self, stage: int, step: int = 0) -> tuple[list[str], list[str], list[str]]:
        """Whom to ask for `stage`'s published state: (the connected peers on that stage that offer
        a state of `step` or later, those on it that do not yet, every other connected member).
        Not us: our own is `states.published`."""
        members = self.announcements.members()
        others = sorted(p for p in members if p != self.me and self.host.is_connected(p))
        on_stage = [p for p in others if members[p].stage == stage]
        replicas = [p for p in on_stage if self.announcements.of(p).get("offer", -1) >= step]
        return replicas, [p for p in on_stage if p not in replicas], others

    def publish(self, trainer: StageTrainer | None) -> None:
        """Offer our stage's state to peers that take the stage over (between two iterations)."""
        if trainer is None or trainer.needs_state:
            return
        self.states.publish(trainer.stage, trainer.step, trainer.donated_state())
        self.announcements.announce(offer=trainer.step)

    def start_backup(
        self, placement: dict[str, int], trainer: StageTrainer | None, nursery: trio.Nursery | None
    ) -> None:
        """If `backers` names us for a stage with one replica in `placement`, back that replica's
        newest snapshot (of our step) up in the background, once it announces it."""
        if not self.spec.pipeline.stage_backup or self.stop.is_set() or nursery is None or trainer is None:
            return
        mine = sorted(s for s, p in backers(placement, self.spec.pipeline.stages).items() if p == self.me)
        if mine:  # one backup per peer (`backers` doubles up only with fewer peers than stages)
            stage = mine[0]
            (replica,) = stage_map(placement, self.spec.pipeline.stages)[stage]
            step = trainer.step

            def offered() -> bool:  # ... or the replica is gone (left, or not reachable): try at once
                caps = self.announcements.of(replica)
                if not caps or not self.host.is_connected(replica):
                    return True
                # Its record must announce this stage: a mover's record from before its move still
                # offers its old stage's step (a backup from it then failed with `no_state`).
                return caps.get("stage") == stage and caps.get("offer", -1) >= step

            self.states.start_backup(nursery, stage, replica, step, offered)

    async def take(self, placement: dict[str, int], base: int, trainer: StageTrainer) -> None:
        """Before an epoch of `placement` from step `base` starts: a fresh stage, or a state behind
        `base`, is replaced by the stage's state downloaded from its replicas (module docstring)."""
        if not trainer.needs_state and trainer.step >= base:
            return
        if base == 0:  # the swarm has not trained: θ0 is every replica's state
            trainer.needs_state = False
            return
        stage = trainer.stage
        left = [p for p in self.last_placement if p not in placement and self.host.is_connected(p)]
        peers = sorted(p for p in {*placement, *left} if p != self.me)  # + the last epoch's, leaving
        replicas = [p for p in peers if placement.get(p) == stage and self.announcements.of(p).get("offer") == base]
        if not replicas:  # a backup of the stage we take may be in flight: ours, if we are its backer
            await self.states.finish_backup(stage, min(self.config.join_timeout, BACKUP_FINISH_WAIT))
        self.waiting = f"pipeline: downloading stage {stage}'s state ({len(replicas)} replica(s) offer step {base})"
        # A last replica that is stopping publishes its state as its epoch ends, which may come
        # after we formed the next epoch without it: while it is still connected, ask again for
        # up to HANDOVER_WAIT (it serves that long) rather than start the stage from θ0 (seen in CI).
        former = [p for p in left if self.last_placement.get(p) == stage]
        deadline = trio.current_time() + (HANDOVER_WAIT if former else 0.0)
        try:
            recent = (backers(p, self.spec.pipeline.stages).get(stage) for p in self.recent_placements)
            backer_peers = {b for b in recent if b is not None}
            while True:
                donated = await self.states.fetch(stage, replicas, peers, backer_peers=backer_peers)
                if (
                    donated is not None
                    or trio.current_time() >= deadline
                    or not any(self.host.is_connected(p) for p in former)
                ):
                    break
                await trio.sleep(TAKE_RETRY)
        finally:
            self.waiting = None
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

    async def hand_over(self, trainer: StageTrainer | None) -> None:
        """Stopping as the last replica of our stage, with enough peers left to refill it: keep
        serving the stage's state (published at the epoch's end) until a peer has downloaded it,
        for at most `HANDOVER_WAIT` seconds — else the stage would restart from θ0."""
        placement = self.last_placement
        if not self.stop.is_set() or trainer is None or trainer.needs_state or HANDOVER_WAIT <= 0:
            return
        if [p for p, s in placement.items() if s == trainer.stage] != [self.me] or len(
            placement
        ) <= self.spec.pipeline.stages:
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
        try:
            with trio.move_on_after(HANDOVER_WAIT):
                while self.states.donor.stats["chunks_served"] == served:
                    await trio.sleep(TAKE_RETRY)
        finally:
            self.waiting = None
