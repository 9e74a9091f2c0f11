"""Downloading the swarm's state: whom to ask, when our own state is the one to keep, and
entering at the swarm's step — a `RunState`'s download and re-sync (node/state/run_state.py).

Problem. A peer that is behind the swarm (a joiner, a restart from an old checkpoint) or out of
step with it (a split round, a round spent alone, a group left behind) must take the swarm's
state — the outer parameters φ and the outer optimizer's state — and enter at its step, under
churn: donors vanish, disagree, or are a round ahead by the time the bytes arrive.

Design. `SwarmDownload` does it for one node:
- `download()`: fetch the outer state from the parity winners (`donors()`, among the trainers at
  the front: a group left behind is never one) and join at their step — unless our own state,
  resumed from our checkpoint in this life (`resumed`), is `BEHIND_ROUNDS` rounds past every
  trainer's: then we are the front and train on it, and they re-sync to us (the front rule). It
  never gives up on a transient (no donor yet, donors that disagree, a state a round old, a donor
  that vanished): it retries with a jittered `Backoff`, saying what it waits for (`waiting`),
  until it joins or the node stops. While the swarm does not admit us (excluded by strikes, or
  off an allowlist) no peer serves us, so it asks none and says why, until we are admitted again.
  With nobody training for `ORPHAN_WAIT`, it trains on its own state rather than wait for peers
  that wait for it (its retries meanwhile, while no other trainer is connected, never sleep past
  that deadline). Only a state that cannot fit this node (another model or optimizer) is fatal,
  `NodeError`, and only once it is the swarm's (`MisfitDonors`: two donors agreed on it, or the
  one donor we reach sent it three times); one donor's misfit is passed over. A state we could
  not enter with — a round old (`OuterOptimizer.entry_step`), or before our roster round — is
  declined from its manifest, before its bytes move (`fetch_state`'s `accept`), and asked for
  again within 2 s (0.5 s while we wait for our roster round): a joiner used to download a state
  a round old whole, refuse it, and back off up to 30 s, every time, while the swarm waited in an
  exchange for it. So is a donor's state of a round it spent alone (`PHI_WITHHELD`) while another
  trainer published a φ for that round (`_solo_offer`); entered where nobody did, its digest is
  withheld by us too. Once joined, `joined(withheld)` (the run state's) records or withholds φ's
  digest and offers the joined state to joiners at once (a snapshot from before the download
  would hand them an older φ than ours).
- `resync()`: `download()`, and when that lands where the last re-sync did (the round we keep
  missing has not completed anywhere we can reach, e.g. during a partition), a pause with backoff
  (`RESYNC_PAUSE` doubling to `RESYNC_PAUSE_CAP`) before training into that round again.

Not here: the download protocol and the vote (node/state/sync.py, node/state/fetch.py), the
parity rule (node/state/parity.py), resuming, parity watching and donor publishing
(node/state/run_state.py), the roster round (node/roster.py).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import trio

from meshtrain.backoff import Backoff
from meshtrain.log import get_logger, kv
from meshtrain.node.phase import NodeError, Phase, StopRequest
from meshtrain.node.presence import PeerPresence
from meshtrain.node.spec.config import NodeConfig
from meshtrain.node.state.checkpoint import MalformedStateError, unflatten_state
from meshtrain.node.state.donor import StateDonor
from meshtrain.node.state.fetch import FetchReport, fetch_state
from meshtrain.node.state.parity import PHI_WITHHELD, winning_digest
from meshtrain.node.state.sync import Offer, OfferDeclined, StateSyncError
from meshtrain.node.trainer import TrainedState
from meshtrain.optim.outer import OuterStateError, StaleStateError
from meshtrain.transport.tensor_streams import TensorStreams

log = get_logger(__name__)

BEHIND_ROUNDS = 3  # a connected trainer this many rounds ahead of us means we were left behind
ORPHAN_WAIT = 20.0  # nobody training to download from for this long: train on our own state
MISFIT_TRIES = 3  # a state that does not fit, from the one donor we can reach, this often: our config is wrong
RESYNC_PAUSE = 0.5  # seconds: the first pause when a re-sync lands where the last one did
RESYNC_PAUSE_CAP = 8.0  # ... doubling up to this (well inside a round's join deadline x 3)
ROSTER_POLL = 0.05  # seconds between two looks at the swarm's step while we wait for our roster round


class MisfitDonors:
    """Donors whose downloaded state unflattened but did not fit our model or optimizer, and how
    often. Two donors that agreed on such a state, or the one donor we can reach sending it
    `MISFIT_TRIES` times, make it the swarm's (`record` says so): this node's model or optimizer is
    not the spec's, and nothing would change. One donor's otherwise — a peer of another release,
    or one that lies — is passed over while other donors remain (`prefer_others`), so that one
    lying donor cannot stop every joiner that asks it."""

    def __init__(self) -> None:
        self.counts: dict[str, int] = {}

    def record(self, senders: list[str]) -> bool:
        """Count one misfit state sent by `senders` (the vote's agreeing donors); whether it is
        the swarm's."""
        for p in senders:
            self.counts[p] = self.counts.get(p, 0) + 1
        return len(senders) >= 2 or max((self.counts[p] for p in senders), default=0) >= MISFIT_TRIES

    def prefer_others(self, donors: list[str]) -> list[str]:
        """`donors` without those that sent a misfit state, unless that leaves none."""
        return [p for p in donors if p not in self.counts] or donors


class SwarmDownload:
    """A node's download of the swarm's state (module docstring). `joined(withheld)` is called
    on the trio thread once a downloaded state is entered (the trainer stopped meanwhile);
    `waiting` says what the download waits for now, or None; `joined_from` how the last one
    went."""

    def __init__(
        self,
        trainer: TrainedState,
        presence: PeerPresence,
        streams: TensorStreams,
        config: NodeConfig,
        donor: StateDonor,
        joined: Callable[[bool], None],
        *,
        phase: Phase,
        stop: StopRequest,
    ) -> None:
        self.trainer = trainer
        self.presence = presence
        self.streams = streams
        self.config = config
        self.donor = donor
        self.joined = joined
        self.phase = phase
        self.stop = stop
        self.joined_from: dict[str, Any] | None = None  # how a late join got its state
        self.waiting: str | None = None
        # Our state came from our own checkpoint in this life, not from a download: only such a
        # state is kept over the trainers' as the front (`_keep_front`).
        self.resumed = False
        self._resync_landing: tuple[int, int] | None = None  # (step, round) the last re-sync joined at
        self.misfits = MisfitDonors()
        self._resync_backoff = Backoff(initial=RESYNC_PAUSE, cap=RESYNC_PAUSE_CAP)
        # Retries after a state declined from its manifest cost one small RPC per donor, and the
        # swarm publishes its next state within a round: ask again soon (the download's own
        # backoff, for failed downloads, grows to 30 s; CI saw a joiner wait out 26 s of it).
        self._declined_backoff = Backoff(initial=0.2, cap=2.0)
        # Waiting for the state of the round before our roster round: it comes when the swarm ends
        # that round; from every 50 ms (our first round should not start late) to every 0.5 s (each
        # ask is a manifest per donor: a chunk digest per 8 MiB, 64 KB for a 16 GB state).
        self._roster_backoff = Backoff(initial=ROSTER_POLL, cap=0.5)

    def behind_margin(self) -> int:
        """Inner steps a trainer must be behind another to count as left behind (`BEHIND_ROUNDS`
        rounds): the one margin of the front rule, for re-syncing to the front and for refusing
        to download a state from behind it."""
        return BEHIND_ROUNDS * self.trainer.spec.outer.H

    def donors(self) -> list[str]:
        """Whom to download the swarm's state from: among the connected trainers at the front
        (within `behind_margin` of the furthest step one reports), the holders of the winning φ
        digest (the parity rule) at the newest round any of them published — so a split round's
        two states never face each other in the download's vote, and a group left behind
        (restarted from old checkpoints) is not mistaken for the swarm, even where it published
        φ more recently than the front (whose rounds it refuses as out of its window, so the
        front withholds its φ: a 30-minute soak saw the whole swarm pulled back 10,700 steps)."""
        progress = self.presence.training_peers(connected=True)
        if progress:
            front = max(pr.step for pr in progress.values())
            progress = {p: pr for p, pr in progress.items() if pr.step + self.behind_margin() > front}
        donors = sorted(progress)
        newest: dict[int, dict[bytes, set[str]]] = {}
        for p in donors:
            pr = progress[p]
            if pr.phi:
                rnd, digest = pr.phi[-1]
                newest.setdefault(rnd, {}).setdefault(digest, set()).add(p)
        if newest:
            # At the newest round someone published, the parity winner's holders; peers still at
            # an older round would offer the same state once they catch up, but not yet.
            holders = newest[max(newest)]
            donors = sorted(holders[winning_digest(holders)])
        donors = self.misfits.prefer_others(donors)
        if not self.trainer.outer.replicas_identical:
            donors = donors[:1]  # NoLoCo replicas differ: take one peer's state whole
        elif self.config.max_donors:
            donors = donors[: self.config.max_donors]
        return donors

    async def download(self) -> bool:
        """Fetch the swarm's outer state from several peers in parallel and enter at its step;
        False if the node was stopped first (see the module docstring for the retry rule)."""
        trainer, view = self.trainer, self.presence.view
        assert view is not None  # the presence service is entered before us
        if self._keep_front(self.donors()):
            return True  # asked before we announce a download: the front stays a fresh trainer
        self.phase.set("syncing")
        # Count as a trainer from now on: peers then expect us at the next round, and every peer
        # (us included) picks that round's coordinator from the same set. Announcing only after
        # the download made a joiner with the lowest peer id wait as the "coordinator" of a
        # round the others had already formed without it. Where rounds run in groups, from a
        # round announced ahead instead, so that every peer groups us alike (node/roster.py):
        # we then take the state of the round before it, and our first exchange is that round.
        in_from = await self.presence.enter_roster(self.stop)
        # Before replacing the state: end an exchange of ours that still runs, and withdraw the
        # joins prepared for the next ones (outer_round.py, "Prepared rounds"), which would hold
        # the others' round for our data until they expired.
        with trio.move_on_after(self.config.join_timeout):
            await trainer.outer.afinish()
        backoff = Backoff(initial=1.0, cap=30.0)
        attempt = 0
        orphaned_at = trio.current_time()  # trio's clock, the one the waits below sleep on
        try:
            while not self.stop.is_set():
                if not self._reached_roster_round(in_from):
                    await self.stop.sleep(ROSTER_POLL)
                    continue
                attempt += 1
                if (reason := self.presence.not_admitted()) is not None:
                    # Excluded by strikes (or off the allowlist): the swarm's peers ignore us and
                    # serve us no state, so asking them is no use; wait until they admit us again.
                    self.waiting = f"state download: the swarm does not admit this node ({reason}); no peer serves it"
                    await self._retry_later(backoff, f"the swarm does not admit this node ({reason})")
                    continue
                donors = self.donors()
                if not donors:
                    if trio.current_time() - orphaned_at >= ORPHAN_WAIT:
                        # Nobody trains (the last training peer died; everyone else is starting or
                        # syncing too): waiting for each other would stall the swarm for good.
                        # Train on our own state; parity and the front rule merge the lineages
                        # once peers train again (the furthest step wins).
                        log.warning(
                            kv(
                                "nobody is training to download from; training on our own state",
                                step=trainer.step,
                                round=trainer.outer.rounds,
                            )
                        )
                        trainer.outer.needs_resync = False
                        return True
                    self.waiting = "state download: waiting for a connected peer that trains"
                    # Alone among the connected trainers, never past the orphan deadline: a
                    # backoff grown to 23 s overslept it, and the last peer of a swarm whose
                    # partner died sat 42 s idle instead of 20 s. Beside a connected trainer whose
                    # progress record has not come yet (back from a newer checkpoint, it will be
                    # our donor) the backoff runs on: training on our own state at 20 s sharp, a
                    # loaded suite run's peer left behind outran that trainer's checkpoint.
                    left = ORPHAN_WAIT - (trio.current_time() - orphaned_at)
                    alone = all(p == self.presence.me for p in self.presence.candidates())
                    await self._retry_later(
                        backoff, "no connected peer is training yet", at_most=max(left, 0.05) if alone else None
                    )
                    continue
                orphaned_at = trio.current_time()
                if self._keep_front(donors):
                    return True
                if await self._fetch_from(donors, attempt, backoff, in_from):
                    return True
            return False
        finally:
            self.waiting = None

    def _keep_front(self, donors: list[str]) -> bool:
        """Whether our own state — resumed from our checkpoint in this life, and trained on since
        without a download (`resumed`) — is `behind_margin` past every step `donors` report: they
        are a group left behind, and downloading from them would pull us, and through the front
        rule the swarm, back to them (a 30-minute soak: the peer holding the newest checkpoint,
        refused as out of the behind group's round window, re-synced to its old state, 10,700
        steps back). Then we train on ours, and they re-sync to it (`_watch_parity`: a trainer
        `BEHIND_ROUNDS` ahead), as the front rule says. A peer that joined by download and went
        on alone (cut off by a partition) is not the front this way: it re-syncs as before."""
        if not self.resumed:
            return False
        assert self.presence.view is not None
        reported = self.presence.view.progress()
        steps = [reported[d].step for d in donors if d in reported]
        if not steps or self.trainer.step < max(steps) + self.behind_margin():
            return False
        log.warning(
            kv(
                "the swarm's trainers are behind our state; training on it (they re-sync to the front)",
                step=self.trainer.step,
                trainers_step=max(steps),
            )
        )
        self.trainer.outer.needs_resync = False
        return True

    def _reached_roster_round(self, in_from: int) -> bool:
        """Whether the swarm has reached the group round before `in_from`, ours (node/roster.py):
        its state is then the one our first exchange, in our round, starts from. Until then we
        wait, saying so: a state from earlier would take us into rounds whose groups leave us out."""
        period = self.presence.plan.grouping.period if self.presence.plan.grouping is not None else 1
        step = self.presence.swarm_step()
        if step is None or step >= in_from - period:  # nobody trains: the download's own rules apply
            return True
        self.waiting = f"entering the swarm's rounds at step {in_from} (announced ahead); the swarm is at step {step}"
        return False

    async def _fetch_from(self, donors: list[str], attempt: int, backoff: Backoff, in_from: int = 0) -> bool:
        """One download attempt; False (after a backoff) on a transient failure, or at once when
        the state is from before the round preceding ours (`in_from`: the donors had not ended
        it yet)."""
        trainer, host = self.trainer, self.presence.host
        t0 = time.monotonic()
        last_log = 0.0

        def progress(done: int, total: int) -> None:
            nonlocal last_log
            if time.monotonic() - last_log > 2 or done == total:
                last_log = time.monotonic()
                log.warning(
                    kv(
                        "downloading swarm state",
                        done_mib=round(done / 2**20, 1),
                        total_mib=round(total / 2**20, 1),
                        donors=len(donors),
                    )
                )

        def before_roster(state_step: int) -> bool:
            """Whether a round before ours would come first with this state: the donors had not
            ended the one before ours (node/roster.py)."""
            return trainer.outer.next_send_step(state_step) < in_from

        def entry(state_step: int) -> int:
            """The step we enter at — the one the donors, the swarm we join, are at now — or
            `StaleStateError` (`OuterOptimizer.entry_step`)."""
            assert self.presence.view is not None
            reported = self.presence.view.progress()
            now = max([reported[d].step for d in donors if d in reported] or [state_step])
            return trainer.outer.entry_step(state_step, max(now, state_step))

        declined_for_roster = False

        def accept(offer: Offer) -> str | None:
            """Decline, from its manifest, a state we could not enter with (fetch.py, "The vote"),
            or one that is not the swarm's (`_solo_offer`)."""
            nonlocal declined_for_roster
            if before_roster(offer.step):
                declined_for_roster = True
                return f"the offered state (step {offer.step}) precedes our roster round {in_from}"
            if (why := self._solo_offer(offer)) is not None:
                return why
            try:
                entry(offer.step)
            except StaleStateError as e:
                return f"the offered state is a round old: {e}"
            return None

        self.waiting = f"state download from {len(donors)} peers (attempt {attempt})"
        report = FetchReport()
        try:
            meta, tensors = await fetch_state(
                host,
                self.streams,
                donors,
                timeout=600.0,
                progress=progress,
                accept=accept,
                report=report,
                quiet=self.presence.heartbeats_stopped,
            )
        except OfferDeclined as e:
            if declined_for_roster:  # the donors had not ended the round before ours yet
                self.waiting = f"waiting for the swarm's state of the round before ours ({in_from}): {e}"
                await self.stop.sleep(self._roster_backoff.next())
            else:  # the swarm is inside an exchange: its next state comes within a round
                await self._retry_later(self._declined_backoff, str(e), attempt=attempt)
            return False
        except StateSyncError as e:
            await self._retry_later(backoff, f"state download failed: {e}", attempt=attempt)
            return False
        self._declined_backoff.reset()
        self._roster_backoff.reset()
        try:  # the vote's winner, or a lone donor: what it sent is checked before anything reads it
            state = unflatten_state(meta.get("skeleton"), tensors)
            trainer.outer.state_layout().check(state)
        except MalformedStateError as e:
            await self._retry_later(backoff, f"the downloaded state is malformed: {e}", attempt=attempt)
            return False
        except OuterStateError as e:
            await self._misfit_from(report.agreeing or donors, e, backoff, attempt)
            return False
        # The swarm may have moved on while the bytes came: the same questions again.
        send = trainer.outer.next_send_step(state["inner_steps"])
        if before_roster(state["inner_steps"]):
            log.info(kv("downloaded state precedes our roster round; fetching again", send=send, in_from=in_from))
            await self.stop.sleep(ROSTER_POLL)
            return False
        try:
            at_step = entry(state["inner_steps"])
        except StaleStateError as e:
            await self._retry_later(backoff, f"downloaded state is a round old: {e}", attempt=attempt)
            return False
        if send == in_from:  # our first round: the swarm may be in it already, waiting for us
            at_step = min(at_step, send - 1)
        await self.donor.reclaim()  # `join` overwrites the φ lent to joiners
        try:
            # A fresh inner optimizer starts at the donors' scale (optim/inner_moments.py).
            trainer.join(state, at_step=at_step, moments=report.inner_moments)
        except StaleStateError as e:
            await self._retry_later(backoff, f"downloaded state is a round old: {e}", attempt=attempt)
            return False
        except OuterStateError as e:
            await self._misfit_from(report.agreeing or donors, e, backoff, attempt)
            return False
        self.resumed = False  # the swarm's lineage now, not our checkpoint's
        # The donors' own φ of a round they spent alone, where nobody published another for it
        # (`_solo_offer`): the lineage goes on from it, but no digest is ours to publish.
        self.joined(meta.get(PHI_WITHHELD) is True)
        self.joined_from = {
            "donors": len(donors),
            "seconds": time.monotonic() - t0,
            "step": trainer.step,
            "bytes": sum(t.numel() * t.element_size() for t in tensors.values()),
        }
        log.warning(
            kv("joined the swarm", step=trainer.step, donors=len(donors), seconds=round(self.joined_from["seconds"], 2))
        )
        return True

    def _solo_offer(self, offer: Offer) -> str | None:
        """Why an offered state is not the swarm's, or None. A donor offers its state after a
        round it spent alone too (its φ withheld, `PHI_WITHHELD` in the meta; it re-syncs next):
        where every trainer went on alone, a state that nobody offered left them downloading each
        other's old ones (tests/test_daemon_matrix.py). But where another trainer published a φ
        for that round or a later one, the swarm's lineage is there, not here: entering with the
        donor's φ, we would record a second digest for its round (a 30-minute soak: a joiner
        downloaded round 1,484 from the one donor it saw, a round that donor spent alone, and
        parity re-synced it 3 s later), and average the next round from another φ than our
        partners'. Declined, the download asks again within 2 s, when the donor has re-synced or
        `donors()` names the holders of the swarm's φ."""
        if offer.meta.get(PHI_WITHHELD) is not True:
            return None
        published = [
            p
            for p, pr in self.presence.training_peers(connected=False).items()
            if pr.phi and pr.phi[-1][0] >= offer.round
        ]
        if not published:
            return None  # the donors' lineage is the only one going on: enter it, withholding (above)
        return (
            f"the offered state (round {offer.round}) is one its donors spent alone (φ withheld), and "
            f"{len(published)} trainers published a φ for round {offer.round} or later"
        )

    async def resync(self) -> None:
        """We missed a round or drifted: download the swarm's state again. When that puts us back
        where the previous re-sync did (the swarm has not finished the round we keep missing: its
        group formed without us, and its members are cut off), pause with a growing backoff
        before training into that round again, rather than loop download-train-miss many times a
        second until the swarm moves."""
        await self.download()
        landed = (self.trainer.step, self.trainer.outer.rounds)
        if landed != self._resync_landing:
            self._resync_backoff.reset()
            self._resync_landing = landed
            return
        delay = self._resync_backoff.next()
        log.warning(
            kv("the swarm has not moved since our last re-sync; pausing", step=landed[0], pause_s=round(delay, 1))
        )
        self.waiting = f"re-sync: the swarm is still at step {landed[0]}; trying its next round again in {delay:.1f} s"
        await self.stop.sleep(delay)
        self.waiting = None

    async def _misfit_from(self, senders: list[str], e: OuterStateError, backoff: Backoff, attempt: int) -> None:
        """A downloaded state that unflattens but does not fit our model or optimizer: the node
        stops (`NodeError`, naming what differs) if it is the swarm's (`MisfitDonors`); else it
        asks again, other donors first."""
        if self.misfits.record(senders):
            raise NodeError(
                f"the swarm's state does not fit this node ({e}): every peer must run the "
                f"same model and optimizer as the swarm spec says"
            ) from None
        await self._retry_later(
            backoff, f"peer {senders[0][-8:]}'s state does not fit this node ({e}); asking others", attempt=attempt
        )

    async def _retry_later(
        self, backoff: Backoff, why: str, attempt: int | None = None, at_most: float | None = None
    ) -> None:
        delay = backoff.next() if at_most is None else min(backoff.next(), at_most)
        log.warning(
            kv("cannot join the swarm yet; retrying", why=why[:300], attempt=attempt, retry_in_s=round(delay, 1))
        )
        await self.stop.sleep(delay)
