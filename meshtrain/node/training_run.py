"""A peer's training run: from entering the swarm, once the node is up, to its `NodeResult`.

The node (node/daemon.py) has built every service — host, presence, collective, trainer,
`RunState`, status server — and hands them here. What remains is the run itself, on one of three
paths, each ending the same way: checkpoint, leave the swarm, write history.json, return a
`NodeResult`.

    `TrainingRun.train` (a data-parallel swarm, our own `Trainer`): enter ─► train in a worker
          thread until the spec's steps or a stop (after each outer round `RunState` publishes
          the state for joiners, and checkpoints every `checkpoint_every` seconds in the
          background) ─► stop ─► finish
    `TrainingRun.serve_loop` (loop mode, `meshtrain.Swarm`): hold the user's optimizer entered;
          the user's loop calls `enter_swarm` (its first step) and `resync` through the node
    `run_pipeline_peer` (a pipeline swarm): the `PipelinePeer` runs its stage in epochs, then saves

Entering: wait until the swarm's peers admit us (an allowlist swarm whose owner has not allowed
us yet: a node the others do not admit waits, and says why — the reason and the command that
admits it become the node's `startup_waiting`); resume our checkpoint, or — if the swarm is past
it — download the current state from several peers in parallel and enter at the swarm's step
(`RunState.enter`); count as a "trainer"; then wait for `wait_peers`.

Stopping (the spec's steps reached, `Node.stop()`, a signal): leave the swarm (tombstone) unless
an exchange is in flight or the step in progress may start one — a peer reaching that round after
our tombstone would leave us out and we would wait for it in vain — then let the current step
finish (and its exchange: we leave after it). A round still in flight after
`STOP_GRACE` is cancelled (the collective tells the others at once) and no final checkpoint is
written: the last periodic one stands.

Out of step: a missed round (cut off, late for its group) makes the trainer's outer optimizer ask
for a resync; we download the swarm's state again (as "syncing", or where rounds run in groups
as a trainer that keeps its place in the roster: node/roster.py) rather than drift apart.

Not here: building and wiring the services, signals, the status server and daemon.json
(node/daemon.py); which state we train on (node/state/run_state.py); the training loop
(node/trainer.py); a pipeline stage's epochs (node/stages/peer.py).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import trio

from meshtrain.crdt.swarm_view import SwarmView
from meshtrain.durable import write_atomic
from meshtrain.log import get_logger, kv
from meshtrain.node.pace import SwarmPace
from meshtrain.node.phase import Phase, StoppedWhileStarting, StopRequest
from meshtrain.node.presence import PeerPresence
from meshtrain.node.spec.config import NodeConfig
from meshtrain.node.stages.peer import PipelinePeer
from meshtrain.node.state.run_state import RunState
from meshtrain.node.trainer import TrainedState, Trainer

log = get_logger(__name__)

__all__ = ["ADMISSION_POLL", "STOP_GRACE", "NodeResult", "TrainingRun", "run_pipeline_peer"]

STOP_GRACE = 8.0  # seconds a step or round in flight may take to finish after a stop request (a loaded
# machine took over 3 s, and the stop then saved no checkpoint)
ADMISSION_POLL = 1.0  # seconds between two looks at our own admission while we are not admitted


@dataclass(frozen=True)
class NodeResult:
    peer_id: str
    step: int
    rounds: int
    eval_loss: float | None
    checkpoint: str | None
    stopped_early: bool
    skipped_steps: int = 0  # steps skipped to keep the swarm's pace (the spec's pace "swarm", node/pace.py)


class TrainingRun:
    """The run of a data-parallel swarm's peer, on services the node has built and entered.

    presence: the swarm's membership (entered: its `view` is set).
    run_state: which state we train on (resume, download, parity, checkpoints); its `trainer` is
        our `Trainer`, or the user's loop's state (loop mode), which `train`/`serve_loop` take.
    config: `wait_peers`, `wait_peers_timeout` and `join_timeout` are read here.
    data_dir: where history.json goes.
    peer_id: ours, for the result and for the command that admits us.
    phase, stop: the node's (`Node.state`, `Node.stop()`).
    on_waiting: told what entering waits for (the admission), and None once it waits no more.
    """

    def __init__(
        self,
        presence: PeerPresence,
        run_state: RunState,
        config: NodeConfig,
        data_dir: Path,
        *,
        peer_id: str,
        phase: Phase,
        stop: StopRequest,
        on_waiting: Callable[[str | None], None],
    ) -> None:
        self.presence = presence
        self.run_state = run_state
        self.config = config
        self.data_dir = data_dir
        self.peer_id = peer_id
        self.phase = phase
        self._stop = stop
        self._on_waiting = on_waiting

    async def train(self, trainer: Trainer, until: int) -> NodeResult:
        """Enter the swarm, train until step `until` (0: never) or a stop, then finish."""
        presence, run_state = self.presence, self.run_state
        view = presence.view
        assert view is not None  # entered
        stop = self._stop
        await self.enter_swarm()
        finished_cleanly = True
        async with trainer.outer:
            async with trio.open_nursery() as nursery:

                async def train() -> None:
                    async with trio.open_nursery() as pacing:
                        if trainer.spec.outer.pace == "swarm":
                            pace = SwarmPace(presence, trainer)
                            trainer.pace = pace.behind
                            pacing.start_soon(pace.run)
                        while True:
                            await trio.to_thread.run_sync(trainer.run, stop.flag, until, run_state.after_step)
                            if stop.is_set() or not trainer.outer.needs_resync:
                                break
                            # We missed a round (cut off, or late for its group): our outer state
                            # differs from the swarm's. Download it again rather than drift apart.
                            await self.resync()
                        pacing.cancel_scope.cancel()
                    stop.requested.set()

                nursery.start_soon(train)
                await stop.requested.wait()
                self.phase.set("stopping")
                stop.flag.set()
                stopped_early = until == 0 or trainer.step < until
                if stopped_early and not _exchange_near(trainer):
                    # Others stop expecting us before we finish the step. With an exchange in
                    # flight, or one the step in progress may start, we stay a member until it
                    # ends: a peer reaching that round after our tombstone would leave us out and
                    # we would wait for it in vain, past STOP_GRACE, and save nothing (seen in CI).
                    await view.leave()
                with trio.move_on_after(STOP_GRACE):
                    await _wait_done(nursery)
                if nursery.child_tasks:
                    log.warning("a round was in flight; cancelling it")
                    finished_cleanly = False
                    nursery.cancel_scope.cancel()
            if finished_cleanly:  # merge what is in flight, withdraw the joins prepared ahead
                with trio.move_on_after(STOP_GRACE):
                    await trainer.outer.afinish()
                finished_cleanly = not trainer.outer.in_flight
        return await self._finish(trainer, view, save=finished_cleanly, stopped_early=stopped_early)

    async def enter_swarm(self) -> None:
        """Wait to be admitted, resume or download the swarm's state, count as a trainer, wait
        for `wait_peers`."""
        presence = self.presence
        view = presence.view
        assert view is not None  # entered
        await self._wait_admitted()
        await self.run_state.enter()
        view.role = "trainer"
        view.heartbeat()
        await self._wait_for_peers()
        await self.run_state.announce_progress()
        self.phase.set("training")

    async def _wait_admitted(self) -> None:
        """Until the swarm's peers admit us (an allowlist swarm whose owner has not allowed us
        yet), say so and wait: they ignore our records, serve us no state and take us into no
        round."""
        told = False
        while (reason := self.presence.not_admitted()) is not None and not self._stop.is_set():
            self._on_waiting(
                f"not admitted to the swarm ({reason}): its owner admits this node with "
                f"`meshtrain swarm allow {self.peer_id}`"
            )
            if not told:
                log.warning(kv("waiting for admission", reason=reason, peer=self.peer_id))
                told = True
            await self._stop.sleep(ADMISSION_POLL)
        if self._stop.is_set():
            raise StoppedWhileStarting(
                "stopped before the swarm admitted this node" if told else "stopped while starting; nothing was trained"
            )
        self._on_waiting(None)

    async def resync(self) -> None:
        """We missed a round (cut off, late for its group) or parity says we are in the minority:
        our outer state differs from the swarm's. Download it again rather than drift apart."""
        run_state = self.run_state
        view, trainer = self.presence.view, run_state.trainer
        assert view is not None  # entered
        log.warning(kv("out of step with the swarm; downloading its state", step=trainer.step))
        if not self.presence.rounds_grouped():
            # Out of the rounds while we download. Not where rounds run in groups: they are a
            # function of the roster, and a trainer leaving it regroups every peer's rounds, each
            # when our record arrives; we keep our place, and our group waits for us as for a
            # late peer (collective/groups.py, "Failures").
            view.role = "syncing"
            view.heartbeat()
        await run_state.downloads.resync()
        view.role = "trainer"
        view.heartbeat()
        await run_state.announce_progress()
        self.phase.set("training")

    async def serve_loop(self, trainer: TrainedState, entered: trio.Event) -> NodeResult:
        """Loop mode: hold the user's optimizer entered (then set `entered`) until `stop()`, then
        finish its exchange in flight, checkpoint and leave."""
        view = self.presence.view
        assert view is not None  # entered
        async with trainer.outer:
            entered.set()
            await self._stop.requested.wait()
            self.phase.set("stopping")
            with trio.move_on_after(self.config.join_timeout):  # also withdraws prepared joins
                await trainer.outer.afinish()
        began = self.phase.changes > 1  # starting -> training happened
        return await self._finish(trainer, view, save=began and not trainer.outer.in_flight, stopped_early=False)

    async def _wait_for_peers(self) -> None:
        """With `wait_peers`, start training only once that many trainers (us included) are in
        the swarm, so a swarm started together begins its first round together."""
        presence = self.presence
        want = self.config.wait_peers
        if want <= 1:
            return
        with trio.move_on_after(self.config.wait_peers_timeout):
            while len(presence.trainers()) < want and not self._stop.is_set():
                await trio.sleep(0.1)
        have = len(presence.trainers())
        if have < want:
            log.warning(kv("starting without every awaited peer", have=have, want=want))

    async def _finish(self, trainer: TrainedState, view: SwarmView, *, save: bool, stopped_early: bool) -> NodeResult:
        """Checkpoint (unless stopped mid-round), leave the swarm, write the loss history."""
        run_state = self.run_state
        path = None
        if save:
            path = await run_state.save_final()
        else:
            log.warning(
                kv(
                    "stopped mid-round; the last periodic checkpoint stands",
                    checkpoint=run_state.last_checkpoint.get("path"),
                )
            )
        if not view.has_left:
            await view.leave()
        with trainer.lock:
            history = list(trainer.info.history)
        write_atomic(self.data_dir / "history.json", json.dumps(history).encode())
        return NodeResult(
            self.peer_id,
            trainer.step,
            trainer.outer.rounds,
            trainer.info.eval_loss,
            path or run_state.last_checkpoint.get("path"),
            stopped_early,
            trainer.outer.skipped_steps,
        )


