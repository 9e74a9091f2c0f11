"""Keeping the swarm's pace: a peer behind the swarm skips inner steps (the spec's `pace` "swarm").

Problem. A round starts when its peers reach the same inner step. With `pace` "steps" (the
default) a peer with a slower GPU reaches it late every round: the others wait for it (up to the
collective's join timeout), or it misses the round, proceeds alone and downloads the swarm's state
again — every round. hivemind closes its rounds at a target batch size instead, whoever reached
it; DiLoCo variants close them on samples or wall time.

Design. Rounds stay at the swarm's steps (round ids, the schedule, fragments and joiners are
unchanged); what changes is that a step may be skipped. `SwarmPace` runs beside the trainer
(node/training_run.py): every `TICK_S` it reports our live step into our progress record while the
node trains (it goes out with the next heartbeat — also while we wait inside a round, where our
step is the round's; not while we re-sync, when a fresh record would say we train) and reads the
others'. The trainer (node/trainer.py) skips a step instead of training it while,
by the time the step would be done (our own step time), it would be `SLACK` or more steps behind
`target()`, or while it is short of the round most of the others report waiting at (`behind`;
`OuterOptimizer.skip`), so it reaches each round about when the others do. Its Δ then weighs the
share of the round it trained (optim/outer.py, "Swarm pace"); it is never re-synced for being
slow. A peer no slower than the median never skips.

The target. A record is up to a heartbeat old (3 s) when it arrives, so each other peer's step is
carried forward from when it was written (`SwarmView.age`, by our clock) at the rate the peer
reports (its `steps_per_s` metric: how fast its step counter moves while it does not wait on a
round, node/trainer.py), but never past the next step at which it sends — where it waits for us,
the round needing us too; a peer already at a send step stays there. `target()` is the median
(the lower one) of those estimates, worked out when the trainer asks, and the trainer asks it for
the moment its next step would end (its own step time, smoothed): a slow peer skips toward where
the others will be, not where they were a heartbeat ago, and arrives at the round with them. Why
the median of the others, not the front: a faster minority does not make the rest skip, and one
peer reporting a step far ahead (a bug, or a liar) moves the target only if it is the only other
peer — and never past a round. `SLACK` keeps a peer just as fast from skipping on the estimates'
jitter. `scripts/bench/bench_hetero.py` measures what the fast peers still wait.

Failures: no other peer trains now (a solo swarm, everyone else syncing) → no target → every
step is trained. A stale record is not a target (`PeerPresence.training_peers`: fresh ones only).

Not here: multi-rank peers (every rank would have to agree on each skip, a collective per step)
and the user's own loop (`meshtrain.Swarm`: the user decides what a step trains) train every
step whatever the spec says.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass

import trio

from meshtrain.crdt.swarm_view import PROGRESS
from meshtrain.log import get_logger, kv
from meshtrain.node.presence import PeerPresence
from meshtrain.node.trainer import TrainedState

log = get_logger(__name__)

TICK_S = 0.5  # how often our live step is reported and the target re-read
SLACK = 2  # steps behind the target before a step is skipped (unless the others wait for us)


@dataclass(frozen=True)
class PeerPace:
    """Another peer's step as its progress record said, carried forward: `step` written at our
    monotonic time `at`, `rate` steps a second since, up to `cap` (its next send step)."""

    step: int
    at: float
    rate: float
    cap: int

    def now(self, t: float) -> int:
        return min(self.cap, self.step + int(self.rate * max(0.0, t - self.at)))


class SwarmPace:
    """The step the swarm is at, for a trainer that keeps its pace (module docstring).

    presence: the node's (entered). trainer: the run's; its live step is reported as ours, and its
    outer optimizer's schedule says where each peer's next round is.
    `run` in a nursery for the training run's lifetime; `behind` from the trainer's thread."""

    def __init__(self, presence: PeerPresence, trainer: TrainedState) -> None:
        self.presence, self.trainer = presence, trainer
        self._peers: tuple[PeerPace, ...] = ()  # replaced whole each tick: read from the trainer's thread
        self._skipping = False
        self._step_s = 0.0  # our own trained step's duration, smoothed (`behind`, the trainer's thread)
        self._trained_from: float | None = None  # when the step `behind` last let train began

    def update(self, peers: list[PeerPace]) -> None:
        """The other training peers' paces, as their latest records say (`run`, every tick)."""
        self._peers = tuple(peers)

    def target(self, at: float | None = None) -> int | None:
        """The median of the other training peers' estimated steps at monotonic time `at` (default:
        now); None: nobody else trains."""
        peers, t = self._peers, time.monotonic() if at is None else at
        return statistics.median_low([p.now(t) for p in peers]) if peers else None

    def waiting_at(self) -> int | None:
        """The send step most of the other training peers report being at — where they wait
        for us — or None."""
        peers = self._peers
        at = [p.step for p in peers if p.step == p.cap]
        return statistics.median_low(at) if peers and 2 * len(at) > len(peers) else None

    def behind(self, step: int, at: float | None = None) -> bool:
        """Whether the trainer, about to train step `step` + 1, should skip it instead: by the time
        that step would be done (our own step time, measured here), it would still be `SLACK`
        steps behind the target, or the others wait for it at a round it has not reached.
        Called from the trainer's thread before every step; `at`: the monotonic time (default: now)."""
        t = time.monotonic() if at is None else at
        if self._trained_from is not None:  # the previous call trained a step: how long it took
            took = t - self._trained_from
            # a step that ran a round counts no more than 3 ordinary ones
            took = min(took, 3 * self._step_s) if self._step_s else took
            self._step_s = took if not self._step_s else 0.8 * self._step_s + 0.2 * took
        target = self.target(t + self._step_s)
        waiting = self.waiting_at()
        skip = target is not None and (
            target - step >= SLACK or (waiting is not None and step < waiting and target >= waiting)
        )
        self._trained_from = None if skip else t
        return skip

    async def run(self) -> None:
        view = self.presence.view
        assert view is not None  # entered
        trainer = self.trainer
        batch = trainer.spec.data.batch_size
        while True:
            if view.progress_live:  # training (not re-syncing): a fresh record says we train now
                view.report_progress(step=trainer.step, samples=trainer.step * batch)
            t = time.monotonic()
            metrics = view.metrics()
            peers = []
            for peer, progress in self.presence.training_peers(connected=False).items():
                age = view.age(PROGRESS, peer, t) or 0.0
                m = metrics.get(peer)
                rate = (m.rate("steps_per_s") if m is not None else None) or 0.0
                step = progress.step
                cap = step if trainer.outer.sends_at(step) else trainer.outer.next_send_step(step)
                peers.append(PeerPace(step, t - age, rate, cap))
            self.update(peers)
            target = self.target()
            behind = target is not None and target - trainer.step >= SLACK
            if behind != self._skipping:
                self._skipping = behind
                log.info(
                    kv(
                        "behind the swarm: skipping steps to keep its pace" if behind else "at the swarm's pace",
                        step=trainer.step,
                        swarm_step=target,
                        skipped=trainer.outer.skipped_steps,
                    )
                )
            await trio.sleep(TICK_S)
