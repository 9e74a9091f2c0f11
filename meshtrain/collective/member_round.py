"""A member's side of one all-reduce round, from its join to its result: `MemberRounds`.

The problem. A member enters a round with its contribution (contribution.py) and must leave it
with the committed result, bit-identical to every other survivor's, or with a `CollectiveError`
soon enough to proceed alone — while its coordinator may die, stall, hand the round over or
leave the swarm, and its partners may fail mid-transfer.

Joining. The member joins at the lowest live candidate of its group (the coordinator: allreduce.py,
"Group and attempts") — the join sent ahead if there is one (`prepare`, prepared.py), else now —
and waits for the reply that fixes the group, unless that coordinator leaves the round's candidates
meanwhile (join_wait.py). The reply is attempt 0's group (`Joined`), or:
- `Moved`: the coordinator handed the round to a lower-id candidate our view was missing; take
  the fresh membership and start again there. A coordinator we found gone may be back (restarted):
  the one handing over heard from it (missing_peers.py `MissingPeers.probe`); handed over to it a
  second time, we proceed alone. A hand-over to a higher id ends the round for us.
- `Late`: with `regroup`, the round's peers grouped it differently, or its coordinator was paused
  (`Regroup`: `SwarmCollective.all_reduce`, allreduce.py, computes our group again and joins anew,
  at most `MAX_REGROUPS` times); else the others are in the round at a coordinator we cannot
  reach, or moved past it (we re-sync), or we joined after the group was fixed (we wait for the
  next round) — each a `CollectiveError`.

Attempts. Each attempt runs its data phase (data_phase.py, planned by `AttemptPlan` from the
coordinator's layout) while watching for the coordinator's decision. A peer that sees a failure
reports it to the coordinator, which at once declares the next attempt with the suspects removed;
every peer watches for that decision while it transfers and abandons the attempt immediately
(`Retry`: the next attempt, with the group it names; `Abort`: a `CollectiveError`). A peer whose
data phase found a peer silent marks it for the rounds its own coordinator keeps (probe.py
`SilentPeers`). A member leaving mid-attempt (its round cancelled) says so (coordinator_client.py
`leave`), so the others retry at once instead of waiting out a deadline for its data. A data phase
that completes measures our uplink (shares.py `egress_rate`) for our next joins.

The commit. When all members report success, the coordinator commits if their digests agree; a
minority digest is told to re-sync from a majority peer: a member whose result is missing or
differs fetches the committed one from its first holder, and that holder sends it to every member
that needs it (committed.py). Our result must then match the committed digest. Contributors are the
group less zero-weight members and those excluded (failed, or rejected as an owner's invalid
contribution). With `screen_norm`, the round's `RoundScreening` — our flags as a part's owner,
replays dropped (echoes.py), the sampled peers' contributions for loss scoring (contract.py) — is
in the `ReduceResult` and goes to the collective's `screening_listeners`.

Coordinator lost. If the coordinator itself dies, its watchers see the RPC fail and restart the
round with the next lowest id; so do peers waiting for its group once it leaves the round's
candidates while still connected (excluded by strikes, or gone from the swarm: join_wait.py),
where the others form the round, and members that find it silent (no heartbeat, no answer to a
probe: probe.py), at any step of the round. A peer that is itself cut off (it lost contact as the
round's coordinator, or has no candidate left) raises `CollectiveError`, and so does a round with
no outcome within its deadline (`AllReduceConfig.round_deadline`), a safety net over the per-step
deadlines.

Not here: the RPC handlers, grouping, joins sent ahead and regrouping (allreduce.py), the
coordinator's state machine (coordinator.py), the control RPCs to it (coordinator_client.py), one
attempt's transfers (data_phase.py), the messages (protocol.py).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Sequence
from typing import Protocol

import torch
import trio

from meshtrain.collective.committed import fetch_committed, send_committed
from meshtrain.collective.contract import CollectiveError, ReduceResult, RoundScreening, sampled_peers
from meshtrain.collective.contribution import Contribution
from meshtrain.collective.coordinator_client import CoordinatorClient, CoordinatorLost
from meshtrain.collective.data_phase import AttemptFailed, AttemptPlan, AttemptStats, DataPhase, exception_leaves
from meshtrain.collective.echoes import EchoMemory
from meshtrain.collective.flat import flat_slice, result_digest
from meshtrain.collective.join_wait import await_join_reply
from meshtrain.collective.own_rounds import OwnRounds
from meshtrain.collective.prepared import PreparedJoins
from meshtrain.collective.probe import SilentPeers, wait_silent
from meshtrain.collective.protocol import (
    DONE,
    FAIL,
    Abort,
    AllReduceConfig,
    Commit,
    Joined,
    JoinReply,
    JoinRequest,
    Late,
    Moved,
    Outcome,
    Report,
    Retry,
    RoundKey,
)
from meshtrain.collective.shares import egress_rate
from meshtrain.log import get_logger, kv
from meshtrain.transport.host import Host
from meshtrain.transport.tensor_streams import TensorStreams

__all__ = ["MemberContext", "MemberRounds", "Regroup"]

log = get_logger(__name__)


class _Moved(Exception):
    """The coordinator handed the round to a lower-id candidate: re-read the membership, go there."""


class Regroup(Exception):
    """The round's peers computed its groups differently: compute ours again, join anew."""