async def run_pipeline_peer(
    peer: PipelinePeer, presence: PeerPresence, data_dir: Path, *, peer_id: str, phase: Phase, until: int
) -> NodeResult:
    """A pipeline swarm's run (node/stages/peer.py): run our stage until step `until` (0: never)
    or a stop, save it, leave the swarm and write the loss history."""
    await peer.run(until)
    phase.set("stopping")
    path = await peer.save()
    view = presence.view
    assert view is not None  # entered
    if not view.has_left:
        await view.leave()
    trainer = peer.trainer
    step = trainer.step if trainer is not None else 0
    history: list[dict[str, Any]] = []
    if trainer is not None:
        with trainer.lock:
            history = list(trainer.info.history)
    write_atomic(data_dir / "history.json", json.dumps(history).encode())
    return NodeResult(
        peer_id,
        step,
        trainer.rounds if trainer is not None else 0,
        None,
        path or peer.last_checkpoint.get("path"),
        until == 0 or step < until,
    )


def _exchange_near(trainer: TrainedState) -> bool:
    """Whether an exchange is in flight or the trainer's thread may start one before it stops:
    the step in progress sends (read from the trio thread while the trainer runs: its step
    counter may move on between the reads, so the step just done counts too)."""
    outer = trainer.outer
    step = trainer.step  # first: an exchange this step starts is in flight by the next read
    return outer.in_flight or any(outer.sends_at(s) for s in (step, step + 1))


async def _wait_done(nursery: trio.Nursery) -> None:
    while nursery.child_tasks:
        await trio.sleep(0.05)