class MemberContext(Protocol):
    """What a member's rounds read and update of the collective they run in (`SwarmCollective`,
    allreduce.py, which documents each)."""

    host: Host
    streams: TensorStreams
    config: AllReduceConfig
    membership: Callable[[int], Sequence[str]]
    present: Callable[[str], bool] | None
    quiet: Callable[[str], bool] | None
    coordinator: CoordinatorClient  # our control RPCs to a round's coordinator
    prepared: PreparedJoins  # joins sent ahead
    own: OwnRounds  # the rounds our trainer entered
    echoes: EchoMemory  # replay screening
    screening_listeners: list[Callable[[RoundScreening], None]]
    measured_uplink: float | None  # bytes/s: set here, from our sends in a data phase
    stripe_taper: int | None  # the stripe taper our joins offer

    @property
    def peer_id(self) -> str: ...

    @property
    def uplink(self) -> float | None:
        """Our link rate in bytes/s as our joins carry it (None: unknown)."""
        ...

    def group(self, round_id: int) -> tuple[str, ...]:
        """The peers expected in our round `round_id`."""
        ...


class MemberRounds:
    """Our rounds as a member (module docstring): `run` takes one round through its coordinators.

    collective: what the rounds read and update of their collective (`MemberContext`).
    running: awaited for the collective's nursery (started on first use), which holds our watches
        of a silent coordinator and the committed result's sends.
    silent: the peers found silent (probe.py), marked for the rounds our own coordinator keeps."""

    def __init__(
        self, collective: MemberContext, running: Callable[[], Awaitable[trio.Nursery]], silent: SilentPeers
    ) -> None:
        self.col = collective
        self._running = running
        self.silent = silent
        self.waiting: str | None = None  # what our round waits for now (for `/status`)

    @property
    def peer_id(self) -> str:
        return self.col.peer_id

    def join_request(self, round_id: int, tag: str, live: Sequence[str], dead: set[str]) -> JoinRequest:
        """Our join of round `round_id` at `live[0]`, having given up on `dead`."""
        key = RoundKey(round_id, tag, live[0])
        return JoinRequest(key, tuple(live), tuple(sorted(dead)), self.col.uplink, self.col.stripe_taper)

    async def run(self, contribution: Contribution, tag: str, codec: str) -> ReduceResult:
        """Our round `contribution.round_id` under `tag`, at the lowest live candidate, restarted
        at the next one whenever its coordinator is lost or hands it over."""
        round_id = contribution.round_id
        candidates = self._candidates(round_id, tag)
        dead: set[str] = set()
        revived: set[str] = set()  # dead coordinators a hand-over sent us back to (once each)
        while True:
            live = [p for p in candidates if p not in dead]
            if not live:  # every candidate we tried is gone or handed over in a loop
                raise CollectiveError(f"round {round_id}: no coordinator left to join")
            coordinator = live[0]
            self.col.own.at(RoundKey(round_id, tag, coordinator))
            try:
                # A safety net over the per-step deadlines: however the round misbehaves, the
                # caller gets an error and proceeds (alone) instead of waiting forever.
                with trio.fail_after(self.col.config.round_deadline(contribution.numel)):
                    return await self._run_round(self.join_request(round_id, tag, live, dead), contribution, codec)
            except trio.TooSlowError:
                raise CollectiveError(
                    f"round {round_id}: no outcome within {self.col.config.round_deadline(contribution.numel):.0f} s"
                ) from None
            except _Moved as e:
                # Our view was behind: take the fresh membership (it now has the newcomer). A
                # coordinator we found gone may be back (restarted): the one handing over heard
                # from it (missing_peers.py `MissingPeers.probe`). A second time, we proceed alone.
                to = str(e)
                if to in dead:
                    if to in revived:
                        raise CollectiveError(
                            f"round {round_id}: handed over again to {to[-8:]}, which we could not reach; proceed alone"
                        ) from None
                    dead.discard(to)
                    revived.add(to)
                candidates = sorted(set(self._candidates(round_id, tag)) | {to})
                log.info(kv("allreduce coordinator moved, restarting round", round=round_id, to=str(e)[-8:]))
            except CoordinatorLost as e:
                log.info(
                    kv(
                        "allreduce coordinator lost, restarting round",
                        round=round_id,
                        coordinator=coordinator[-8:],
                        reason=str(e),
                    )
                )
                if coordinator == self.peer_id:
                    raise CollectiveError(f"round {round_id}: lost contact with the swarm ({e})") from None
                dead.add(coordinator)

    def _candidates(self, round_id: int, tag: str) -> list[str]:
        """The peers we expect in our exchange `round_id` under `tag`: `group`, cut to a follow-up's
        peers (`RoundRequest.among`, own_rounds.py), sorted."""
        among = self.col.own.among(RoundKey(round_id, tag, self.peer_id))
        group = self.col.group(round_id)
        return sorted(group if among is None else set(group) & among)

    def _still_coordinates(self, coordinator: str, round_id: int) -> bool:
        """Whether a coordinator holding our join still counts (join_wait.py): one of the round's
        candidates, or still present in the swarm (`present`)."""
        col = self.col
        return coordinator in col.membership(round_id) or (col.present is not None and col.present(coordinator))

    async def _joined(self, join: JoinRequest) -> JoinReply:
        """The coordinator's reply to the round's join: the one sent ahead, or one sent now."""
        prepared = await self.col.prepared.take(join)  # sent ahead by `prepare` (prepared.py), or now:
        return prepared if prepared is not None else await self.col.coordinator.join(join)

    async def _run_round(self, join: JoinRequest, contribution: Contribution, codec: str) -> ReduceResult:
        """One round at `join`'s coordinator — left for the next candidate (`CoordinatorLost`)
        once that coordinator went silent, at any step of the round (probe.py)."""
        key, coordinator, quiet = join.key, join.key.coordinator, self.col.quiet
        if coordinator == self.peer_id or quiet is None:
            return await self._round_at(join, contribution, codec)
        round_scope, watching = trio.CancelScope(), trio.CancelScope()

        async def watch() -> None:
            with watching:
                self.silent.mark(await wait_silent(self.col.host, lambda: [coordinator], quiet, key))
                round_scope.cancel()

        (await self._running()).start_soon(watch)
        try:
            with round_scope:
                return await self._round_at(join, contribution, codec)
        finally:
            watching.cancel()
        raise CoordinatorLost("it went silent (no heartbeat, no answer to a probe)")

    async def _round_at(self, join: JoinRequest, contribution: Contribution, codec: str) -> ReduceResult:
        key, coordinator = join.key, join.key.coordinator
        log.debug(kv("allreduce join", key=key, expected=len(join.expected)))
        joined: JoinReply | None
        if coordinator == self.peer_id:
            joined = await self._joined(join)
        else:  # unless the coordinator leaves the round's candidates meanwhile (join_wait.py)
            self.waiting = f"round {key.round_id}: waiting for coordinator {coordinator[-8:]} to form the group"
            joined = await await_join_reply(
                lambda: self._joined(join),
                lambda: self._still_coordinates(coordinator, key.round_id),
                await self._running(),
                lambda: self.col.coordinator.withdraw(key),
            )
        if joined is None:
            raise CoordinatorLost("it left the round's candidates (excluded, or left the swarm)")
        self.waiting = None
        log.debug(kv("allreduce joined", key=key, reply=type(joined).__name__))
        if isinstance(joined, Moved):
            if joined.to < coordinator:
                raise _Moved(joined.to)
            raise CollectiveError(f"{key}: coordinator handed the round to a higher id; proceed alone")
        if isinstance(joined, Late):
            if joined.regroup:
                raise Regroup(
                    f"{key}: the coordinator restarted the round (its peers grouped it differently, or it was paused)"
                )
            if joined.elsewhere is not None:
                raise CollectiveError(
                    f"{key}: the others are in this round at {joined.elsewhere[-8:]}, "
                    "which we cannot reach; proceed alone and re-sync"
                )
            if joined.passed:
                raise CollectiveError(f"{key}: the other peers have moved past this round; re-sync")
            raise CollectiveError(f"{key}: joined after the group was formed; wait for the next round")
        layout: Joined | Retry = joined  # the attempt as the coordinator announced it
        excluded: dict[str, str] = {}
        while True:
            if self.peer_id not in layout.group:
                raise CollectiveError(f"{key}: this peer was excluded from the round")
            plan = AttemptPlan.of(
                key, layout, self.peer_id, contribution.numel, self.col.config, codec, self.col.uplink
            )
            try:
                outcome, result, stats = await self._attempt(plan, contribution)
            except* trio.Cancelled:
                # We are leaving mid-round: say so, so the others retry at once instead of
                # waiting out a deadline for our data — or blaming whoever our silence makes drop
                # out next (seen in CI: an innocent peer excluded). `except*`: a cancellation
                # that lands in the data phase's nursery arrives wrapped in an exception group.
                await self.col.coordinator.leave(key, plan.attempt)
                raise
            if isinstance(outcome, Retry):
                for p in outcome.excluded:
                    excluded.setdefault(p, "failed during the round")
                layout = outcome
                log.info(kv("allreduce retry", key=key, attempt=outcome.attempt, group=len(outcome.group)))
                continue
            if isinstance(outcome, Abort):
                raise CollectiveError(f"{key}: {outcome.why}")
            return await self._commit(plan, outcome, result, stats, contribution.tensors, excluded)

    async def _commit(
        self,
        plan: AttemptPlan,
        outcome: Commit,
        result: dict[str, torch.Tensor] | None,
        stats: AttemptStats,
        tensors: dict[str, torch.Tensor],
        excluded: dict[str, str],
    ) -> ReduceResult:
        """Our result once the coordinator committed `outcome.digest`: fetched from a holder if
        ours is missing or differs; sent to the peers that need it if we are the first holder."""
        key, group, col = plan.key, plan.group, self.col
        needy = [p for p in (*outcome.resync, *outcome.unconfirmed) if p != self.peer_id]
        resync_tag = f"{plan.tag}/resync"
        digest = stats.digest
        if self.peer_id in outcome.resync or result is None:
            if not outcome.holders:
                raise CollectiveError(f"{key}: nobody holds the committed result")
            result = await fetch_committed(col.streams, col.config, outcome.holders[0], resync_tag, tensors)
            digest = result_digest(result)
        elif outcome.holders and outcome.holders[0] == self.peer_id and needy:
            nursery = await self._running()
            for p in needy:
                nursery.start_soon(send_committed, col.streams, col.config, p, resync_tag, result)
        if digest != outcome.digest:
            raise CollectiveError(f"{key}: result does not match the committed digest")
        for p in outcome.rejected:
            excluded.setdefault(p, stats.rejected.get(p, "sent an invalid contribution"))
        contributors = tuple(p for p in group if p not in stats.zero_weight and p not in excluded)
        # Screening (contract.py): what we flagged as a part's owner, with the round it belongs to.
        flags = tuple(f for f in stats.flags if f.peer != self.peer_id)
        if stats.sketch is not None and stats.digest == outcome.digest and result is not None:
            # Replay screening (echoes.py): the committed round's part is remembered, and the
            # echoes we dropped from it are flagged (rather than as a norm or direction flag).
            col.echoes.remember(key.tag, stats.sketch)
            echoed = {e.peer for e in stats.echoes}
            part = group.index(self.peer_id)
            flags = tuple(f for f in flags if f.peer not in echoed) + tuple(
                stats.sketch.flag(e, part) for e in stats.echoes
            )
        stats.sketch = None
        screening = None
        if col.config.screen_norm:
            samples, aggregate = {}, None
            if stats.kept and stats.digest == outcome.digest and result is not None:
                # Loss scoring (contract.py): the sampled peers' contributions to our part.
                chosen = sampled_peers(group, digest, col.config.score_samples)
                samples = {p: stats.kept[p] for p in chosen if p in stats.kept and p not in excluded}
                a, b = stats.part
                aggregate = flat_slice(result, a, b) if samples else None
            stats.kept = {}
            screening = RoundScreening(key.round_id, key.tag, group, digest, flags, stats.part, samples, aggregate)
        if screening is not None:
            for listener in col.screening_listeners:
                listener(screening)
        return ReduceResult(
            result, contributors, digest, stats.sent, stats.received, excluded, screening, tuple(sorted(group))
        )

    async def _attempt(
        self, plan: AttemptPlan, contribution: Contribution
    ) -> tuple[Outcome, dict[str, torch.Tensor] | None, AttemptStats]:
        """Run one attempt's data phase while watching for the coordinator's decision."""
        key, attempt, col = plan.key, plan.attempt, self.col
        phase = DataPhase(col.streams, col.host, col.config, plan, contribution, col.echoes, col.quiet)
        decided: list[Outcome] = []
        result: list[dict[str, torch.Tensor]] = []
        try:
            async with trio.open_nursery() as nursery:

                async def watch() -> None:
                    decided.append(await col.coordinator.watch(key, attempt))
                    nursery.cancel_scope.cancel()

                async def work() -> None:
                    try:
                        out = await phase.run()
                        phase.stats.digest = await trio.to_thread.run_sync(result_digest, out)
                        result.append(out)
                        col.measured_uplink = egress_rate(phase.stats.sends) or col.measured_uplink
                        report = Report(key, attempt, DONE, phase.stats.digest, (), tuple(sorted(phase.stats.rejected)))
                    except AttemptFailed as e:
                        log.info(
                            kv(
                                "allreduce attempt failed",
                                key=key,
                                attempt=attempt,
                                suspects=",".join(s[-8:] for s in e.suspects),
                                why=str(e),
                            )
                        )
                        if phase.silent:  # our verdict: our own coordinator's rounds go without them too
                            self.silent.mark(phase.silent)
                        if key.coordinator in phase.silent:  # a report to it would hang: on to the next one
                            raise CoordinatorLost("it went silent (no heartbeat, no answer to a probe)") from None
                        report = Report(
                            key,
                            attempt,
                            FAIL,
                            None,
                            tuple(sorted(e.suspects)),
                            tuple(sorted(phase.stats.rejected)),
                            e.evidence,
                        )
                    log.debug(kv("allreduce report", key=key, attempt=attempt, status=report.status))
                    await col.coordinator.report(report)

                nursery.start_soon(watch)
                nursery.start_soon(work)
        except BaseExceptionGroup as eg:
            leaves = list(exception_leaves(eg))
            for kind in (CollectiveError, CoordinatorLost):
                for e in leaves:
                    if isinstance(e, kind):
                        raise e from None
            raise
        log.debug(kv("allreduce attempt decided", key=key, attempt=attempt, outcome=type(decided[0]).__name__))
        return decided[0], (result[0] if result else None), phase.stats
